"""The way into every op: validate this rank's arguments per format, admit the call across ranks, choose the backend.

Each public function of :mod:`kernels.ops` builds its operands with one of :func:`plain_operands`,
:func:`fp8_operands` or :func:`int8_operands` (each raises ``ValueError`` / ``TypeError`` naming the
argument) inside :func:`submit`, which checks the options every op takes, admits the call
(:mod:`kernels.callcheck`: the ranks compare it, and a rank's error reaches every rank) and resolves
the backend (:mod:`kernels.dispatch`). The caller then makes one call of its registered operator with
the resolved call's string.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import callcheck, checks, dispatch, quant
from ..call import OpCall, Operands, decode, group_name, resolve_group
from ..format import PLAIN, OperandFormat, fp8, int8
from ..fp8 import scales
from ..op_registration import define_op


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
    a tensorwise one)."""
    listed = isinstance(weight, (list, tuple))
    weights = _weight_list(weight, "weight")
    w_scales = _per_weight(w_scale, len(weights), "w_scale", listed)
    biases = _per_weight(bias, len(weights), "bias", listed)
    modes = {
        scales.check_operands(x, x_scale, w, s, b, out_dtype=out_dtype)
        for w, s, b in zip(weights, w_scales, biases, strict=True)
    }
    if len(modes) > 1:
        raise ValueError(f"w_scale: the weights' scales describe different scaling modes {sorted(modes)}; use one")
    mode = modes.pop()
    assert isinstance(x, torch.Tensor) and isinstance(x_scale, torch.Tensor)
    rows = math.prod(x.shape[:-1])
    xs = scales.kernel_scale(x_scale, mode, rows).contiguous()
    ws = tuple(scales.kernel_scale(s, mode).contiguous() for s in w_scales)  # type: ignore[arg-type]
    operands = Operands(x=x, weights=weights, biases=biases, x_scale=xs, w_scales=ws)  # type: ignore[arg-type]
    return fp8(mode), operands


def fp8_values(ops: Operands) -> None:
    """The FP8 scale values (finite, > 0): a host read, where :func:`kernels.fp8.scales.value_check_wanted`."""
    if ops.x_scale is not None and scales.value_check_wanted(ops.x.device):
        scales.check_scale_values("x_scale", ops.x_scale)
        for s in ops.w_scales:
            scales.check_scale_values("w_scale", s)


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
class Request:
    """What a public function asks of :func:`submit` besides its operands."""

    pattern: str
    op_name: str
    group: dist.ProcessGroup | None
    backend: str | None
    parallel_num: int | None
    out_dtype: torch.dtype | None = None
    return_gathered: bool = False
    deterministic: bool = False
    # ("gather_dim" | "scatter_dim", the value given) for the patterns that communicate along a dim.
    dim: tuple[str, int] | None = None
    # x's device, where x is a tensor: the admission's messages travel there.
    device: torch.device | None = None
    # all_reduce: the epilogue after the reduction (kernels.call.OpCall.epilogue).
    epilogue: str = ""


def request(pattern: str, op_name: str, x: object, **fields: object) -> Request:
    """The :class:`Request` of a public function's call on ``x`` (``fields``: the other Request fields)."""
    return Request(
        pattern=pattern,
        op_name=op_name,
        device=x.device if isinstance(x, torch.Tensor) else None,
        **fields,  # type: ignore[arg-type]
    )


def submit(
    request: Request,
    build: Callable[[], tuple[OperandFormat, Operands]],
    values: Callable[[Operands], None] | None = None,
) -> tuple[OpCall, Operands]:
    """Validate (``build``, then the options), admit the call across ranks and choose its backend: the
    resolved call and its operands, ready for the registered operator."""
    world = checks.world_of(request.group)
    built: list[tuple[OpCall, Operands]] = []
    flag_name = "return_gathered" if request.pattern == "all_gather" else "deterministic"
    flag = request.return_gathered if request.pattern == "all_gather" else request.deterministic

    def validate() -> tuple[int, ...]:
        fmt, ops = build()
        checks.check_options(request.backend, request.parallel_num, flag_name, flag)
        comm_dim = 0
        if request.dim is not None:
            comm_dim = checks.normalize_dim(request.dim[0], request.dim[1], ops.x)
            if request.pattern == "reduce_scatter" and ops.x.shape[comm_dim] % world:
                raise ValueError(
                    f"{request.op_name}: scatter_dim={request.dim[1]} splits x.shape[{comm_dim}]="
                    f"{ops.x.shape[comm_dim]} (m={ops.x.shape[comm_dim]}, x shape {tuple(ops.x.shape)}), which is "
                    f"not divisible by the group size W={world}"
                )
        call = OpCall(
            pattern=request.pattern,
            fmt=fmt,
            out_dtype=request.out_dtype,
            return_gathered=request.return_gathered,
            deterministic=request.deterministic,
            comm_dim=comm_dim,
            group_name=group_name(request.group),
            world=world,
            backend=request.backend,
            parallel_num=request.parallel_num,
            epilogue=request.epilogue,
        )
        built.append((call, ops))
        return call.descriptor(ops)

    def check_values() -> None:
        if values is not None:
            values(built[0][1])

    callcheck.admit(
        request.op_name, request.group, world, request.device, validate, values=check_values, backend=request.backend
    )
    call, ops = built[0]
    return dispatch.decide(call, ops), ops


def dims_before(x: torch.Tensor, dim: int) -> int:
    """``outer``: how many row blocks of the flattened ``x`` are gathered / scattered on their own, the
    product of the dims before ``dim`` (1 for dim 0, and for an empty ``x``)."""
    outer = math.prod(x.shape[:dim])
    return outer if outer > 0 else 1


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x [..., k]`` as ``[m, k]`` rows (``reshape`` with both sizes: ``-1`` cannot be inferred for k = 0)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def same_rows(x: torch.Tensor, call: OpCall, n: int) -> tuple[int, ...]:
    """The output shape of an op whose rows are x's: ``x.shape[:-1] + (n,)``."""
    return tuple(x.shape[:-1]) + (n,)


def one_weight_operands(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    x_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    w_offset: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> Operands:
    """The :class:`Operands` of a one-weight registered operator's arguments (its schema's order)."""
    return Operands(
        x=x,
        weights=(weight,),
        biases=(bias,),
        x_scale=x_scale,
        w_scales=() if w_scale is None else (w_scale,),
        w_offsets=() if w_offset is None else (w_offset,),
    )


def define_one_weight_op(
    name: str,
    impl: dict[str, Callable[..., torch.Tensor]],
    out_shape: Callable[[torch.Tensor, OpCall, int], tuple[int, ...]],
) -> torch._ops.OpOverload:
    """Register ``coc::<name>`` for a pattern with one weight (reduce-scatter, all-reduce, the local GEMM)::

        coc::<name>(Tensor x, Tensor? x_scale, Tensor weight, Tensor? w_scale, Tensor? w_offset, Tensor? bias,
                    str call) -> Tensor

    running ``impl[call.backend](call, operands, group)`` and returning ``out_shape(x, call, n)`` in the
    call's ``out_dtype`` (x's when None); the fake gives that shape and dtype without running anything.
    """

    def run(
        x: torch.Tensor,
        x_scale: torch.Tensor | None,
        weight: torch.Tensor,
        w_scale: torch.Tensor | None,
        w_offset: torch.Tensor | None,
        bias: torch.Tensor | None,
        call_text: str,
    ) -> torch.Tensor:
        call = decode(call_text)
        ops = one_weight_operands(x, weight, x_scale=x_scale, w_scale=w_scale, w_offset=w_offset, bias=bias)
        out = impl[call.backend](call, ops, resolve_group(call.group_name))
        out = out.to(call.out_dtype) if call.out_dtype is not None else out
        return out.view(out_shape(x, call, weight.shape[0]))

    def fake(x: torch.Tensor, x_scale: object, weight: torch.Tensor, *args: object) -> torch.Tensor:
        call = decode(str(args[-1]))
        return x.new_empty(out_shape(x, call, weight.shape[0]), dtype=call.out_dtype or x.dtype)

    schema = "(Tensor x, Tensor? x_scale, Tensor weight, Tensor? w_scale, Tensor? w_offset, Tensor? bias, str call)"
    return define_op(f"{name}{schema} -> Tensor", run, fake)
