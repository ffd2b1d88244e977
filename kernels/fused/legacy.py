"""The old entry points' arguments as one call: they build an :class:`~kernels.call.OpCall` and
:class:`~kernels.call.Operands` and run the pattern modules (:mod:`matmul`, :mod:`all_gather`,
:mod:`scatter`, :mod:`all_reduce`). Goes away with the wrappers once the ops layer calls ``run``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..call import OpCall, Operands, group_name
from ..format import OperandFormat
from . import runtime


def described(x: torch.Tensor, comm_dim: int, outer: int) -> torch.Tensor:
    """2-D rows ``x`` as a tensor whose dims before ``comm_dim`` multiply to ``outer`` (a view: x's
    ``outer`` row blocks, then ``comm_dim - 1`` dims of 1), so the call descriptor and the row layout
    read the caller's ``gather_dim`` / ``scatter_dim`` and blocks from its shape."""
    if comm_dim == 0:
        return x
    return x.view(outer, *([1] * (comm_dim - 1)), x.shape[0] // outer, x.shape[1])


def call_of(
    pattern: str,
    fmt: OperandFormat,
    group: dist.ProcessGroup | None,
    *,
    out_dtype: torch.dtype | None = None,
    flag: bool = False,
    comm_dim: int = 0,
) -> OpCall:
    """The fused call of an old entry point (``flag``: ``return_gathered`` or ``deterministic``)."""
    return OpCall(
        pattern=pattern,
        fmt=fmt,
        out_dtype=out_dtype,
        return_gathered=flag and pattern == "all_gather",
        deterministic=flag and pattern != "all_gather",
        comm_dim=comm_dim,
        group_name=group_name(group),
        world=runtime.world_size(runtime.resolve_group(group)),
        backend="fused",
    )


def operands(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    *,
    x_scale: torch.Tensor | None = None,
    w_scales: Sequence[torch.Tensor | None] = (),
    w_offsets: Sequence[torch.Tensor | None] = (),
) -> Operands:
    return Operands(x, tuple(weights), tuple(biases), x_scale, tuple(w_scales), tuple(w_offsets))


def int8_format(scale: torch.Tensor, group_size: int, offset: torch.Tensor | None) -> OperandFormat:
    """The w8A16 format of a validated ``scale`` (its dims name the layout; ``group_size`` counts for
    per-group scales only)."""
    mode = ("per_tensor", "per_channel", "per_group")[scale.dim()]
    return OperandFormat(
        kind="int8", mode=mode, group_size=group_size if mode == "per_group" else 0, offset=offset is not None
    )
