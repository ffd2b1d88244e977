"""The public FP8 ops: validate, admit the call across ranks, choose the backend, one call to a registered operator.

Separate entry points, not an FP8 keyword on the bf16 ops: their arguments mirror
``torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)`` and torch's
``fused_all_gather_scaled_matmul`` / ``fused_scaled_matmul_reduce_scatter`` (payloads and scales
side by side, ``out_dtype``, the mode inferred from the scale shapes), and their results differ in
kind (``return_gathered`` also returns the gathered scales). See docs/fp8.md.

Everything is checked before any communication: dtypes, shapes and devices from metadata, scale
values (finite, > 0) with one host read when :func:`kernels.fp8.scales.value_check_wanted` (CPU
always, GPU under ``COC_CHECK=1``). The call is admitted by :mod:`kernels.callcheck` like every op:
its descriptor holds the FP8 fields (scaling mode, x's FP8 dtype, the weight's and the output's
dtypes), and a rank's bad scales reach every rank when the call is checked.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .. import agree, callcheck, checks, dispatch
from ..config import get_config
from ..library import blocks_before
from ..op_registration import assume_constant_result
from . import library
from .scales import check_operands, check_scale_values, kernel_scale
from .scales import value_check_wanted as _value_check_wanted

# The bf16 op whose split count (customized_coc, COC_PARALLEL_NUM=auto) an FP8 op of the same shape uses:
# FP8 operands cannot run the bf16 timing, and the split trades the same GEMM rows against the same
# collective.
_SPLIT_AS = {
    "all_gather_scaled_matmul": "all_gather_matmul",
    "scaled_matmul_reduce_scatter": "matmul_reduce_scatter",
    "scaled_matmul_all_reduce": "matmul_all_reduce",
}
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
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    world: int,
) -> tuple[str, int, str]:
    # The dispatcher (and COC_PARALLEL_NUM=auto's tuner) sees stand-ins of the op's output dtype.
    base = _SPLIT_AS[op]
    x_stand = dispatch._stand_in(tuple(x2d.shape), out_dtype, x2d.device)
    w_stand = dispatch._stand_in(tuple(weight.shape), out_dtype, x2d.device)
    name, num, group_name = dispatch.decide(base, backend, parallel_num, x_stand, w_stand, group, world)
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
            name, num, group_name = dispatch.decide(base, "chunked", parallel_num, x_stand, w_stand, group, world)
    return name, num, group_name


def _validate(
    op: str,
    x: object,
    x_scale: object,
    weight: object,
    w_scale: object,
    bias: object,
    out_dtype: object,
    backend: object,
    parallel_num: object,
    flag: tuple[str, object],
    dim: tuple[str, object] | None = None,
) -> tuple[str, agree.Descriptor]:
    """``(mode, descriptor)`` of one FP8 call after its argument checks (:func:`kernels.callcheck.admit`'s
    ``validate``); ``flag`` is ``(name, value)`` of ``return_gathered`` / ``deterministic`` and ``dim``
    ``(name, value)`` of ``gather_dim`` / ``scatter_dim``."""
    mode = check_operands(x, x_scale, weight, w_scale, bias, out_dtype)
    checks.check_options(backend, parallel_num, *flag)
    assert isinstance(x, torch.Tensor) and isinstance(x_scale, torch.Tensor) and isinstance(weight, torch.Tensor)
    d, outer = 0, None
    if dim is not None:
        d = checks.normalize_dim(dim[0], dim[1], x)
        outer = blocks_before(x, d)
    descriptor = agree.describe_call(
        op,
        math.prod(x.shape[:-1]),
        x.shape[-1],
        weight.shape[0],
        x.dtype,
        bias=bias is not None,
        flag=bool(flag[1]),
        backend=backend,  # type: ignore[arg-type]
        parallel_num=parallel_num,  # type: ignore[arg-type]
        quant_mode=mode,
        comm_dim=d,
        outer=outer,
        weight_dtype=weight.dtype,
        out_dtype=out_dtype,  # type: ignore[arg-type]
    )
    return mode, descriptor


def _check_values(x: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor) -> None:
    if _value_check_wanted(x.device):
        check_scale_values("x_scale", x_scale)
        check_scale_values("w_scale", w_scale)


def _admit(
    op: str, group: object, world: int, x: object, x_scale: object, w_scale: object, validate: Any, backend: object
) -> str:
    """The scaling mode of an admitted FP8 call (``validate`` returns ``(mode, descriptor)``; ``backend`` is the
    call's argument)."""
    found: list[str] = []

    def describe() -> agree.Descriptor:
        mode, descriptor = validate()
        found.append(mode)
        return descriptor

    def values() -> None:
        _check_values(x, x_scale, w_scale)  # type: ignore[arg-type]

    device = x.device if isinstance(x, torch.Tensor) else None
    callcheck.admit(op, group, world, device, describe, values, backend=backend)  # type: ignore[arg-type]
    return found[0]


def _rows(x: torch.Tensor, x_scale: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as ``[m, k]`` rows and its scale in the kernels' layout (``[m, G]``, or 0-dim in tensor mode);
    ``reshape`` with both sizes, since ``-1`` cannot be inferred for an empty ``k`` shard."""
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).contiguous()
    return x2d, kernel_scale(x_scale, mode, x2d.shape[0]).contiguous()


def _move_to_dim0(d: int, x: torch.Tensor, x_scale: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, x_scale)`` with dim ``d`` of x (and of its per-row scales) moved to dim 0, contiguous."""
    lead = tuple(x.shape[:-1])
    if mode != "tensor":
        x_scale = x_scale.reshape(lead + (x_scale.shape[-1],)).movedim(d, 0).contiguous()
    return x.movedim(d, 0).contiguous(), x_scale


def _scale_back(x_scale_gathered: torch.Tensor, x_gathered_dim0: torch.Tensor, d: int) -> torch.Tensor:
    """The gathered per-row scales in the caller's layout (``[..., G]`` over the gathered x's leading dims)."""
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
        x_scale_gathered = cat([x_scale of each rank])               # tensor mode: each rank's scalar per row
        y = (dequant(x_gathered) @ dequant(weight).T + bias).to(out_dtype)     # fp32 inside
        return (y, x_gathered, x_scale_gathered) if return_gathered else y

    ``x [..., k]`` FP8 (leading dims flattened to ``m_local`` rows, gathered along dim 0 and restored
    with dim 0 multiplied by W), ``weight [n, k]`` FP8, scales fp32 per mode (``kernels.fp8.scales``;
    ``x_scale`` may also be ``[..., G]`` over x's leading dims), ``bias [n]`` in ``out_dtype`` or fp32.
    In tensor mode each rank's ``x_scale`` scales its own rows (it travels with them), so every
    rank may quantize its shard on its own; the gathered scales come back as ``[m_local * W, 1]``,
    one per row.

    ``gather_dim`` (not the last dim; ``[b, s_local, k]`` with ``gather_dim=1`` for Hugging Face's
    layout): x and its per-row scales (``[..., G]`` or ``[m_local, G]`` in x's row order) are gathered
    on that dim and the outputs keep x's layout. The kernels gather rows of dim 0, so the FP8 bytes
    and their scales are first moved to dim 0 (a copy of one byte per element) and the result back.
    """
    op = "all_gather_scaled_matmul"
    world = checks.world_of(group)
    mode = _admit(
        op,
        group,
        world,
        x,
        x_scale,
        w_scale,
        lambda: _validate(
            op,
            x,
            x_scale,
            weight,
            w_scale,
            bias,
            out_dtype,
            backend,
            parallel_num,
            ("return_gathered", return_gathered),
            ("gather_dim", gather_dim),
        ),
        backend,
    )
    d = gather_dim % x.dim()
    layout = (d, blocks_before(x, d))
    xm, sm = _move_to_dim0(d, x, x_scale, mode) if d else (x, x_scale)
    x2d, xs = _rows(xm, sm, mode)
    name, num, group_name = _choose(op, backend, parallel_num, x2d, weight, out_dtype, group, world)
    lead = (xm.shape[0] * world,) + tuple(xm.shape[1:-1])
    w, ws = weight.contiguous(), kernel_scale(w_scale, mode).contiguous()
    args = (x2d, xs, w, ws, bias, mode, out_dtype, group_name, world, name, num, *layout)
    if not return_gathered:
        y = library.all_gather_scaled_matmul(*args).view(lead + (weight.shape[0],))
        return y.movedim(0, d).contiguous() if d else y
    y, xg, xsg = library.all_gather_scaled_matmul_gathered(*args)
    y, xg = y.view(lead + (weight.shape[0],)), xg.view(lead + (x.shape[-1],))
    if not d:
        return y, xg, xsg
    return y.movedim(0, d).contiguous(), xg.movedim(0, d).contiguous(), _scale_back(xsg, xg, d)


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

    ``x [..., k_local]`` (dim 0 must divide by W; leading dims restored with dim 0 divided by W; an
    empty ``k_local`` shard contributes zeros, as in the bf16 op). ``deterministic=True`` sums the
    partials in rank order: repeated calls give identical bits. ``scatter_dim`` (not the last dim;
    it must divide by W): as ``gather_dim`` of :func:`all_gather_scaled_matmul`, x and its scales are
    moved to dim 0 first and the result back.
    """
    op = "scaled_matmul_reduce_scatter"
    world = checks.world_of(group)

    def validate() -> tuple[str, agree.Descriptor]:
        found = _validate(
            op,
            x,
            x_scale,
            weight,
            w_scale,
            bias,
            out_dtype,
            backend,
            parallel_num,
            ("deterministic", deterministic),
            ("scatter_dim", scatter_dim),
        )
        d = scatter_dim % x.dim()
        if x.shape[d] % world:
            raise ValueError(
                f"{op}: scatter_dim={scatter_dim} splits x.shape[{d}]={x.shape[d]} (x shape {tuple(x.shape)}), "
                f"which is not divisible by the group size W={world}"
            )
        return found

    mode = _admit(op, group, world, x, x_scale, w_scale, validate, backend)
    d = scatter_dim % x.dim()
    layout = (d, blocks_before(x, d))
    xm, sm = _move_to_dim0(d, x, x_scale, mode) if d else (x, x_scale)
    x2d, xs = _rows(xm, sm, mode)
    name, num, group_name = _choose(op, backend, parallel_num, x2d, weight, out_dtype, group, world)
    ws = kernel_scale(w_scale, mode).contiguous()
    y = library.scaled_matmul_reduce_scatter(
        x2d, xs, weight.contiguous(), ws, bias, mode, out_dtype, group_name, world, name, num, *layout, deterministic
    )
    y = y.view((xm.shape[0] // world,) + tuple(xm.shape[1:-1]) + (weight.shape[0],))
    return y.movedim(0, d).contiguous() if d else y


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
    op = "scaled_matmul_all_reduce"
    world = checks.world_of(group)
    mode = _admit(
        op,
        group,
        world,
        x,
        x_scale,
        w_scale,
        lambda: _validate(
            op, x, x_scale, weight, w_scale, bias, out_dtype, backend, parallel_num, ("deterministic", deterministic)
        ),
        backend,
    )
    x2d, xs = _rows(x, x_scale, mode)
    name, num, group_name = _choose(op, backend, parallel_num, x2d, weight, out_dtype, group, world)
    ws = kernel_scale(w_scale, mode).contiguous()
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
    assert isinstance(x, torch.Tensor)
    x2d, xs = _rows(x, x_scale, mode)
    ws = kernel_scale(w_scale, mode).contiguous()
    _check_values(x, xs, ws)
    use_fused = backend == "fused" or (backend is None and get_config().use_fused)
    name = "fused" if use_fused and x.is_cuda else "sequential"
    y = library.scaled_matmul(x2d, xs, weight.contiguous(), ws, bias, mode, out_dtype, name)
    return y.view(tuple(x.shape[:-1]) + (weight.shape[0],))
