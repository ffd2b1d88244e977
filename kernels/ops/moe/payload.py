"""The payload format of an expert-parallel dispatch (:mod:`kernels.ops.moe_ep`): plain rows, or FP8 rows that
carry their scales.

One implementation moves both: an FP8 row and its fp32 scales are packed into one ``uint8`` row
(:func:`kernels.format.pack_rows`, as the dense FP8 all-gather does), every backend moves those bytes as it moves
plain rows, and the received rows are unpacked. The format is part of the call value
(:class:`kernels.ops.moe.layout.EpCall`) and of its descriptor (x's dtype and the scale layout), so ranks that
disagree on it are refused by name before anything moves.

Convention (DeepEP's ``x = (x_fp8, x_scale)``): ``x_fp8 [m_local, k]`` float8_e4m3fn / float8_e5m2 with
``x_scale`` fp32 ``[m_local, 1]`` (per row, :mod:`kernels.fp8.scales`' "row") or ``[m_local, ceil(k / 128)]``
(per 1 x 128 block, "block"; for ``k <= 128`` the two are one layout, called "row"). The rows come back as
``(rows_fp8 [R, k], rows_scale [R, s])``, ready for ``kernels.grouped_matmul(rows_fp8, w, expert_offsets,
x_scale=rows_scale, w_scale=...)``.
"""

from __future__ import annotations

import torch

from ...format import PLAIN, OperandFormat, fp8, unpack_rows
from ...fp8.scales import BLOCK, FP8_DTYPES, ceil_div
from ..grouped_matmul import PLAIN_DTYPES


def split_x(x: object) -> tuple[object, object]:
    """``(payload, scale)`` of a dispatch's ``x``: a ``(x_fp8, x_scale)`` pair, or a tensor and None. Anything
    else comes back as it is, for :func:`check_payload` to name."""
    if isinstance(x, (tuple, list)) and len(x) == 2:
        return x[0], x[1]
    return x, None


def check_payload(x: object, x_scale: object) -> OperandFormat:
    """The format of a dispatch's ``x`` (metadata only), or a named ``TypeError`` / ``ValueError``."""
    if not isinstance(x, torch.Tensor):
        shown = f"a {type(x).__name__} of {len(x)}" if isinstance(x, (tuple, list)) else type(x).__name__
        raise TypeError(f"x must be a torch.Tensor or an (x_fp8, x_scale) pair of tensors, got {shown}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [m_local, k] (this rank's tokens), got shape {tuple(x.shape)}")
    if x.dtype not in FP8_DTYPES:
        if x.dtype not in PLAIN_DTYPES:
            raise TypeError(
                f"x dtype {x.dtype} is not accepted; use one of {[str(d) for d in PLAIN_DTYPES]}, or an FP8 "
                "payload with its scale as x = (x_fp8, x_scale)"
            )
        if x_scale is not None:
            raise ValueError(f"x carries a scale but x is {x.dtype}: scales go with FP8 payloads only")
        return PLAIN
    m, k = x.shape
    if x.requires_grad and torch.is_grad_enabled():
        # torch lets an FP8 tensor require grad, but the dispatch of FP8 rows has no backward: its gradient
        # would be dropped without a word.
        raise TypeError(
            f"x ({x.dtype}) requires grad; an FP8 dispatch is not differentiable: quantize under torch.no_grad() "
            "or detach it, or dispatch the bf16 / fp32 rows to train through the dispatch"
        )
    if x_scale is None:
        raise TypeError(
            f"x is {x.dtype} without its scale: pass x = (x_fp8, x_scale), x_scale fp32 [m_local, 1] (per row) "
            f"or [m_local, ceil(k / {BLOCK})] (per 1 x {BLOCK} block), so the scales travel with the rows"
        )
    if not isinstance(x_scale, torch.Tensor):
        raise TypeError(f"x_scale must be a torch.Tensor, got {type(x_scale).__name__}")
    if x_scale.dtype != torch.float32:
        raise TypeError(f"x_scale dtype {x_scale.dtype} is not accepted; scales are torch.float32")
    if x_scale.device != x.device:
        raise ValueError(f"x_scale is on {x_scale.device} but x is on {x.device}")
    if x_scale.requires_grad and torch.is_grad_enabled():
        raise TypeError("x_scale requires grad; an FP8 dispatch is not differentiable (call it under torch.no_grad())")
    shape, blocks = tuple(x_scale.shape), ceil_div(k, BLOCK)
    if shape in ((), (1,)):
        raise ValueError(
            f"x_scale of shape {list(shape)} is tensor-wise (one scalar for this rank's rows), which a dispatch does "
            "not take: a receiver holds rows of every rank and could not apply their senders' scalars unless they "
            f"travelled with each row; pass it per row, x_scale.reshape(1, 1).expand({m}, 1)"
        )
    if shape == (m, 1):
        return fp8("row")
    if shape == (m, blocks):
        return fp8("block")
    raise ValueError(
        f"x_scale shape {list(shape)} does not fit x [m_local={m}, k={k}]: use [{m}, 1] (per row) or "
        f"[{m}, {blocks}] (per 1 x {BLOCK} block)"
    )


def unpack(
    fmt: OperandFormat, rows: torch.Tensor, x: torch.Tensor, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [R, k] in x's dtype, rows_scale [R, s] fp32)`` from the moved rows (plain: ``s = 0``). ``valid``
    (bounded mode, 0-d, on the device): the rows past it get scale 1.0, not the zero bytes they arrived as, since a
    scale must be finite and > 0 (``kernels.grouped_matmul`` checks) and their payload is zero anyway."""
    k = x.shape[1]
    payload, row_scale = unpack_rows(fmt, rows, k, x.dtype)
    if row_scale is None:
        return payload, rows.new_empty((rows.shape[0], 0), dtype=torch.float32)
    if valid is not None:
        held = torch.arange(rows.shape[0], device=rows.device)[:, None] < valid
        row_scale = torch.where(held, row_scale, torch.ones((), dtype=torch.float32, device=rows.device))
    return payload, row_scale


def scale_cols(fmt: OperandFormat, k: int) -> int:
    """The scale columns of the dispatched rows (0 for plain rows)."""
    return fmt.scale_cols(k) if fmt.scaled_rows else 0
