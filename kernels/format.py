"""How an op's operands are stored and scaled: one value, passed down every layer of one implementation.

An :class:`OperandFormat` says what ``x`` and the weight hold and how they turn into numbers::

    kind    x                         weight                  dequantized (the reference's operands)
    plain   bf16 / fp16 / fp32 / fp64 same dtype               as they are
    fp8     FP8 payload + fp32 scale  FP8 payload + fp32 scale payload.float() * scale per mode (fp32)
    int8    fp16 / bf16 (fp32 on CPU) int8 + scale (+ offset)  (q - offset) * scale, rounded to x's dtype

FP8 modes (``mode``) are those of :mod:`kernels.fp8.scales` (x and weight share one: tensor, row,
block = 1x128 x / 128x128 weight); int8 modes those of :mod:`kernels.quant` (per_tensor,
per_channel, per_group with ``group_size``, optional ``offset``). Validation of each format's
operands lives beside its quantizer (``kernels.fp8.scales.check_operands``,
``kernels.quant.quant_spec``); this module is what every pattern shares: the value, its reference
dequantization, the packing of a row with its scale row for the all-gathers, the arithmetic the
partial products follow (:attr:`OperandFormat.partial_fp32`) and the constants the Triton kernels take.

Rows that travel (all-gather): an FP8 row carries its scales, one per 128 columns in block mode and
one otherwise (a tensorwise scale is the scale of its rank's rows, so each row carries it), packed
with the payload bytes into one ``uint8`` row: gloo cannot move float8 tensors, and one collective
moves both.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import padding

KINDS = ("plain", "fp8", "int8")
FP8_MODES = ("tensor", "row", "block")
INT8_MODES = ("per_tensor", "per_channel", "per_group")
# The weight's dequantization mode of each FP8 mode (kernels.fp8.quantize_fp8's names).
_FP8_WEIGHT_MODE = {"tensor": "tensor", "row": "row", "block": "block2d"}


@dataclass(frozen=True)
class OperandFormat:
    """The storage and scaling of one call's operands (module docstring); hashable, picklable.

    ``mode``: the FP8 scaling mode or the int8 weight's scale layout (None for plain);
    ``group_size``: int8 per_group columns per scale (0 otherwise); ``offset``: int8 zero points given.
    """

    kind: str = "plain"
    mode: str | None = None
    group_size: int = 0
    offset: bool = False

    def __post_init__(self) -> None:
        modes = {"plain": (None,), "fp8": FP8_MODES, "int8": INT8_MODES}.get(self.kind)
        if modes is None or self.mode not in modes:
            raise ValueError(f"OperandFormat(kind={self.kind!r}, mode={self.mode!r}) is not a format")

    @property
    def scaled_rows(self) -> bool:
        """Whether x's rows carry scales (they travel with the rows in an all-gather)."""
        return self.kind == "fp8"

    @property
    def partial_fp32(self) -> bool:
        """Whether partial products travel and are summed in fp32 and rounded once to ``out_dtype`` (FP8),
        rather than rounded to x's dtype before the exchange as the plain and int8 ops do."""
        return self.kind == "fp8"

    def scale_cols(self, k: int) -> int:
        """fp32 scale columns that travel with each row of x: ``ceil(k / 128)`` in FP8 block mode, else 1."""
        return -(-k // 128) if self.mode == "block" else 1

    def __str__(self) -> str:
        return self.encode()

    def encode(self) -> str:
        """The format as a string (a constant of a compiled graph): ``plain``, ``fp8:block``,
        ``int8:per_group:128:offset``."""
        if self.kind == "plain":
            return "plain"
        parts = [self.kind, str(self.mode)]
        if self.kind == "int8":
            parts += [str(self.group_size)] + (["offset"] if self.offset else [])
        return ":".join(parts)

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def decode(text: str) -> OperandFormat:
        """Inverse of :meth:`encode`."""
        kind, *rest = text.split(":")
        if kind == "plain":
            return PLAIN
        if kind == "fp8":
            return OperandFormat(kind="fp8", mode=rest[0])
        return OperandFormat(kind="int8", mode=rest[0], group_size=int(rest[1]), offset=rest[2:] == ["offset"])


PLAIN = OperandFormat()


def fp8(mode: str) -> OperandFormat:
    return OperandFormat(kind="fp8", mode=mode)


def int8(mode: str, group_size: int, offset: bool) -> OperandFormat:
    return OperandFormat(kind="int8", mode=mode, group_size=group_size if mode == "per_group" else 0, offset=offset)


@contextlib.contextmanager
def fp32_matmuls() -> Iterator[None]:
    """fp32 matmuls at full precision whatever ``torch.set_float32_matmul_precision`` says: "high" and
    "medium" let them run on TF32 (GPUs) or bf16 passes (CPUs), and the FP8 results promise fp32
    products and sums (the bounds of ``kernels.fp8.numerics``)."""
    saved = torch.get_float32_matmul_precision()
    if saved == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def compute(fmt: OperandFormat) -> contextlib.AbstractContextManager[None]:
    """Where the reference's matmuls of ``fmt`` run: full fp32 precision for FP8 (their contract); plain
    and int8 matmuls run in x's dtype as torch runs them."""
    return fp32_matmuls() if fmt.kind == "fp8" else contextlib.nullcontext()


def product(
    fmt: OperandFormat,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``padding.linear(x, weight, bias, out=out)`` in :func:`compute`'s arithmetic for ``fmt`` (a plain or int8
    product enters no context: this runs on every call)."""
    if fmt.kind != "fp8":
        return padding.linear(x, weight, bias, out=out)
    with fp32_matmuls():
        return padding.linear(x, weight, bias, out=out)


def row_scales(fmt: OperandFormat, x_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """An FP8 x scale as one row of scales per row of x (``[rows, 1]`` for a tensorwise scale)."""
    return x_scale.reshape(1, 1).expand(rows, 1) if fmt.mode == "tensor" else x_scale


def pack_rows(fmt: OperandFormat, x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
    """The rows an all-gather moves: ``x`` itself, or for FP8 ``uint8 [m, k + 4 * cols]``, each row's payload
    bytes followed by the bytes of its fp32 scales."""
    if not fmt.scaled_rows:
        return x
    assert x_scale is not None
    scales = row_scales(fmt, x_scale, x.shape[0]).contiguous()
    # Sizes spelled out: -1 cannot be inferred for a rank with no rows.
    scale_bytes = scales.view(torch.uint8).view(x.shape[0], 4 * scales.shape[-1])
    return torch.cat([x.view(torch.uint8), scale_bytes], dim=1)


def unpack_rows(
    fmt: OperandFormat, rows: torch.Tensor, k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`pack_rows` for gathered rows: ``(x, per-row scales [rows, cols] or None)``, contiguous."""
    if not fmt.scaled_rows:
        return rows, None
    return rows[:, :k].contiguous().view(dtype), rows[:, k:].contiguous().view(torch.float32)


def dequantize_x(fmt: OperandFormat, x: torch.Tensor, x_scale: torch.Tensor | None, per_row: bool) -> torch.Tensor:
    """x as the reference multiplies it: FP8 dequantized to fp32, else x itself. ``per_row``: the scales are
    one row per row of x (gathered rows, :func:`unpack_rows`), not the call's own layout."""
    if fmt.kind != "fp8":
        return x
    from .fp8.quantize import dequantize_fp8

    assert x_scale is not None
    mode = ("row" if fmt.mode == "tensor" else fmt.mode) if per_row else fmt.mode
    return dequantize_fp8(x, x_scale, mode)


def dequantize_weight(
    fmt: OperandFormat,
    weight: torch.Tensor,
    w_scale: torch.Tensor | None,
    w_offset: torch.Tensor | None,
    x_dtype: torch.dtype,
) -> torch.Tensor:
    """The weight as the reference multiplies it: FP8 in fp32, int8 ``(q - offset) * scale`` rounded to x's
    dtype (the fused kernels round each dequantized tile the same way), plain as it is."""
    if fmt.kind == "plain":
        return weight
    assert w_scale is not None
    if fmt.kind == "fp8":
        from .fp8.quantize import dequantize_fp8

        return dequantize_fp8(weight, w_scale, _FP8_WEIGHT_MODE[fmt.mode])
    from .quant import dequantize

    return dequantize(weight, w_scale, fmt.group_size or None, w_offset, x_dtype)


def bias_of(fmt: OperandFormat, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as the reference adds it: fp32 under FP8 (added before the one rounding), else as given."""
    return bias.float() if bias is not None and fmt.kind == "fp8" else bias
