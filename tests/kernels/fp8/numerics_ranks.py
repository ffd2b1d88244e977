"""Rank bodies of the FP8 numerics tests: every op x mode x backend against the fp64 reference of the
dequantized inputs, error divided by the bound of ``kernels.fp8.numerics`` (a ratio <= 1 passes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import kernels
from kernels.fp8 import numerics
from kernels.fp8.quantize import dequantize_fp8

MODES = ("tensor", "row", "block")
K, N = 200, 130  # k not a multiple of 128; n crosses one 128-row weight block
M_LOCAL, M_AR = 3, 5  # odd row counts


def _quant(t: torch.Tensor, mode: str, weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qmode = "block2d" if weight and mode == "block" else mode
    q, s = kernels.quantize_fp8(t, qmode)
    return q, s, dequantize_fp8(q, s, qmode, dtype=torch.float64)


def _data(seed: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes over six decades per row, so blocks, rows and the tensor get different scales.
    return torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)[torch.randperm(cols, generator=g)]


def _ratio(y: torch.Tensor, ref: torch.Tensor, abs_sum: torch.Tensor, k: int, world: int, out_dtype, acc) -> float:
    bound = numerics.op_error_bound(ref, abs_sum, k, world, out_dtype, acc)
    return float(((y.double() - ref).abs() / bound).max())


def numerics_rank(rank: int, world: int, backends: tuple[str, ...], repeats: bool = True) -> dict[str, float]:
    """``{"op/mode/backend/out_dtype[/det]": max error / bound}`` on this rank.

    ``repeats`` adds the identity checks that call an op twice (return_gathered or not, deterministic
    reruns, ranks' bits); the fused backend's are in tests/kernels/fused/test_fp8.py, where they cost
    less than at these shapes under the interpreter."""
    results: dict[str, float] = {}
    group = dist.group.WORLD if world > 1 else None
    for mode in MODES:
        for out_dtype in (torch.float32, torch.bfloat16):
            bias = _data(7, 1, N)[0].to(out_dtype) if out_dtype != torch.float32 else _data(7, 1, N)[0]
            b64 = bias.double()
            # all-gather: one global x (tensor mode needs the one global scale), each rank its rows.
            xq, xs, xd = _quant(_data(1, M_LOCAL * world, K), mode, False)
            wq, ws, wd = _quant(_data(2, N, K), mode, True)
            ref = xd @ wd.T + b64
            abs_sum = xd.abs() @ wd.abs().T + b64.abs()
            rows = slice(rank * M_LOCAL, (rank + 1) * M_LOCAL)
            xs_local = xs if mode == "tensor" else xs[rows]
            # reducing ops: each rank its own x and weight shard.
            parts = [
                (_quant(_data(10 + r, M_LOCAL * world, K), mode, False), _quant(_data(20 + r, N, K), mode, True))
                for r in range(world)
            ]
            (rxq, rxs, _), (rwq, rws, _) = parts[rank]
            red_ref = sum(p[0][2] @ p[1][2].T for p in parts) + b64
            red_abs = sum(p[0][2].abs() @ p[1][2].abs().T for p in parts) + b64.abs()
            aq, as_, _ = _quant(_data(30 + rank, M_AR, K), mode, False)
            ar_parts = [
                (_quant(_data(30 + r, M_AR, K), mode, False), _quant(_data(40 + r, N, K), mode, True))
                for r in range(world)
            ]
            ar_ref = sum(p[0][2] @ p[1][2].T for p in ar_parts) + b64
            ar_abs = sum(p[0][2].abs() @ p[1][2].abs().T for p in ar_parts) + b64.abs()
            awq, aws = ar_parts[rank][1][0], ar_parts[rank][1][1]
            for backend in backends:
                acc = numerics.accumulation_of(backend, mode)
                tag = f"{mode}/{backend}/{str(out_dtype)[6:]}"
                opts = {"out_dtype": out_dtype, "group": group, "backend": backend, "parallel_num": 2}
                with torch.no_grad():
                    y, xg, xsg = kernels.all_gather_scaled_matmul(
                        xq[rows], xs_local, wq, ws, bias, return_gathered=True, **opts
                    )
                    assert torch.equal(xg.view(torch.uint8), xq.view(torch.uint8)), "gathered FP8 bytes differ"
                    assert torch.equal(xsg, xs), "gathered scales differ"
                    if repeats:
                        y_plain = kernels.all_gather_scaled_matmul(xq[rows], xs_local, wq, ws, bias, **opts)
                        assert torch.equal(y_plain, y)
                    results[f"all_gather_scaled_matmul/{tag}"] = _ratio(y, ref, abs_sum, K, world, out_dtype, acc)
                    for det in (False, True):
                        rs = kernels.scaled_matmul_reduce_scatter(rxq, rxs, rwq, rws, bias, deterministic=det, **opts)
                        out_rows = slice(rank * M_LOCAL, (rank + 1) * M_LOCAL)
                        results[f"scaled_matmul_reduce_scatter/{tag}{'/det' if det else ''}"] = _ratio(
                            rs, red_ref[out_rows], red_abs[out_rows], K, world, out_dtype, acc
                        )
                        ar = kernels.scaled_matmul_all_reduce(aq, as_, awq, aws, bias, deterministic=det, **opts)
                        results[f"scaled_matmul_all_reduce/{tag}{'/det' if det else ''}"] = _ratio(
                            ar, ar_ref, ar_abs, K, world, out_dtype, acc
                        )
                        if det and repeats:
                            again = kernels.scaled_matmul_all_reduce(
                                aq, as_, awq, aws, bias, deterministic=True, **opts
                            )
                            assert torch.equal(again, ar), "deterministic all-reduce is not bitwise repeatable"
                            if world > 1:
                                table = [torch.empty_like(ar) for _ in range(world)]
                                dist.all_gather(table, ar)
                                assert all(torch.equal(t, ar) for t in table), "ranks hold different bits"
                            rs2 = kernels.scaled_matmul_reduce_scatter(
                                rxq, rxs, rwq, rws, bias, deterministic=True, **opts
                            )
                            assert torch.equal(rs2, rs)
    return results
