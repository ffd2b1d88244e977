"""The fused FP8 kernels compile for sm_90a without a GPU, with FP8 wgmma and without spills.

The method of :mod:`tests.kernels.fused.test_compile_sm90` (each kernel compiled in a subprocess
under the argument specialization of a real launch, Triton's bundled ptxas), for every kernel the
FP8 ops launch: the scaled GEMMs (W == 1, all-gather, scatter), the push of payload and scale
rows, and the fp32 reduce / gather specializations of the shared reduction kernels. Each must

* spill nothing (local memory in the cubin; one listed exception for unaligned k);
* on aligned shapes (``k % 16 == 0``), multiply with FP8 wgmma: the SASS holds ``QGMMA`` with FP8
  operand types (``.E4M3.E4M3``; ``.E5M2.E4M3`` for an e5m2 x), which is how sm_90 SASS spells
  the FP8 form of HGMMA, and the operand tiles reach shared memory by 16-byte cp.async;
* on unaligned shapes (``k % 16 != 0``) take the 16-deep fp16 path (``gemm_fp8.fp8_dot``): HGMMA
  with fp16 operands; FP8 k steps of 32 or more spilled there.

The registers, spills and GMMA forms of every kernel are printed (``pytest -s``).
"""

from __future__ import annotations

import re

from tests.kernels.fused.sm90 import (
    CP_ASYNC_16,
    compile_jobs,
    compile_like_launch,
    gather_rows_args,
    reduce_slots_args,
    report_failures,
    resources,
    run_compile_check,
    sass,
)

# Known exceptions, by label prefix: (spilled bytes allowed, why).
ALLOWED = {
    # k % 16 != 0 is refused by torch._scaled_mm and cuBLASLt altogether; here it runs, with
    # byte-loaded 16-deep k steps beside the W-way broadcast of the fp32 tile (one-shot all-reduce,
    # outputs of at most 256 KiB only).
    "scaled_gemm_scatter block broadcast=True unaligned": (256, "unaligned k, one-shot broadcast"),
}
_GMMA = re.compile(r"\b([HQ]GMMA)\.(\d+x\d+x\d+)\.F32((?:\.[A-Z0-9]+)*)")


def gmma_forms(kernel) -> set[str]:
    """The (H|Q)GMMA forms in the kernel's SASS, e.g. ``QGMMA.E4M3.E4M3``."""
    return {name + types for name, _, types in _GMMA.findall(sass(kernel))}


def _cases():
    """``(label, kernel, args, num_warps, num_stages, expected GMMA form or None)``."""
    import torch
    import triton.language as tl

    from kernels.fused import ag_gemm_fp8, all_reduce, gemm_fp8, matmul, scatter, signals, tile

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

    def t(dtype=e4m3):
        return torch.empty(64, dtype=dtype)

    cuda = torch.device("cuda")
    tab = t(torch.int64)
    timeout = 60 * 10**9
    cases = []
    # (W, k, n, rows per owner): LLaMA-70B TP8-like aligned shapes, decode-size m, k % 16 == 8.
    for w, k, n, rows in ((8, 8192, 7168, 512), (8, 8192, 7168, 16), (4, 4104, 4100, 1024)):
        aligned = k % 16 == 0
        fp8_form = "QGMMA.E4M3.E4M3" if aligned else "HGMMA"
        tag = f"{'' if aligned else 'unaligned '}W={w} k={k} n={n} rows={rows}"
        cfg = gemm_fp8.fp8_block_config(cuda, rows, k)
        blocks = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
        off = {c: signals.channel_offset(c, w) for c in range(signals.NUM_CHANNELS)}
        sig = dict(sig_tab_ptr=tab, rank=w - 2, timeout=timeout, USE_GLOBALTIMER=True)
        ld = scatter.slot_stride(n)
        for mode in ("row", "block") if aligned else ("block",):
            sk = gemm_fp8.scale_cols(mode, k)
            per_block = mode == "block"
            # x scales [m, sk]; w scales [ceil(n / 128), sk] (block) or [n, 1] (row).
            xs_strides = dict(stride_xsm=sk, stride_xsk=1 if per_block else 0)
            ws_strides = dict(stride_wsn=sk if per_block else 1, stride_wsk=1 if per_block else 0)
            cases.append(
                (
                    f"ag_scaled_gemm {mode} {tag}",
                    ag_gemm_fp8._ag_scaled_gemm_kernel,
                    dict(
                        x_ptr=t(),
                        xs_ptr=t(torch.float32),
                        data_tab_ptr=tab,
                        w_ptr=t(),
                        ws_ptr=t(torch.float32),
                        bias_ptr=t(torch.bfloat16),
                        y_ptr=t(torch.bfloat16),
                        M_LOCAL=rows,
                        N=n,
                        K=k,
                        SK=sk,
                        s_base=ag_gemm_fp8.scale_base(w, rows, k),
                        n_tiles=-(-n // cfg.block_n),
                        chunk_rows=256,
                        stride_xm=k,
                        stride_xk=1,
                        **xs_strides,
                        stride_wn=k,
                        stride_wk=1,
                        **ws_strides,
                        stride_ym=n,
                        stride_yn=1,
                        flag_offset=off[signals.CH_AG],
                        WORLD=w,
                        CHANNEL=signals.CH_AG,
                        FLAG_STRIDE=signals.AG_MAX_SPLITS,
                        HAS_BIAS=True,
                        PER_BLOCK=per_block,
                        **sig,
                        **blocks,
                    ),
                    cfg.num_warps,
                    cfg.num_stages,
                    fp8_form,
                )
            )
            cases.append(
                (
                    f"copy_gathered {mode} {tag}",
                    ag_gemm_fp8._copy_gathered_kernel,
                    dict(
                        x_ptr=t(),
                        xs_ptr=t(torch.float32),
                        data_tab_ptr=tab,
                        g_ptr=t(),
                        gs_ptr=t(torch.float32),
                        M_LOCAL=rows,
                        K=k,
                        SK=sk,
                        s_base=ag_gemm_fp8.scale_base(w, rows, k),
                        stride_xm=k,
                        stride_xk=1,
                        stride_xsm=sk,
                        stride_xsk=1,
                        rank=w - 2,
                        BLOCK_R=32,
                        BLOCK_K=ag_gemm_fp8.copy_cols(cuda, k),
                        BLOCK_S=min(64, 1 << (sk - 1).bit_length()),
                    ),
                    4,
                    3,
                    None,
                )
            )
            cases.append(
                (
                    f"push_scaled_shard {mode} {tag}",
                    ag_gemm_fp8._push_scaled_shard_kernel,
                    dict(
                        x_ptr=t(),
                        xs_ptr=t(torch.float32),
                        data_tab_ptr=tab,
                        sig_tab_ptr=tab,
                        M_LOCAL=rows,
                        K=k,
                        SK=sk,
                        s_base=ag_gemm_fp8.scale_base(w, rows, k),
                        stride_xm=k,
                        stride_xk=1,
                        stride_xsm=sk,
                        stride_xsk=1,
                        chunk_rows=256,
                        n_chunks=4,
                        rank=w - 2,
                        WORLD=w,
                        FLAG_OFFSET=off[signals.CH_AG],
                        FLAG_STRIDE=signals.AG_MAX_SPLITS,
                        BLOCK_R=32,
                        BLOCK_K=ag_gemm_fp8.push_cols(cuda, k),
                        BLOCK_S=min(64, 1 << (sk - 1).bit_length()),
                    ),
                    4,
                    3,
                    None,
                )
            )
            for broadcast in (False, True) if per_block else (False,):
                cases.append(
                    (
                        f"scaled_gemm_scatter {mode} broadcast={broadcast} {tag}",
                        scatter._gemm_scatter_kernel,
                        dict(
                            X=(t(), k, 1, t(torch.float32), xs_strides["stride_xsm"], xs_strides["stride_xsk"]),
                            W=(
                                t(),
                                k,
                                1,
                                t(torch.float32),
                                None,
                                ws_strides["stride_wsn"],
                                ws_strides["stride_wsk"],
                                1,
                            ),
                            heap=(tab, tab, off[signals.CH_DONE], off[signals.CH_RS]),
                            dims=(w * rows, n, k, ld, rows),
                            rows_per_block=rows,
                            rank=w - 2,
                            timeout=timeout,
                            FMT=(tile.FP8, tile.PER_BLOCK if per_block else tile.PER_ROW, False),
                            TILE=cfg.tile(),
                            MATH=(tl.float32, "tf32"),
                            PROTO=(w, broadcast, False, True),
                        ),
                        cfg.num_warps,
                        cfg.num_stages,
                        fp8_form,
                    )
                )
        if aligned and rows > 64:
            # The shared reduction kernels in the FP8 ops' specialization: fp32 slots and output.
            for push in (False, True):
                cases.append(
                    (
                        f"reduce_slots fp32 push={push} {tag}",
                        scatter._reduce_slots_kernel,
                        reduce_slots_args(
                            tab, t(torch.bfloat16), t(torch.float32), (rows, n, ld, w), push, cfg, timeout
                        ),
                        cfg.num_warps,
                        1,
                        None,
                    )
                )
            cases.append(
                (
                    f"gather_rows fp32 {tag}",
                    all_reduce._gather_rows_kernel,
                    gather_rows_args(tab, t(torch.float32), (rows, n, ld, w), cfg, timeout),
                    cfg.num_warps,
                    1,
                    None,
                )
            )
    # The W == 1 GEMM: every mode, an e5m2 x (gradients), decode-size m.
    for mode, x_dtype, m in (("tensor", e4m3, 4096), ("row", e4m3, 4096), ("block", e4m3, 4096), ("block", e5m2, 16)):
        k, n = 8192, 7168
        cfg = gemm_fp8.fp8_block_config(cuda, m, k)
        sk = gemm_fp8.scale_cols(mode, k)
        strides = {"tensor": (0, 0, 0, 0), "row": (1, 0, 1, 0), "block": (sk, 1, sk, 1)}[mode]
        cases.append(
            (
                f"scaled_matmul {mode} x={x_dtype} m={m}",
                matmul._matmul_kernel,
                dict(
                    X=(t(x_dtype), k, 1, t(torch.float32), strides[0], strides[1]),
                    W=(t(), k, 1, t(torch.float32), None, strides[2], strides[3], 1),
                    OUT=(t(torch.bfloat16), n, 1, t(torch.bfloat16)),
                    dims=(m, n, k),
                    FMT=(tile.FP8, tile.PER_BLOCK if mode == "block" else tile.PER_ROW, False),
                    TILE=cfg.tile(),
                    MATH=(tl.float32, "tf32"),
                    ROUND=tile.ROUND_NEAREST,
                ),
                cfg.num_warps,
                cfg.num_stages,
                "QGMMA.E5M2.E4M3" if x_dtype == e5m2 else "QGMMA.E4M3.E4M3",
            )
        )
    return cases


def _compile_case(i: int) -> tuple[str, int, int, set[str], str | None, bool]:
    """Compile case ``i`` of :func:`_cases`: ``(label, registers, spilled bytes, GMMA forms, wanted form,
    16-byte cp.async present)``. Cases are rebuilt by index in the worker (kernels do not pickle)."""
    label, fn, args, num_warps, num_stages, form = _cases()[i]
    kernel = compile_like_launch(fn, args, num_warps, num_stages)
    regs, spills = resources(kernel)
    return label, regs, spills, gmma_forms(kernel), form, bool(CP_ASYNC_16.search(kernel.asm["ptx"]))


def main() -> None:
    import triton

    failures = []
    workers, results = compile_jobs(_compile_case, list(range(len(_cases()))))
    print(f"Triton {triton.__version__} ({workers} processes)")
    print(f"{'kernel':62} {'regs':>5} {'spill B':>8}  GMMA")
    for label, regs, spills, forms, form, cp_async_16 in results:
        print(f"{label:62} {regs:5d} {spills:8d}  {' '.join(sorted(forms)) or '-'}", flush=True)
        allowed, _ = next((v for p, v in ALLOWED.items() if label.startswith(p)), (0, ""))
        if spills > allowed:
            failures.append(f"{label}: {spills} bytes of register spills")
        if form is not None and forms != {form}:
            failures.append(f"{label}: GMMA forms {sorted(forms)}, want only {form}")
        if form is not None and form.startswith("QGMMA") and not cp_async_16:
            failures.append(f"{label}: no 16-byte cp.async (FP8 operand loads not pipelined)")
    report_failures(failures, "compiled: no spills, FP8 wgmma in every aligned FP8 GEMM")


def test_fp8_kernels_compile_for_sm90():
    run_compile_check("tests.kernels.fused.test_compile_sm90_fp8", "compiled: no spills, FP8 wgmma")
