"""The grouped GEMM of mixture-of-experts layers (no communication): each expert's rows times its own weight.

Public function: :func:`grouped_matmul` (docs/api.md, "Grouped GEMM"; ``backend="sequential"`` is the reference,
in torch). Registered operator::

    coc::grouped_matmul(Tensor x, Tensor weight, Tensor expert_offsets, Tensor? x_scale, Tensor? w_scale,
                        str call) -> Tensor                     # call: GroupedCall (format, out_dtype, backend)

``x [m, k]`` holds the tokens grouped by expert: the rows of expert ``e`` are
``x[expert_offsets[e - 1]:expert_offsets[e]]`` (``expert_offsets [E]``, int32 or int64, cumulative end
offsets whose last is ``m``: ``torch._grouped_mm``'s ``offs``); ``weight [E, n, k]`` is one
``F.linear``-layout weight per expert. Formats (:mod:`kernels.format`): plain (fp16 / bf16 / fp32, weight
of x's dtype) and FP8 (e4m3 / e5m2 payloads with fp32 scales, :mod:`kernels.fp8.scales` modes with a leading
expert dim on the weight's scale: block ``x_scale [m, ceil(k / 128)]``, ``w_scale [E, ceil(n / 128),
ceil(k / 128)]``; row ``[m, 1]``, ``[E, n, 1]``; tensor ``[]``, ``[E]``).

Metadata is checked on every call. The values of ``expert_offsets`` (non-decreasing, last == m) and of the
scales (finite, > 0) need a host read: they are checked where :func:`kernels.fp8.scales.value_check_wanted`
says (CPU tensors always, CUDA under ``COC_CHECK=1``; never while compiling or capturing a CUDA graph). The
kernel reads the offsets on the device and clamps them into ``[0, m]``, non-decreasing, so unchecked bad
offsets give wrong rows but never touch memory outside the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..capture import capturing
from ..format import PLAIN, OperandFormat, compute, dequantize_weight, dequantize_x, fp8
from ..fp8 import scales
from ..protocol import Built, Call, OpSpec, submit
from ..protocol.call import shown_as

PLAIN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OFFSET_DTYPES = (torch.int32, torch.int64)
BACKENDS = ("sequential", "fused")


@dataclass(frozen=True, kw_only=True)
class GroupedCall(Call):
    """One grouped GEMM (local: no group): its operands' format and output dtype."""

    fmt: OperandFormat = field(default=PLAIN, metadata=shown_as("format"))
    out_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class GroupedOperands:
    x: torch.Tensor
    weight: torch.Tensor
    expert_offsets: torch.Tensor
    x_scale: torch.Tensor | None = None
    w_scale: torch.Tensor | None = None

    def flat(self) -> tuple:
        return (self.x, self.weight, self.expert_offsets, self.x_scale, self.w_scale)


def _expected_scales(mode: str, shape: tuple[int, int, int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(x_scale, w_scale)`` shapes of ``mode`` for ``shape = (m, k, n, E)``: the weight's per expert."""
    m, k, n, num_experts = shape
    xs, ws = scales.expected_shapes(mode, m, k, n)
    return xs, (num_experts, *ws)


def _fp8_mode(x_scale: object, w_scale: object, x: torch.Tensor, weight: torch.Tensor, x_name: str = "x") -> str:
    for name, t in (("x_scale", x_scale), ("w_scale", w_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor for FP8 {x_name} (dtype {x.dtype}), got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} dtype {t.dtype} is not accepted; scales are torch.float32")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}")
    assert isinstance(x_scale, torch.Tensor) and isinstance(w_scale, torch.Tensor)
    shape = (x.shape[0], x.shape[1], weight.shape[1], weight.shape[0])
    got = (() if tuple(x_scale.shape) == (1,) else tuple(x_scale.shape), tuple(w_scale.shape))
    for mode in scales.MODES:
        if got == _expected_scales(mode, shape):
            return mode
    accepted = "; ".join(
        f"{mode}: x_scale {list(xs)}, w_scale {list(ws)}"
        for mode, (xs, ws) in ((mode, _expected_scales(mode, shape)) for mode in scales.MODES)
    )
    raise ValueError(
        f"x_scale shape {list(x_scale.shape)} with w_scale shape {list(w_scale.shape)} fit no scaling mode for "
        f"{x_name} [m={shape[0]}, k={shape[1]}] and weight [E={shape[3]}, n={shape[2]}, k={shape[1]}]; accepted: "
        f"{accepted}"
    )


def _check_tensors(x: object, weight: object, expert_offsets: object) -> None:
    for name, t in (("x", x), ("weight", weight), ("expert_offsets", expert_offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
    assert isinstance(expert_offsets, torch.Tensor)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [m, k] (the tokens grouped by expert), got shape {tuple(x.shape)}")
    if weight.dim() != 3 or weight.shape[0] < 1:
        raise ValueError(f"weight must be 3-D [E, n, k] with E >= 1 (one [n, k] per expert), got {tuple(weight.shape)}")
    if weight.shape[2] != x.shape[1]:
        raise ValueError(
            f"k mismatch: x has k={x.shape[1]} (shape {tuple(x.shape)}) but weight has k={weight.shape[2]} "
            f"(shape {tuple(weight.shape)}); weight must be [E, n, k] (torch.nn.functional.linear layout per expert)"
        )
    if expert_offsets.dtype not in OFFSET_DTYPES:
        raise TypeError(f"expert_offsets dtype {expert_offsets.dtype} is not accepted; use torch.int32 or torch.int64")
    if tuple(expert_offsets.shape) != (weight.shape[0],):
        raise ValueError(
            f"E mismatch: expert_offsets has shape {tuple(expert_offsets.shape)} but weight has E={weight.shape[0]} "
            f"experts (shape {tuple(weight.shape)}); expert_offsets must be [E], the cumulative end row of each expert"
        )
    for name, t in (("weight", weight), ("expert_offsets", expert_offsets)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    needs_grad = [name for name, t in (("x", x), ("weight", weight)) if t.requires_grad]
    if needs_grad and torch.is_grad_enabled():
        raise TypeError(
            f"grouped_matmul is forward-only and {', '.join(needs_grad)} requires grad; call it under no_grad"
        )


def check_operands(
    x: object,
    weight: object,
    expert_offsets: object,
    *,
    x_scale: object = None,
    w_scale: object = None,
    out_dtype: object = None,
) -> tuple[OperandFormat, torch.dtype]:
    """Validate a call (metadata only; ``ValueError`` / ``TypeError`` naming the argument and its value) and
    return its format and output dtype (plain: x's; FP8: ``out_dtype``, default bf16)."""
    _check_tensors(x, weight, expert_offsets)
    assert isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
    return operand_format(x, weight, dict(x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype))


def operand_format(
    x: torch.Tensor, weight: torch.Tensor, options: dict, x_name: str = "x"
) -> tuple[OperandFormat, torch.dtype]:
    """The format and output dtype of a grouped GEMM's operands ``x [m, k]``, ``weight [E, n, k]`` (shapes
    checked by the caller) and ``options`` = ``{x_scale, w_scale, out_dtype}``: also the MoE ops' check
    (:mod:`kernels.ops.moe.routing`), whose x is named ``x_name``."""
    x_scale, w_scale, out_dtype = options["x_scale"], options["w_scale"], options["out_dtype"]
    if x.dtype in scales.FP8_DTYPES:
        if weight.dtype not in scales.FP8_DTYPES:
            raise TypeError(
                f"weight dtype {weight.dtype} is not FP8 but {x_name} is {x.dtype}; FP8 {x_name} needs an FP8 weight"
            )
        out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
        scales.check_out_dtype(out_dtype)
        assert isinstance(out_dtype, torch.dtype)
        return fp8(_fp8_mode(x_scale, w_scale, x, weight, x_name)), out_dtype
    if x.dtype not in PLAIN_DTYPES:
        raise TypeError(f"{x_name} dtype {x.dtype} is not accepted; use one of {[str(d) for d in PLAIN_DTYPES]} or FP8")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} does not match {x_name} dtype {x.dtype}")
    for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
        if scale is not None:
            raise ValueError(f"{name} is given but {x_name} is {x.dtype}: scales go with FP8 {x_name} and weight only")
    if out_dtype is not None and out_dtype != x.dtype:
        raise ValueError(
            f"out_dtype={out_dtype} is not accepted for {x.dtype} {x_name}; plain results are in {x_name}'s dtype"
        )
    return PLAIN, x.dtype


def check_values(x: torch.Tensor, expert_offsets: torch.Tensor, x_scale: object, w_scale: object) -> None:
    """The offsets non-decreasing from 0 with the last equal to ``m``, the scales finite and > 0 (a host read)."""
    ends = [int(v) for v in expert_offsets.tolist()]
    m = x.shape[0]
    for e, end in enumerate(ends):
        before = ends[e - 1] if e else 0
        if end < before:
            where = f"expert_offsets[{e - 1}]={before}" if e else "0"
            raise ValueError(
                f"expert_offsets must be non-decreasing (cumulative end rows): expert_offsets[{e}]={end} < {where}"
            )
    if ends[-1] != m:
        raise ValueError(
            f"expert_offsets[-1]={ends[-1]} must equal m={m} (x has {m} rows, every row belongs to one expert); "
            f"expert_offsets={ends}"
        )
    for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
        if isinstance(scale, torch.Tensor):
            scales.check_scale_values(name, scale)


def grouped_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``out [m, n]``, the rows of expert ``e`` times ``weight[e].T`` (module docstring)::

        out = empty(m, n, dtype=out_dtype)        # plain: x's dtype; FP8: out_dtype (default bf16)
        start = 0
        for e in range(E):
            end = expert_offsets[e]
            # plain: torch's GEMM in x's dtype (fp32 accumulation, one rounding to x's dtype)
            out[start:end] = torch.mm(x[start:end], weight[e].T)
            # FP8: dequantized operands in fp32, fp32 products and sums, one rounding to out_dtype
            out[start:end] = (dequant(x, x_scale)[start:end] @ dequant(weight[e], w_scale[e]).T).to(out_dtype)
            start = end

    ``dequant`` is :func:`kernels.dequantize_fp8` (x per 1 x 128 block / row / tensor, the weight per
    128 x 128 block / row / tensor). ``backend``: ``None`` runs the persistent Triton kernel where it runs
    (CUDA; the CPU under ``TRITON_INTERPRET=1``), else the reference; ``"fused"`` the kernel (``ValueError``
    where it cannot run); ``"sequential"`` the reference above, in torch (a host read of the offsets: not for
    CUDA graphs).
    """

    def build(world: int) -> Built:
        options = dict(x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype)
        fmt, out = check_operands(x, weight, expert_offsets, **options)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not accepted; use None or one of {BACKENDS}")
        if backend == "sequential" or (scales.value_check_wanted(x.device) and not capturing(x.device)):
            check_values(x, expert_offsets, x_scale, w_scale)
        call = GroupedCall(op="grouped_matmul", backend=backend, fmt=fmt, out_dtype=out)
        return Built(call, GroupedOperands(x, weight, expert_offsets, x_scale, w_scale), x.device)

    return submit(SPEC, "grouped_matmul", None, build)


def grouped_matmul_grads(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor, *, needs: tuple
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_x, grad_w)`` of ``y = grouped_matmul(x, weight, expert_offsets)`` (plain operands), each None
    unless ``needs = (x's, weight's)`` asks for it:

    - dgrad, the same op on the transposed weights: ``grad_x[rows of e] = grad_y[rows of e] @ weight[e]``;
    - wgrad, one ``torch.mm`` per expert (the offsets read on the host; zeros for an expert with no rows):
      ``grad_w[e] = grad_y[rows of e].T @ x[rows of e]``.
    """
    grad_y = grad_y.contiguous()
    grad_x = grad_w = None
    if needs[0]:
        grad_x = grouped_matmul(grad_y, weight.transpose(1, 2).contiguous(), expert_offsets)
    if needs[1]:
        grad_w = torch.zeros_like(weight)
        start = 0
        for e, end in enumerate(expert_offsets.tolist()):
            if end > start:
                grad_w[e] = grad_y[start:end].T @ x[start:end]
            start = end
    return grad_x, grad_w


def _reference(call: GroupedCall, ops: GroupedOperands) -> torch.Tensor:
    fmt, x, weight, x_scale, w_scale = call.fmt, ops.x, ops.weight, ops.x_scale, ops.w_scale
    out = torch.empty((x.shape[0], weight.shape[1]), dtype=call.out_dtype, device=x.device)
    xs = None if x_scale is None else scales.kernel_scale(x_scale, str(fmt.mode), x.shape[0])
    xd = dequantize_x(fmt, x, xs, per_row=False)
    start = 0
    with compute(fmt):
        for e, end in enumerate(int(v) for v in ops.expert_offsets.tolist()):
            wd = dequantize_weight(fmt, weight[e], None if w_scale is None else w_scale[e], None, x.dtype)
            out[start:end] = torch.mm(xd[start:end], wd.T).to(call.out_dtype)
            start = end
    return out


def _kernel(call: GroupedCall, ops: GroupedOperands) -> torch.Tensor:
    from ..fused import grouped

    x, weight = ops.x, ops.weight
    out = torch.empty((x.shape[0], weight.shape[1]), dtype=call.out_dtype, device=x.device)
    xs = None if ops.x_scale is None else scales.kernel_scale(ops.x_scale, str(call.fmt.mode), x.shape[0]).contiguous()
    ws = None if ops.w_scale is None else ops.w_scale.contiguous()
    return grouped.launch(call.fmt, x, weight, ops.expert_offsets.contiguous(), out, x_scale=xs, w_scale=ws)


def _fake(call: GroupedCall, ops: GroupedOperands) -> torch.Tensor:
    return ops.x.new_empty((ops.x.shape[0], ops.weight.shape[1]), dtype=call.out_dtype)


SPEC = OpSpec(
    name="grouped_matmul",
    call=GroupedCall,
    schema="(Tensor x, Tensor weight, Tensor expert_offsets, Tensor? x_scale, Tensor? w_scale, str call) -> Tensor",
    operands=GroupedOperands,
    flat=GroupedOperands.flat,
    impl={"sequential": _reference, "fused": _kernel},
    fake=_fake,
    local="kernel",
)
