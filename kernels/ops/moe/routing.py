"""Routing for the tensor-parallel MoE ops (:mod:`kernels.ops.moe.tp`): their call value, checks and routing.

The gathered tokens' rows are grouped by expert with a stable sort of the flattened ``topk_ids`` (ties in
``(token, slot)`` order)::

    order = argsort(topk_ids_gathered.flatten(), stable=True)       # [M * topk], M = m_local * W
    token_index, slot = order // topk, order % topk                 # row j is the pair (token_index[j], slot[j])
    expert_offsets[e] = count(topk_ids_gathered <= e)               # cumulative end rows, last = M * topk

The ops' local grouped GEMMs are here too (:func:`grouped_mm`, :func:`grouped_mm_loop`), shared by the forward
(:mod:`kernels.ops.moe.tp`) and the backward (:mod:`kernels.ops.moe.autograd`). Everything else here runs on the
device with shapes known on the host (sort, ``searchsorted``, index ops): no host
read of the routing, except the value checks that :func:`kernels.fp8.scales.value_check_wanted` asks for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ...capture import capturing
from ...format import PLAIN, OperandFormat, compute, dequantize_weight, dequantize_x
from ...fp8 import scales
from ...protocol import Call, kernel_runs_on
from ...protocol.call import Items, shown_as
from ..grouped_matmul import operand_format

ID_DTYPES = (torch.int32, torch.int64)
GATHER, SCATTER = "all_gather_grouped_matmul", "grouped_matmul_reduce_scatter"


@dataclass(frozen=True, kw_only=True)
class MoeCall(Call):
    """One tensor-parallel MoE call without its tensors: the operands' format (plain or FP8) and an FP8 call's
    output dtype (None: plain, the output in x's dtype), the expert count and top-k."""

    fmt: OperandFormat = field(default=PLAIN, metadata=shown_as("format"))
    out_dtype: torch.dtype | None = None
    num_experts: int = 0
    topk: int = 0

    def operand_items(self, operands: Any) -> Items:
        if self.op == GATHER:
            # Every rank's tokens are gathered: m_local and k must agree; the column shards may differ in n_local.
            x, weight = operands.x, operands.weight
            items: tuple = (("x.shape", tuple(x.shape)), ("x.dtype", x.dtype))
        else:
            # The row shards may differ in n_local (h's and the weight's last dim); the rest must agree.
            x, weight = operands.h, operands.weight
            items = (
                ("h.shape[0] (rows)", x.shape[0]),
                ("h.dtype", x.dtype),
                ("weight.shape[1] (k_out)", weight.shape[1]),
                ("topk_weights.shape", tuple(operands.topk_weights.shape)),
            )
        return items + ((("weight.dtype", weight.dtype),) if self.fmt.kind == "fp8" else ())


class MoeRouting(NamedTuple):
    """Where each row of :func:`kernels.all_gather_grouped_matmul`'s output comes from (all int64, on x's device).

    ``expert_offsets [E]``: cumulative end row of each expert (``torch._grouped_mm``'s ``offs``);
    ``token_index [M * topk]``: the gathered token of each row (rank ``r``'s local token ``i`` is
    ``r * m_local + i``); ``slot [M * topk]``: which of that token's top-k choices the row is.
    """

    expert_offsets: torch.Tensor
    token_index: torch.Tensor
    slot: torch.Tensor


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_same_device(x: torch.Tensor, named: tuple[tuple[str, torch.Tensor], ...]) -> None:
    """Every tensor of ``named`` (``(name, tensor)`` pairs) on ``x``'s device; ``ValueError`` naming the first that
    is not."""
    for name, t in named:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def check_topk_ids(topk_ids: torch.Tensor, x: torch.Tensor) -> None:
    """``topk_ids [m_local, topk]`` (int32 / int64, topk >= 1): one row of expert ids per token of ``x``, as both the
    TP gather and the EP dispatch take them."""
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"topk_ids dtype {topk_ids.dtype} is not accepted; use torch.int32 or torch.int64")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] < 1:
        raise ValueError(
            f"topk_ids shape {tuple(topk_ids.shape)} does not fit x shape {tuple(x.shape)}: it must be "
            f"[m_local, topk] = [{x.shape[0]}, topk] with topk >= 1 (one row of expert ids per token)"
        )


def check_gather(
    x: object, topk_ids: object, weight: object, num_experts: object, options: dict
) -> tuple[int, OperandFormat, torch.dtype]:
    """``all_gather_grouped_matmul``'s metadata (``ValueError`` / ``TypeError`` naming the argument); returns
    ``(E, format, output dtype)``. ``options``: ``{x_scale, w_scale, out_dtype}`` (:func:`check_format`)."""
    x, topk_ids, weight = _tensor("x", x), _tensor("topk_ids", topk_ids), _tensor("weight", weight)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [m_local, k] (this rank's tokens), got shape {tuple(x.shape)}")
    if weight.dim() != 3 or weight.shape[0] < 1:
        raise ValueError(f"weight must be 3-D [E, n_local, k] with E >= 1 (one per expert), got {tuple(weight.shape)}")
    if weight.shape[2] != x.shape[1]:
        raise ValueError(
            f"k mismatch: x has k={x.shape[1]} (shape {tuple(x.shape)}) but weight has k={weight.shape[2]} "
            f"(shape {tuple(weight.shape)}); weight must be [E, n_local, k] (F.linear layout per expert)"
        )
    fmt, out_dtype = check_format(x, weight, options, ("x", x), ())
    check_topk_ids(topk_ids, x)
    num_e = weight.shape[0]
    if num_experts is not None and (type(num_experts) is not int or num_experts != num_e):
        raise ValueError(
            f"E mismatch: num_experts={num_experts!r} but weight has E={num_e} experts (shape {tuple(weight.shape)})"
        )
    check_same_device(x, (("topk_ids", topk_ids), ("weight", weight)))
    return num_e, fmt, out_dtype


def check_format(
    x: torch.Tensor, weight: torch.Tensor, options: dict, named: tuple[str, torch.Tensor], others: tuple
) -> tuple[OperandFormat, torch.dtype]:
    """The operands' format and output dtype, checked as :func:`kernels.grouped_matmul` checks them (plain: one
    floating dtype, no scales; FP8: FP8 payloads, fp32 scales of one mode with a leading expert dim on w_scale).
    ``named = (name, x)`` names x in messages; ``others``: further ``(name, tensor)`` that would need a gradient.

    The FP8 format is forward-only, as the dense FP8 ops are: a gradient through an FP8 payload or its scale
    has no meaning here, so an operand that requires one is refused rather than left without it."""
    fmt, out_dtype = operand_format(x, weight, options, named[0])
    if fmt.kind == "fp8" and torch.is_grad_enabled():
        operands = (named, ("weight", weight), ("x_scale", options["x_scale"]), ("w_scale", options["w_scale"]))
        needs = [name for name, t in operands + others if isinstance(t, torch.Tensor) and t.requires_grad]
        if needs:
            raise TypeError(
                f"{', '.join(needs)} requires grad, but the FP8 format of the MoE ops is forward-only (as the dense "
                "FP8 ops are): call them under torch.no_grad(), or use a plain dtype to train"
            )
    return fmt, out_dtype


def check_id_values(topk_ids: torch.Tensor, num_experts: int, *, named: str = "E") -> None:
    """Every id in ``[0, E)``: a host read, where :func:`wanted` says so. ``named``: what the caller calls E
    (``"E"``: weight.shape[0]; the expert-parallel ops: their ``num_experts`` argument)."""
    if topk_ids.numel() == 0:
        return
    bad = (topk_ids < 0) | (topk_ids >= num_experts)
    if bool(bad.any()):
        token, slot = (int(v) for v in bad.nonzero()[0])
        source = " (E = weight.shape[0])" if named == "E" else ""
        raise ValueError(
            f"topk_ids[{token}, {slot}]={int(topk_ids[token, slot])} is out of range: expert ids must be in "
            f"[0, {named}) = [0, {num_experts}){source}; {int(bad.sum())} id(s) out of range"
        )


def check_scatter(tensors: tuple, world: int, options: dict) -> tuple[int, int, OperandFormat, torch.dtype]:
    """``grouped_matmul_reduce_scatter``'s metadata, ``tensors = (h, weight, routing, topk_weights)``; returns
    ``(E, topk, format, output dtype)``. ``options`` as :func:`check_gather`'s."""
    h, weight, routing, topk_weights = tensors
    h, weight, topk_weights = _tensor("h", h), _tensor("weight", weight), _tensor("topk_weights", topk_weights)
    if not isinstance(routing, MoeRouting):
        raise TypeError(
            "routing must be the kernels.MoeRouting that all_gather_grouped_matmul returned, got "
            f"{type(routing).__name__}"
        )
    offsets, token_index, slot = (_tensor(f"routing.{f}", t) for f, t in zip(MoeRouting._fields, routing, strict=True))
    if h.dim() != 2:
        raise ValueError(f"h must be 2-D [M * topk, n_local] (rows grouped by expert), got shape {tuple(h.shape)}")
    if weight.dim() != 3 or weight.shape[2] != h.shape[1]:
        raise ValueError(
            f"weight must be [E, k_out, n_local] with n_local = h.shape[1] = {h.shape[1]} (F.linear layout per "
            f"expert, the row shard), got {tuple(weight.shape)}"
        )
    for name, t in (("routing.expert_offsets", offsets), ("routing.token_index", token_index), ("routing.slot", slot)):
        if t.dtype not in ID_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} is not accepted; use torch.int32 or torch.int64")
    if tuple(offsets.shape) != (weight.shape[0],):
        raise ValueError(
            f"E mismatch: routing.expert_offsets has shape {tuple(offsets.shape)} but weight has E={weight.shape[0]} "
            f"experts (shape {tuple(weight.shape)})"
        )
    rows = h.shape[0]
    if tuple(token_index.shape) != (rows,) or tuple(slot.shape) != (rows,):
        raise ValueError(
            f"routing.token_index {tuple(token_index.shape)} and routing.slot {tuple(slot.shape)} must be [rows of h] "
            f"= [{rows}]: the routing of the call that produced h's rows"
        )
    if topk_weights.dim() != 2 or not topk_weights.is_floating_point() or topk_weights.shape[1] < 1:
        raise ValueError(
            f"topk_weights must be a floating [M, topk] (the gathered tokens' weights, M = m_local * W), got "
            f"{tuple(topk_weights.shape)} {topk_weights.dtype}"
        )
    tokens, topk = topk_weights.shape
    if tokens * topk != rows or tokens % world:
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} does not fit h shape {tuple(h.shape)} and W={world}: it "
            f"must be [M, topk] with M * topk = rows of h and M = m_local * W (every rank's tokens, rank order)"
        )
    named = (("weight", weight), ("topk_weights", topk_weights), ("routing.expert_offsets", offsets))
    check_same_device(h, named + (("routing.token_index", token_index), ("routing.slot", slot)))
    fmt, out_dtype = check_format(h, weight, options, ("h", h), (("topk_weights", topk_weights),))
    return weight.shape[0], topk, fmt, out_dtype


def check_scale_values(options: dict) -> None:
    """The FP8 scales finite and > 0 (a host read, where :func:`wanted`)."""
    for name in ("x_scale", "w_scale"):
        if isinstance(options[name], torch.Tensor):
            scales.check_scale_values(name, options[name])


def check_routing_values(routing: MoeRouting, topk: int) -> None:
    """The offsets non-decreasing with the last = rows, every (token, slot) pair once (a host read)."""
    ends = routing.expert_offsets.tolist()
    rows = routing.token_index.numel()
    if any(b < a for a, b in zip([0] + ends[:-1], ends, strict=True)) or (ends and ends[-1] != rows):
        raise ValueError(
            f"routing.expert_offsets={ends} must be non-decreasing with the last = {rows} (rows of h); pass the "
            "routing all_gather_grouped_matmul returned"
        )
    pairs = routing.token_index.long() * topk + routing.slot.long()
    if rows and not torch.equal(torch.sort(pairs).values, torch.arange(rows, device=pairs.device)):
        raise ValueError(
            f"routing.token_index / routing.slot do not name every (token, slot) pair of M = {rows // topk} tokens "
            f"and topk = {topk} (topk_weights.shape[1]) once; pass the routing all_gather_grouped_matmul returned"
        )


def needs_grad(*tensors: object) -> bool:
    """Whether a call on ``tensors`` must go through its autograd Function."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def wanted(device: torch.device) -> bool:
    """Whether to read routing values on the host (CPU always; CUDA under ``COC_CHECK=1``; not in capture)."""
    return scales.value_check_wanted(device) and not capturing(device)


def route(ids: torch.Tensor, num_experts: int) -> MoeRouting:
    """The routing of the gathered ``ids [M, topk]`` (module docstring)."""
    topk = ids.shape[1]
    flat = ids.reshape(-1).to(torch.int64)
    experts, order = torch.sort(flat, stable=True)
    targets = torch.arange(num_experts, device=ids.device, dtype=torch.int64)
    # A sorted search, not bincount: CUDA's bincount reads its input's max on the host.
    offsets = torch.searchsorted(experts, targets, right=True)
    return MoeRouting(offsets, order // topk, order % topk)


def row_of_pair(routing: MoeRouting, topk: int) -> torch.Tensor:
    """``[M, topk]``: the output row of each (token, slot) pair, the inverse of the routing's permutation."""
    rows = routing.token_index.numel()
    pos = torch.empty(rows, dtype=torch.int64, device=routing.token_index.device)
    pos[routing.token_index.long() * topk + routing.slot.long()] = torch.arange(rows, device=pos.device)
    return pos.view(rows // topk if topk else 0, topk)


def piece_tokens(world: int, m_local: int, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """The gathered tokens of a piece, rank-major: rows ``[start, stop)`` of every rank's ``m_local``."""
    ranks = torch.arange(world, device=device)[:, None] * m_local
    return (ranks + torch.arange(start, stop, device=device)[None, :]).reshape(-1)


def expert_of_rows(routing: MoeRouting) -> torch.Tensor:
    """``[rows]``: the expert of each output row (E for rows past the last offset, which unchecked bad ids make)."""
    offsets = routing.expert_offsets.to(torch.int64)
    rows = torch.arange(routing.token_index.numel(), device=offsets.device)
    return torch.searchsorted(offsets, rows, right=True)


def piece_rows(
    pair_rows: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a piece's pairs ``pair_rows [p, topk]`` (their output rows): ``(rows, offsets, order)``.

    ``rows``: the pairs' output rows ascending, so grouped by expert as the whole output is; ``offsets``: the
    piece's own cumulative expert ends over ``rows``; ``order``: which flattened pair each of ``rows`` is.
    """
    rows, order = torch.sort(pair_rows.reshape(-1))
    targets = torch.arange(num_experts, device=rows.device)
    return rows, torch.searchsorted(expert_of_row[rows], targets, right=True), order


def grouped_mm_loop(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype, *, fp8: tuple | None = None
) -> torch.Tensor:
    """The per-expert ``torch.mm`` loop (a host read of the offsets), the products in ``out_dtype`` (fp32 for
    the reducing op's partials: products of fp16 / bf16 values are exact there, the sums fp32).

    ``fp8 = (format, x_scale, w_scale)`` for FP8 operands, ``x_scale`` one row per row of x (``[rows, 1]`` or
    ``[rows, G]``: a tensorwise scale on each row, as the rows travel): the operands dequantized to fp32, the
    products and sums in full fp32 (:func:`kernels.format.compute`), one rounding to ``out_dtype``."""
    out = torch.empty((x.shape[0], weight.shape[1]), dtype=out_dtype, device=x.device)
    if fp8 is not None:
        fmt, x_scale, w_scale = fp8
        x = dequantize_x(fmt, x, x_scale, per_row=True)
    # FP8: fp32 products whatever out_dtype is; the store into out is the one rounding.
    acc = out_dtype if fp8 is None else torch.float32
    start = 0
    with compute(PLAIN if fp8 is None else fmt):
        for e, end in enumerate(offsets.tolist()):
            we = weight[e] if fp8 is None else dequantize_weight(fmt, weight[e], w_scale[e], None, x.dtype)
            out[start:end] = torch.mm(x[start:end].to(acc), we.to(acc).T)
            start = end
    return out


def grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype, *, fp8: tuple | None = None
) -> torch.Tensor:
    """The persistent grouped GEMM (no host read of the offsets; fp32 accumulation, stored in ``out_dtype``)
    where it runs, else :func:`grouped_mm_loop`; ``fp8`` as there."""
    if not kernel_runs_on(x.device):
        return grouped_mm_loop(x, weight, offsets, out_dtype, fp8=fp8)
    from ...fused import grouped

    out = torch.empty((x.shape[0], weight.shape[1]), dtype=out_dtype, device=x.device)
    if fp8 is None:
        return grouped.launch(PLAIN, x.contiguous(), weight.contiguous(), offsets.contiguous(), out)
    fmt, x_scale, w_scale = fp8
    xs, ws = x_scale.contiguous(), w_scale.contiguous()
    return grouped.launch(fmt, x.contiguous(), weight.contiguous(), offsets.contiguous(), out, x_scale=xs, w_scale=ws)


def x_scale_of(fmt: OperandFormat, x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor | None:
    """An FP8 call's x scale in the kernels' layout (0-dim for a tensorwise one, else ``[m, G]``), contiguous;
    None for plain. :func:`kernels.format.pack_rows` and :func:`kernels.format.row_scales` take it from there."""
    if fmt.kind != "fp8":
        return None
    assert x_scale is not None
    return scales.kernel_scale(x_scale, str(fmt.mode), x.shape[0]).contiguous()
