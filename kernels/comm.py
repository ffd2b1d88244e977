"""Thin wrappers over torch.distributed collectives used by the sequential and chunked paths.

They hide the renames across torch releases (``all_gather_into_tensor`` -> ``all_gather_single``,
``reduce_scatter_tensor`` -> ``reduce_scatter_single``) and hold the fixed-order reductions that
``deterministic=True`` relies on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .checks import group_size


class _Done:
    """Stands for the work of a collective over one rank: there is nothing to wait for."""

    def wait(self) -> bool:
        return True


def _single_rank(group: dist.ProcessGroup | None) -> bool:
    # A group of one needs no communication, and works without torch.distributed initialized.
    return group_size(group) == 1


def _out_of_place(
    collective: Callable[..., dist.Work | None],
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> dist.Work | _Done | None:
    """``collective(out, inp)`` over ``group``; a group of one only copies ``inp`` into ``out`` (the one step every
    out-of-place collective shares, so none of them needs torch.distributed for a single rank)."""
    if not _single_rank(group):
        return collective(out, inp, group=group, async_op=async_op)
    if out.data_ptr() != inp.data_ptr():
        out.copy_(inp.view_as(out))
    return _Done() if async_op else None


# torch's own functions under this release's names (bound here, so a caller that always has several ranks, such as
# the admission, calls torch directly).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """``out [W * r, ...] = concat over ranks of inp [r, ...]`` (rank order)."""
    return _out_of_place(all_gather_single, out, inp, group, async_op)


def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """``out [r, ...] = sum over ranks of inp [W * r, ...][rank * r : (rank + 1) * r]``."""
    return _out_of_place(_reduce_scatter_single, out, inp, group, async_op)


def all_to_all(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """``out[src] = inp_of_rank_src[rank]`` along dim 0, equal splits."""
    return _out_of_place(dist.all_to_all_single, out, inp, group, async_op)


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False) -> dist.Work | None:
    """In-place sum over ranks."""
    if _single_rank(group):
        return _Done() if async_op else None
    return dist.all_reduce(t, group=group, async_op=async_op)


def sum_in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """``parts[0] + parts[1] + ... + parts[W-1]``, left to right.

    An explicit loop rather than ``parts.sum(0)``: the result must not depend on how a reduction
    kernel happens to tree its additions, so every rank and every backend that sums the same
    partials in rank order gets the same bits.
    """
    acc = parts[0].clone()
    for i in range(1, parts.shape[0]):
        acc += parts[i]
    return acc


def split_rows(rows: int, parallel_num: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of up to ``parallel_num`` non-empty pieces covering ``rows`` (the scripted path's
    pieces: each piece's collective overlaps the next piece's GEMM).

    Sizes differ by at most one row (the first pieces take the remainder), so an uneven row
    count costs one slightly larger piece, not a padded tail.
    """
    pieces = min(parallel_num, rows) if rows > 0 else 1
    base, extra = divmod(rows, pieces)
    bounds, start = [], 0
    for i in range(pieces):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` extended with zero rows to ``rows`` rows (adding zeros keeps sums exact)."""
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows,) + tuple(t.shape[1:]))
    out[: t.shape[0]] = t
    return out
