"""Expert-parallel dispatch / combine (:mod:`kernels.ops.moe.ep`): checks, the handle, the call value, the layout.

Notation: ``W`` ranks, this rank ``me``, ``E`` experts split evenly (expert ``e`` lives on rank ``e // E_l``,
``E_l = E / W``), ``m`` this rank's tokens, ``topk`` slots, ``S = m * topk`` pairs, pair ``p = t * topk + s``.

Layout of one dispatch (everything on the device with shapes known on the host, except where a mode says)::

    counts[r, e] = pairs of rank r routed to expert e             # all_gather of each rank's [E]: every rank
                                                                  # knows every rank's send and receive counts
    send order  = argsort(topk_ids.flatten(), stable=True)        # (dest rank, local expert, token, slot)
    send buffer = dest blocks: exact mode packed (send_counts[d] rows each), bounded mode one block of
                  max_tokens rows per dest (rows past it go to a dump row: only on overflow, which raises)
    receive buffer = the same from every source rank: (src, local expert, token, slot)
    rows        = the received rows grouped by local expert: (local expert, src, token, slot)

``send_index [S]`` (where each pair sits in the send buffer) and ``recv_to_row [Q]`` (the output row of each
receive-buffer position, ``R`` = a dump row for padding) are all the data movement needs, in both directions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ...format import PLAIN, OperandFormat
from ...protocol import Call
from ...protocol.call import Items, shown_as
from ..grouped_matmul import PLAIN_DTYPES
from .payload import check_payload, split_x
from .routing import check_id_values, check_same_device, check_topk_ids

DISPATCH, COMBINE = "moe_dispatch", "moe_combine"


class MoeDispatchHandle(NamedTuple):
    """What :func:`kernels.moe_combine` (and the backward) needs from one :func:`kernels.moe_dispatch` call.

    ``expert_offsets [E_l]`` int64: cumulative end row of each local expert (``kernels.grouped_matmul``'s
    ``expert_offsets``; bounded mode: the last is ``max_tokens``, the zero padding rows counted in the last
    expert); ``src_rank``, ``src_token``, ``src_slot [R]`` int64: where each row comes from (-1 for padding);
    ``recv_to_row [Q]`` int64: the row of each receive-buffer position (``R`` for an empty one);
    ``send_index [S]`` int64: where each of this rank's pairs sits in the send buffer; ``send_counts``,
    ``recv_counts [W]`` int64: rows this rank sends to / receives from each rank; ``valid`` (0-d int64): the
    rows that hold data (``R`` in exact mode); ``pair_dest [S]`` int64: ``row * W + rank`` of each of this rank's
    pairs, its row on the rank of its expert (-1: dropped by a bounded overflow); ``rows_bound`` (0-d int64): the
    most rows any rank holds (``max_tokens`` in bounded mode; the same on every rank); ``topk_weights [m, topk]``:
    as given; ``call``: the dispatch's :class:`EpCall` string.
    """

    expert_offsets: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_slot: torch.Tensor
    recv_to_row: torch.Tensor
    send_index: torch.Tensor
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    valid: torch.Tensor
    pair_dest: torch.Tensor
    rows_bound: torch.Tensor
    topk_weights: torch.Tensor
    call: str


@dataclass(frozen=True, kw_only=True)
class EpCall(Call):
    """One dispatch / combine call without its tensors. ``num_experts`` E (a multiple of W), ``topk``,
    ``max_tokens`` (0: the exact mode), ``fmt`` the dispatch's payload format (plain, ``fp8:row``, ``fp8:block``;
    a combine's is plain), ``deterministic`` (the combine's; always summed in slot order)."""

    num_experts: int = 0
    topk: int = 0
    max_tokens: int = 0
    fmt: OperandFormat = field(default=PLAIN, metadata=shown_as("format"))
    deterministic: bool = True

    def operand_items(self, operands: Any) -> Items:
        # m_local (each rank's own token count) may differ between ranks; the row width and dtype may not.
        x, name = operands.rows_in, "y" if self.op == COMBINE else "x"
        return ((f"{name}.shape[1]", x.shape[1]), (f"{name}.dtype", x.dtype))

    @property
    def bounded(self) -> bool:
        return self.max_tokens > 0


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_dispatch(
    x: object, topk_ids: object, topk_weights: object, sizes: tuple[object, object, int]
) -> OperandFormat:
    """``moe_dispatch``'s metadata and its payload format; ``x`` as given (a tensor or an ``(x_fp8, x_scale)``
    pair, :mod:`kernels.ops.moe.payload`), ``sizes = (num_experts, max_tokens, W)``."""
    num_experts, max_tokens, world = sizes
    payload, x_scale = split_x(x)
    fmt = check_payload(payload, x_scale)
    assert isinstance(payload, torch.Tensor)
    x, ids, tw = payload, _tensor("topk_ids", topk_ids), _tensor("topk_weights", topk_weights)
    check_topk_ids(ids, x)
    if not tw.is_floating_point() or tuple(tw.shape) != tuple(ids.shape):
        raise ValueError(
            f"topk_weights must be a floating tensor of topk_ids' shape {tuple(ids.shape)}, got "
            f"{tuple(tw.shape)} {tw.dtype}"
        )
    if type(num_experts) is not int or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if num_experts % world:
        raise ValueError(
            f"num_experts={num_experts} does not split evenly over W={world} ranks: expert parallelism places "
            f"E / W experts on each rank (expert e on rank e // (E / W)); use a multiple of {world}"
        )
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise ValueError(
            f"max_tokens must be None (exact mode) or an int >= 1 (the most rows any rank may receive), "
            f"got {max_tokens!r}"
        )
    check_same_device(x, (("topk_ids", ids), ("topk_weights", tw)))
    return fmt


def check_combine(y: object, handle: object, deterministic: object) -> MoeDispatchHandle:
    """``moe_combine``'s metadata; returns the handle."""
    y = _tensor("y", y)
    if not isinstance(handle, MoeDispatchHandle):
        raise TypeError(
            f"handle must be the kernels.MoeDispatchHandle that moe_dispatch returned, got {type(handle).__name__}"
        )
    if type(deterministic) is not bool:
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    rows = handle.src_rank.shape[0]
    if y.dim() != 2 or y.shape[0] != rows:
        raise ValueError(
            f"y must be 2-D [R, n] with R = {rows} (the rows moe_dispatch returned, in their order), got "
            f"shape {tuple(y.shape)}"
        )
    if y.dtype not in PLAIN_DTYPES:
        raise TypeError(
            f"y dtype {y.dtype} is not accepted; use one of {[str(d) for d in PLAIN_DTYPES]} (the combine moves and "
            "sums y in its own dtype: its payloads are never FP8, even after an FP8 dispatch)"
        )
    if y.device != handle.src_rank.device:
        raise ValueError(f"y is on {y.device} but the handle's tensors are on {handle.src_rank.device}")
    return handle


def check_id_range(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Every id in ``[0, num_experts)`` (a host read, where :func:`kernels.ops.moe.routing.wanted` says so)."""
    check_id_values(topk_ids, num_experts, named="num_experts")


def my_rank(call: EpCall, group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if call.world > 1 else 0


class Layout(NamedTuple):
    """One dispatch's placement (module docstring); ``table [W, E]`` every rank's per-expert send counts."""

    send_index: torch.Tensor
    recv_to_row: torch.Tensor
    expert_offsets: torch.Tensor
    src_rank: torch.Tensor
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    valid: torch.Tensor
    pair_dest: torch.Tensor
    rows_bound: torch.Tensor
    rows: int


def expert_counts(flat_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(send order, counts [E])`` of this rank's flattened ids: a sorted search, not bincount (CUDA's
    bincount reads its input's max on the host)."""
    experts, order = torch.sort(flat_ids, stable=True)
    targets = torch.arange(num_experts, device=flat_ids.device, dtype=torch.int64)
    ends = torch.searchsorted(experts, targets, right=True)
    return order, torch.diff(ends, prepend=ends.new_zeros(1))


def _exclusive(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.cumsum(t, dim) - t


def layout(order: torch.Tensor, table: torch.Tensor, call: EpCall, me: int) -> Layout:
    """Where every pair goes and where every received row lands (module docstring). Bounded mode reads
    nothing on the host; exact mode reads the receive total (the output's row count)."""
    world, num_e, cap = call.world, call.num_experts, call.max_tokens
    e_l = num_e // world
    dev = table.device
    per = table.view(world, world, e_l)  # [src, dest, local expert]
    send_counts, recv_counts = per[me].sum(1), per[:, me].sum(1)
    counts_from = per[:, me]  # [src, local expert]: what this rank receives
    # Sender: the sorted pairs are dest-major; a pair's rank within its dest block places it.
    send_start = _exclusive(send_counts)
    pairs = order.numel()
    sorted_pos = torch.empty(pairs, dtype=torch.int64, device=dev)
    sorted_pos[order] = torch.arange(pairs, device=dev)
    if call.bounded:
        dest = torch.searchsorted(torch.cumsum(send_counts, 0), sorted_pos, right=True)
        within = sorted_pos - send_start[dest.clamp(max=world - 1)]
        send_index = torch.where(within < cap, dest * cap + within, world * cap)
        rows, recv_slots = cap, world * cap
        block_start = torch.arange(world, device=dev) * cap
    else:
        send_index = sorted_pos
        recv_total = int(recv_counts.sum())  # exact mode: the host read that sizes the output
        rows, recv_slots = recv_total, recv_total
        block_start = _exclusive(recv_counts)
    # Receiver: position q of source block r is that source's row i = q - block_start[r]; its local expert
    # from the source's per-expert counts; its row: expert start + rows of that expert from earlier sources
    # + its rank within (r, e).
    q = torch.arange(recv_slots, device=dev)
    block_len = torch.full_like(recv_counts, cap) if call.bounded else recv_counts
    src = torch.searchsorted(block_start + block_len, q, right=True).clamp(max=world - 1)
    i = q - block_start[src]
    ok = i < recv_counts[src]
    cum_from = torch.cumsum(counts_from, 1)  # [src, e] inclusive ends within the block
    if call.bounded:
        cum_from = cum_from.clamp(max=cap)  # an overflowing source's ends stay inside its block
    flat = torch.searchsorted((block_start[:, None] + cum_from).reshape(-1), q, right=True)
    expert = (flat - src * e_l).clamp(0, e_l - 1)
    per_expert = counts_from.sum(0)
    expert_start = _exclusive(per_expert)
    earlier_srcs = _exclusive(counts_from, 0)  # [src, e]
    within_block = i - (cum_from - counts_from)[src, expert]
    row = expert_start[expert] + earlier_srcs[src, expert] + within_block
    ok = ok & (row < rows)
    recv_to_row = torch.where(ok, row, rows)
    offsets = torch.cumsum(per_expert, 0)
    valid = offsets[-1].clamp(max=rows) if call.bounded else offsets[-1].clone()
    if call.bounded:
        # Padding rows count in the last expert, so the offsets end at max_tokens (grouped_matmul's contract).
        offsets = torch.cat([offsets[:-1].clamp(max=cap), offsets.new_full((1,), cap)])
    src_rank = torch.full((rows + 1,), -1, dtype=torch.int64, device=dev)
    src_rank[recv_to_row] = torch.where(ok, src, -1)
    pair_dest, rows_bound = pair_destinations(order, table, call, me)
    return Layout(
        send_index, recv_to_row, offsets, src_rank[:rows], send_counts, recv_counts, valid, pair_dest, rows_bound, rows
    )


def pair_destinations(
    order: torch.Tensor, table: torch.Tensor, call: EpCall, me: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pair_dest [S], rows_bound)`` (:class:`MoeDispatchHandle`), on the device: the row of a pair on the rank
    ``d`` of its expert ``e = d * E_l + j`` is an exclusive scan of the counts over (local expert, source), the
    rows of ``d``'s experts below ``j`` plus the rows of expert ``e`` from sources below this rank, plus the pair's
    rank among this rank's pairs of ``e`` (``layout``'s receive-side row, computed at the sender)."""
    world, num_e = call.world, call.num_experts
    e_l = num_e // world
    per = table.view(world, world, e_l)  # [src, dest, local expert]
    base = (_exclusive(per.sum(0), 1) + _exclusive(per, 0)[me]).reshape(num_e)
    mine = table[me]
    ends = torch.cumsum(mine, 0)
    pos = torch.arange(order.numel(), device=table.device)
    expert = torch.searchsorted(ends, pos, right=True).clamp(max=num_e - 1)
    row = base[expert] + pos - (ends - mine)[expert]
    if call.bounded:
        keep = row < call.max_tokens
        rows_bound = torch.full((), call.max_tokens, dtype=torch.int64, device=table.device)
    else:
        keep = torch.ones_like(row, dtype=torch.bool)
        rows_bound = per.sum((0, 2)).max()
    pair_dest = torch.empty_like(order)
    pair_dest[order] = torch.where(keep, row * world + expert // e_l, -1)
    return pair_dest, rows_bound


def overflow_message(op: str, table: torch.Tensor, call: EpCall) -> str | None:
    """The bounded mode's overflow error (a host read of the all-gathered counts, the same on every rank)."""
    world, e_l = call.world, call.num_experts // call.world
    totals = table.view(world, world, e_l).sum((0, 2)).tolist()
    over = [(r, n) for r, n in enumerate(totals) if n > call.max_tokens]
    if not over:
        return None
    named = ", ".join(f"rank {r} would receive {n}" for r, n in over)
    return (
        f"{op}: max_tokens={call.max_tokens} overflow: {named} rows (pairs routed to its experts); no row was "
        "sent or dropped. Raise max_tokens to the most rows a rank may receive, or use max_tokens=None (exact "
        "mode). Every rank raised this error"
    )


class Piece(NamedTuple):
    """One all-to-all of the chunked movement: send-buffer and receive-buffer positions and their splits."""

    send_pos: torch.Tensor
    in_splits: list[int]
    recv_pos: torch.Tensor
    out_splits: list[int]


def pieces(call: EpCall, send_counts: torch.Tensor, recv_counts: torch.Tensor, device: torch.device) -> list[Piece]:
    """The ``parallel_num`` pieces: piece i holds rows ``[c * i // P, c * (i + 1) // P)`` of every (src, dest)
    block of ``c`` rows, so a sender and its receiver cut a block alike. Exact mode reads the counts on the
    host (its all-to-all takes host splits); bounded mode cuts the fixed ``max_tokens`` blocks."""
    num = max(call.parallel_num, 1)
    world = call.world
    if call.bounded:
        sends = recvs = [call.max_tokens] * world
    else:
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
    out = []
    for p in range(num):
        parts = []
        for lens in (sends, recvs):
            starts = [0, *itertools.accumulate(lens)][:-1]
            bounds = [(s + c * p // num, s + c * (p + 1) // num) for s, c in zip(starts, lens, strict=True)]
            pos = [torch.arange(a, b, device=device) for a, b in bounds]
            parts.append((torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64, device=device), bounds))
        (send_pos, sb), (recv_pos, rb) = parts
        out.append(Piece(send_pos, [b - a for a, b in sb], recv_pos, [b - a for a, b in rb]))
    return out


def _a2a(out: torch.Tensor, inp: torch.Tensor, splits: tuple[list[int], list[int]], call: EpCall) -> object:
    """``all_to_all_single`` (async) with ``splits = (out_splits, in_splits)``; a copy for one rank."""
    if call.world == 1:
        out.copy_(inp)
        return None
    # gloo's all-to-all takes no 2-byte dtype: 2-byte floats travel as their bytes (uint8), splits unchanged.
    if out.element_size() == 2:
        out, inp = out.view(torch.uint8), inp.view(torch.uint8)
    group = call.group
    return dist.all_to_all_single(out, inp, splits[0], splits[1], group=group, async_op=True)


def to_experts(
    pair_rows: torch.Tensor,
    tensors: list[torch.Tensor],
    rows: int,
    call: EpCall,
    *,
    landed: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The dispatch's movement: ``pair_rows [S, n]`` (pair ``t * topk + s``) -> ``[rows, n]`` in expert-grouped
    order (zeros where nothing lands). ``tensors = [recv_to_row, send_index, send_counts, recv_counts]``.
    ``landed(out [rows + 1, n], piece_rows)``, if given, runs as each piece is placed, while the later pieces
    travel: ``piece_rows`` are the piece's rows of ``out`` (``rows``, the dump row, for a bounded block's padding)."""
    recv_to_row, send_index, send_counts, recv_counts = tensors
    n, slots = pair_rows.shape[1], (call.world * call.max_tokens if call.bounded else pair_rows.shape[0])
    send = pair_rows.new_zeros((slots + 1, n))
    send[send_index] = pair_rows
    out = pair_rows.new_zeros((rows + 1, n))
    started = []
    for piece in pieces(call, send_counts, recv_counts, pair_rows.device):
        recv = pair_rows.new_empty((piece.recv_pos.numel(), n))
        started.append((piece, recv, _a2a(recv, send[piece.send_pos], (piece.out_splits, piece.in_splits), call)))
    for piece, recv, work in started:
        if work is not None:
            work.wait()
        placed = recv_to_row[piece.recv_pos]
        out[placed] = recv  # the regrouping of this piece, while later pieces travel
        if landed is not None:
            landed(out, placed)
    return out[:rows]


def to_sources(rows: torch.Tensor, tensors: list[torch.Tensor], pairs: int, call: EpCall) -> torch.Tensor:
    """The combine's movement, the inverse of :func:`to_experts`: ``rows [R, n]`` -> each pair's row ``[S, n]``
    at its token's rank (zeros for pairs a bounded overflow left unsent)."""
    recv_to_row, send_index, send_counts, recv_counts = tensors
    n = rows.shape[1]
    slots = call.world * call.max_tokens if call.bounded else pairs
    padded = torch.cat([rows, rows.new_zeros((1, n))])
    back = rows.new_zeros((slots + 1, n))
    started = []
    for piece in pieces(call, send_counts, recv_counts, rows.device):
        recv = rows.new_empty((piece.send_pos.numel(), n))
        sent = padded[recv_to_row[piece.recv_pos]]
        started.append((piece, recv, _a2a(recv, sent, (piece.in_splits, piece.out_splits), call)))
    for piece, recv, work in started:
        if work is not None:
            work.wait()
        back[piece.send_pos] = recv
    return back[send_index]


def weighted_sum(pair_rows: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum over s, in slot order, of w[t, s] * pair_rows[t * topk + s]`` in fp32, rounded once: an
    explicit loop (not ``sum(dim)``), so every backend adds in the same order."""
    m, topk = topk_weights.shape
    w, rows = topk_weights.to(torch.float32), pair_rows.view(m, topk, pair_rows.shape[1]).to(torch.float32)
    acc = rows[:, 0] * w[:, 0:1]
    for s in range(1, topk):
        acc += rows[:, s] * w[:, s : s + 1]
    return acc.to(dtype)
