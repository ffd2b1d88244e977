"""w8A16 weights: symmetric int8 quantization, the validation of quantized operands and their dequantization.

Convention (one place, every backend follows it)::

    dequant(qweight)[j, i] = (qweight[j, i] - offset[g]) * scale[g]      # computed in fp32,
                                                                          # rounded to x.dtype
    g = ()                        per_tensor   scale []
    g = (j,)                      per_channel  scale [n]
    g = (j, i // group_size)      per_group    scale [n, ceil(k / group_size)]

``offset`` (optional, same shape as ``scale``) defaults to 0; :func:`quantize_weight` is
symmetric and never produces one. ``per_group`` groups run along k; when ``group_size`` does not
divide k the last group is partial (docs/api.md's ``ceil``). The op needs ``group_size`` to know where
the groups start: it is inferred as ``k // G`` only when ``G`` (the scale's group count) divides
k exactly, otherwise it must be passed.

The ops with int8 weights are the int8 format of the ops of ``kernels.ops`` (``kernels.format``): the
``sequential`` and ``chunked`` backends materialize the dequantized weight (:func:`dequantize`) and run
the plain arithmetic; ``fused`` dequantizes tile by tile inside the Triton GEMM main loop, never
materializing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("per_tensor", "per_channel", "per_group")
QMAX = 127  # symmetric: -128 is never produced, so negation is exact and the range is balanced


@dataclass(frozen=True)
class QuantSpec:
    """Validated quantization layout of one ``(qweight, scale, offset)`` triple."""

    mode: str
    group_size: int  # k for per_tensor / per_channel (one group spans all of k)
    groups: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quantize_weight(
    weight: torch.Tensor, mode: str = "per_channel", group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of ``weight [n, k]``: ``(qweight int8 [n, k], scale)``.

    Reference::

        amax  = max |weight| over the tensor / each row / each (row, k-group)
        scale = amax / 127                        (stored in weight.dtype; 1 where amax == 0)
        qweight = clamp(round(weight / scale), -127, 127)

    ``scale`` has shape ``[]`` (per_tensor), ``[n]`` (per_channel) or
    ``[n, ceil(k / group_size)]`` (per_group). The rounding uses the stored scale, so the
    round-trip error is at most ``scale / 2`` per element plus the scale's own rounding
    (``127 * eps(weight.dtype) * scale``).
    """
    _check_quantize_args(weight, mode, group_size)
    n, k = weight.shape
    w = weight.detach().float()
    if mode == "per_tensor":
        # An empty shard (a row-parallel weight split unevenly) has amax 0: scale 1, as a zero group.
        amax = w.abs().amax() if w.numel() else w.new_zeros(())
        grouped = w
    elif mode == "per_channel":
        amax = w.abs().amax(dim=1) if k else w.new_zeros((n,))
        grouped = w
    else:
        groups = _ceil_div(k, group_size)
        # Pad k with zeros to whole groups: zeros never raise a group's amax.
        padded = w.new_zeros((n, groups * group_size))
        padded[:, :k] = w
        grouped = padded.view(n, groups, group_size)
        amax = grouped.abs().amax(dim=2)
    # A zero group quantizes to zeros with any scale; 1 keeps the scale finite and dequant exact.
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax)).to(weight.dtype)
    s = scale.float()
    if mode == "per_tensor":
        q = torch.round(w / s)
    elif mode == "per_channel":
        q = torch.round(w / s[:, None])
    else:
        q = torch.round(grouped / s[:, :, None]).view(n, -1)[:, :k]
    return q.clamp_(-QMAX, QMAX).to(torch.int8).contiguous(), scale


def _check_quantize_args(weight: object, mode: str, group_size: object) -> None:
    """Refuse what :func:`quantize_weight` cannot quantize before any arithmetic runs."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [n, k], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be floating point to quantize, got dtype {weight.dtype}")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not accepted; use one of {MODES}")
    if mode == "per_group":
        _check_group_size_value(group_size)
    elif group_size is not None:
        raise ValueError(f"group_size={group_size!r} is only meaningful with mode='per_group', got mode={mode!r}")


def _check_group_size_value(group_size: object) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(
            f"group_size={group_size!r} is not accepted; per_group quantization needs a positive integer group_size"
        )


def quant_spec(qweight: torch.Tensor, scale: object, group_size: int | None, offset: object) -> QuantSpec:
    """Check ``qweight``/``scale``/``offset``/``group_size`` together and name the layout."""
    _check_qweight(qweight)
    _check_scale(scale, qweight)
    spec = _spec_from_scale_shape(qweight, scale, group_size)
    if spec.mode != "per_group" and group_size is not None:
        raise ValueError(
            f"group_size={group_size!r} needs a per_group scale [n, G], got scale shape "
            f"{tuple(scale.shape)} ({spec.mode})"
        )
    if offset is not None:
        _check_offset(offset, scale, qweight)
    return spec


def _check_qweight(qweight: object) -> None:
    """``qweight`` must be what :func:`quantize_weight` returns: a 2-D int8 tensor."""
    if not isinstance(qweight, torch.Tensor):
        raise TypeError(f"qweight must be a torch.Tensor, got {type(qweight).__name__}")
    if qweight.dtype != torch.int8:
        raise TypeError(f"qweight must be int8 (from kernels.quantize_weight), got dtype {qweight.dtype}")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [n, k], got shape {tuple(qweight.shape)}")


def _check_scale(scale: object, qweight: torch.Tensor) -> None:
    """``scale``'s type, dtype and device; its shape names the mode (:func:`_spec_from_scale_shape`)."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
    if not scale.is_floating_point():
        raise TypeError(f"scale must be floating point, got dtype {scale.dtype}")
    if scale.device != qweight.device:
        raise ValueError(f"scale is on {scale.device} but qweight is on {qweight.device}")


def _spec_from_scale_shape(qweight: torch.Tensor, scale: torch.Tensor, group_size: int | None) -> QuantSpec:
    """The layout is never passed: it is read from the scale's shape against ``qweight [n, k]``."""
    n, k = qweight.shape
    if scale.dim() == 0:
        return QuantSpec("per_tensor", k, 1)
    if scale.dim() == 1 and scale.shape[0] == n:
        return QuantSpec("per_channel", k, 1)
    if scale.dim() == 2 and scale.shape[0] == n and (scale.shape[1] >= 1 or k == 0):
        # k == 0 (an empty shard of a row-parallel weight): no group, and group_size must be given.
        groups = scale.shape[1]
        return QuantSpec("per_group", _per_group_size(k, scale, group_size), groups)
    raise ValueError(
        f"scale shape {tuple(scale.shape)} does not fit qweight [n={n}, k={k}]; accepted: "
        f"[] (per_tensor), [{n}] (per_channel), [{n}, G] (per_group)"
    )


def _per_group_size(k: int, scale: torch.Tensor, group_size: int | None) -> int:
    """The group size of a per_group scale ``[n, G]``: the one passed, checked, or ``k // G`` when exact."""
    groups = scale.shape[1]
    if group_size is None:
        if groups == 0 or k % groups != 0:
            raise ValueError(
                f"group_size=None cannot be inferred: k={k} is not divisible by the "
                f"{groups} groups of scale {tuple(scale.shape)}; pass the group_size "
                "used to quantize"
            )
        group_size = k // groups
    _check_group_size_value(group_size)
    if _ceil_div(k, group_size) != groups:
        raise ValueError(
            f"group_size={group_size} does not match scale shape {tuple(scale.shape)}: "
            f"k={k} needs ceil({k} / {group_size}) = {_ceil_div(k, group_size)} groups"
        )
    return group_size


def _check_offset(offset: object, scale: torch.Tensor, qweight: torch.Tensor) -> None:
    """An ``offset`` is one real number per scale entry, on qweight's device."""
    if not isinstance(offset, torch.Tensor):
        raise TypeError(f"offset must be a torch.Tensor or None, got {type(offset).__name__}")
    if offset.shape != scale.shape:
        raise ValueError(f"offset shape {tuple(offset.shape)} must equal scale shape {tuple(scale.shape)}")
    if offset.dtype == torch.bool or offset.is_complex():
        raise TypeError(f"offset must be a real number tensor, got dtype {offset.dtype}")
    if offset.device != qweight.device:
        raise ValueError(f"offset is on {offset.device} but qweight is on {qweight.device}")


def _expand(t: torch.Tensor, spec: QuantSpec, k: int) -> torch.Tensor:
    """A per-mode parameter broadcast to ``[n, k]`` (or a scalar for per_tensor)."""
    if spec.mode == "per_tensor":
        return t
    if spec.mode == "per_channel":
        return t[:, None]
    return t.repeat_interleave(spec.group_size, dim=1)[:, :k]


def dequantize(
    qweight: torch.Tensor,
    scale: torch.Tensor,
    group_size: int | None = None,
    offset: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``(qweight - offset) * scale`` in fp32, rounded to ``dtype`` (default ``scale.dtype``)."""
    spec = quant_spec(qweight, scale, group_size, offset)
    k = qweight.shape[1]
    w = qweight.float()
    if offset is not None:
        w = w - _expand(offset.float(), spec, k)
    w = w * _expand(scale.float(), spec, k)
    return w.to(dtype or scale.dtype)


def check_activation(x: torch.Tensor) -> None:
    """x must be fp16 / bf16 (the A16 of w8A16); fp32 only on CPU (for CI and references)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if x.device.type == "cpu" else ())
    if x.dtype not in allowed:
        raise TypeError(f"x dtype {x.dtype} is not accepted on {x.device.type}; use one of {[str(d) for d in allowed]}")
