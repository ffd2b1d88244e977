"""Rank bodies of the pattern x format tests (module level so the rank pools can unpickle them).

Each body runs one pattern's ``run(call, operands)`` for a format given by name
(:meth:`kernels.format.OperandFormat.encode`) on x with a communicated dim > 0 and checks it against
fp64 torch math on the dequantized operands: FP8 operands exactly in fp64 (``kernels.testing.fp8.dequant``)
with the bound of ``kernels.fp8.numerics`` for the fused kernels' accumulation; int8 weights as
:func:`kernels.format.dequantize_weight` gives them (rounded to x's dtype, as the kernels round each
dequantized tile) with the bound of ``kernels.testing.reference``. The gathered rows and scale rows
are compared exactly, and every result also bit for bit with the same call on x moved to dim 0
(the strided rows change where rows are read and stored, never a sum).
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
        return op_error_bound(y, magnitude, k, world, out_dtype=OUT_DTYPE["fp8"], accumulation="promoted", u_acc=U32)
    return tolerance(OUT_DTYPE[fmt.kind], k, world) * magnitude


def _check(what: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    excess = ((got.double() - want).abs() - bound).nan_to_num(nan=float("inf"))
    assert float(excess.max()) <= 0, f"{what}: error exceeds the bound by {float(excess.max()):.3g}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _per_row_scales(fmt: Any, scale: torch.Tensor, rows: int) -> torch.Tensor:
    return scale.reshape(1, 1).expand(rows, 1) if fmt.mode == "tensor" else scale


def all_gather_body(rank: int, world: int, name: str) -> int:
    """Two weights, one gather, along dim 1 of x ``[2, 3, k]`` (outer blocks of 3 rows), with the gathered
    rows (and FP8 scale rows) returned; then the same call on a group of one."""
    from kernels.format import OperandFormat
    from kernels.fused import all_gather
    from kernels.ops.gemm import Operands

    fmt = OperandFormat.decode(name)
    k, out_dtype = K[fmt.kind], OUT_DTYPE[fmt.kind]
    g = torch.Generator().manual_seed(7)
    parts = [_rows(fmt, 6, k, g) for _ in range(world)]
    weights = [_weight(fmt, n, k, g) for n in (20, 12)]
    biases = (torch.randn(20, generator=g).to(out_dtype), None)
    x, x_scale, _ = parts[rank]
    ops = Operands(
        x.view(2, 3, k),
        tuple(w[0] for w in weights),
        biases,
        x_scale,
        tuple(w[1] for w in weights),
        tuple(w[2] for w in weights),
    )
    group = dist.new_group(list(range(world)))
    call = fused_call("all_gather", group, fmt, out_dtype=out_dtype, return_gathered=True, comm_dim=1)
    ys, x_gathered, scales = all_gather.run(call, ops)
    # The reference: rows gathered along dim 1, in fp64.
    x64 = torch.cat([p[2].view(2, 3, k) for p in parts], dim=1).reshape(-1, k)
    for i, (y, (_, _, _, w64), b) in enumerate(zip(ys, weights, biases, strict=True)):
        b64 = torch.zeros(w64.shape[0], dtype=torch.float64) if b is None else b.double()
        want = x64 @ w64.T + b64
        bound = _bound(fmt, want, x64.abs() @ w64.abs().T + b64.abs(), k, world)
        assert y.dtype == out_dtype, (name, y.dtype)
        _check(f"{name} all_gather weight {i} rank {rank}", y, want, bound)
    payload = torch.cat([p[0].view(2, 3, k) for p in parts], dim=1).reshape(-1, k)
    assert torch.equal(_bits(x_gathered), _bits(payload)), f"{name}: gathered rows differ"
    if fmt.kind == "fp8":
        cols = fmt.scale_cols(k)
        want_scales = torch.cat([_per_row_scales(fmt, p[1], 6).reshape(2, 3, cols) for p in parts], dim=1)
        assert torch.equal(scales, want_scales.reshape(-1, cols)), f"{name}: gathered scale rows differ"
    else:
        assert scales is None
    # The same call on x moved to dim 0: the same dot products, in other rows.
    moved_scale = x_scale
    if x_scale is not None and x_scale.dim() > 0:
        moved_scale = x_scale.view(2, 3, -1).transpose(0, 1).reshape(6, -1)
    rows = x.view(2, 3, k).transpose(0, 1).reshape(-1, k)
    moved = Operands(rows, ops.weights, biases, moved_scale, ops.w_scales, ops.w_offsets)
    ys0, _, _ = all_gather.run(fused_call("all_gather", group, fmt, out_dtype=out_dtype), moved)
    for y, y0 in zip(ys, ys0, strict=True):
        order = y0.view(3 * world, 2, -1).transpose(0, 1).reshape(-1, y0.shape[1])
        assert torch.equal(y, order), f"{name}: rows of gather_dim 1 differ from the same rows at dim 0"
    # A group of one: the local GEMM, the rows themselves.
    single = [dist.new_group([r]) for r in range(world)][rank]
    ys1, x1, s1 = all_gather.run(fused_call("all_gather", single, fmt, out_dtype=out_dtype, return_gathered=True), ops)
    from kernels.fused import matmul

    local = matmul.run(fused_call("matmul", single, fmt, out_dtype=out_dtype), ops)
    assert all(torch.equal(a, b) for a, b in zip(ys1, local, strict=True)), f"{name}: W == 1 differs from matmul"
    assert torch.equal(_bits(x1), _bits(x.reshape(-1, k))) and (s1 is None) == (x_scale is None)
    return len(ys)


def reduce_scatter_body(rank: int, world: int, name: str) -> int:
    """Reduce-scatter along dim 1 of x ``[2, 3 W, k]`` (every outer block scattered on its own)."""
    from kernels.format import OperandFormat
    from kernels.fused import scatter
    from kernels.ops.gemm import Operands

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
    from kernels.format import OperandFormat
    from kernels.fused import all_reduce
    from kernels.ops.gemm import Operands

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


def local_gemm_strided_bias(name: str) -> None:
    """The local GEMM (:func:`kernels.fused.matmul.run`, every op's W == 1 path) with a stride-2 bias view
    whose gaps hold NaN (a unit-stride read shows as NaN): bit for bit the call with the bias contiguous,
    and within the bound of the fp64 reference. Runs in the calling process (no group)."""
    from kernels.format import OperandFormat
    from kernels.fused import matmul
    from kernels.ops.gemm import GemmCall, Operands

    fmt = OperandFormat.decode(name)
    k, out_dtype = K[fmt.kind], OUT_DTYPE[fmt.kind]
    g = torch.Generator().manual_seed(5)
    x, x_scale, x64 = _rows(fmt, 7, k, g)
    q, s, o, w64 = _weight(fmt, 20, k, g)
    b = torch.randn(20, generator=g).to(out_dtype)
    strided = torch.stack([b, torch.full_like(b, float("nan"))], dim=1)[:, 0]
    assert strided.stride() == (2,)
    call = GemmCall(op="scaled_matmul", pattern="matmul", fmt=fmt, out_dtype=out_dtype)
    y, y_contiguous = (matmul.run(call, Operands(x, (q,), (bias,), x_scale, (s,), (o,)))[0] for bias in (strided, b))
    assert torch.equal(y, y_contiguous), f"{name}: a strided bias changes the result"
    want = x64 @ w64.T + b.double()
    magnitude = x64.abs() @ w64.abs().T + b.double().abs()
    _check(f"{name} local GEMM, strided bias", y, want, _bound(fmt, want, magnitude, k, 1))


def int8_all_reduce_choice_body(rank: int, world: int) -> tuple[list[str], list[torch.Tensor]]:
    """The public int8 all-reduce with ``backend="fused"`` (a fallback warning is an error) under
    ``all_reduce.ONE_SHOT_MAX_BYTES`` at its value, at the call's partials' size (``m * n`` in x's dtype),
    one byte below and 0. Every result against the fp64 reference (per-group weights with offsets, k = 40:
    three 16-wide k tiles, the last group partial; x ``[3, 3, k]``). Returns the algorithm each call
    ran (recorded at :func:`all_reduce.all_reduce_partials`) and the outputs."""
    import warnings

    import kernels
    from kernels.format import int8
    from kernels.fused import all_reduce

    fmt = int8("per_group", 16, True)
    k, n = 40, 10
    g = torch.Generator().manual_seed(5)
    parts = [_rows(fmt, 9, k, g) for _ in range(world)]
    weights = [_weight(fmt, n, k, g) for _ in range(world)]
    b = torch.randn(n, generator=g)
    x = parts[rank][0].view(3, 3, k)
    q, s, o, _ = weights[rank]
    want = sum(p[2] @ w[3].T for p, w in zip(parts, weights, strict=True)) + b.double()
    magnitude = sum(p[2].abs() @ w[3].abs().T for p, w in zip(parts, weights, strict=True)) + b.double().abs()
    size = 9 * n * x.element_size()
    real, threshold = all_reduce.all_reduce_partials, all_reduce.ONE_SHOT_MAX_BYTES
    chosen: list[str] = []

    def spy(op: str, group: Any, partials: Any, algorithm: str, descriptor: Any) -> torch.Tensor:
        chosen.append(algorithm)
        return real(op, group, partials, algorithm, descriptor)

    outs = []
    all_reduce.all_reduce_partials = spy
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for limit in (threshold, size, size - 1, 0):
                all_reduce.ONE_SHOT_MAX_BYTES = limit
                y = kernels.quantized_matmul_all_reduce(x, q, s, b, group_size=16, offset=o, backend="fused")
                assert y.shape == (3, 3, n), y.shape
                bound = _bound(fmt, want, magnitude, k, world)
                _check(f"int8 all-reduce ONE_SHOT_MAX_BYTES={limit} rank {rank}", y.reshape(-1, n), want, bound)
                outs.append(y)
    finally:
        all_reduce.all_reduce_partials, all_reduce.ONE_SHOT_MAX_BYTES = real, threshold
    return chosen, outs


def _fp8_uneven_n(world: int, seed: int) -> tuple[list, list]:
    """Every rank's FP8 (row mode) x ``[24, 20]`` and column shard ``[n, 20]``, n = 16 on even ranks and
    64 on odd ones (the FP8 twin of ``cases._uneven_n_inputs``)."""
    from kernels.testing import fp8 as fp8_testing

    g = torch.Generator().manual_seed(seed)
    xs = [fp8_testing.quantize(torch.randn(24, 20, generator=g), "row", False) for _ in range(world)]
    ws = [
        fp8_testing.quantize(torch.randn(16 if r % 2 == 0 else 64, 20, generator=g), "row", True) for r in range(world)
    ]
    return xs, ws


def _fp8_all_gather(x: Any, w: Any, group: Any) -> torch.Tensor:
    from kernels.format import fp8
    from kernels.fused import all_gather
    from kernels.ops.gemm import Operands

    call = fused_call("all_gather", group, fp8("row"), out_dtype=torch.float32)
    return all_gather.run(call, Operands(x[0], (w[0],), (None,), x[1], (w[1],)))[0][0]


def fp8_per_rank_tiles_body(rank: int, world: int) -> list[int]:
    """``cases.per_rank_tiles_body`` for FP8: a tuned file (``COC_TUNED_DIR``) with FP8 entries gives each
    n another tile height; the chunks pushed must not depend on it. Returns the tile heights run."""
    from kernels.format import fp8
    from kernels.fused import blocks
    from kernels.testing import fp8 as fp8_testing
    from kernels.testing import presize, scramble

    dev = torch.device("cpu")
    group = dist.group.WORLD
    presize(group, dev)
    xs, ws = _fp8_uneven_n(world, 11)
    n = ws[rank][0].shape[0]
    cfg = blocks.block_config(fp8("row"), dev, 24, 20, dtype=torch.float8_e4m3fn, op="all_gather_matmul", n=n)
    scramble(group, dev)
    if rank == 0:
        import time

        time.sleep(0.25)  # its peers' tiles of its rows must wait for every chunk they cover
    got = _fp8_all_gather(xs[rank], ws[rank], group)
    want, bound = fp8_testing.reference(
        "ag", xs=xs, ws=[ws[rank]], b=None, rank=rank, mode="row", out_dtype=torch.float32
    )
    fp8_testing.assert_close(f"fp8 n={n} block_m={cfg.block_m} rank={rank}", got, want, bound, torch.float32)
    return [cfg.block_m]


def fp8_withheld_chunk_body(rank: int, world: int) -> str | None:
    """As ``cases.withheld_chunk_body``, FP8: rank 0 pushes only its first chunk (payload and scale rows);
    rank 1's 32-row tile over rows 0-23 of rank 0's shard must wait for the second chunk and time out."""
    from dataclasses import replace

    from kernels.fused import all_gather

    group = dist.new_group(list(range(world)))
    xs, ws = _fp8_uneven_n(world, 12)
    real = all_gather._push
    if rank == 0:
        all_gather._push = lambda call, fmt, ops, chunk, side: real(
            call, fmt, replace(ops, x=ops.x[:chunk], x_scale=ops.x_scale[:chunk]), chunk, side
        )
    dist.barrier(group)
    try:
        _fp8_all_gather(xs[rank], ws[rank], group)
    except RuntimeError as e:
        return str(e) if rank == 1 else None
    finally:
        all_gather._push = real
    if rank == 1:
        raise AssertionError("rank 1 returned a result although rank 0's second chunk never arrived")
    return None


def fp8_tuned_tiles_body(rank: int, world: int, tuned_dir: str) -> list[str]:
    """The last rank reads a tuned file with FP8 entries giving the reducing ops other tiles than its
    peers' defaults: every FP8 reduce-scatter and all-reduce must raise naming the tiles, at a group's
    first call and at a later one."""
    import os

    from kernels.format import fp8
    from kernels.fused import all_reduce, scatter, tuned
    from kernels.ops.gemm import Operands
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
