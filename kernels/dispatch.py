"""Backend choice per call: explicit argument, else the COC_* environment, with fused fallback.

Order (design.md, "Choosing a path"): an explicit ``backend=`` wins; else
``USE_COC_FUSED_KERNEL=1`` -> fused; else a split count > 1 from ``parallel_num=``,
``customized_coc[m, k, n]`` or ``COC_PARALLEL_NUM`` -> chunked; else sequential. A fused request
on a group whose ranks cannot map each other's memory runs the chunked path instead and warns
once per reason.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from . import agree, chunked, sequential
from .config import get_config

_warned: set[str] = set()


def _fused_module() -> Any:
    try:
        from . import fused
    except ImportError as e:
        raise NotImplementedError(f"the fused backend is not available in this build ({e})") from e
    return fused


def _fused_unavailable(group: Optional[dist.ProcessGroup], device: torch.device) -> Optional[str]:
    return _fused_module().unavailable_reason(group, device)


def _warn_fallback(op: str, reason: str) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(f"{op}: the fused backend cannot run here ({reason}); using the chunked path "
                  "instead (this warning is shown once per reason)", RuntimeWarning, stacklevel=4)


def resolve(op: str, backend: Optional[str], parallel_num: Optional[int], x: torch.Tensor,
            weight: torch.Tensor, group: Optional[dist.ProcessGroup], world: int, *,
            bias: Optional[torch.Tensor] = None, flag: bool = False,
            quant: Optional[tuple[str, int]] = None) -> tuple[str, int]:
    """``(backend, parallel_num)`` to run ``op`` with; ``x`` is the 2-D input as the op sees it.

    Under ``COC_CHECK=1`` the ranks first compare their calls (``kernels.agree``; ``bias``,
    ``flag`` and ``quant``, the ``(mode, group_size)`` of a w8A16 weight, are compared too):
    resolving may already communicate, so the check comes first.
    """
    config = get_config()
    if config.check and world > 1:
        agree.check_call(op, x, weight, bias, flag, backend, parallel_num, quant, config, group, world)
    if backend == "sequential":
        return backend, 1
    if backend is None and config.use_fused:
        backend = "fused"
    if backend == "fused":
        reason = _fused_unavailable(group, x.device)
        if reason is None:
            return backend, 1
        _warn_fallback(op, reason)
        backend = "chunked"
    num: Union[int, str] = parallel_num if parallel_num is not None else config.parallel_num_for(
        x.shape[0], x.shape[1], weight.shape[0])
    if num == "auto":
        from .tune import choose_parallel_num

        # Fused is a candidate only when nothing forced a backend (an unavailable fused request
        # has become "chunked" above).
        num = choose_parallel_num(op, x, weight, group, world, allow_fused=backend is None)
        if num == "fused":
            return "fused", 1
    assert isinstance(num, int)
    if backend is None:
        backend = "chunked" if num > 1 else "sequential"
    return backend, num


def run(op: str, backend: str, parallel_num: int, x: torch.Tensor, weight: torch.Tensor,
        bias: Optional[torch.Tensor], group: Optional[dist.ProcessGroup], world: int,
        flag: bool) -> Any:
    """Run ``op`` on 2-D ``x``; ``flag`` is ``return_gathered`` for the all-gather op and
    ``deterministic`` for the reducing ops."""
    if backend == "fused":
        return getattr(_fused_module(), op)(x, weight, bias, group, flag)
    if backend == "chunked":
        return getattr(chunked, op)(x, weight, bias, group, world, flag, parallel_num)
    return getattr(sequential, op)(x, weight, bias, group, world, flag)
