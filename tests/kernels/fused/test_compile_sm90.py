"""The fused kernels compile for a Hopper GPU (sm_90a) even where no GPU exists, and compile well.

The interpreter does not type-check like the compiler (operand types of atomics, loop-carried
types, inline assembly), so CI compiles the GPU build of every kernel with a spin loop in a
subprocess without ``TRITON_INTERPRET`` (Triton's bundled ptxas does the last step).

Each kernel is compiled under the argument specialization a real launch of it gets: the example
arguments below go through the JIT's own binder, so pointers of torch tensors are 16-byte aligned,
integers divisible by 16 are marked so, integers equal to 1 become constants and
``do_not_specialize`` is honoured. For those aligned shapes the compiled code must not

* touch global memory 16 bits at a time (a pointer loaded from a peer table carries no alignment
  unless the kernel states it: without it every peer access is one element per instruction, and
  the GEMM's operand loads lose cp.async pipelining), nor
* spill registers (local memory in the cubin, cuobjdump ``-res-usage``; the driver's ``n_spills``).

Registers per kernel are printed. Odd shapes (k, n not multiples of 8) are compiled too: there the
alignment hints must not claim what does not hold, and 16-bit accesses are expected.
"""

from __future__ import annotations

import re

from tests.kernels.fused.sm90 import (
    CP_ASYNC_16,
    compile_like_launch,
    gather_rows_args,
    reduce_slots_args,
    report_failures,
    resources,
    run_compile_check,
)

# One access instruction of 16 bits to global memory (no .v2/.v4 vector form).
_ACCESS_16 = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(?:ld|st)\.global(?:\.[a-z0-9_]+)*\.(?:b16|u16|s16|f16|bf16)\s", re.MULTILINE
)


def accesses_16bit(kernel) -> list[str]:
    return [m.group(0).strip() for m in _ACCESS_16.finditer(kernel.asm["ptx"])]


# A [BLOCK_N] vector (bias, per-channel scales) loaded once per program may land one element per
# thread in the layouts of 4-warp tiles: up to 2 such loads are not a peer tile moved 16 bits at a
# time (a 128x128 tile at 8 warps is 64 per thread).
ONCE_PER_PROGRAM = 2
# Known exceptions, by label prefix: (16-bit accesses allowed, spilled bytes allowed, why).
ALLOWED = {
    # Per-group scales [n, groups] are strided along n: a [BLOCK_N] gather per k step (local memory).
    "w8a16_scatter PER_GROUP_ALIGNED": (4, 0, "scale column gather per k step"),
    "w8a16_scatter PER_GROUP ": (None, 0, "scale tile gather per k step"),
    # The NaN fill of a failed call's outputs (error path only).
    "finish_call": (16, 0, "error path"),
    # Odd k: the all-gather buffer's rows (stride k) and x's rows are not 16-byte aligned, so A is
    # loaded an element at a time; the gather buffer layout is the AG protocol's (see docs/fused.md).
    "ag_gemm odd": (None, 0, "odd k, unaligned gather-buffer rows"),
    "push_shard odd": (None, 64, "odd k, unaligned gather-buffer rows"),
}


def _blocks(cfg) -> dict:
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)


def _cases():
    """``(label, kernel, args, num_warps, num_stages, aligned)``: a launch as the host code makes it.

    ``aligned`` cases (k and n multiples of 16) must make no 16-bit global access at all.
    """
    import torch
    import triton.language as tl

    from kernels.format import int8
    from kernels.fused import ag_gemm, all_reduce, blocks, gemm, matmul, scatter, signals, tile

    def t(dtype=torch.float16):
        return torch.empty(64, dtype=dtype)

    cuda = torch.device("cuda")
    tab = t(torch.int64)
    timer = dict(USE_GLOBALTIMER=True)
    acc = dict(ACC_DTYPE=tl.float32)
    timeout = 60 * 10**9
    cases = []
    # (W, k, n, rows per owner): LLaMA-like aligned shapes, decode-size m, and odd k and n.
    for w, k, n, rows_own in ((8, 8192, 4096, 512), (8, 8192, 4096, 16), (4, 4097, 8191, 1024)):
        aligned = k % 16 == 0 and n % 16 == 0
        tag = f"{'' if aligned else 'odd '}W={w} k={k} n={n} rows={rows_own}"
        ld = scatter.slot_stride(n)
        cfg = gemm.block_config(cuda, rows_own, k, torch.float16)
        launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        off = {c: signals.channel_offset(c, w) for c in range(signals.NUM_CHANNELS)}
        sig = dict(sig_tab_ptr=tab, rank=w - 2, timeout=timeout)
        # split: a gather_dim > 0 (outer blocks of rows addressed with strides, gathered rows copied out).
        for split in (False, True):
            cases.append(
                (
                    f"ag_gemm {tag}{' split' if split else ''}",
                    ag_gemm._ag_gemm_kernel,
                    dict(
                        x_ptr=t(),
                        data_tab_ptr=tab,
                        w_ptr=t(),
                        bias_ptr=t(),
                        y_ptr=t(),
                        g_ptr=t(),
                        M_LOCAL=rows_own,
                        N=n,
                        K=k,
                        n_tiles=-(-n // cfg.block_n),
                        chunk_rows=256,
                        stride_xm=k,
                        stride_xk=1,
                        stride_wn=k,
                        stride_wk=1,
                        stride_ym=n,
                        stride_yn=1,
                        rows_per_block=rows_own // 2 + 1 if split else rows_own,
                        flag_offset=off[signals.CH_AG],
                        WORLD=w,
                        CHANNEL=signals.CH_AG,
                        FLAG_STRIDE=signals.AG_MAX_SPLITS,
                        HAS_BIAS=True,
                        STORE_A=True,
                        SPLIT_BLOCKS=split,
                        STORE_IN_GEMM=not split,
                        **sig,
                        **timer,
                        **acc,
                        DOT_PRECISION="tf32",
                        **_blocks(cfg),
                    ),
                    cfg.num_warps,
                    cfg.num_stages,
                    aligned,
                )
            )
        cases.append(
            (
                f"push_shard {tag}",
                ag_gemm._push_shard_kernel,
                dict(
                    x_ptr=t(),
                    data_tab_ptr=tab,
                    sig_tab_ptr=tab,
                    M_LOCAL=rows_own,
                    K=k,
                    stride_xm=k,
                    stride_xk=1,
                    chunk_rows=256,
                    n_chunks=4,
                    rank=w - 2,
                    WORLD=w,
                    FLAG_OFFSET=off[signals.CH_AG],
                    FLAG_STRIDE=signals.AG_MAX_SPLITS,
                    BLOCK_R=32,
                    BLOCK_K=128,
                ),
                4,
                3,
                aligned,
            )
        )
        m = w * rows_own
        for broadcast, split in ((False, False), (True, False), (False, True)):
            cases.append(
                (
                    f"gemm_scatter broadcast={broadcast} {tag}{' split' if split else ''}",
                    scatter._gemm_scatter_kernel,
                    dict(
                        X=(t(), k, 1, None, 0, 0),
                        W=(t(), k, 1, None, None, 0, 0, 1),
                        heap=(tab, tab, off[signals.CH_DONE], off[signals.CH_RS]),
                        dims=(m, n, k, ld, rows_own),
                        rows_per_block=rows_own // 2 + 1 if split else rows_own,
                        rank=w - 2,
                        timeout=timeout,
                        FMT=(tile.PLAIN, 0, False),
                        TILE=cfg.tile(),
                        MATH=(tl.float32, "tf32"),
                        PROTO=(w, broadcast, split, True),
                    ),
                    *launch.values(),
                    aligned,
                )
            )
        for push in (False, True):
            cases.append(
                (
                    f"reduce_slots push={push} {tag}",
                    scatter._reduce_slots_kernel,
                    reduce_slots_args(tab, t(), t(), (rows_own, n, ld, w), push, cfg, timeout),
                    cfg.num_warps,
                    1,
                    aligned,
                )
            )
        cases.append(
            (
                f"gather_rows {tag}",
                all_reduce._gather_rows_kernel,
                gather_rows_args(tab, t(), (rows_own, n, ld, w), cfg, timeout),
                cfg.num_warps,
                1,
                aligned,
            )
        )
        for name, group_size in (("PER_CHANNEL", 0), ("PER_GROUP_ALIGNED", 128), ("PER_GROUP", 40)):
            groups = -(-k // group_size) if group_size else 1
            fmt = int8("per_group" if group_size else "per_channel", group_size, True)
            qcfg = blocks.block_config(fmt, cuda, rows_own, k, dtype=torch.float16)
            code = blocks.kernel_format(fmt, qcfg)
            assert ("PER_GROUP" not in name) or code[1] == getattr(tile, name), (name, code)
            cases.append(
                (
                    f"w8a16_scatter {name} {tag}",
                    scatter._gemm_scatter_kernel,
                    dict(
                        X=(t(), k, 1, None, 0, 0),
                        W=(t(torch.int8), k, 1, t(), t(torch.float32), groups, 1, max(group_size, 1)),
                        heap=(tab, tab, off[signals.CH_DONE], off[signals.CH_RS]),
                        dims=(m, n, k, ld, rows_own),
                        rows_per_block=rows_own,
                        rank=w - 2,
                        timeout=timeout,
                        FMT=code,
                        TILE=qcfg.tile(),
                        MATH=(tl.float32, "tf32"),
                        PROTO=(w, False, False, True),
                    ),
                    qcfg.num_warps,
                    qcfg.num_stages,
                    aligned,
                )
            )
    for m, dtype, precision in (
        (4096, torch.float32, "ieee"),
        (4096, torch.float16, "tf32"),
        (16, torch.float16, "tf32"),
    ):
        cfg = gemm.block_config(cuda, m, 4096, dtype)
        cases.append(
            (
                f"matmul {dtype} {precision} m={m}",
                matmul._matmul_kernel,
                dict(
                    X=(t(dtype), 4096, 1, None, 0, 0),
                    W=(t(dtype), 4096, 1, None, None, 0, 0, 1),
                    OUT=(t(dtype), 4096, 1, t(dtype)),
                    dims=(m, 4096, 4096),
                    FMT=(tile.PLAIN, 0, False),
                    TILE=cfg.tile(),
                    MATH=(tl.float32, precision),
                    ROUND=tile.CAST,
                ),
                cfg.num_warps,
                cfg.num_stages,
                True,
            )
        )
    cases += [
        (
            "check_call W=4",
            signals._check_call_kernel,
            dict(
                sig_tab_ptr=tab,
                rank=2,
                timeout=timeout,
                must_agree=(1 << signals.DESC_WORDS) - 1,
                **{f"d{i}": 1000 + i for i in range(signals.DESC_WORDS)},
                WORLD=4,
                DESC_LEN=signals.DESC_WORDS,
                DESC_OFFSET=signals.channel_offset(signals.CH_DESC, 4),
                COUNTERS_OFFSET=signals.channel_offset(signals.CH_RS, 4),
                COUNTERS=8,
                **timer,
            ),
            # As launched: one warp (the epoch update's ordering relies on it, see signals).
            signals.CHECK_CALL_WARPS,
            1,
            True,
        ),
        (
            "finish_call W=4",
            signals._finish_call_kernel,
            dict(
                sig_tab_ptr=tab,
                out0_ptr=t(),
                n0=4096 * 4096,
                out1_ptr=t(),
                n1=4096 * 1024,
                rank=2,
                WORLD=4,
                DONE_OFFSET=signals.channel_offset(signals.CH_DONE, 4),
                OUTPUTS=2,
                BLOCK=1024,
            ),
            4,
            1,
            True,
        ),
    ]
    return cases


# GEMMs whose aligned operand tiles must reach shared memory by 16-byte cp.async (pipelined), the
# A operand of the all-gather GEMM included (it comes through a peer-table pointer).
PIPELINED = ("ag_gemm W", "gemm_scatter", "matmul torch.float16")


def main() -> None:
    failures = []
    print(f"{'kernel':58} {'regs':>5} {'spill B':>8} {'16-bit':>7}")
    for label, fn, args, num_warps, num_stages, aligned in _cases():
        kernel = compile_like_launch(fn, args, num_warps, num_stages)
        regs, spills = resources(kernel)
        narrow = accesses_16bit(kernel)
        print(f"{label:58} {regs:5d} {spills:8d} {len(narrow):7d}", flush=True)
        allowed_16, allowed_spill, _ = next(
            (v for p, v in ALLOWED.items() if label.startswith(p)), (ONCE_PER_PROGRAM, 0, "")
        )
        if spills > allowed_spill:
            failures.append(f"{label}: {spills} bytes of register spills")
        if aligned and label.startswith(PIPELINED) and not CP_ASYNC_16.search(kernel.asm["ptx"]):
            failures.append(f"{label}: no 16-byte cp.async (operand loads not pipelined)")
        if aligned and allowed_16 is not None and len(narrow) > allowed_16:
            failures.append(f"{label}: {len(narrow)} 16-bit global accesses, e.g. {narrow[:3]}")
    report_failures(failures, "compiled: no spills, no 16-bit global accesses on aligned shapes")


def test_fused_kernels_compile_for_sm90():
    run_compile_check("tests.kernels.fused.test_compile_sm90", "compiled: no spills")


def test_gemm_space_compiles_for_sm90():
    """Every config of the GEMM space (kernels/fused/gemm_configs.py), and every tile-core config in the
    fused GEMM kernels, compiles for sm_90a under this Triton: no spills, wgmma, TMA loads for the TMA
    variant, 128-bit loads otherwise (tests/kernels/fused/compile_gemm_space.py; ``make test-triton36``
    runs it under Triton 3.6)."""
    run_compile_check("tests.kernels.fused.compile_gemm_space", "gemm space compiled: no spills")


def test_gpu_block_config_keeps_tile_counts_agreed():
    """Tile counts (signal targets) depend only on the rows per owner, n and the format, which every rank
    agrees on; only block_k follows the per-rank k (uneven k shards are allowed), the per-process TF32
    switch and the int8 group size."""
    import torch

    from kernels.format import PLAIN, fp8, int8
    from kernels.fused import blocks, tile
    from kernels.fused.scatter import slot_stride, tiles

    cuda = torch.device("cuda")
    f16, f32, e4m3 = torch.float16, torch.float32, torch.float8_e4m3fn
    assert blocks.block_config(PLAIN, torch.device("cpu"), 8, 3, dtype=f16) == blocks.CPU_BLOCKS
    assert blocks.block_config(PLAIN, cuda) == blocks.GPU_BLOCKS
    assert blocks.block_config(PLAIN, cuda, 65, 4096, dtype=f16) == blocks.GPU_BLOCKS
    small = blocks.block_config(PLAIN, cuda, 64, 4096, dtype=f16)
    assert (small.block_m, small.num_warps) == (64, 4)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for rows in (1, 64, 65, 1000):
            configs = []
            for allow_tf32 in (False, True):
                torch.backends.cuda.matmul.allow_tf32 = allow_tf32
                configs += [
                    blocks.block_config(fmt, cuda, rows, k, dtype=dtype)
                    for k in (4096, 4097, 3)
                    for dtype in (f16, f32)
                    for fmt in (PLAIN, int8("per_group", 48, False), int8("per_channel", 0, True))
                ]
            assert len({tiles(rows, 4097, cfg) for cfg in configs}) == 1, rows
            fp8_configs = [
                blocks.block_config(fp8(mode), cuda, rows, k, dtype=e4m3)
                for k in (4096, 4104, 3)
                for mode in ("row", "block")
            ]
            assert len({tiles(rows, 4097, cfg) for cfg in fp8_configs + configs}) == 1, rows
        assert blocks.block_config(PLAIN, cuda, 512, 4096, dtype=f32).block_k == 64
        torch.backends.cuda.matmul.allow_tf32 = False
        assert blocks.block_config(PLAIN, cuda, 512, 4096, dtype=f32).block_k == blocks.NARROW_BLOCK_K
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert blocks.block_config(PLAIN, cuda, 512, 4097, dtype=f16).block_k == blocks.NARROW_BLOCK_K
    assert blocks.block_config(PLAIN, cuda, 512, 4096, dtype=f16).block_k == 64
    assert blocks.block_config(fp8("block"), cuda, 512, 4096, dtype=e4m3).block_k == 128
    assert blocks.block_config(fp8("block"), cuda, 512, 4104, dtype=e4m3).block_k == blocks.NARROW_BLOCK_K
    aligned = blocks.block_config(int8("per_group", 128, False), cuda, 512, 4096, dtype=f16)
    assert aligned == blocks.GPU_BLOCKS
    assert blocks.kernel_format(int8("per_group", 128, False), aligned)[1] == tile.PER_GROUP_ALIGNED
    narrowed = blocks.block_config(int8("per_group", 48, False), cuda, 512, 4096, dtype=f16)
    assert (narrowed.block_k, narrowed.block_m) == (16, 128)
    assert blocks.kernel_format(int8("per_group", 48, False), narrowed)[1] == tile.PER_GROUP_ALIGNED
    unaligned = int8("per_group", 40, False)
    assert (
        blocks.kernel_format(unaligned, blocks.block_config(unaligned, cuda, 512, 4096, dtype=f16))[1] == tile.PER_GROUP
    )
    assert [slot_stride(n) for n in (1, 8, 9, 4097)] == [8, 8, 16, 4104]
