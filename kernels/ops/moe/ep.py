"""Expert-parallel mixture of experts: dispatch each (token, slot) pair's row to the rank of its expert, and
combine the experts' outputs back into each token's top-k weighted sum.

Public functions (docs/api.md, "Expert-parallel MoE"): :func:`moe_dispatch` and :func:`moe_combine` (their
docstrings state the semantics: the sequential backend). Registered operators::

    coc::moe_dispatch(Tensor x, Tensor? x_scale, Tensor topk_ids, str call)
        -> (Tensor rows, Tensor rows_scale, Tensor[11] handle tensors)      # rows_scale [R, 0]: plain rows
    coc::moe_combine(Tensor y, Tensor topk_weights, Tensor[] handle, str call) -> (Tensor out, Tensor returned)
                                                    # call: kernels.ops.moe.layout.EpCall

Backends (results bitwise equal: the ops move rows and sum in a fixed order):

- ``sequential``: one ``torch.distributed.all_to_all_single`` of the rows (exact mode: split sizes from the
  all-gathered counts, read on the host; bounded mode: equal ``max_tokens`` blocks per peer), then the rows
  placed in their expert-grouped order.
- ``chunked``: every (source, destination) block cut in ``parallel_num`` pieces, all pieces' all-to-alls
  started at once, and each piece placed in its final rows (the regrouping: an index copy) as it lands,
  while the later pieces are in flight. That copy is the only local work the op itself holds, a small
  fraction of the all-to-all's time: the overlap that matters, the all-to-all of one piece under the
  grouped GEMM of another, is :func:`kernels.ops.moe.ep_gemm.moe_dispatch_grouped_matmul` (this movement with
  the GEMM run on each piece as it lands, ``consumer`` of :func:`dispatch_run`).
- ``fused`` (:mod:`kernels.fused.moe_ep`, W > 1; a group of one runs the local movement): the counts exchanged
  through the symmetric heap, each row written by its sender straight to its final row in the receiver's heap,
  and the combine's rows read back from the experts' ranks and summed in the same kernel; the same placement
  (:func:`layout`) and :func:`weighted_sum`'s order and roundings, so the same bits. Where the fused kernels cannot run
  (:func:`kernels.fused.unavailable_reason`) it warns once per reason and runs ``chunked``. The backward passes
  run the chunked movement.

Payloads (:mod:`kernels.ops.moe.payload`): plain rows, or FP8 rows with their per-row / per-1x128 scales packed
into one ``uint8`` row that every backend moves as it moves plain rows (the format is a field of the call value),
unpacked on arrival; bounded mode's padding rows get scale 1.0.

The bounded mode's overflow (some rank would receive more than ``max_tokens`` rows) is found from the count
table [W, E] (all-gathered, or exchanged over the heap by the fused backend), which every rank holds, so every
rank raises the same ``RuntimeError`` before any row moves: where a host read is allowed (CPU always; CUDA under
``COC_CHECK=1``). Elsewhere (CUDA eager, CUDA-graph capture) the op reads nothing: the verdict is computed on the
device and ORed into the group's sticky flag (in place, so every replay of a captured dispatch sets it again), and
the next eager dispatch on the group (or :func:`moe_check_overflow`) reads it, clears it and raises naming the
call; the rows of an overflowing call are never silently kept (the flag is always read; the rows past
``max_tokens`` are dropped, and a combine after it sums zeros for them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import checks
from ...capture import capturing
from ...format import pack_rows
from ...protocol import Built, OpSpec, admitted, group_name, resolve_group, run
from ..all_gather import gather_rows
from .layout import (
    COMBINE,
    DISPATCH,
    EpCall,
    Layout,
    MoeDispatchHandle,
    check_combine,
    check_dispatch,
    check_id_range,
    expert_counts,
    layout,
    my_rank,
    overflow_message,
    to_experts,
    to_sources,
    weighted_sum,
)
from .payload import scale_cols, split_x, unpack
from .routing import needs_grad, wanted

# Bounded-mode overflow not read on the host yet: one sticky device flag per (group name, device) that every such
# dispatch ORs its verdict into in place, so a dispatch captured in a CUDA graph sets it again at every replay; the
# groups whose flag may be set since its last read (captured: always, since replays run without the host).
_pending: dict[tuple[str, str], torch.Tensor] = {}
_unread: set[str] = set()
_captured: set[str] = set()


@dataclass(frozen=True)
class DispatchOperands:
    """A dispatch's tensors (``x_scale`` an FP8 payload's, else None); ``extra``: a fused op's other operands."""

    x: torch.Tensor
    x_scale: torch.Tensor | None
    topk_ids: torch.Tensor

    @property
    def rows_in(self) -> torch.Tensor:
        return self.x

    def flat(self) -> tuple:
        return (self.x, self.x_scale, self.topk_ids)


@dataclass(frozen=True)
class CombineOperands:
    """A combine's tensors: ``handle`` the movement's six handle tensors (:func:`handle_tensors`)."""

    y: torch.Tensor
    topk_weights: torch.Tensor
    handle: tuple[torch.Tensor, ...]

    @property
    def rows_in(self) -> torch.Tensor:
        return self.y

    def flat(self) -> tuple:
        return (self.y, self.topk_weights, list(self.handle))

    @staticmethod
    def of(y: torch.Tensor, topk_weights: torch.Tensor, handle: list[torch.Tensor]) -> CombineOperands:
        return CombineOperands(y, topk_weights, tuple(handle))


def moe_dispatch(
    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    *,
    max_tokens: int | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], MoeDispatchHandle]:
    """``(rows [R, k], handle)``: the (token, slot) rows this rank's experts need from every rank, grouped by
    local expert. Semantics (the ``sequential`` backend)::

        E_l = E // W; dest(e) = e // E_l                              # expert e lives on rank dest(e)
        order = argsort(topk_ids.flatten(), stable=True)              # pairs p = t * topk + s by (expert, t, s)
        send = x[order // topk]                                       # dest-major blocks
        counts = all_gather(count of each expert in topk_ids)         # [W, E]: every rank's counts
        recv = all_to_all_single(send, splits from counts)            # from each src: (local expert, t, s)
        rows = recv sorted stably by local expert                     # (local expert, src rank, token, slot)
        expert_offsets[e] = rows of local experts <= e                # cumulative ends

    ``x [m_local, k]`` (fp16 / bf16 / fp32) this rank's tokens (m_local may differ between ranks), or an FP8
    pair ``(x_fp8, x_scale)`` (:mod:`kernels.ops.moe.payload`; then ``rows`` is ``(rows_fp8 [R, k],
    rows_scale [R, s])``, not differentiable: each row moves with its scale row, so ``rows_fp8[j]`` and
    ``rows_scale[j]`` are the bytes of its source row); ``topk_ids [m_local, topk]`` (int32 / int64 in
    ``[0, num_experts)``); ``topk_weights [m_local, topk]`` (floating; kept in the handle for :func:`moe_combine`);
    ``num_experts``: E, a multiple of W (expert e lives on rank ``e // (E / W)``); ``max_tokens``: None (exact
    mode, R = the rows received) or the most rows any rank may receive (bounded mode: every peer block is
    ``max_tokens`` rows, no host read, ``rows`` is ``[max_tokens, k]`` with the rows past ``handle.valid`` zero
    (FP8: scale 1.0), ``expert_offsets[-1] = max_tokens``; a rank that would receive more makes every rank raise
    ``RuntimeError`` (``max_tokens ... overflow``) before rows move); ``backend`` / ``parallel_num`` as the dense
    ops. Differentiable in plain ``x`` (:class:`kernels.ops.moe.autograd.MoeDispatchFunction`).
    """
    request = (backend, parallel_num)
    build = dispatch_builder(DISPATCH, (x, topk_ids, topk_weights), (num_experts, max_tokens), group, request)
    built, call, text = admitted(DISPATCH_SPEC, DISPATCH, group, build)
    ops = built.operands
    if ops.x_scale is None and needs_grad(ops.x):
        from .autograd import MoeDispatchFunction

        text = text or call.encode()
        out = MoeDispatchFunction.apply(ops.x, ops.topk_ids, text)
    else:
        out = run(DISPATCH_SPEC, call, ops, text)
        text = text or call.encode()
    rows, rows_scale, *parts = out
    handle = MoeDispatchHandle(*parts, topk_weights=topk_weights, call=text)
    return ((rows, rows_scale) if ops.x_scale is not None else rows), handle


def moe_combine(
    y: torch.Tensor,
    handle: MoeDispatchHandle,
    *,
    deterministic: bool = True,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
) -> torch.Tensor:
    """``out [m_local, n]``: the experts' outputs ``y [R, n]`` (rows in the order :func:`moe_dispatch`
    returned) sent back to their tokens' ranks and summed per token with the top-k weights. Semantics (the
    ``sequential`` backend)::

        back = all_to_all_single(y in receive order, the dispatch's splits reversed)   # each pair's row, home
        y_ts = back row of pair (t, s)                       # bounded mode: rows past handle.valid never sent
        out[t] = w[t, 0] * y_t0 (fp32)                       # w = handle.topk_weights.float()
        for s in 1 .. topk - 1: out[t] += w[t, s] * y_ts     # fp32, slot order
        return out.to(y.dtype)                               # [m_local, n], one rounding

    The sum is bitwise equal across runs, backends, modes and W for the same expert outputs.
    ``deterministic=False`` is accepted and sums alike (no faster unordered path exists). ``group``: None or the
    dispatch's group. Differentiable in ``y`` and the handle's ``topk_weights``
    (:class:`kernels.ops.moe.autograd.MoeCombineFunction`).
    """
    sent = EpCall(op=DISPATCH)
    if isinstance(handle, MoeDispatchHandle):
        sent = EpCall.decode(handle.call)
        if group is not None and group_name(group) != sent.group_name:
            raise ValueError(f"{COMBINE}: group is not the group of the dispatch that made the handle")
        group = resolve_group(sent.group_name)

    def build(world: int) -> Built:
        check_combine(y, handle, deterministic)
        checks.check_backend(backend)
        checks.check_parallel_num(parallel_num)
        call = EpCall(
            op=COMBINE,
            group_name=sent.group_name,
            world=world,
            backend=backend,
            parallel_num=parallel_num,
            num_experts=sent.num_experts,
            topk=handle.topk_weights.shape[1],
            max_tokens=sent.max_tokens,
            deterministic=deterministic,
        )
        return Built(call, CombineOperands(y, handle.topk_weights, handle_tensors(handle)), y.device)

    built, call, text = admitted(COMBINE_SPEC, COMBINE, group, build)
    if needs_grad(y, handle.topk_weights):
        from .autograd import MoeCombineFunction

        ops = built.operands
        return MoeCombineFunction.apply(ops.y, ops.topk_weights, ops.handle, text or call.encode())
    return run(COMBINE_SPEC, call, built.operands, text)[0]


def moe_check_overflow(group: dist.ProcessGroup | None = None) -> None:
    """Read the bounded-mode overflow flag of ``group``'s dispatches that were not checked on the host
    (CUDA without ``COC_CHECK=1``, or captured: every replay of a captured dispatch sets it again) and raise the
    named ``RuntimeError`` if one overflowed since the last read (the flag is then cleared). Every rank holds the
    same flag (it comes from the count table every rank holds), so every rank raises alike. A host read: waits
    for the flagged calls' streams."""
    name = group_name(group)
    if name not in _unread and name not in _captured:
        return
    _unread.discard(name)
    for key, flag in _pending.items():
        if key[0] == name and bool(flag.item()):
            flag.zero_()
            raise RuntimeError(
                f"{DISPATCH}: max_tokens overflow in an earlier bounded call on this group: a rank had more rows "
                "routed to its experts than max_tokens (found from the count table every rank holds, read at this "
                "check; rows past max_tokens were not kept). Raise max_tokens or use max_tokens=None (exact mode)"
            )


def handle_tensors(handle: MoeDispatchHandle) -> tuple[torch.Tensor, ...]:
    """What the combine's movement needs: the all-to-all's four (:func:`to_sources`) and the fused pull's two."""
    return (
        handle.recv_to_row,
        handle.send_index,
        handle.send_counts,
        handle.recv_counts,
        handle.pair_dest,
        handle.rows_bound,
    )


def dispatch_builder(
    op: str,
    tensors: tuple,
    sizes: tuple,
    group: dist.ProcessGroup | None,
    request: tuple,
    *,
    also: Callable[[int], object] | None = None,
    operands: Callable[..., object] | None = None,
) -> Callable[[int], Built]:
    """The validation of a dispatch (``tensors = (x, topk_ids, topk_weights)``, ``sizes = (num_experts,
    max_tokens)``, ``request = (backend, parallel_num)``); ``also``: a fused op's checks of its other operands,
    ``operands``: its operands value from ``(x, x_scale, topk_ids)`` (default :class:`DispatchOperands`)."""
    given, topk_ids, topk_weights = tensors
    num_experts, max_tokens = sizes
    backend, parallel_num = request

    def build(world: int) -> Built:
        fmt = check_dispatch(given, topk_ids, topk_weights, (num_experts, max_tokens, world))
        if also is not None:
            also(world)
        checks.check_backend(backend)
        checks.check_parallel_num(parallel_num)
        x, x_scale = split_x(given)
        if wanted(x.device):
            check_id_range(topk_ids, num_experts)
        call = EpCall(
            op=op,
            group_name=group_name(group),
            world=world,
            backend=backend,
            parallel_num=parallel_num,
            num_experts=num_experts,
            topk=topk_ids.shape[1],
            max_tokens=max_tokens or 0,
            fmt=fmt,
        )
        ops = (operands or DispatchOperands)(x, x_scale, topk_ids)
        return Built(call, ops, x.device)

    return build


def _read_pending(call: EpCall) -> None:
    if call.group_name in _unread or call.group_name in _captured:
        moe_check_overflow(resolve_group(call.group_name))


def _check_table(table: torch.Tensor, call: EpCall, device: torch.device) -> None:
    """The bounded mode's overflow, from the count table every rank holds: raised now where a host read is
    allowed, else kept on the device for the next check (module docstring)."""
    if not call.bounded:
        return
    if wanted(device):
        message = overflow_message(DISPATCH, table, call)
        if message is not None:
            raise RuntimeError(message)
    else:
        key = (call.group_name, str(table.device))
        flag = _pending.get(key)
        if flag is None:
            flag = _pending[key] = torch.zeros((), dtype=torch.bool, device=table.device)
        totals = table.view(call.world, call.world, -1).sum((0, 2))
        flag.logical_or_((totals > call.max_tokens).any())
        (_captured if capturing(device) else _unread).add(call.group_name)


def dispatch_run(
    call: EpCall,
    ops: DispatchOperands,
    *,
    consumer: Callable[[Layout], Callable[[torch.Tensor, torch.Tensor], None]] | None = None,
) -> tuple:
    """One dispatch, every backend. ``consumer(layout)``: the ``landed`` callback of :func:`to_experts` for the
    rows' movement (:mod:`kernels.ops.moe.ep_gemm`'s per-piece GEMM); not with the fused backend, which moves no
    pieces."""
    x, x_scale, topk_ids = ops.x, ops.x_scale, ops.topk_ids
    fmt = call.fmt
    group, topk = call.group, topk_ids.shape[1]
    # The rows that move: x, or FP8 payload and scale bytes packed in one uint8 row (the same movement below).
    packed = pack_rows(fmt, x, x_scale)
    if not capturing(x.device):
        _read_pending(call)
    order, mine = expert_counts(topk_ids.reshape(-1).to(torch.int64), call.num_experts)
    me = my_rank(call, group)
    if call.backend == "fused" and call.world > 1:
        from ...fused import moe_ep as fused_ep
        from ...fused import runtime

        descriptor = runtime.describe(call, ops)
        moved, src_pair, lay = fused_ep.dispatch(
            packed,
            (order, mine, topk),
            call,
            plan=lambda table: layout(order, table, call, me),
            check_table=lambda table: _check_table(table, call, x.device),
            descriptor=descriptor,
        )
        tensors = [lay.recv_to_row, lay.send_index, lay.send_counts, lay.recv_counts]
    else:
        table = gather_rows(mine[None, :].contiguous(), group, call.world)  # [W, E]: every rank's counts
        _check_table(table, call, x.device)
        lay = layout(order, table, call, me)
        tensors = [lay.recv_to_row, lay.send_index, lay.send_counts, lay.recv_counts]
        landed = None if consumer is None else consumer(lay)
        moved = to_experts(packed.repeat_interleave(topk, 0), tensors, lay.rows, call, landed=landed)
        pair_ids = torch.arange(x.shape[0] * topk, device=x.device)[:, None]
        # The source pair of each row travels as the rows do (-1: padding), from which token and slot follow.
        src_pair = to_experts(pair_ids + 1, tensors, lay.rows, call)[:, 0] - 1
    token = torch.where(src_pair >= 0, src_pair // topk, -1)
    slot = torch.where(src_pair >= 0, src_pair % topk, -1)
    rows, rows_scale = unpack(fmt, moved, x, lay.valid if call.bounded else None)
    handle = (lay.expert_offsets, lay.src_rank, token, slot, *tensors, lay.valid, lay.pair_dest, lay.rows_bound)
    return (rows, rows_scale, *handle)


def dispatch_fake(call: EpCall, ops: DispatchOperands) -> tuple:
    """The dispatch's outputs without running it (shapes, dtypes; the exact mode's row count is dynamic)."""
    x, topk_ids = ops.x, ops.topk_ids
    cols = scale_cols(call.fmt, x.shape[1])
    rows = call.max_tokens if call.bounded else torch.library.get_ctx().new_dynamic_size()
    slots = call.world * call.max_tokens if call.bounded else rows
    index = x.new_empty((rows,), dtype=torch.int64)
    world = x.new_empty((call.world,), dtype=torch.int64)
    return (
        x.new_empty((rows, x.shape[1])),
        x.new_empty((rows, cols), dtype=torch.float32),
        x.new_empty((call.num_experts // call.world,), dtype=torch.int64),
        index,
        torch.empty_like(index),
        torch.empty_like(index),
        x.new_empty((slots,), dtype=torch.int64),
        x.new_empty((topk_ids.numel(),), dtype=torch.int64),
        world,
        torch.empty_like(world),
        x.new_empty((), dtype=torch.int64),
        x.new_empty((topk_ids.numel(),), dtype=torch.int64),
        x.new_empty((), dtype=torch.int64),
    )


def _combine_run(call: EpCall, ops: CombineOperands) -> tuple:
    y, topk_weights, handle = ops.y, ops.topk_weights, ops.handle
    if call.backend == "fused" and call.world > 1:
        from ...fused import moe_ep as fused_ep
        from ...fused import runtime

        descriptor = runtime.describe(call, ops)
        # Exact mode: the heap region's rows, the same on every rank, read on the host (bounded: max_tokens).
        bound = call.max_tokens if call.bounded else int(handle[5])
        return fused_ep.combine(y, topk_weights, handle[4], bound, group_name=call.group_name, descriptor=descriptor)
    returned = to_sources(y, list(handle[:4]), topk_weights.numel(), call)
    return weighted_sum(returned, topk_weights, y.dtype), returned


def _combine_fake(call: EpCall, ops: CombineOperands) -> tuple:
    y, topk_weights = ops.y, ops.topk_weights
    return y.new_empty((topk_weights.shape[0], y.shape[1])), y.new_empty((topk_weights.numel(), y.shape[1]))


DISPATCH_SPEC = OpSpec(
    name=DISPATCH,
    call=EpCall,
    schema="(Tensor x, Tensor? x_scale, Tensor topk_ids, str call) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
    "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    operands=DispatchOperands,
    flat=DispatchOperands.flat,
    impl={"sequential": dispatch_run, "chunked": dispatch_run, "fused": dispatch_run},
    fake=dispatch_fake,
)
COMBINE_SPEC = OpSpec(
    name=COMBINE,
    call=EpCall,
    schema="(Tensor y, Tensor topk_weights, Tensor[] handle, str call) -> (Tensor, Tensor)",
    operands=CombineOperands.of,
    flat=CombineOperands.flat,
    impl={"sequential": _combine_run, "chunked": _combine_run, "fused": _combine_run},
    fake=_combine_fake,
)
