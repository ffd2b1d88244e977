"""The FP8 recipe of the tensor-parallel linears: forward, dgrad and wgrad GEMMs in FP8.

Switched on per layer with ``fp8=autopar.Fp8Recipe()`` on :class:`autopar.ColumnParallelLinear` /
:class:`autopar.RowParallelLinear`, :class:`autopar.CocColwiseParallel` / :class:`autopar.CocRowwiseParallel`
and ``autopar.parallelize_hf``, or for every one built while ``COC_FP8=1`` (the default recipe). The recipe
is an operand format (:class:`Fp8Operands`) of the one set of linear Functions (:mod:`autopar.tp.functions`):
the same Functions run plain or FP8 GEMMs.
Scaling is DeepSeek-V3's: activations and gradients one fp32 scale per row per 128 columns
(``quantize_fp8(mode="block")``), weights one per 128 x 128 block (``"block2d"``). The weight is
quantized once per change: the quantized copy is keyed on the parameter's version counter (bumped
by every in-place update, optimizer steps included; an update through ``.data`` is not seen, call
``layer.fp8_cache.clear()`` after one). Its transpose for the dgrad is the transposed copy (128 x 128
blocks are the same blocks of ``w.T``, so this is exact). Master weights, their gradients and the
optimizer stay in the parameter dtype. The communicating GEMMs are the FP8 ops of
:mod:`kernels.fp8` (backend from the ``COC_*`` environment), the local ones ``kernels.scaled_matmul``.

wgrad: ``grad_w = grad_y.T @ x`` contracts over the tokens, so both operands are quantized along
the token dim: ``grad_y.T`` 1 x 128 (a gradient, the finer scales) and ``x.T`` in 128 x 128 blocks
(the op's weight operand layout; DeepSeek-V3 uses 128 x 1 there). Where only the FP8 copy of an
operand exists (the gathered input of a sequence-parallel column layer, the gathered gradient of a
sequence-parallel row layer), it is dequantized and requantized along the token dim: a second
rounding of at most the FP8 unit roundoff. Not supported with FP8 (refused by name):
``gradient_accumulation_fusion``, ``defer_embedding_wgrad_compute`` (:class:`autopar.tp.options.LinearOptions`),
explicit expert communication (the linears' forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kernels.fp8.scales import FP8_DTYPES, OUT_DTYPES

from .comm import rows
from .operands import CommCall

ENV_FP8 = "COC_FP8"


@dataclass(frozen=True)
class Fp8Recipe:
    """Which FP8 formats the linears use. DeepSeek-V3 uses E4M3 everywhere (its fine-grained scales
    make E5M2's range unnecessary); ``grad_dtype=torch.float8_e5m2`` gives the older hybrid recipe."""

    activation_dtype: torch.dtype = torch.float8_e4m3fn
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    grad_dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self) -> None:
        for name in ("activation_dtype", "weight_dtype", "grad_dtype"):
            value = getattr(self, name)
            if value not in FP8_DTYPES:
                raise ValueError(f"Fp8Recipe.{name}={value!r} is not accepted; use one of {FP8_DTYPES}")


def resolve_recipe(fp8: Fp8Recipe | None) -> Fp8Recipe | None:
    """``fp8`` itself, else the default recipe when ``COC_FP8=1``, else None (validated: 0 or 1)."""
    if fp8 is not None:
        if not isinstance(fp8, Fp8Recipe):
            raise TypeError(f"fp8 must be an autopar.Fp8Recipe or None, got {type(fp8).__name__}")
        return fp8
    from kernels.config import get_config

    return Fp8Recipe() if get_config().fp8 else None


class Fp8WeightCache:
    """The quantized weight ``(q, scale)`` and its transpose, requantized when the weight changes.

    A change is a new version of the weight (every in-place update bumps it) or of the tensor given to
    :meth:`track`: the CoC styles pass the local shard of a DTensor parameter, whose in-place updates
    (optimizer steps, ``copy_``) bump the DTensor's version counter and leave the shard's at 0.
    """

    def __init__(self) -> None:
        self._source: torch.Tensor | None = None
        self.clear()

    def clear(self) -> None:
        self._key: tuple | None = None
        self._fwd: tuple[torch.Tensor, torch.Tensor] | None = None
        self._t: tuple[torch.Tensor, torch.Tensor] | None = None
        self.quantizations = 0

    def track(self, source: torch.Tensor) -> None:
        """Key the copy on ``source``'s version too (the parameter the weight given to :meth:`get` is a
        local view of)."""
        self._source = source

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        source = () if self._source is None else (id(self._source), self._source._version)
        key = (weight._version, weight.data_ptr(), tuple(weight.shape), weight.dtype, dtype, *source)
        if key != self._key or self._fwd is None:
            self._fwd = kernels.quantize_fp8(weight.detach(), "block2d", dtype=dtype)
            self._t = None
            self._key = key
            self.quantizations += 1
        return self._fwd

    def transposed(self, weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize_fp8(weight.T, "block2d")``, from the cached copy (the same 128 x 128 blocks)."""
        q, s = self.get(weight, dtype)
        if self._t is None:
            self._t = (q.t().contiguous(), s.t().contiguous())
        return self._t


def _cols(t2d: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t2d.T`` quantized in 128 x 128 blocks (the wgrad's weight operand)."""
    q, s = kernels.quantize_fp8(t2d, "block2d", dtype=dtype)
    return q.t().contiguous(), s.t().contiguous()


Quantized = tuple[torch.Tensor, torch.Tensor]  # FP8 bytes and their fp32 scales


def _no_autocast(t: torch.Tensor) -> torch.autocast:
    """The FP8 GEMMs' own precision: FP8 products are exact in fp32 and the ops sum in fp32, but an enclosing
    autocast (the linears' backward runs under the forward's) would round the fp32 matmuls of the sequential
    and chunked backends to bf16."""
    return torch.autocast(t.device.type, enabled=False)


class Fp8Operands:
    """The FP8 recipe as an operand format (:class:`autopar.tp.operands.Operands`).

    Activations (``recipe.activation_dtype``) and gradients (``recipe.grad_dtype``) are quantized in 1 x 128
    blocks along their last dim, the weight in 128 x 128 blocks once per change (``cache``); the GEMMs are
    the FP8 ops of ``kernels`` (``kernels.scaled_matmul`` for the local ones) with fp32 sums, rounded once to
    ``out_dtype``. ``group=None``: one process, the local GEMM.
    """

    # The FP8 ops sum the ranks' partials in fp32 and round once; a separate collective after an FP8 GEMM
    # would sum rounded partials. The gathered FP8 input is kept (half the bytes of a bf16 one).
    fused_dgrad = True
    recompute_all_gather = False

    def __init__(self, recipe: Fp8Recipe, cache: Fp8WeightCache) -> None:
        self.recipe = recipe
        self.cache = cache

    def check(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        if x.dtype not in OUT_DTYPES:
            raise TypeError(f"input_ dtype {x.dtype} is not accepted by the FP8 linears; use one of {OUT_DTYPES}")
        if bias is not None and bias.dtype not in (x.dtype, torch.float32):
            bias = bias.float()  # the ops take a bias in the output dtype or fp32, added in fp32 either way
        return x, weight, bias

    def input(self, x: torch.Tensor) -> Quantized:
        return kernels.quantize_fp8(x, "block", dtype=self.recipe.activation_dtype)

    def grad(self, g: torch.Tensor) -> Quantized:
        return kernels.quantize_fp8(g, "block", dtype=self.recipe.grad_dtype)

    def weight(self, w: torch.Tensor) -> Quantized:
        return self.cache.get(w, self.recipe.weight_dtype)

    def weight_t(self, w: torch.Tensor) -> Quantized:
        return self.cache.transposed(w, self.recipe.weight_dtype)

    def dequant(self, a: Quantized) -> torch.Tensor:
        q, s = a
        return kernels.dequantize_fp8(rows(q), s.reshape(-1, s.shape[-1]), "block").view(q.shape)

    def wgrad_input(self, x: torch.Tensor) -> Quantized:
        # Along the tokens: x.T in 128 x 128 blocks, the wgrad GEMM's weight operand.
        return _cols(rows(x), self.recipe.activation_dtype)

    def pack(self, a: Quantized | None) -> tuple:
        return (None, None) if a is None else tuple(a)

    def unpack(self, tensors: tuple) -> Quantized | None:
        return None if tensors[0] is None else (tensors[0], tensors[1])

    def linear(self, a: Quantized, w: Quantized, bias: torch.Tensor | None, *, out_dtype: torch.dtype) -> torch.Tensor:
        with _no_autocast(a[0]):
            return kernels.scaled_matmul(*a, *w, bias, out_dtype=out_dtype)

    def linear_all_reduce(self, a: Quantized, w: Quantized, bias: torch.Tensor | None, call: CommCall) -> torch.Tensor:
        if call.group is None:
            return self.linear(a, w, bias, out_dtype=call.out_dtype)
        with _no_autocast(a[0]):
            return kernels.scaled_matmul_all_reduce(*a, *w, bias, out_dtype=call.out_dtype, group=call.group)

    def linear_reduce_scatter(
        self, a: Quantized, w: Quantized, bias: torch.Tensor | None, call: CommCall
    ) -> torch.Tensor:
        if call.group is None:
            return self.linear(a, w, bias, out_dtype=call.out_dtype)
        with _no_autocast(a[0]):
            return kernels.scaled_matmul_reduce_scatter(
                *a, *w, bias, out_dtype=call.out_dtype, group=call.group, scatter_dim=call.dim
            )

    def all_gather_linear(
        self, a: Quantized, w: Quantized, bias: torch.Tensor | None, call: CommCall, *, keep: bool
    ) -> tuple[torch.Tensor, Quantized | None]:
        if call.group is None:
            return self.linear(a, w, bias, out_dtype=call.out_dtype), (a if keep else None)
        gather = {"out_dtype": call.out_dtype, "group": call.group, "gather_dim": call.dim}
        with _no_autocast(a[0]):
            if not keep:
                return kernels.all_gather_scaled_matmul(*a, *w, bias, **gather), None
            y, xg, xsg = kernels.all_gather_scaled_matmul(*a, *w, bias, **gather, return_gathered=True)
        return y, (xg, xsg)

    def all_gather_linears(
        self, a: Quantized, ws: list, bs: list, call: CommCall
    ) -> tuple[list[torch.Tensor], Quantized]:
        if call.group is None:
            return [self.linear(a, w, b, out_dtype=call.out_dtype) for w, b in zip(ws, bs, strict=True)], a
        with _no_autocast(a[0]):
            ys, xg, xsg = kernels.all_gather_scaled_matmul(
                *a,
                [w[0] for w in ws],
                [w[1] for w in ws],
                list(bs),
                out_dtype=call.out_dtype,
                group=call.group,
                gather_dim=call.dim,
                return_gathered=True,
            )
        return ys, (xg, xsg)

    def partial_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # As inside the FP8 ops: partial products summed in fp32, rounded once at the end.
        return torch.float32

    def wgrad_gemm(self, grad_y2d: torch.Tensor, x_tokens: Quantized, dtype: torch.dtype) -> torch.Tensor:
        # grad_y.T along the tokens in 1 x 128 blocks (a gradient: the finer scales), x.T in 128 x 128.
        gq, gs = kernels.quantize_fp8(grad_y2d.t(), "block", dtype=self.recipe.grad_dtype)
        out = dtype if dtype in OUT_DTYPES else torch.float32
        with _no_autocast(gq):
            return kernels.scaled_matmul(gq, gs, *x_tokens, out_dtype=out).to(dtype)


__all__ = ["ENV_FP8", "Fp8Operands", "Fp8Recipe", "Fp8WeightCache", "resolve_recipe"]
