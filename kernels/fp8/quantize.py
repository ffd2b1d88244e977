"""``quantize_fp8``: FP8 payloads with fp32 scales, and the matching dequantization.

Reference (every mode, every device)::

    amax  = max |t| over the block                      # fp32; a block is the mode's tile of t
    scale = max(amax, EPS) / FP8_MAX                    # fp32, EPS = 1e-12, FP8_MAX = 448 (e4m3fn) / 57344 (e5m2)
    q     = cast_fp8(clamp(t / scale, -FP8_MAX, FP8_MAX))    # round to nearest even
    dequant(q) = q.float() * scale                      # scale broadcast over its block

    mode      tile of t [m, k]        scale
    block     1 x 128                 [m, ceil(k / 128)]      activations and gradients (DeepSeek-V3)
    block2d   128 x 128               [ceil(m / 128), ceil(k / 128)]   weights
    row       1 x k                   [m, 1]
    tensor    m x k                   []

Shapes that are not multiples of the block are handled: the last block of a row (and, for block2d,
of a column) is partial, its amax taken over the elements it has. The clamp matters because the
rounded ``scale`` can make ``amax / scale`` exceed ``FP8_MAX`` by an ulp, and casting past the
largest finite value gives NaN in torch's e4m3fn. A block holding a NaN or Inf gets a NaN scale,
which the ops refuse (``kernels.fp8.scales.check_scale_values``). ``block`` / ``row`` / ``tensor``
take ``t`` with any leading dims (the scale keeps them: ``[..., ceil(k / 128)]``); ``block2d`` a 2-D
weight. ``block`` must be 128 for the ops (their layouts are 128-wide); other sizes quantize fine.

On a CUDA device the ``block`` mode (the per-step activation and gradient quantization) runs the
fused Triton kernel of :mod:`kernels.fp8.quantize_triton` (one pass: read, amax, scale, write), whose
results are identical to this torch twin; the other modes, and CPU tensors, run the torch twin.
"""

from __future__ import annotations

import torch

from .scales import EPS, FP8_DTYPES, FP8_MAX, QUANT_MODES, ceil_div


def _check_args(t: object, mode: object, block: object, dtype: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point() or t.dtype in FP8_DTYPES:
        raise TypeError(f"t must be a floating-point (not FP8) tensor to quantize, got dtype {t.dtype}")
    if mode not in QUANT_MODES:
        raise ValueError(f"mode={mode!r} is not accepted; use one of {QUANT_MODES}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} is not accepted; use a positive int (128 for the FP8 ops)")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not accepted; use one of {[str(d) for d in FP8_DTYPES]}")
    if mode == "block2d" and t.dim() != 2:
        raise ValueError(f"mode='block2d' quantizes a 2-D weight [n, k], got shape {tuple(t.shape)}")
    if mode in ("block", "row") and t.dim() < 1:
        raise ValueError(f"mode={mode!r} needs t with at least 1 dim [..., k], got a 0-dim tensor")


def _scale_of(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    scale = amax.clamp_min(EPS) / fp8_max
    # amax is Inf for a block with an Inf and NaN for one with a NaN: both mark the scale NaN.
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def _cast(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fp8_max = FP8_MAX[dtype]
    return scaled.clamp(-fp8_max, fp8_max).to(dtype)


def quantize_fp8_reference(
    t: torch.Tensor, mode: str = "block", block: int = 128, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of :func:`quantize_fp8` (module docstring): same arguments, same results."""
    _check_args(t, mode, block, dtype)
    fp8_max = FP8_MAX[dtype]
    x = t.detach().float()
    if mode == "tensor":
        scale = _scale_of(x.abs().amax() if x.numel() else x.new_zeros(()), fp8_max)
        return _cast(x / scale, dtype), scale
    if mode == "row":
        amax = x.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else x.new_zeros(x.shape[:-1] + (1,))
        scale = _scale_of(amax, fp8_max)
        return _cast(x / scale, dtype), scale
    lead, k = x.shape[:-1], x.shape[-1]
    kb = ceil_div(k, block)
    if mode == "block":
        # Zero padding to whole blocks never raises a block's amax.
        padded = x if k == kb * block else torch.nn.functional.pad(x, (0, kb * block - k))
        tiles = padded.reshape(lead + (kb, block))
        scale = _scale_of(tiles.abs().amax(dim=-1) if block else tiles.new_zeros(lead + (kb,)), fp8_max)
        q = _cast(tiles / scale.unsqueeze(-1), dtype).view(lead + (kb * block,))[..., :k]
        return q.contiguous(), scale
    m = x.shape[0]
    mb = ceil_div(m, block)
    padded = (
        x if (m, k) == (mb * block, kb * block) else torch.nn.functional.pad(x, (0, kb * block - k, 0, mb * block - m))
    )
    tiles = padded.view(mb, block, kb, block)
    scale = _scale_of(tiles.abs().amax(dim=(1, 3)), fp8_max) if mb and kb else x.new_zeros((mb, kb))
    q = _cast(tiles / scale[:, None, :, None], dtype).view(mb * block, kb * block)[:m, :k]
    return q.contiguous(), scale


def quantize_fp8(
    t: torch.Tensor, mode: str = "block", block: int = 128, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t_fp8, scale)``: ``t`` quantized to ``dtype`` with fp32 scales per ``mode`` (module docstring).

    ``mode="block"`` (1 x ``block`` per row, for activations and gradients) runs a fused Triton
    kernel on CUDA tensors; everything else runs :func:`quantize_fp8_reference`. Both give the
    same bits. Not differentiable (the FP8 linears of ``autopar`` hold the autograd).
    """
    _check_args(t, mode, block, dtype)
    if mode == "block" and t.is_cuda and not torch.compiler.is_compiling():
        from . import quantize_triton

        if quantize_triton.available():
            return quantize_triton.quantize_block(t, block, dtype)
    return quantize_fp8_reference(t, mode, block, dtype)


def expand_scale(scale: torch.Tensor, mode: str, rows: int, cols: int, block: int = 128) -> torch.Tensor:
    """``scale`` broadcast to the ``[rows, cols]`` elements it scales (a 0-dim scale stays 0-dim)."""
    if mode == "tensor":
        return scale
    if mode == "row":
        return scale.reshape(rows, 1)
    s = scale.repeat_interleave(block, dim=1)[:, :cols]
    if mode == "block2d":
        s = s.repeat_interleave(block, dim=0)[:rows]
    return s


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, mode: str, block: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q.float() * scale`` broadcast over its blocks (fp32), then cast to ``dtype``; ``q`` 2-D ``[rows, cols]``
    (``mode`` as in :func:`quantize_fp8`; the activation of an op is ``"block"``, its weight ``"block2d"``)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"mode={mode!r} is not accepted; use one of {QUANT_MODES}")
    rows, cols = q.shape
    if mode in ("block", "block2d") and cols % block == 0 and (mode == "block" or rows % block == 0):
        # Whole blocks: broadcast the scales over a blocked view instead of materializing them.
        kb = cols // block
        if mode == "block":
            out = q.float().view(rows, kb, block) * scale.float()[:, :, None]
        else:
            out = q.float().view(rows // block, block, kb, block) * scale.float()[:, None, :, None]
        return out.view(rows, cols).to(dtype)
    return (q.float() * expand_scale(scale.float(), mode, rows, cols, block)).to(dtype)
