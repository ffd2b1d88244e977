"""Rank bodies of the FP8 numerics tests: every op x mode x backend against the fp64 reference of the
dequantized inputs (:mod:`kernels.testing.fp8`), error divided by the bound of ``kernels.fp8.numerics`` under
the backend's accumulation model (a ratio <= 1 passes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import kernels
from kernels.fp8 import numerics
from kernels.testing.fp8 import error_ratio, reference

MODES = ("tensor", "row", "block")
K, N = 200, 130  # k not a multiple of 128; n crosses one 128-row weight block
M_LOCAL, M_AR = 3, 5  # odd row counts


def _quant(t: torch.Tensor, mode: str, weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The product's quantizer (``kernels.quantize_fp8``): block weights are 128 x 128 blocks."""
    return kernels.quantize_fp8(t, "block2d" if weight and mode == "block" else mode)


def _data(seed: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes over six decades per row, so blocks, rows and the tensor get different scales.
    return torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)[torch.randperm(cols, generator=g)]


def _ratio(op: str, got: torch.Tensor, parts: list, mode: str, bias, rank: int, out_dtype, acc: str) -> float:
    """max error / bound of ``got`` against the reference of every rank's ``((x, x_scale), (w, w_scale))``."""
    xs, ws = [p[0] for p in parts], [p[1] for p in parts]
    return error_ratio(got, *reference(op, xs, ws, bias, rank, mode=mode, out_dtype=out_dtype, accumulation=acc))


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
            # all-gather: each rank quantizes its own rows (in tensor mode each rank has its own scale).
            x_full = _data(1, M_LOCAL * world, K)
            ag_x = [_quant(x_full[r * M_LOCAL : (r + 1) * M_LOCAL], mode, False) for r in range(world)]
            xq = torch.cat([p for p, _ in ag_x])
            xs = torch.cat([s.reshape(1, 1).expand(M_LOCAL, 1) if mode == "tensor" else s for _, s in ag_x])
            wq, ws = _quant(_data(2, N, K), mode, True)
            rows = slice(rank * M_LOCAL, (rank + 1) * M_LOCAL)
            xs_local = ag_x[rank][1]
            # reducing ops: each rank its own x and weight shard.
            red = [
                (_quant(_data(10 + r, M_LOCAL * world, K), mode, False), _quant(_data(20 + r, N, K), mode, True))
                for r in range(world)
            ]
            (rxq, rxs), (rwq, rws) = red[rank]
            ar = [
                (_quant(_data(30 + r, M_AR, K), mode, False), _quant(_data(40 + r, N, K), mode, True))
                for r in range(world)
            ]
            (aq, as_), (awq, aws) = ar[rank]
            for backend in backends:
                acc = numerics.accumulation_of(backend, mode)
                ctx = (mode, bias, rank, out_dtype, acc)
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
                    ag_parts = [(x, (wq, ws)) for x in ag_x]
                    results[f"all_gather_scaled_matmul/{tag}"] = _ratio("ag", y, ag_parts, *ctx)
                    for det in (False, True):
                        rs = kernels.scaled_matmul_reduce_scatter(rxq, rxs, rwq, rws, bias, deterministic=det, **opts)
                        results[f"scaled_matmul_reduce_scatter/{tag}{'/det' if det else ''}"] = _ratio(
                            "rs", rs, red, *ctx
                        )
                        y_ar = kernels.scaled_matmul_all_reduce(aq, as_, awq, aws, bias, deterministic=det, **opts)
                        results[f"scaled_matmul_all_reduce/{tag}{'/det' if det else ''}"] = _ratio("ar", y_ar, ar, *ctx)
                        if det and repeats:
                            again = kernels.scaled_matmul_all_reduce(
                                aq, as_, awq, aws, bias, deterministic=True, **opts
                            )
                            assert torch.equal(again, y_ar), "deterministic all-reduce is not bitwise repeatable"
                            if world > 1:
                                table = [torch.empty_like(y_ar) for _ in range(world)]
                                dist.all_gather(table, y_ar)
                                assert all(torch.equal(t, y_ar) for t in table), "ranks hold different bits"
                            rs2 = kernels.scaled_matmul_reduce_scatter(
                                rxq, rxs, rwq, rws, bias, deterministic=True, **opts
                            )
                            assert torch.equal(rs2, rs)
    return results
