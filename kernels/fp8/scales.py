"""FP8 formats, scale layouts and argument validation shared by every FP8 op and backend.

Scale layouts (all fp32), as ``torch._scaled_mm`` infers them from the shapes::

    mode      x_scale (x [m, k])          w_scale (weight [n, k])
    tensor    []                          []
    row       [m, 1]                      [n, 1]
    block     [m, ceil(k / 128)]          [ceil(n / 128), ceil(k / 128)]     (DeepSeek-V3: 1x128, 128x128)

Shapes that fit two modes (``k <= 128`` makes a block scale ``[m, 1]``) describe the same
numbers either way, so the inference is never ambiguous in its result. Everything here is checked
from metadata only, before any communication; the value checks (non-finite, non-positive) need a
host read and run only when :func:`value_check_wanted` says so.
"""

from __future__ import annotations

import math

import torch

from ..config import get_config

BLOCK = 128
MODES = ("tensor", "row", "block")
QUANT_MODES = ("block", "block2d", "row", "tensor")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Largest finite value: e4m3fn has no Inf (S.1111.111 is NaN, S.1111.110 = 448); e5m2 is IEEE-like.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# amax floor of a scale (torchao's float8 EPS): an all-zero block gets a tiny finite positive scale
# instead of 0 (whose division would give NaN), and quantizes to exact zeros.
EPS = 1e-12


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_fp8(name: str, t: object, dims: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FP8_DTYPES:
        raise TypeError(
            f"{name} dtype {t.dtype} is not FP8; use one of {[str(d) for d in FP8_DTYPES]} "
            "(kernels.quantize_fp8 produces them)"
        )
    if dims == "2d" and t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [n, k] (torch.nn.functional.linear layout), got shape {tuple(t.shape)}")
    if dims == "nd" and t.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims [..., k], got shape {tuple(t.shape)}")


def check_out_dtype(out_dtype: object) -> None:
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {out_dtype!r}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} is not accepted; use one of {[str(d) for d in OUT_DTYPES]}")


def _check_scale_tensor(name: str, scale: object, device: torch.device) -> None:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} dtype {scale.dtype} is not accepted; scales are torch.float32")
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device} but x is on {device}")
    if scale.requires_grad and torch.is_grad_enabled():
        raise TypeError(f"{name} requires grad; the FP8 ops are forward-only (call them under torch.no_grad())")


def expected_shapes(mode: str, m: int, k: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(x_scale shape, w_scale shape)`` of ``mode`` for ``x [m, k]``, ``weight [n, k]``."""
    if mode == "tensor":
        return (), ()
    if mode == "row":
        return (m, 1), (n, 1)
    return (m, ceil_div(k, BLOCK)), (ceil_div(n, BLOCK), ceil_div(k, BLOCK))


def _one_value(shape: tuple[int, ...]) -> tuple[int, ...]:
    # A tensorwise scale may be given as [1] (torch._scaled_mm takes both): the same one value as [].
    return () if shape == (1,) else shape


def infer_mode(m: int, k: int, n: int, x_scale: torch.Tensor, w_scale: torch.Tensor) -> str:
    """The scaling mode the two scale shapes describe, or ``ValueError`` listing the accepted ones
    (a tensorwise scale may be ``[]`` or ``[1]``)."""
    got = (_one_value(tuple(x_scale.shape)), _one_value(tuple(w_scale.shape)))
    for mode in MODES:
        if got == expected_shapes(mode, m, k, n):
            return mode
    accepted = "; ".join(
        f"{mode}: x_scale {list(xs)}, w_scale {list(ws)}"
        for mode, (xs, ws) in ((mode, expected_shapes(mode, m, k, n)) for mode in MODES)
    )
    raise ValueError(
        f"x_scale shape {list(got[0])} with w_scale shape {list(got[1])} fit no scaling mode for x [m={m}, k={k}] "
        f"and weight [n={n}, k={k}]; accepted ({BLOCK}-wide blocks; a tensor scale may also be [1]): {accepted}"
    )


def flatten_x_scale(x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """An activation scale given per leading dim (``[..., G]`` for ``x [..., k]``) as ``[m, G]``."""
    if x_scale.dim() == x.dim() and x.dim() > 2 and tuple(x_scale.shape[:-1]) == tuple(x.shape[:-1]):
        return x_scale.reshape(-1, x_scale.shape[-1])
    return x_scale


def kernel_scale(scale: torch.Tensor, mode: str, rows: int | None = None) -> torch.Tensor:
    """A validated scale in the kernels' layout: 0-dim in tensor mode, an activation's ``[..., G]`` as
    ``[rows, G]`` (``rows`` given), else unchanged."""
    if mode == "tensor":
        return scale.reshape(())
    if rows is not None:
        return scale.reshape(rows, scale.shape[-1])
    return scale


def check_operands(
    x_pair: tuple[object, object], w_pair: tuple[object, object], bias: object, *, out_dtype: object
) -> str:
    """Validate one FP8 op call (metadata only) and return its mode; ``x_pair = (x, x_scale)`` and ``w_pair =
    (weight, w_scale)``: each FP8 payload with its scale, as :func:`kernels.quantize_fp8` returns them."""
    x, x_scale = x_pair
    weight, w_scale = w_pair
    check_fp8("x", x, "nd")
    check_fp8("weight", weight, "2d")
    assert isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"k mismatch: x has k={x.shape[-1]} (shape {tuple(x.shape)}) but weight has k={weight.shape[1]} "
            f"(shape {tuple(weight.shape)}); weight must be [n, k] (the torch.nn.functional.linear layout)"
        )
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    check_out_dtype(out_dtype)
    _check_scale_tensor("x_scale", x_scale, x.device)
    _check_scale_tensor("w_scale", w_scale, x.device)
    assert isinstance(x_scale, torch.Tensor) and isinstance(w_scale, torch.Tensor)
    k, n = x.shape[-1], weight.shape[0]
    m = math.prod(x.shape[:-1])
    mode = infer_mode(m, k, n, flatten_x_scale(x, x_scale), w_scale)
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},) = [n] of weight, got {tuple(bias.shape)}")
        if bias.dtype not in (out_dtype, torch.float32):
            raise TypeError(f"bias dtype {bias.dtype} is not accepted; use out_dtype={out_dtype} or torch.float32")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
        if bias.requires_grad and torch.is_grad_enabled():
            raise TypeError("bias requires grad; the FP8 ops are forward-only (call them under torch.no_grad())")
    return mode


def value_check_wanted(device: torch.device) -> bool:
    """Whether to read scale values on the host: always on CPU (free), on a GPU only under
    ``COC_CHECK=1`` (a device-to-host copy would synchronize every call), never while tracing."""
    if torch.compiler.is_compiling():
        return False
    return device.type == "cpu" or get_config().check


def check_scale_values(name: str, scale: torch.Tensor) -> None:
    """``scale`` finite and > 0 everywhere (one host read), else ``ValueError`` naming the first bad entry."""
    if scale.numel() == 0:
        return
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0]) if scale.dim() else ()
        value = float(scale[index]) if scale.dim() else float(scale)
        raise ValueError(
            f"{name}[{', '.join(map(str, index))}]={value} is not accepted; scales must be finite and > 0 "
            "(a non-finite scale comes from a non-finite input to quantize_fp8)"
        )
