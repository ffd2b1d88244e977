"""The public FP8 ops: validate, choose the backend, one call to a registered operator.

Separate entry points, not an FP8 keyword on the bf16 ops: their arguments mirror
``torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)`` and torch's
``fused_all_gather_scaled_matmul`` / ``fused_scaled_matmul_reduce_scatter`` (payloads and scales
side by side, ``out_dtype``, the mode inferred from the scale shapes), and their results differ in
kind (``return_gathered`` also returns the gathered scales). See docs/fp8.md.

Everything is checked before any communication: dtypes, shapes and devices from metadata, scale
values (finite, > 0) with one host read when :func:`kernels.fp8.scales.value_check_wanted` (CPU
always, GPU under ``COC_CHECK=1``). Under ``COC_CHECK=1`` the ranks also compare their calls (the
shared descriptor of ``kernels.agree`` plus the FP8 fields: mode, FP8 dtypes, ``out_dtype`` and, in
tensor mode of the all-gather, the global scale's bits) before the op communicates.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from .. import checks, comm, dispatch
from ..config import get_config
from ..library import blocks_before
from ..op_registration import assume_constant_result
from . import library
from .scales import FP8_DTYPES, MODES, OUT_DTYPES, check_fp8, check_operands, check_scale_values, flatten_x_scale
from .scales import value_check_wanted as _value_check_wanted

_warned: set[str] = set()


@assume_constant_result
def _fused_missing(op: str) -> str | None:
    """Why the fused FP8 function of ``op`` cannot be imported, or None."""
    try:
        library.fused_function(op)
    except (ImportError, NotImplementedError, AttributeError) as e:
        return str(e)
    return None


def _choose(
    op: str,
    backend: str | None,
    parallel_num: int | None,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    flag: bool,
    group: dist.ProcessGroup | None,
    world: int,
    layout: tuple[int, int] = (0, 1),
) -> tuple[str, int, str]:
    # The dispatcher (and COC_PARALLEL_NUM=auto's tuner) sees stand-ins of the op's output dtype:
    # the split count tuned for the bf16 op of the same shape is the one used (FP8 operands cannot
    # run the bf16 timing). The FP8 fields are compared by _check_agreement.
    base = {
        "all_gather_scaled_matmul": "all_gather_matmul",
        "scaled_matmul_reduce_scatter": "matmul_reduce_scatter",
        "scaled_matmul_all_reduce": "matmul_all_reduce",
    }[op]
    x_stand = dispatch._stand_in(tuple(x2d.shape), out_dtype, x2d.device)
    w_stand = dispatch._stand_in(tuple(weight.shape), out_dtype, x2d.device)
    b_stand = None if bias is None else dispatch._stand_in((weight.shape[0],), out_dtype, x2d.device)
    name, num, group_name = dispatch.decide(
        base, backend, parallel_num, x_stand, w_stand, b_stand, flag, group, world, comm_dim=layout[0], outer=layout[1]
    )
    if name == "fused":
        reason = _fused_missing(op)
        if reason is not None:
            if reason not in _warned:
                _warned.add(reason)
                warnings.warn(
                    f"{op}: the fused FP8 kernels are not available ({reason}); using the chunked path instead "
                    "(this warning is shown once per reason)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            name, num, group_name = dispatch.decide(
                base, "chunked", parallel_num, x_stand, w_stand, b_stand, flag, group, world
            )
    return name, num, group_name


def _check_agreement(
    op: str,
    mode: str,
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    world: int,
) -> None:
    """Under ``COC_CHECK=1``: every rank passes the same mode, FP8 dtypes and ``out_dtype`` (and, for
    the all-gather in tensor mode, the same global scale); else ``RuntimeError`` on every rank."""
    if world == 1 or torch.compiler.is_compiling() or not get_config().check:
        return
    scale_bits = 0
    if op == "all_gather_scaled_matmul" and mode == "tensor":
        scale_bits = int(x_scale.detach().reshape(1).cpu().view(torch.int32)[0])
    mine = [
        MODES.index(mode),
        FP8_DTYPES.index(x.dtype),
        FP8_DTYPES.index(weight.dtype),
        OUT_DTYPES.index(out_dtype),
        scale_bits,
    ]
    table = torch.zeros((world * len(mine),), dtype=torch.int64)
    comm.all_gather(table, torch.tensor(mine, dtype=torch.int64), group)
    rows = table.view(world, len(mine)).tolist()
    if any(row != rows[0] for row in rows):
        fields = ("mode", "x dtype", "weight dtype", "out_dtype", "tensor-mode x_scale bits")
        differing = [f for i, f in enumerate(fields) if len({row[i] for row in rows}) > 1]
        raise RuntimeError(
            f"{op}: the ranks of the group passed different {', '.join(differing)} (per rank: {rows}; columns "
            f"{fields}); an all-gather in tensor mode needs one global x_scale on every rank"
        )


def _prepare(
    op: str,
    x: object,
    x_scale: object,
    weight: object,
    w_scale: object,
    bias: object,
    out_dtype: object,
    group: object,
    backend: object,
    parallel_num: object,
    flag_name: str,
    flag: object,
) -> tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    mode = check_operands(x, x_scale, weight, w_scale, bias, out_dtype)
    checks.check_group(group)
    checks.check_backend(backend)
    checks.check_parallel_num(parallel_num)
    checks.check_flag(flag_name, flag)
    assert isinstance(x, torch.Tensor) and isinstance(x_scale, torch.Tensor) and isinstance(w_scale, torch.Tensor)
    world = checks.group_size(group)  # type: ignore[arg-type]
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    xs = flatten_x_scale(x, x_scale).contiguous()
    ws = w_scale.contiguous()
    if _value_check_wanted(x.device):
        check_scale_values("x_scale", xs)
        check_scale_values("w_scale", ws)
    return mode, world, x2d, xs, ws


def _move_to_dim0(name: str, dim: object, x: object, x_scale: object) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """``(d, x, x_scale)`` with dim ``d`` of x (and of its per-row scales) moved to dim 0, contiguous;
    None when ``d`` is 0 after normalization. Tensor-mode scales (one value) are left as they are."""
    check_fp8("x", x, "nd")
    if not isinstance(x_scale, torch.Tensor):
        raise TypeError(f"x_scale must be a torch.Tensor, got {type(x_scale).__name__}")
    assert isinstance(x, torch.Tensor)
    d = checks.normalize_dim(name, dim, x)
    if d == 0:
        return None
    lead = tuple(x.shape[:-1])
    if x_scale.numel() > 1:
        rows = x_scale.shape[0] if x_scale.dim() == 2 else -1
        if x_scale.dim() == 2 and rows == math.prod(lead):
            x_scale = x_scale.reshape(lead + (x_scale.shape[-1],))
        elif x_scale.dim() != x.dim() or tuple(x_scale.shape[:-1]) != lead:
            raise ValueError(
                f"x_scale shape {tuple(x_scale.shape)} does not match x {tuple(x.shape)} for {name}={dim}: "
                f"want [..., G] over x's leading dims {lead} or [{math.prod(lead)}, G] in x's row order"
            )
        x_scale = x_scale.movedim(d, 0).contiguous()
    return d, x.movedim(d, 0).contiguous(), x_scale


def _scale_back(x_scale_gathered: torch.Tensor, x_gathered_dim0: torch.Tensor, d: int) -> torch.Tensor:
    """The gathered per-row scales in the caller's layout (``[..., G]`` over the gathered x's leading dims)."""
    if x_scale_gathered.numel() <= 1:
        return x_scale_gathered
    lead = tuple(x_gathered_dim0.shape[:-1])
    return x_scale_gathered.reshape(lead + (x_scale_gathered.shape[-1],)).movedim(0, d).contiguous()


def all_gather_scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    return_gathered: bool = False,
    gather_dim: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 ``y = all_gather(x, dim=gather_dim) @ weight.T + bias``, rounded once to ``out_dtype``.

    Reference::

        x_gathered = cat([x of rank 0, ..., x of rank W-1])          # FP8 bytes, [m_local * W, k]
        x_scale_gathered = cat([x_scale of each rank])               # tensor mode: the global x_scale
        y = (dequant(x_gathered) @ dequant(weight).T + bias).to(out_dtype)     # fp32 inside
        return (y, x_gathered, x_scale_gathered) if return_gathered else y

    ``x [..., k]`` FP8 (leading dims flattened to ``m_local`` rows, gathered along dim 0 and restored
    with dim 0 multiplied by W), ``weight [n, k]`` FP8, scales fp32 per mode (``kernels.fp8.scales``;
    ``x_scale`` may also be ``[..., G]`` over x's leading dims), ``bias [n]`` in ``out_dtype`` or fp32.
    In tensor mode ``x_scale`` is one global scale: every rank passes the same value.

    ``gather_dim`` (not the last dim; ``[b, s_local, k]`` with ``gather_dim=1`` for Hugging Face's
    layout): x and its per-row scales (``[..., G]`` or ``[m_local, G]`` in x's row order) are gathered
    on that dim and the outputs keep x's layout. The kernels gather rows of dim 0, so the FP8 bytes
    and their scales are first moved to dim 0 (a copy of one byte per element) and the result back.
    """
    if gather_dim != 0:
        moved = _move_to_dim0("gather_dim", gather_dim, x, x_scale)
        if moved is not None:
            d, xm, sm = moved
            layout = (d, blocks_before(x, d))
            out = _all_gather_scaled_matmul(
                xm, sm, weight, w_scale, bias, out_dtype, group, backend, parallel_num, return_gathered, layout
            )
            if not return_gathered:
                return out.movedim(0, d).contiguous()
            y, xg, xsg = out
            return y.movedim(0, d).contiguous(), xg.movedim(0, d).contiguous(), _scale_back(xsg, xg, d)
    return _all_gather_scaled_matmul(
        x, x_scale, weight, w_scale, bias, out_dtype, group, backend, parallel_num, return_gathered, (0, 1)
    )


def _all_gather_scaled_matmul(
    x: object,
    x_scale: object,
    weight: object,
    w_scale: object,
    bias: object,
    out_dtype: object,
    group: object,
    backend: object,
    parallel_num: object,
    return_gathered: object,
    layout: tuple[int, int],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`all_gather_scaled_matmul` on dim 0 of ``x``; ``layout`` the caller's ``(gather_dim, product of
    x's dims before it)``, which the ranks' call check compares (x arrives with that dim moved to 0)."""
    mode, world, x2d, xs, ws = _prepare(
        "all_gather_scaled_matmul",
        x,
        x_scale,
        weight,
        w_scale,
        bias,
        out_dtype,
        group,
        backend,
        parallel_num,
        "return_gathered",
        return_gathered,
    )
    name, num, group_name = _choose(
        "all_gather_scaled_matmul",
        backend,
        parallel_num,
        x2d,
        weight,
        bias,
        out_dtype,
        return_gathered,
        group,
        world,
        layout,
    )
    _check_agreement("all_gather_scaled_matmul", mode, x2d, xs, weight, out_dtype, group, world)
    lead = (x.shape[0] * world,) + tuple(x.shape[1:-1])
    w = weight.contiguous()
    if not return_gathered:
        y = library.all_gather_scaled_matmul(
            x2d, xs, w, ws, bias, mode, out_dtype, group_name, world, name, num, *layout
        )
        return y.view(lead + (weight.shape[0],))
    y, xg, xsg = library.all_gather_scaled_matmul_gathered(
        x2d, xs, w, ws, bias, mode, out_dtype, group_name, world, name, num, *layout
    )
    return y.view(lead + (weight.shape[0],)), xg.view(lead + (x.shape[-1],)), xsg


def scaled_matmul_reduce_scatter(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    deterministic: bool = False,
    scatter_dim: int = 0,
) -> torch.Tensor:
    """FP8 ``y = reduce_scatter(x @ weight.T, dim=scatter_dim) + bias``, rounded once to ``out_dtype``.

    Reference::

        partial = dequant(x) @ dequant(weight).T                     # fp32 [m, n] on every rank
        y = (reduce_scatter_dim0(partial) + bias).to(out_dtype)      # [m / W, n], fp32 sum

    ``x [..., k_local]`` (dim 0 must divide by W; leading dims restored with dim 0 divided by W).
    ``deterministic=True`` sums the partials in rank order: repeated calls give identical bits.
    ``scatter_dim`` (not the last dim; it must divide by W): as ``gather_dim`` of
    :func:`all_gather_scaled_matmul`, x and its scales are moved to dim 0 first and the result back.
    """
    if scatter_dim != 0:
        moved = _move_to_dim0("scatter_dim", scatter_dim, x, x_scale)
        if moved is not None:
            d, xm, sm = moved
            layout = (d, blocks_before(x, d))
            y = _scaled_matmul_reduce_scatter(
                xm, sm, weight, w_scale, bias, out_dtype, group, backend, parallel_num, deterministic, layout
            )
            return y.movedim(0, d).contiguous()
    return _scaled_matmul_reduce_scatter(
        x, x_scale, weight, w_scale, bias, out_dtype, group, backend, parallel_num, deterministic, (0, 1)
    )


def _scaled_matmul_reduce_scatter(
    x: object,
    x_scale: object,
    weight: object,
    w_scale: object,
    bias: object,
    out_dtype: object,
    group: object,
    backend: object,
    parallel_num: object,
    deterministic: object,
    layout: tuple[int, int],
) -> torch.Tensor:
    """:func:`scaled_matmul_reduce_scatter` on dim 0 of ``x``; ``layout`` as in :func:`_all_gather_scaled_matmul`."""
    mode, world, x2d, xs, ws = _prepare(
        "scaled_matmul_reduce_scatter",
        x,
        x_scale,
        weight,
        w_scale,
        bias,
        out_dtype,
        group,
        backend,
        parallel_num,
        "deterministic",
        deterministic,
    )
    if x.shape[0] % world:
        raise ValueError(
            f"scaled_matmul_reduce_scatter scatters dim 0 of x: x.shape[0]={x.shape[0]} (x shape {tuple(x.shape)}) "
            f"is not divisible by the group size W={world}"
        )
    name, num, group_name = _choose(
        "scaled_matmul_reduce_scatter",
        backend,
        parallel_num,
        x2d,
        weight,
        bias,
        out_dtype,
        deterministic,
        group,
        world,
        layout,
    )
    _check_agreement("scaled_matmul_reduce_scatter", mode, x2d, xs, weight, out_dtype, group, world)
    y = library.scaled_matmul_reduce_scatter(
        x2d, xs, weight.contiguous(), ws, bias, mode, out_dtype, group_name, world, name, num, *layout, deterministic
    )
    return y.view((x.shape[0] // world,) + tuple(x.shape[1:-1]) + (weight.shape[0],))


def scaled_matmul_all_reduce(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    parallel_num: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """FP8 ``y = all_reduce(x @ weight.T) + bias``, rounded once to ``out_dtype``.

    Reference::

        partial = dequant(x) @ dequant(weight).T                     # fp32 [m, n] on every rank
        y = (all_reduce(partial) + bias).to(out_dtype)               # [m, n], fp32 sum

    ``deterministic=True`` sums in rank order: identical bits on every call and every rank.
    """
    mode, world, x2d, xs, ws = _prepare(
        "scaled_matmul_all_reduce",
        x,
        x_scale,
        weight,
        w_scale,
        bias,
        out_dtype,
        group,
        backend,
        parallel_num,
        "deterministic",
        deterministic,
    )
    name, num, group_name = _choose(
        "scaled_matmul_all_reduce", backend, parallel_num, x2d, weight, bias, out_dtype, deterministic, group, world
    )
    _check_agreement("scaled_matmul_all_reduce", mode, x2d, xs, weight, out_dtype, group, world)
    y = library.scaled_matmul_all_reduce(
        x2d, xs, weight.contiguous(), ws, bias, mode, out_dtype, group_name, world, name, num, 0, 1, deterministic
    )
    return y.view(tuple(x.shape[:-1]) + (weight.shape[0],))


def scaled_matmul(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
) -> torch.Tensor:
    """The local FP8 GEMM (no communication; the FP8 linears' non-communicating GEMMs).

    Reference: ``(dequant(x) @ dequant(weight).T + bias).to(out_dtype)`` with fp32 inside. Runs the
    fused Triton FP8 GEMM when the backend resolves to ``"fused"`` on a CUDA tensor, else the reference.
    """
    mode = check_operands(x, x_scale, weight, w_scale, bias, out_dtype)
    checks.check_backend(backend)
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    xs = flatten_x_scale(x, x_scale).contiguous()
    ws = w_scale.contiguous()
    if _value_check_wanted(x.device):
        check_scale_values("x_scale", xs)
        check_scale_values("w_scale", ws)
    use_fused = backend == "fused" or (backend is None and get_config().use_fused)
    name = "fused" if use_fused and x.is_cuda else "sequential"
    y = library.scaled_matmul(x2d, xs, weight.contiguous(), ws, bias, mode, out_dtype, name)
    return y.view(tuple(x.shape[:-1]) + (weight.shape[0],))
