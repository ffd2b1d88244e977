"""The dense GEMM family's call value, operands and validation: what its four patterns share.

Patterns: ``all_gather`` (all-gather + GEMM), ``reduce_scatter`` (GEMM + reduce-scatter), ``all_reduce`` (GEMM +
all-reduce, optionally with the RMSNorm epilogue) and ``matmul`` (local); operand formats: plain, FP8, int8
weights (:mod:`kernels.format`). A public function builds its operands with :func:`plain_operands`,
:func:`fp8_operands` or :func:`int8_operands` (each raises ``ValueError`` / ``TypeError`` naming the argument) and
hands :func:`builder`'s closure to :func:`kernels.protocol.submit`, which admits, decides and runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from .. import checks, quant
from ..format import PLAIN, OperandFormat, bias_of, dequantize_weight, dequantize_x, fp8, int8
from ..fp8 import scales
from ..protocol import MISS, Built, Call, OpSpec, group_name, resolved, submit, tensors_key
from ..protocol.admission import ERRORS
from ..protocol.call import LOCAL, Items, shown_as

# The public function of each (pattern, format kind): the op a call names in its messages. A row per pattern: its
# plain, FP8 and int8 functions.
PUBLIC_NAMES = {
    (pattern, kind): name
    for pattern, names in {
        "all_gather": ("all_gather_matmul", "all_gather_scaled_matmul", "quantized_all_gather_matmul"),
        "reduce_scatter": ("matmul_reduce_scatter", "scaled_matmul_reduce_scatter", "quantized_matmul_reduce_scatter"),
        "all_reduce": ("matmul_all_reduce", "scaled_matmul_all_reduce", "quantized_matmul_all_reduce"),
        "matmul": ("matmul", "scaled_matmul", "quantized_matmul"),
    }.items()
    for kind, name in zip(("plain", "fp8", "int8"), names, strict=True)
}


@dataclass(frozen=True, kw_only=True)
class GemmCall(Call):
    """One dense call without its tensors.

    ``pattern``: the communication; ``fmt``: the operands' format; ``out_dtype``: the output's dtype (None: x's);
    ``return_gathered`` (all-gather) / ``deterministic`` (reducing); ``comm_dim``: the normalized ``gather_dim`` /
    ``scatter_dim``; ``epilogue`` (all-reduce): ``""``, ``"rmsnorm"`` or ``"rmsnorm:<quant>"``, with its ``eps``.
    """

    pattern: str
    fmt: OperandFormat = field(default=PLAIN, metadata=shown_as("format"))
    out_dtype: torch.dtype | None = None
    return_gathered: bool = False
    deterministic: bool = False
    # Compared as the caller's gather_dim / scatter_dim (operand_items).
    comm_dim: int = field(default=0, metadata=LOCAL)
    epilogue: str = ""
    eps: float = 0.0

    def operand_items(self, operands: Operands) -> Items:
        x = operands.x
        items: list[tuple[str, object]] = [("x.dtype", x.dtype)]
        if self.pattern == "all_gather":
            # Every dim must agree, the gathered one included; column shards may differ in n.
            items += [("x.shape", tuple(x.shape)), ("gather_dim", self.comm_dim)]
        else:
            # Row-parallel weights may differ in k (uneven shards, even empty ones); the rows and n may not.
            items.append(("x.shape[:-1]", tuple(x.shape[:-1])))
            if self.pattern == "reduce_scatter":
                items.append(("scatter_dim", self.comm_dim))
            items.append(("weight.shape[0] (n)", operands.weights[0].shape[0]))
        items.append(("bias given", tuple(b is not None for b in operands.biases)))
        if self.fmt.kind == "fp8":
            items.append(("weight.dtype", operands.weights[0].dtype))
        return tuple(items)


@dataclass(slots=True)
class Operands:
    """A call's tensors: ``x`` (any leading dims), one or more weights ``[n_i, k]`` with their biases, and the
    scales of a scaled format (``x_scale`` in rows layout ``[m, G]`` or 0-dim; per weight ``w_scales`` and
    int8 ``w_offsets``)."""

    x: torch.Tensor
    weights: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]
    x_scale: torch.Tensor | None = None
    w_scales: tuple[torch.Tensor | None, ...] = ()
    w_offsets: tuple[torch.Tensor | None, ...] = ()

    def scale_of(self, i: int) -> torch.Tensor | None:
        return self.w_scales[i] if self.w_scales else None

    def offset_of(self, i: int) -> torch.Tensor | None:
        return self.w_offsets[i] if self.w_offsets else None

    def one_weight(self) -> tuple:
        """The one-weight operators' tensor arguments: ``(x, x_scale, weight, w_scale, w_offset, bias)``."""
        return (self.x, self.x_scale, self.weights[0], self.scale_of(0), self.offset_of(0), self.biases[0])


ONE_WEIGHT_ARGS = "Tensor x, Tensor? x_scale, Tensor weight, Tensor? w_scale, Tensor? w_offset, Tensor? bias"


def one_weight_operands(*args: torch.Tensor | None) -> Operands:
    """The :class:`Operands` of a one-weight registered operator's arguments, in :data:`ONE_WEIGHT_ARGS`' order
    ``(x, x_scale, weight, w_scale, w_offset, bias)``."""
    x, x_scale, weight, w_scale, w_offset, bias = args
    assert x is not None and weight is not None
    return Operands(
        x=x,
        weights=(weight,),
        biases=(bias,),
        x_scale=x_scale,
        w_scales=() if w_scale is None else (w_scale,),
        w_offsets=() if w_offset is None else (w_offset,),
    )


def _weight_list(weight: object, what: str) -> tuple[object, ...]:
    if isinstance(weight, (list, tuple)):
        if len(weight) == 0:
            raise ValueError(f"{what}: an empty list; pass one weight [n, k] or a non-empty list of them")
        return tuple(weight)
    return (weight,)


def _per_weight(value: object, count: int, name: str, listed: bool) -> tuple[object, ...]:
    """``bias`` (or a scale) as one entry per weight: None for every weight, or a list of ``count`` entries
    when the weights are a list."""
    if not listed:
        return (value,)
    if value is None:
        return (None,) * count
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{name} must be None or a list / tuple of tensors or None (one per weight) when weight is a list, "
            f"got {type(value).__name__}"
        )
    if len(value) != count:
        raise ValueError(f"{name}: {len(value)} entries for {count} weights; pass one per weight (None allowed)")
    return tuple(value)


def plain_operands(x: object, weight: object, bias: object) -> tuple[OperandFormat, Operands]:
    """``x [..., k]``, ``weight [n, k]`` or a list of them (one gather, several GEMMs), ``bias`` to match."""
    if type(weight) is torch.Tensor and (bias is None or type(bias) is torch.Tensor):
        checks.check_matmul_operands(x, weight, bias)
        return PLAIN, Operands(x=x, weights=(weight,), biases=(bias,))  # type: ignore[arg-type]
    listed = isinstance(weight, (list, tuple))
    weights = _weight_list(weight, "weight")
    biases = _per_weight(bias, len(weights), "bias", listed)
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        names = {"weight_name": f"weight[{i}]", "bias_name": f"bias[{i}]"} if listed else {}
        checks.check_matmul_operands(x, w, b, **names)
    return PLAIN, Operands(x=x, weights=weights, biases=biases)  # type: ignore[arg-type]


def fp8_operands(
    x: object, x_scale: object, weight: object, w_scale: object, bias: object, *, out_dtype: object
) -> tuple[OperandFormat, Operands]:
    """FP8 payloads and their fp32 scales (modes of :mod:`kernels.fp8.scales`, inferred from the shapes; a
    tensorwise scale may be ``[]`` or ``[1]``); ``x_scale`` comes out in rows layout ``[m, G]`` (0-dim for
    a tensorwise one). The scale values (finite, > 0) are read on the host where
    :func:`kernels.fp8.scales.value_check_wanted` says."""
    listed = isinstance(weight, (list, tuple))
    weights = _weight_list(weight, "weight")
    w_scales = _per_weight(w_scale, len(weights), "w_scale", listed)
    biases = _per_weight(bias, len(weights), "bias", listed)
    modes = {
        scales.check_operands((x, x_scale), (w, s), b, out_dtype=out_dtype)
        for w, s, b in zip(weights, w_scales, biases, strict=True)
    }
    if len(modes) > 1:
        raise ValueError(f"w_scale: the weights' scales describe different scaling modes {sorted(modes)}; use one")
    mode = modes.pop()
    assert isinstance(x, torch.Tensor) and isinstance(x_scale, torch.Tensor)
    xs = scales.kernel_scale(x_scale, mode, math.prod(x.shape[:-1])).contiguous()
    ws = tuple(scales.kernel_scale(s, mode).contiguous() for s in w_scales)  # type: ignore[arg-type]
    if scales.value_check_wanted(x.device):
        scales.check_scale_values("x_scale", xs)
        for s in ws:
            scales.check_scale_values("w_scale", s)
    operands = Operands(x=x, weights=weights, biases=biases, x_scale=xs, w_scales=ws)  # type: ignore[arg-type]
    return fp8(mode), operands


def int8_operands(
    x: object, qweight: object, scale: object, bias: object, *, group_size: object, offset: object
) -> tuple[OperandFormat, Operands]:
    """w8A16: ``x`` fp16 / bf16 (fp32 on CPU), int8 ``qweight [n, k]`` (or a list) with its scale and
    optional offset (:func:`kernels.quant.quant_spec` layouts)."""
    quant.check_activation(x)
    listed = isinstance(qweight, (list, tuple))
    weights = _weight_list(qweight, "qweight")
    w_scales = _per_weight(scale, len(weights), "scale", listed)
    w_offsets = _per_weight(offset, len(weights), "offset", listed)
    biases = _per_weight(bias, len(weights), "bias", listed)
    specs = {
        quant.quant_spec(q, s, group_size, o)  # type: ignore[arg-type]
        for q, s, o in zip(weights, w_scales, w_offsets, strict=True)
    }
    for i, (q, b) in enumerate(zip(weights, biases, strict=True)):
        names = {"weight_name": f"qweight[{i}]", "bias_name": f"bias[{i}]"} if listed else {"weight_name": "qweight"}
        checks.check_matmul_operands(x, q, b, weight_dtypes=(torch.int8,), **names)
    if len({(s.mode, s.group_size if s.mode == "per_group" else 0) for s in specs}) > 1:
        raise ValueError("scale: the weights' scales describe different quantization layouts; use one")
    spec = specs.pop()
    fmt = int8(spec.mode, spec.group_size, offset is not None)
    w_offsets = tuple(None if o is None else o.to(torch.float32).contiguous() for o in w_offsets)  # type: ignore[union-attr]
    ops = Operands(x=x, weights=weights, biases=biases, w_scales=w_scales, w_offsets=w_offsets)  # type: ignore[arg-type]
    return fmt, ops


@dataclass(frozen=True)
class Options:
    """What a dense public function asks besides its operands (validated by :func:`builder`'s closure)."""

    op: str
    pattern: str
    group: object = None
    backend: object = None
    parallel_num: object = None
    return_gathered: object = False
    deterministic: object = False
    # ("gather_dim" | "scatter_dim", the value given) for the patterns that communicate along a dim.
    dim: tuple[str, object] | None = None
    out_dtype: torch.dtype | None = None
    epilogue: str = ""
    eps: float = 0.0
    # The caller's x, so that a dim that cannot be gathered / scattered is named before the operands' checks (a
    # torch-style call gathering k would be told to transpose its weight first).
    x: object = None


def builder(
    options: Options,
    operands: Callable[[], tuple[OperandFormat, Operands]],
    also: Callable[[Operands], None] | None = None,
) -> Callable[[int], Built]:
    """The validation of one dense call (``operands``, then the options, then ``also`` on the operands): the
    ``build`` of :func:`kernels.protocol.submit`."""

    def build(world: int) -> Built:
        if options.dim is not None and isinstance(options.x, torch.Tensor) and options.x.dim() >= 2:
            checks.normalize_dim(options.dim[0], options.dim[1], options.x)
        fmt, ops = operands()
        checks.check_backend(options.backend)
        checks.check_parallel_num(options.parallel_num)
        flag_name, flag = (
            ("return_gathered", options.return_gathered)
            if options.pattern == "all_gather"
            else ("deterministic", options.deterministic)
        )
        checks.check_flag(flag_name, flag)
        comm_dim = 0
        x = ops.x
        if options.dim is not None:
            comm_dim = checks.normalize_dim(options.dim[0], options.dim[1], x)
            if options.pattern == "reduce_scatter" and x.shape[comm_dim] % world:
                raise ValueError(
                    f"{options.op}: scatter_dim={options.dim[1]} splits x.shape[{comm_dim}]={x.shape[comm_dim]} "
                    f"(m={x.shape[comm_dim]}, x shape {tuple(x.shape)}), which is not divisible by the group size "
                    f"W={world}"
                )
        if also is not None:
            also(ops)
        call = GemmCall(
            op=options.op,
            pattern=options.pattern,
            fmt=fmt,
            out_dtype=options.out_dtype,
            return_gathered=bool(options.return_gathered),
            deterministic=bool(options.deterministic),
            comm_dim=comm_dim,
            group_name=group_name(options.group),  # type: ignore[arg-type]
            world=world,
            backend=options.backend,  # type: ignore[arg-type]
            parallel_num=options.parallel_num,  # type: ignore[arg-type]
            epilogue=options.epilogue,
            eps=options.eps,
        )
        m, k = math.prod(x.shape[:-1]), x.shape[-1]
        n = sum(w.shape[0] for w in ops.weights)
        out = options.out_dtype or x.dtype
        # An FP8 call's split count is timed on stand-ins of its output dtype.
        dtypes = (out, out if fmt.kind == "fp8" else ops.weights[0].dtype)
        return Built(call, ops, x.device, (m, k, n), dtypes)

    return build


def submit_dense(spec: OpSpec, pattern: str, signature: tuple, tensors: tuple) -> Any:
    """A plain or FP8 call of ``spec``: ``signature = (op, group, backend, parallel_num, flag, dim, out_dtype)``
    (``flag``: ``return_gathered`` or ``deterministic``; ``dim``: ``("gather_dim" | "scatter_dim", value)`` or None;
    ``out_dtype``: None for a plain call), ``tensors = (x, weight, bias)`` plain or ``(x, x_scale, weight, w_scale,
    bias)`` FP8, each weight entry one tensor or a list. A one-weight call whose signature (``signature`` and the
    tensors' shapes, dtypes and devices) resolved before takes :func:`kernels.protocol.resolved`: a plain call's
    operands as given, an FP8 call's from :func:`fp8_operands` (their scale values read where
    :func:`kernels.fp8.scales.value_check_wanted` says, as the full path reads them; operands that fail take the
    full path, whose admission raises the error on every rank)."""
    op, group = signature[0], signature[1]
    scaled = len(tensors) == 5
    key = None
    if type(tensors[-3]) is torch.Tensor:
        described = tensors_key(*tensors)
        key = None if described is None else (signature, described)
    if key is not None:
        if not scaled:
            x, weight, bias = tensors
            ops = Operands(x, (weight,), (bias,))
        else:
            try:
                ops = fp8_operands(*tensors, out_dtype=signature[6])[1]
            except ERRORS:
                ops = None
        if ops is not None:
            out = resolved(spec, op, group, key, ops)
            if out is not MISS:
                return out
    # A module-level build (a nested one would make its variables cells, allocated on every call).
    return submit(spec, op, group, partial(_dense_build, pattern, signature, tensors), key)


def _dense_build(pattern: str, signature: tuple, tensors: tuple, world: int) -> Built:
    op, group, backend, parallel_num, flag, dim, out_dtype = signature
    flags = {"return_gathered": flag} if pattern == "all_gather" else {"deterministic": flag}
    options = Options(op, pattern, group, backend, parallel_num, dim=dim, x=tensors[0], out_dtype=out_dtype, **flags)
    if len(tensors) == 5:
        return builder(options, lambda: fp8_operands(*tensors, out_dtype=out_dtype))(world)
    return builder(options, lambda: plain_operands(*tensors))(world)


def dequantized(call: GemmCall, ops: Operands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A one-weight reference's operands: x's rows, the weight and the bias as they are multiplied and added
    (:func:`kernels.format.dequantize_x` / ``dequantize_weight`` / ``bias_of``); a plain call's are its own."""
    x2d = rows_of(ops.x)
    fmt = call.fmt
    if fmt.kind == "plain":
        return x2d, ops.weights[0], ops.biases[0]
    xd = dequantize_x(fmt, x2d, ops.x_scale, per_row=False)
    wd = dequantize_weight(fmt, ops.weights[0], ops.scale_of(0), ops.offset_of(0), x2d.dtype)
    return xd, wd, bias_of(fmt, ops.biases[0])


def dims_before(x: torch.Tensor, dim: int) -> int:
    """``outer``: how many row blocks of the flattened ``x`` are gathered / scattered on their own, the
    product of the dims before ``dim`` (1 for dim 0, and for an empty ``x``)."""
    outer = math.prod(x.shape[:dim])
    return outer if outer > 0 else 1


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x [..., k]`` as ``[m, k]`` rows (``reshape`` with both sizes: ``-1`` cannot be inferred for k = 0); a 2-D
    ``x`` is its own rows (a reshape to the same shape would be a view of it, at a dispatcher round trip's cost)."""
    if x.dim() == 2:
        return x
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
