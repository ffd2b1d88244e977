"""Rank bodies of the pattern x format tests (module level so the rank pools can unpickle them).

Each body runs one pattern's ``run(call, operands)`` for a format given by name
(:meth:`kernels.format.OperandFormat.encode`) on x with a communicated dim > 0 (reduce-scatter) and checks it against
fp64 torch math on the dequantized operands: FP8 operands exactly in fp64 (``kernels.testing.fp8.dequant``)
with the bound of ``kernels.fp8.numerics`` for the fused kernels' accumulation; int8 weights as
:func:`kernels.format.dequantize_weight` gives them (rounded to x's dtype, as the kernels round each
dequantized tile) with the bound of ``kernels.testing.reference``; every reduce-scatter result also bit
for bit with the same call on x moved to dim 0 (the strided rows change where rows are read, never a
sum).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.kernels.fused.cases import fused_call

K = {"plain": 40, "int8": 40, "fp8": 200}
OUT_DTYPE = {"plain": torch.float32, "int8": torch.float32, "fp8": torch.bfloat16}


def _weight(fmt: Any, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, Any, Any, torch.Tensor]:
    """``(weight payload, scale, offset, the weight the reference multiplies by in fp64)``."""
    import kernels
    from kernels.format import dequantize_weight
    from kernels.testing import fp8 as fp8_testing

    w = torch.randn(n, k, generator=g)
    if fmt.kind == "fp8":
        q, s = fp8_testing.quantize(w, fmt.mode, True)
        return q, s, None, fp8_testing.dequant(q, s, fmt.mode, True)
    if fmt.kind == "int8":
        q, s = kernels.quantize_weight(w, fmt.mode, fmt.group_size or None)
        o = torch.randint(-3, 4, s.shape, generator=g).float() if fmt.offset else None
        return q, s, o, dequantize_weight(fmt, q, s, o, torch.float32).double()
    return w, None, None, w.double()


def _rows(fmt: Any, rows: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """``(x rows [rows, k], x scale in row order or None, x in fp64)``."""
    from kernels.testing import fp8 as fp8_testing

    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-3, 4, (rows, 1), generator=g).float())
    if fmt.kind != "fp8":
        return x, None, x.double()
    q, s = fp8_testing.quantize(x, fmt.mode, False)
    return q, s, fp8_testing.dequant(q, s, fmt.mode, False)


def _bound(fmt: Any, y: torch.Tensor, magnitude: torch.Tensor, k: int, world: int) -> torch.Tensor:
    from kernels.fp8.numerics import U32, op_error_bound
    from kernels.testing import tolerance

    if fmt.kind == "fp8":
        return op_error_bound(y, magnitude, k, world, OUT_DTYPE["fp8"], "promoted", U32)
    return tolerance(OUT_DTYPE[fmt.kind], k, world) * magnitude


def _check(what: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    excess = ((got.double() - want).abs() - bound).nan_to_num(nan=float("inf"))
    assert float(excess.max()) <= 0, f"{what}: error exceeds the bound by {float(excess.max()):.3g}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _per_row_scales(fmt: Any, scale: torch.Tensor, rows: int) -> torch.Tensor:
    return scale.reshape(1, 1).expand(rows, 1) if fmt.mode == "tensor" else scale


def reduce_scatter_body(rank: int, world: int, name: str) -> int:
    """Reduce-scatter along dim 1 of x ``[2, 3 W, k]`` (every outer block scattered on its own)."""
    from kernels.call import Operands
    from kernels.format import OperandFormat
    from kernels.fused import scatter

    fmt = OperandFormat.decode(name)
    k, out_dtype = K[fmt.kind], OUT_DTYPE[fmt.kind]
    g = torch.Generator().manual_seed(11)
    parts = [_rows(fmt, 6 * world, k, g) for _ in range(world)]
    weights = [_weight(fmt, 20, k, g) for _ in range(world)]
    b = torch.randn(20, generator=g).to(out_dtype)
    x, x_scale, _ = parts[rank]
    q, s, o, _ = weights[rank]
    ops = Operands(x.view(2, 3 * world, k), (q,), (b,), x_scale, (s,), (o,))
    group = dist.new_group(list(range(world)))
    y = scatter.run(fused_call("reduce_scatter", group, fmt, out_dtype=out_dtype, deterministic=True, comm_dim=1), ops)
    full = sum(p[2] @ w[3].T for p, w in zip(parts, weights, strict=True))
    magnitude = sum(p[2].abs() @ w[3].abs().T for p, w in zip(parts, weights, strict=True)) + b.double().abs()
    mine = torch.chunk(full.view(2, 3 * world, -1), world, dim=1)[rank].reshape(-1, 20) + b.double()
    magnitude = torch.chunk(magnitude.view(2, 3 * world, -1), world, dim=1)[rank].reshape(-1, 20)
    assert y.dtype == out_dtype
    _check(f"{name} reduce_scatter rank {rank}", y, mine, _bound(fmt, mine, magnitude, k, world))
    # The same rows moved to dim 0 first.
    rows = x.view(2, world, 3, k).transpose(0, 1).reshape(-1, k)
    scale = x_scale
    if x_scale is not None and x_scale.dim() > 0:
        scale = x_scale.view(2, world, 3, -1).transpose(0, 1).reshape(6 * world, -1)
    moved = Operands(rows, (q,), (b,), scale, (s,), (o,))
    y0 = scatter.run(fused_call("reduce_scatter", group, fmt, out_dtype=out_dtype, deterministic=True), moved)
    assert torch.equal(y, y0), f"{name}: scatter_dim 1 differs from the same rows at dim 0"
    return 1


def all_reduce_body(rank: int, world: int, name: str) -> dict[str, torch.Tensor]:
    """Both all-reduce algorithms, each against the reference; returns the outputs (ranks must agree)."""
    from kernels.call import Operands
    from kernels.format import OperandFormat
    from kernels.fused import all_reduce

    fmt = OperandFormat.decode(name)
    k, out_dtype = K[fmt.kind], OUT_DTYPE[fmt.kind]
    g = torch.Generator().manual_seed(13)
    parts = [_rows(fmt, 7, k, g) for _ in range(world)]
    weights = [_weight(fmt, 20, k, g) for _ in range(world)]
    b = torch.randn(20, generator=g).to(out_dtype)
    x, x_scale, _ = parts[rank]
    q, s, o, _ = weights[rank]
    ops = Operands(x, (q,), (b,), x_scale, (s,), (o,))
    group = dist.new_group(list(range(world)))
    want = sum(p[2] @ w[3].T for p, w in zip(parts, weights, strict=True)) + b.double()
    magnitude = sum(p[2].abs() @ w[3].abs().T for p, w in zip(parts, weights, strict=True)) + b.double().abs()
    out = {}
    for algorithm in ("one_shot", "two_shot"):
        y = all_reduce.run(
            fused_call("all_reduce", group, fmt, out_dtype=out_dtype, deterministic=True), ops, algorithm
        )
        _check(f"{name} {algorithm} rank {rank}", y, want, _bound(fmt, want, magnitude, k, world))
        out[algorithm] = y
    return out


def fp8_tuned_tiles_body(rank: int, world: int, tuned_dir: str) -> list[str]:
    """The last rank reads a tuned file with FP8 entries giving the reducing ops other tiles than its
    peers' defaults: every FP8 reduce-scatter and all-reduce must raise naming the tiles, at a group's
    first call and at a later one."""
    import os

    from kernels.call import Operands
    from kernels.format import fp8
    from kernels.fused import all_reduce, scatter, tuned
    from kernels.testing import fp8 as fp8_testing

    g = torch.Generator().manual_seed(rank)
    x, xs = fp8_testing.quantize(torch.randn(2 * world, 8, generator=g), "row", False)
    w, ws = fp8_testing.quantize(torch.randn(6, 8, generator=g), "row", True)
    ops = Operands(x, (w,), (None,), xs, (ws,))
    messages = []
    for pattern in ("reduce_scatter", "all_reduce"):
        for warm in (False, True):
            group = dist.new_group(list(range(world)))
            call = fused_call(pattern, group, fp8("row"), out_dtype=torch.float32, deterministic=True)
            run = scatter.run if pattern == "reduce_scatter" else all_reduce.run
            if warm:
                run(call, ops)  # the same tiles: the heap exists
            if rank == world - 1:
                os.environ[tuned.ENV_TUNED_DIR] = tuned_dir
            try:
                run(call, ops)
            except RuntimeError as e:
                messages.append(str(e))
            else:
                raise AssertionError(f"{pattern} (warm={warm}) with other FP8 tiles on rank {world - 1} returned")
            finally:
                os.environ.pop(tuned.ENV_TUNED_DIR, None)
    return messages
