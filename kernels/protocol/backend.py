"""Backend choice, one resolver for every op: the request (what the ranks compare), then what runs.

:func:`requested` reads the environment (design.md, "Choosing a path"): an explicit ``backend=`` wins; else
``USE_COC_FUSED_KERNEL=1`` asks for fused; the split count is ``parallel_num=``, else ``customized_coc[m, k, n]``,
else ``COC_PARALLEL_NUM``; a sequential request takes one piece. Every rank's request is part of its admitted call.

:func:`decide` turns the admitted request into the backend that runs, among those the op's table entry really
implements (``OpSpec.backends``): a fused request where the fused kernels cannot run on the group and device runs
chunked (or sequential, for an op without chunked), and a request for a backend the op does not have runs the one
it has; each warns once per reason, naming what runs. ``COC_PARALLEL_NUM=auto`` tunes where the op has a tuner
(``OpSpec.tune``), else runs one piece with a warning. With no backend asked for, more than one piece is chunked.

Local ops (no communication: the grouped GEMM, the local FP8 GEMM) run their Triton kernel or the torch
reference: ``OpSpec.local`` says when the kernel is the default (``"kernel"``: wherever it runs; ``"cuda"``: on
CUDA when the fused backend is asked for); an explicit ``backend="fused"`` where the kernel cannot run is a
``ValueError``.

Under ``torch.compile`` the choice is made once, while tracing, and is a constant of the graph (the functions it
runs are marked ``assume_constant_result``): the graph holds one registered operator call with the backend and
split count in its call string. It depends on the shape only through ``customized_coc`` (a graph with dynamic
shapes guards on whether its shape is one of the keys) and ``COC_PARALLEL_NUM=auto`` (compile it with static
shapes). A changed environment takes effect in a compiled function after ``torch._dynamo.reset()``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from typing import Any

import torch

from ..config import CocConfig, get_config
from .call import Call, resolve_group
from .registry import assume_constant_result

ShapeKey = tuple[int, int, int]
_warned: set[str] = set()


def warn_once(key: str, message: str, stacklevel: int = 5) -> None:
    """``message`` as a RuntimeWarning, once per ``key`` for the whole process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def kernel_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA (compiled) or the CPU under the interpreter."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return (device.type == "cuda" and not interpreted) or (device.type == "cpu" and interpreted)


def requested(call: Call, shape: ShapeKey | None, config: CocConfig | None = None) -> Call:
    """``call`` with the backend and split count it requests once the environment is read (module docstring);
    ``shape``: ``(m, k, n)`` for ``customized_coc`` (None: the op has no GEMM shape)."""
    config = config or get_config()
    backend, num = call.backend, call.parallel_num
    if backend is None and config.use_fused:
        backend = "fused"
    if backend == "sequential":
        num = 1
    elif num is None:
        num = config.parallel_num_for(*shape) if shape is not None else config.parallel_num
    if backend == call.backend and num == call.parallel_num:
        return call
    return replace(call, backend=backend, parallel_num=num)


def fused_unavailable(call: Call, device: torch.device) -> str | None:
    """None when the fused kernels can run on the call's group and ``device``, else why not (a collective at a
    group's first ask, made by every rank alike: they all admitted the same call)."""
    try:
        from .. import fused
    except ImportError as e:
        return f"the fused backend is not available in this build ({e})"
    return fused.unavailable_reason(resolve_group(call.group_name), device)


def decide(spec: Any, call: Call, device: torch.device, tune_args: tuple = (None, ())) -> Call:
    """The admitted request ``call`` resolved to what runs (module docstring); ``spec`` the op's table entry,
    ``tune_args = (shape, dtypes)`` what its tuner times."""
    if spec.local:
        return replace(call, backend=_local(spec, call, device), parallel_num=1)
    backend, num = call.backend, call.parallel_num
    if backend == "sequential":
        return call if num == 1 else replace(call, parallel_num=1)
    if backend == "fused":
        if "fused" in spec.backends:
            reason = fused_unavailable(call, device)
            if reason is None:
                return replace(call, parallel_num=1)
        else:
            reason = f"{call.op} has no fused backend"
        backend = "chunked" if "chunked" in spec.backends else "sequential"
        warn_once(
            f"{call.op}:{reason}",
            f"{call.op}: the fused backend cannot run here ({reason}); running the "
            f"{backend} path instead (this warning is shown once per reason)",
        )
    if num == "auto":
        num = _tuned(spec, call, device, backend, tune_args)
        if num == "fused":
            return replace(call, backend="fused", parallel_num=1)
    assert isinstance(num, int)
    if backend is None:
        backend = "chunked" if num > 1 else "sequential"
    if backend == "chunked" and "chunked" not in spec.backends:
        warn_once(
            f"{call.op}:chunked",
            f"{call.op} has no chunked backend (nothing to overlap in pieces); running the sequential path for a "
            "chunked request (this warning is shown once)",
        )
        backend, num = "sequential", 1
    return replace(call, backend=backend, parallel_num=num)


def _tuned(spec: Any, call: Call, device: torch.device, backend: str | None, tune_args: tuple) -> int | str:
    if spec.tune is None:
        warn_once(
            f"{call.op}:auto",
            f"{call.op}: COC_PARALLEL_NUM=auto does not tune this op; running with parallel_num=1",
        )
        return 1
    # Fused is a candidate only when nothing forced a backend (an unavailable fused request is chunked now).
    shape, dtypes = tune_args
    return spec.tune(call, shape, dtypes, device, backend is None)


def _local(spec: Any, call: Call, device: torch.device) -> str:
    runs = kernel_runs_on(device)
    if call.backend == "fused":
        if not runs:
            raise ValueError(
                f"{call.op}: backend='fused': the Triton kernel cannot run on {device} here (CUDA tensors without "
                "TRITON_INTERPRET, or CPU tensors with TRITON_INTERPRET=1 set before kernels is imported)"
            )
        return "fused"
    if call.backend == "sequential":
        return "sequential"
    if spec.local == "kernel":
        return "fused" if runs else "sequential"
    return "fused" if device.type == "cuda" and runs and get_config().use_fused else "sequential"


@assume_constant_result
def shape_keys(backend: str | None, parallel_num: int | str | None) -> None | str | tuple:
    """What of the op's shape the choice depends on in the current environment: ``None``, nothing; ``"exact"``,
    the shape itself (``auto`` tunes for it); else the ``customized_coc`` keys, of which only the one the shape
    equals (if any) matters."""
    config = get_config()
    if backend == "sequential" or parallel_num is not None:
        return None
    if config.parallel_num == "auto":
        return "exact"
    return tuple(config.customized_coc) or None


def traced_shape(call: Call, shape: ShapeKey) -> ShapeKey:
    """The shape a compiled call decides with: as much of it as the choice depends on (:func:`shape_keys`), so
    a graph compiled with dynamic shapes stays dynamic. Comparisons with ``customized_coc`` keys become guards."""
    keys = shape_keys(call.backend, call.parallel_num)
    if keys is None:
        return (0, 0, 0)
    if keys == "exact":
        return shape
    m, k, n = shape
    for key in keys:
        if m == key[0] and k == key[1] and n == key[2]:
            return key
    return (0, 0, 0)
