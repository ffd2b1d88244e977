"""Backend choice per call: explicit argument, else the COC_* environment, with fused fallback.

Order (design.md, "Choosing a path"): an explicit ``backend=`` wins; else
``USE_COC_FUSED_KERNEL=1`` -> fused; else a split count > 1 from ``parallel_num=``,
``customized_coc[m, k, n]`` or ``COC_PARALLEL_NUM`` -> chunked; else sequential. A fused request
on a group whose ranks cannot map each other's memory runs the chunked path instead and warns
once per reason.

Under ``torch.compile`` the choice is made once, while tracing, and is a constant of the graph
(``_decide`` is marked ``assume_constant_result``): the graph holds one registered operator call
(``kernels.library``) with the backend and split count as arguments. A changed environment takes
effect in a compiled function after ``torch._dynamo.reset()``. The choice depends on the shape only
through ``customized_coc`` (a graph with dynamic shapes guards on whether its shape is one of the
keys) and ``COC_PARALLEL_NUM=auto`` (which needs the exact shape: compile it with static shapes).
Whether the ranks agree on the call is settled before, by :mod:`kernels.callcheck`.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from . import library
from .backends import fused_unavailable as _fused_unavailable
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
    op: str,
    backend: str | None,
    parallel_num: int | None,
    m: int,
    k: int,
    n: int,
    dtype: torch.dtype,
    weight_dtype: torch.dtype,
    device: torch.device,
    group_name: str,
    world: int,
) -> tuple[str, int]:
    config = get_config()
    group = library.resolve_group(group_name)
    if backend == "sequential":
        return backend, 1
    if backend is None and config.use_fused:
        backend = "fused"
    if backend == "fused":
        reason = _fused_unavailable(group, device)
        if reason is None:
            return backend, 1
        _warn_fallback(op, reason)
        backend = "chunked"
    num: int | str = parallel_num if parallel_num is not None else config.parallel_num_for(m, k, n)
    if num == "auto":
        # Fused is a candidate only when nothing forced a backend (an unavailable fused request
        # has become "chunked" above).
        num = choose_parallel_num(
            op,
            _stand_in((m, k), dtype, device),
            _stand_in((n, k), weight_dtype, device),
            group,
            world,
            allow_fused=backend is None,
        )
        if num == "fused":
            return "fused", 1
    assert isinstance(num, int)
    if backend is None:
        backend = "chunked" if num > 1 else "sequential"
    return backend, num


def decide(
    op: str,
    backend: str | None,
    parallel_num: int | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    group: dist.ProcessGroup | None,
    world: int,
    *,
    n: int | None = None,
) -> tuple[str, int, str]:
    """``(backend, parallel_num, group name)`` for a call of ``op`` on 2-D ``x`` (already admitted by
    :mod:`kernels.callcheck`: resolving may tune, which communicates); ``n`` overrides
    ``weight.shape[0]`` (the total ``n`` of an all-gather feeding several weights)."""
    name = library.group_name(group)
    # _decide and shape_keys are assume_constant_result: while tracing, dynamo calls them with the
    # constant arguments and keeps the result, instead of tracing the environment reads, caches and
    # collectives inside. A shape is passed only as far as the choice depends on it, so a graph
    # compiled with dynamic shapes stays dynamic (auto needs the exact shape: static).
    m, k = x.shape[0], x.shape[1]
    n = weight.shape[0] if n is None else n
    if torch.compiler.is_compiling():
        keys = shape_keys(backend, parallel_num)
        if keys is None:
            m = k = n = 0
        elif keys != "exact":
            m, k, n = _matching_key(keys, m, k, n)
    chosen, num = _decide(op, backend, parallel_num, m, k, n, x.dtype, weight.dtype, x.device, name, world)
    return chosen, num, name


def resolve(
    op: str,
    backend: str | None,
    parallel_num: int | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    group: dist.ProcessGroup | None,
    world: int,
) -> tuple[str, int]:
    """``(backend, parallel_num)`` to run ``op`` with; ``x`` is the 2-D input as the op sees it."""
    chosen, num, _ = decide(op, backend, parallel_num, x, weight, group, world)
    return chosen, num
