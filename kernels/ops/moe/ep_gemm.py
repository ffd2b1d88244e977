"""Expert-parallel dispatch fused with the first expert GEMM: :func:`moe_dispatch_grouped_matmul` (docs/api.md,
"Expert-parallel MoE"), the all-to-all of :func:`kernels.moe_dispatch` overlapped with
:func:`kernels.grouped_matmul` on its rows. Registered operator::

    coc::moe_dispatch_grouped_matmul(Tensor x, Tensor topk_ids, Tensor weight, str call)
        -> (Tensor y, Tensor rows, Tensor[11] handle tensors)        # call: kernels.ops.moe.layout.EpCall

One implementation, the dispatch's own (:func:`kernels.ops.moe.ep.dispatch_run`), with the GEMM a parameter (as
PyTorch's ``_fused_all_gather_matmul_impl`` takes its matmul):

- ``sequential`` / ``fused``: the dispatch, then the grouped GEMM on all rows.
- ``chunked``: as each of the ``parallel_num`` pieces lands (:func:`kernels.ops.moe.layout.to_experts`'s
  ``landed``), the grouped GEMM on that piece's rows, written into their final rows of ``y``, while the later
  pieces are in flight. A piece holds a range of every (source, destination) block, so its rows are runs per
  (source, local expert) scattered over the final rows; sorted by final row they are grouped by local expert, and
  the piece's offsets are its rows below each expert's end (a sorted search on the device: no host read beyond
  the exact mode's own). Bounded mode: the padding rows past ``handle.valid`` never land; they get the GEMM of a
  zero row by the last local expert, as the two-call sequence computes them.

Bits: each row of the grouped GEMM depends only on that row and its expert's weight where the GEMM's tiles do not
depend on the call's row count: the Triton kernel under the interpreter (one tile shape on CPU, k steps fixed by
k and dtype), tested ``torch.equal`` to the two-call sequence. On CUDA the kernel's row-tile height follows the
mean rows per expert (64 or 128), so a piece may run other tiles than the whole call; the k steps are the same,
but the same bits are not claimed there (each row within the grouped GEMM's own fp32-accumulation bound). The
per-expert ``torch.mm`` path (CPU without the interpreter) makes no such claim either: BLAS may pick another kernel
for another row count.

FP8 x is refused by name (use :func:`kernels.moe_dispatch` with an ``(x_fp8, x_scale)`` pair, then
:func:`kernels.grouped_matmul`). Differentiable in plain ``x`` and ``weight``
(:class:`kernels.ops.moe.autograd.MoeDispatchGroupedMatmulFunction`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...protocol import OpSpec, admitted, run
from ..grouped_matmul import check_operands, grouped_matmul
from .ep import DispatchOperands, dispatch_builder, dispatch_fake, dispatch_run
from .layout import EpCall, Layout, MoeDispatchHandle
from .payload import split_x
from .routing import needs_grad

OP = "moe_dispatch_grouped_matmul"
Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DispatchGemmOperands(DispatchOperands):
    """A dispatch's tensors (plain x) and this rank's experts' weights ``[E / W, n, k]``."""

    weight: torch.Tensor | None = None

    def flat(self) -> tuple:
        return (self.x, self.topk_ids, self.weight)

    @staticmethod
    def of(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor) -> DispatchGemmOperands:
        return DispatchGemmOperands(x, None, topk_ids, weight)


def moe_dispatch_grouped_matmul(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    weight: torch.Tensor,
    *,
    max_tokens: int | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
) -> tuple[torch.Tensor, MoeDispatchHandle]:
    """``(y [R, n], handle)``: :func:`kernels.moe_dispatch`'s rows times this rank's experts' weights
    ``weight [E_local, n, k]`` (``E_local = num_experts / W``, x's dtype), with the chunked backend's pieces
    multiplied as they land (module docstring). Semantics (the ``sequential`` backend)::

        rows, handle = moe_dispatch(x, topk_ids, topk_weights, num_experts, max_tokens=max_tokens, group=group)
        y = grouped_matmul(rows, weight, handle.expert_offsets)      # [R, n]
        return y, handle

    Arguments as :func:`kernels.moe_dispatch` (plain x only). Differentiable in ``x`` and ``weight``.
    """
    request = (backend, parallel_num)

    def also(world: int) -> None:
        check_weight(x, weight, num_experts, world)

    def operands(x_: torch.Tensor, x_scale: object, ids: torch.Tensor) -> DispatchGemmOperands:
        return DispatchGemmOperands(x_, None, ids, weight)

    sizes = (num_experts, max_tokens)
    build = dispatch_builder(OP, (x, topk_ids, topk_weights), sizes, group, request, also=also, operands=operands)
    built, call, text = admitted(SPEC, OP, group, build)
    if needs_grad(x, weight):
        from .autograd import MoeDispatchGroupedMatmulFunction

        text = text or call.encode()
        out = MoeDispatchGroupedMatmulFunction.apply(x, weight, topk_ids, text)
    else:
        out = run(SPEC, call, built.operands, text)
        text = text or call.encode()
    y, _, *parts = out
    return y, MoeDispatchHandle(*parts, topk_weights=topk_weights, call=text)


def check_weight(x: object, weight: object, num_experts: int, world: int) -> None:
    """The GEMM's operands (after the dispatch's own checks): plain x, ``weight [E / W, n, k]`` of x's dtype and
    device (``grouped_matmul``'s operand checks)."""
    payload, x_scale = split_x(x)
    if x_scale is not None or not isinstance(payload, torch.Tensor):
        raise TypeError(
            f"{OP} takes plain x only (fp16 / bf16 / fp32), got an (x_fp8, x_scale) pair: for FP8 rows call "
            "kernels.moe_dispatch((x_fp8, x_scale), ...) and kernels.grouped_matmul(rows_fp8, w_fp8, "
            "handle.expert_offsets, x_scale=rows_scale, w_scale=...)"
        )
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    local = num_experts // world
    if weight.dim() != 3 or weight.shape[0] != local:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} does not fit: it must be [E_local, n, k] with E_local = "
            f"num_experts / W = {num_experts} / {world} = {local} (this rank's experts)"
        )
    offsets = torch.empty(local, dtype=torch.int64, device=payload.device)
    check_operands(payload.detach(), weight.detach(), offsets)


class PieceGemm:
    """The chunked backend's consumer: ``gemm`` on each piece's rows as it lands, into ``y``'s final rows."""

    def __init__(self, gemm: Gemm, weight: torch.Tensor, lay: Layout, bounded: bool) -> None:
        self.gemm, self.weight, self.offsets = gemm, weight, lay.expert_offsets
        k = weight.shape[2]
        # One row past R: the dump row that a bounded block's padding lands in (sliced off by the caller).
        self.y = weight.new_empty((lay.rows + 1, weight.shape[1]))
        if bounded:
            # Rows past handle.valid never land: the GEMM of a zero row by the last expert, as the whole call.
            one = torch.ones(1, dtype=torch.int64, device=weight.device)
            self.y[:] = gemm(weight.new_zeros((1, k)), weight[-1:], one)

    def __call__(self, out: torch.Tensor, placed: torch.Tensor) -> None:
        rows, _ = torch.sort(placed)  # by final row: grouped by local expert, the dump row last
        # The piece's rows below each expert's end; the last takes the rest (a bounded block's padding, zeros).
        ends = torch.searchsorted(rows, self.offsets[:-1])
        offsets = torch.cat([ends, ends.new_full((1,), rows.numel())])
        self.y[rows] = self.gemm(out[rows], self.weight, offsets)


def dispatch_gemm(call: EpCall, ops: DispatchGemmOperands, *, gemm: Gemm = grouped_matmul) -> tuple:
    """``(y, rows, *handle tensors)`` of one call (module docstring), ``gemm(rows, weight, offsets)`` the GEMM."""
    weight = ops.weight
    assert weight is not None
    if call.backend == "chunked":
        consumers: list[PieceGemm] = []

        def consumer(lay: Layout) -> PieceGemm:
            consumers.append(PieceGemm(gemm, weight, lay, call.bounded))
            return consumers[-1]

        rows, _, *handle = dispatch_run(call, ops, consumer=consumer)
        return (consumers[0].y[: rows.shape[0]], rows, *handle)
    rows, _, *handle = dispatch_run(call, ops)
    return (gemm(rows, weight, handle[0]), rows, *handle)


def _fake(call: EpCall, ops: DispatchGemmOperands) -> tuple:
    rows, _, *handle = dispatch_fake(call, ops)
    assert ops.weight is not None
    return (rows.new_empty((rows.shape[0], ops.weight.shape[1])), rows, *handle)


SPEC = OpSpec(
    name=OP,
    call=EpCall,
    schema="(Tensor x, Tensor topk_ids, Tensor weight, str call) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
    "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    operands=DispatchGemmOperands.of,
    flat=DispatchGemmOperands.flat,
    impl={"sequential": dispatch_gemm, "chunked": dispatch_gemm, "fused": dispatch_gemm},
    fake=_fake,
)
