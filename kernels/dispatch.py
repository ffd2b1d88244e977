"""Backend choice per call: explicit argument, else the COC_* environment, with fused fallback.

Order (design.md, "Choosing a path"): an explicit ``backend=`` wins; else
``USE_COC_FUSED_KERNEL=1`` -> fused; else a split count > 1 from ``parallel_num=``,
``customized_coc[m, k, n]`` or ``COC_PARALLEL_NUM`` -> chunked; else sequential. A fused request
on a group whose ranks cannot map each other's memory runs the chunked path instead and warns
once per reason.

Under ``torch.compile`` the choice is made once, while tracing, and is a constant of the graph
(``_decide`` is marked ``assume_constant_result``): the graph holds one registered operator call
(``torch.ops.coc.*``, :mod:`kernels.ops`) with the backend and split count in its ``call`` string.
A changed environment takes effect in a compiled function after ``torch._dynamo.reset()``. The
choice depends on the shape only through ``customized_coc`` (a graph with dynamic shapes guards on
whether its shape is one of the keys) and ``COC_PARALLEL_NUM=auto`` (which needs the exact shape:
compile it with static shapes). Whether the ranks agree on the call is settled before, by :mod:`kernels.callcheck`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist

from .call import OpCall, Operands, decode, resolve_group
from .config import get_config
from .op_registration import assume_constant_result
from .tune import choose_parallel_num

_warned: set[str] = set()


def _warn_fallback(op: str, reason: str) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(
        f"{op}: the fused backend cannot run here ({reason}); using the chunked path "
        "instead (this warning is shown once per reason)",
        RuntimeWarning,
        stacklevel=5,
    )


def _stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` without its memory (one element, expanded): what the agreement check
    and the tuner's key read is the shape, dtype and device, never the values."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def _fused_unavailable(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """None when the fused kernels can run on ``group`` and ``device``, else why not."""
    try:
        from . import fused
    except ImportError as e:
        return f"the fused backend is not available in this build ({e})"
    return fused.unavailable_reason(group, device)


@assume_constant_result
def shape_keys(backend: str | None, parallel_num: int | None) -> None | str | tuple:
    """What of the op's shape the choice depends on in the current environment: ``None``, nothing;
    ``"exact"``, the shape itself (``auto`` tunes for it); else the
    ``customized_coc`` keys, of which only the one the shape equals (if any) matters."""
    config = get_config()
    if backend == "sequential" or parallel_num is not None:
        return None
    if config.parallel_num == "auto":
        return "exact"
    return tuple(config.customized_coc) or None


def _matching_key(keys: tuple, m: int, k: int, n: int) -> tuple[int, int, int]:
    """The customized_coc key equal to ``(m, k, n)``, else ``(0, 0, 0)`` (no key: the default).

    Under compile with dynamic shapes the comparisons become guards of the graph, so the choice
    is exact for every shape the graph serves, without specializing it to one shape."""
    for key in keys:
        if m == key[0] and k == key[1] and n == key[2]:
            return key
    return (0, 0, 0)


@assume_constant_result
def _decide(
    call_text: str, shape: tuple[int, int, int], dtypes: tuple[torch.dtype, torch.dtype], device: torch.device
) -> tuple[str, int]:
    """``(backend, parallel_num)`` of the call encoded in ``call_text`` (with its requested ones) for an op of
    ``shape`` ``(m, k, n)`` with operands of ``dtypes`` ``(x's, the weight's)``. The call travels as its
    string: Dynamo hands a function it keeps out of the graph constants, and a string is one (a dataclass
    instance is not rebuilt faithfully)."""
    call = decode(call_text)
    m, k, n = shape
    dtype, weight_dtype = dtypes
    config = get_config()
    group = resolve_group(call.group_name)
    backend = call.backend
    if backend == "sequential":
        return backend, 1
    if backend is None and config.use_fused:
        backend = "fused"
    if backend == "fused":
        reason = _fused_unavailable(group, device)
        if reason is None:
            return backend, 1
        _warn_fallback(call.op_name, reason)
        backend = "chunked"
    num: int | str = call.parallel_num if call.parallel_num is not None else config.parallel_num_for(m, k, n)
    if num == "auto":
        # Fused is a candidate only when nothing forced a backend (an unavailable fused request
        # has become "chunked" above).
        num = choose_parallel_num(
            call,
            _stand_in((m, k), dtype, device),
            _stand_in((n, k), weight_dtype, device),
            group,
            allow_fused=backend is None,
        )
        if num == "fused":
            return "fused", 1
    assert isinstance(num, int)
    if backend is None:
        backend = "chunked" if num > 1 else "sequential"
    return backend, num


def decide(call: OpCall, ops: Operands) -> OpCall:
    """``call`` with its backend and split count resolved (it was admitted by :mod:`kernels.callcheck`
    already: resolving may tune, which communicates)."""
    # _decide and shape_keys are assume_constant_result: while tracing, dynamo calls them with the
    # constant arguments and keeps the result, instead of tracing the environment reads, caches and
    # collectives inside. A shape is passed only as far as the choice depends on it, so a graph
    # compiled with dynamic shapes stays dynamic (auto needs the exact shape: static).
    x = ops.x
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    n = sum(w.shape[0] for w in ops.weights)
    if torch.compiler.is_compiling():
        keys = shape_keys(call.backend, call.parallel_num)
        if keys is None:
            m = k = n = 0
        elif keys != "exact":
            m, k, n = _matching_key(keys, m, k, n)
    dtype = call.out_dtype or x.dtype  # an FP8 call's split count is timed on stand-ins of its output dtype
    weight_dtype = dtype if call.fmt.kind == "fp8" else ops.weights[0].dtype
    backend, num = _decide(call.encode(), (m, k, n), (dtype, weight_dtype), x.device)
    return replace(call, backend=backend, parallel_num=num)
