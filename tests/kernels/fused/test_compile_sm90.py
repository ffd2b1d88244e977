"""The fused kernels compile for a Hopper GPU (sm_90a) even where no GPU exists, and compile well.

The interpreter does not type-check like the compiler (operand types of atomics, loop-carried
types, inline assembly), so CI compiles the GPU build of every kernel in a subprocess without
``TRITON_INTERPRET`` (Triton's bundled ptxas does the last step): one case table over (kernel, operand
format, shape kind), each case compiled under the argument specialization a real launch of it gets
(:func:`sm90.compile_like_launch`: pointers of torch tensors 16-byte aligned, integers divisible by
16 marked so, integers equal to 1 constants, ``do_not_specialize`` honoured). Every case must

* spill nothing (local memory in the cubin, cuobjdump ``-res-usage``; the driver's ``n_spills``;
  exceptions in :data:`ALLOWED` with their reasons);
* plain and int8 formats, aligned shapes (k, n multiples of 16): touch global memory 16 bits at a time
  at most :data:`ONCE_PER_PROGRAM` times (a pointer loaded from a peer table carries no alignment
  unless the kernel states it: without it every peer access is one element per instruction, and the
  GEMM's operand loads lose cp.async pipelining); the plain GEMMs load their operand tiles by 16-byte
  cp.async and multiply with wgmma (``HGMMA``);
* FP8 GEMMs: multiply with FP8 wgmma on aligned shapes (the SASS holds ``QGMMA`` with FP8 operand
  types, ``.E4M3.E4M3``; ``.E5M2.E4M3`` for an e5m2 x), with operand tiles loaded by 16-byte cp.async;
  on unaligned shapes (``k % 16 != 0``) take the 16-deep fp16 path of ``tile.fp8_dot`` (``HGMMA``
  with fp16 operands; FP8 k steps of 32 or more spilled there).

Odd shapes are compiled too: there the alignment hints must not claim what does not hold, and 16-bit
accesses are expected. Registers, spills, 16-bit accesses and GMMA forms are printed (``pytest -s``).

Labels of the kernels before the formats shared them (for the history of the numbers):
``ag_gemm`` / ``ag_scaled_gemm`` -> ``all_gather <format>``; ``push_shard`` / ``push_scaled_shard`` ->
``push <format>``; ``gemm_scatter`` / ``scaled_gemm_scatter`` / ``w8a16_scatter`` -> ``scatter
<format>``; ``matmul`` / ``scaled_matmul`` -> ``matmul <format>``; ``copy_gathered`` (FP8) is gone
(``all_gather fp8 ... store``: the GEMM's programs copy the gathered rows first).

Two pytest items split the table (plain and int8; FP8), which pytest-xdist runs side by side.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
import triton

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

# The GPU machine's Triton (the Makefile's TRITON36_VERSION, make test-triton36).
GPU_TRITON = "3.6"

# One access instruction of 16 bits to global memory (no .v2/.v4 vector form).
_ACCESS_16 = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(?:ld|st)\.global(?:\.[a-z0-9_]+)*\.(?:b16|u16|s16|f16|bf16)\s", re.MULTILINE
)
_GMMA = re.compile(r"\b([HQ]GMMA)\.(\d+x\d+x\d+)\.F32((?:\.[A-Z0-9]+)*)")
# A [BLOCK_N] vector (bias, per-channel scales) loaded once per program may land one element per
# thread in the layouts of 4-warp tiles: up to 2 such loads are not a peer tile moved 16 bits at a
# time (a 128x128 tile at 8 warps is 64 per thread).
ONCE_PER_PROGRAM = 2
# Known exceptions, by label prefix: (16-bit accesses allowed, spilled bytes allowed, why).
ALLOWED = {
    # Per-group scales [n, groups] are strided along n: a [BLOCK_N] gather per k step (local memory).
    "scatter int8 per_group_aligned": (4, 0, "scale column gather per k step"),
    "scatter int8 per_group ": (None, 0, "scale tile gather per k step"),
    # The all-gather GEMM adds the bias row to the per-channel scale and zero-point rows, each a
    # [BLOCK_N] load once per program in the 8-warp tile's layout.
    "all_gather int8 per_channel": (4, 0, "scale and bias rows once per program"),
    # The NaN fill of a failed call's outputs (error path only).
    "finish_call": (16, 0, "error path"),
    # Odd k: the all-gather buffer's rows (stride k) and x's rows are not 16-byte aligned, so A is
    # loaded an element at a time; the gather buffer layout is the AG protocol's (see docs/fused.md).
    "all_gather plain odd": (None, 0, "odd k, unaligned gather-buffer rows"),
    "push plain odd": (None, 64, "odd k, unaligned gather-buffer rows"),
    # k % 16 != 0 is refused by torch._scaled_mm and cuBLASLt altogether; here it runs, with
    # byte-loaded 16-deep k steps beside the W-way broadcast of the fp32 tile (one-shot all-reduce,
    # outputs of at most 256 KiB only).
    "scatter fp8 block broadcast unaligned": (None, 256, "unaligned k, one-shot broadcast"),
}
TIMEOUT = 60 * 10**9


class Case(NamedTuple):
    """A launch as the host code makes it, and what its binary must show.

    ``narrow``: count 16-bit global accesses against the allowance; ``pipelined``: 16-byte cp.async
    operand loads required; ``gmma``: the only (H|Q)GMMA form allowed (None: not checked).
    """

    label: str
    fn: Any
    args: dict
    num_warps: int
    num_stages: int
    narrow: bool = False
    pipelined: bool = False
    gmma: str | None = None


def _t(dtype: Any) -> Any:
    import torch

    return torch.empty(64, dtype=dtype)


def _operands(fmt: Any, cfg: Any, k: int, n: int, x_dtype: Any, w_dtype: Any) -> tuple[tuple, tuple]:
    """Example ``X`` and ``W`` (kernels.fused.tile) of a launch of ``fmt`` with contiguous operands."""
    import torch

    f32 = torch.float32
    if fmt.kind == "fp8":
        sk = -(-k // 128)
        if fmt.mode == "tensor":
            return (_t(x_dtype), k, 1, _t(f32), 0, 0), (_t(w_dtype), k, 1, _t(f32), None, 0, 0, 1)
        if fmt.mode == "block":
            return (_t(x_dtype), k, 1, _t(f32), sk, 1), (_t(w_dtype), k, 1, _t(f32), None, sk, 1, 1)
        return (_t(x_dtype), k, 1, _t(f32), 1, 0), (_t(w_dtype), k, 1, _t(f32), None, 1, 0, 1)
    if fmt.kind == "int8":
        groups = -(-k // fmt.group_size) if fmt.group_size else 1
        stride_sn = groups if fmt.mode == "per_group" else 1
        w = (_t(torch.int8), k, 1, _t(x_dtype), _t(f32) if fmt.offset else None, stride_sn, 1, max(fmt.group_size, 1))
        return (_t(x_dtype), k, 1, None, 0, 0), w
    return (_t(x_dtype), k, 1, None, 0, 0), (_t(w_dtype), k, 1, None, None, 0, 0, 1)


def _format_label(fmt: Any, fmt_code: tuple) -> str:
    from kernels.fused import tile

    if fmt.kind == "int8":
        names = {tile.PER_GROUP_ALIGNED: "per_group_aligned", tile.PER_GROUP: "per_group"}
        return f"int8 {names.get(fmt_code.SCALES, fmt.mode)}"
    return "plain" if fmt.kind == "plain" else f"fp8 {fmt.mode}"


def _gemm_cases(fmt: Any, shape: tuple, dtypes: tuple, variants: tuple) -> list[Case]:
    """The fused GEMM kernels of ``fmt`` at ``shape = (W, k, n, rows per owner)``: all-gather (``store``:
    return_gathered; ``split``: gather_dim > 0), push, scatter (``broadcast``: one-shot all-reduce;
    ``split``: scatter_dim > 0)."""
    import torch

    from kernels.fused import all_gather, blocks, matmul, scatter, signals, tile

    w, k, n, rows = shape
    x_dtype, w_dtype, out_dtype = dtypes
    cuda = torch.device("cuda")
    aligned = k % 16 == 0 and n % 16 == 0
    # No op: the tuned lookup needs the GPU's name (the tiles are the defaults on every shape here).
    cfg = blocks.block_config(fmt, cuda, rows, k, dtype=x_dtype)
    fmt_code = blocks.kernel_format(fmt, cfg)
    tag = f"{'' if aligned else ('odd ' if fmt.kind != 'fp8' else 'unaligned ')}W={w} k={k} n={n} rows={rows}"
    name = _format_label(fmt, fmt_code)
    X, W = _operands(fmt, cfg, k, n, x_dtype, w_dtype)
    tab = _t(torch.int64)
    sk = fmt.scale_cols(k)
    math = tile.Math(blocks.acc_dtype(x_dtype), "tf32")
    fp8 = fmt.kind == "fp8"
    gmma = ("QGMMA.E5M2.E4M3" if x_dtype == torch.float8_e5m2 else "QGMMA.E4M3.E4M3") if aligned else "HGMMA"
    checks = dict(narrow=aligned and not fp8)
    gemm_checks = dict(
        checks,
        pipelined=aligned and fmt.kind != "int8",
        gmma=(gmma if fp8 else ("HGMMA" if aligned and fmt.kind == "plain" else None)),
    )
    cases = []
    s_base = all_gather.scale_base(w * rows * k * x_dtype.itemsize)
    for store, split in variants.get("all_gather", ()):
        out = (
            _t(out_dtype),
            n,
            1,
            _t(out_dtype),
            _t(x_dtype) if store else None,
            _t(torch.float32) if fp8 and store else None,
        )
        mode = all_gather.NO_STORE
        if store:
            mode = all_gather.STORE_IN_GEMM if fmt.kind == "plain" and not split else all_gather.COPY_FIRST
        cases.append(
            Case(
                f"all_gather {name} {tag}{' store' if store else ''}{' split' if split else ''}",
                all_gather._ag_gemm_kernel,
                dict(
                    X=X,
                    W=W,
                    OUT=out,
                    heap=(tab, tab, signals.channel_offset(signals.CH_AG, w), s_base),
                    dims=(rows, n, k, sk, -(-n // cfg.block_n), 256),
                    rows_per_block=rows // 2 + 1 if split else rows,
                    rank=w - 2,
                    timeout=TIMEOUT,
                    FMT=fmt_code,
                    TILE=cfg.tile(),
                    MATH=math,
                    PROTO=all_gather.AllGatherProto(
                        w,
                        signals.CH_AG,
                        signals.AG_MAX_SPLITS,
                        split,
                        mode,
                        min(64, 1 << (sk - 1).bit_length()),
                        matmul.ROUNDING[fmt.kind],
                        True,
                    ),
                ),
                cfg.num_warps,
                cfg.num_stages,
                **gemm_checks,
            )
        )
    if variants.get("push"):
        cases.append(
            Case(
                f"push {name} {tag}",
                all_gather.push_kernel,
                dict(
                    X=X,
                    heap=(tab, tab, s_base),
                    dims=(rows, k, sk, 256, 4),
                    rank=w - 2,
                    PROTO=all_gather.PushProto(w, signals.channel_offset(signals.CH_AG, w), signals.AG_MAX_SPLITS),
                    BLOCKS=all_gather.PushBlocks(
                        32, all_gather.push_cols(fmt, cuda, k), min(64, 1 << (sk - 1).bit_length())
                    ),
                ),
                4,
                3,
                **checks,
            )
        )
    scfg = cfg
    for broadcast, split in variants.get("scatter", ()):
        cases.append(
            Case(
                f"scatter {name}{' broadcast' if broadcast else ''} {tag}{' split' if split else ''}",
                scatter._gemm_scatter_kernel,
                dict(
                    X=X,
                    W=W,
                    heap=(
                        tab,
                        tab,
                        signals.channel_offset(signals.CH_DONE, w),
                        signals.channel_offset(signals.CH_RS, w),
                    ),
                    dims=(w * rows, n, k, scatter.slot_stride(n), rows),
                    rows_per_block=rows // 2 + 1 if split else rows,
                    rank=w - 2,
                    timeout=TIMEOUT,
                    FMT=fmt_code,
                    TILE=scfg.tile(),
                    MATH=math,
                    PROTO=scatter.ScatterProto(w, broadcast, split, True),
                ),
                scfg.num_warps,
                scfg.num_stages,
                **gemm_checks,
            )
        )
    return cases


def _reduce_cases(shape: tuple, dtypes: tuple, label: str) -> list[Case]:
    """The shared reduce (push off / on) and two-shot gather in the slot dtype ``dtypes[0]`` (bias ``dtypes[1]``)."""
    import torch

    from kernels.format import PLAIN
    from kernels.fused import all_reduce, blocks, scatter

    dtype, bias_dtype = dtypes
    w, k, n, rows = shape
    cfg = blocks.block_config(PLAIN, torch.device("cuda"), rows, k, dtype=torch.float16)
    aligned = k % 16 == 0 and n % 16 == 0
    tab, ld = _t(torch.int64), scatter.slot_stride(n)
    tag = f"{label}{'' if aligned else 'odd '}W={w} k={k} n={n} rows={rows}"
    cases = [
        Case(
            f"reduce_slots push={push} {tag}",
            scatter._reduce_slots_kernel,
            reduce_slots_args(tab, _t(bias_dtype), _t(dtype), (rows, n, ld, w), push, cfg, TIMEOUT),
            cfg.num_warps,
            1,
            narrow=aligned and dtype != torch.float32,
        )
        for push in (False, True)
    ]
    cases.append(
        Case(
            f"gather_rows {tag}",
            all_reduce._gather_rows_kernel,
            gather_rows_args(tab, _t(dtype), (rows, n, ld, w), cfg, TIMEOUT),
            cfg.num_warps,
            1,
            narrow=aligned and dtype != torch.float32,
        )
    )
    return cases


def _matmul_case(fmt: Any, m: int, dtypes: tuple, precision: str, label: str) -> Case:
    import torch

    from kernels.fused import blocks, matmul, tile

    x_dtype, w_dtype, out_dtype = dtypes
    k, n = (4096, 4096) if fmt.kind != "fp8" else (8192, 7168)
    # fp32 on CUDA without TF32 allowed: the "ieee" dot and its narrow k steps.
    cfg = blocks.block_config(fmt, torch.device("cuda"), m, k, dtype=x_dtype)
    X, W = _operands(fmt, cfg, k, n, x_dtype, w_dtype)
    fp8 = fmt.kind == "fp8"
    gmma = None
    if fp8:
        gmma = "QGMMA.E5M2.E4M3" if x_dtype == torch.float8_e5m2 else "QGMMA.E4M3.E4M3"
    elif fmt.kind == "plain" and precision == "tf32":
        gmma = "HGMMA"
    return Case(
        f"matmul {_format_label(fmt, blocks.kernel_format(fmt, cfg))} {label} m={m}",
        matmul._matmul_kernel,
        dict(
            X=X,
            W=W,
            OUT=(_t(out_dtype), n, 1, _t(out_dtype)),
            dims=(m, n, k),
            FMT=blocks.kernel_format(fmt, cfg),
            TILE=cfg.tile(),
            MATH=tile.Math(blocks.acc_dtype(x_dtype), precision),
            ROUND=matmul.ROUNDING[fmt.kind],
        ),
        cfg.num_warps,
        cfg.num_stages,
        narrow=not fp8,
        pipelined=fp8 or gmma is not None,
        gmma=gmma,
    )


def _plain_cases() -> list[Case]:
    """Plain and int8 formats, and the protocol's own kernels."""
    import torch

    from kernels.format import PLAIN, int8
    from kernels.fused import signals

    f16 = (torch.float16, torch.float16, torch.float16)
    cases = []
    # (W, k, n, rows per owner): LLaMA-like aligned shapes, decode-size m, and odd k and n.
    for shape in ((8, 8192, 4096, 512), (8, 8192, 4096, 16), (4, 4097, 8191, 1024)):
        plain = dict(
            all_gather=((True, False), (True, True)), push=True, scatter=((False, False), (True, False), (False, True))
        )
        cases += _gemm_cases(PLAIN, shape, f16, plain)
        cases += _reduce_cases(shape, (torch.float16, torch.float16), "")
        for fmt in (int8("per_channel", 0, True), int8("per_group", 128, True), int8("per_group", 40, True)):
            cases += _gemm_cases(
                fmt, shape, (torch.float16, torch.int8, torch.float16), dict(scatter=((False, False),))
            )
    # The int8 all-gather GEMM (new with the shared kernel) at the aligned TP8 shape.
    cases += _gemm_cases(
        int8("per_channel", 0, True),
        (8, 8192, 4096, 512),
        (torch.float16, torch.int8, torch.float16),
        dict(all_gather=((True, False),)),
    )
    for m, dtype, precision in (
        (4096, torch.float32, "ieee"),
        (4096, torch.float16, "tf32"),
        (16, torch.float16, "tf32"),
    ):
        cases.append(_matmul_case(PLAIN, m, (dtype, dtype, dtype), precision, f"{dtype} {precision}"))
    cases.append(
        _matmul_case(int8("per_group", 128, False), 4096, (torch.float16, torch.int8, torch.float16), "tf32", "f16")
    )
    tab = _t(torch.int64)
    cases += [
        Case(
            "check_call W=4",
            signals._check_call_kernel,
            dict(
                sig_tab_ptr=tab,
                rank=2,
                timeout=TIMEOUT,
                must_agree=(1 << signals.DESC_WORDS) - 1,
                **{f"d{i}": 1000 + i for i in range(signals.DESC_WORDS)},
                WORLD=4,
                DESC_LEN=signals.DESC_WORDS,
                DESC_OFFSET=signals.channel_offset(signals.CH_DESC, 4),
                COUNTERS_OFFSET=signals.channel_offset(signals.CH_RS, 4),
                COUNTERS=8,
                USE_GLOBALTIMER=True,
            ),
            # As launched: one warp (the epoch update's ordering relies on it, see signals).
            signals.CHECK_CALL_WARPS,
            1,
            narrow=True,
        ),
        Case(
            "finish_call W=4",
            signals._finish_call_kernel,
            dict(
                sig_tab_ptr=tab,
                out0_ptr=_t(torch.float16),
                n0=4096 * 4096,
                out1_ptr=_t(torch.int8),  # packed FP8 rows (bytes): poisoned with all-ones bits
                n1=4096 * 1024,
                rank=2,
                WORLD=4,
                DONE_OFFSET=signals.channel_offset(signals.CH_DONE, 4),
                OUTPUTS=2,
                BLOCK=1024,
                INTEGER0=False,
                INTEGER1=True,
            ),
            4,
            1,
            narrow=True,
        ),
    ]
    return cases


def _norm_cases() -> list[Case]:
    """all_reduce_rmsnorm (kernels/fused/all_reduce_norm.py): the row push (one-shot, two-shot), the reduce into
    fp32 with the residual (one-shot) and the two-shot gather adding it, and the norm (bf16 out; fp32 out before FP8
    quantization)."""
    import torch

    from kernels.fp8.quantize_triton import FP8_FORMAT
    from kernels.fp8.scales import FP8_MAX
    from kernels.fused import all_reduce, all_reduce_norm, scatter, signals

    cases = []
    cfg = all_reduce_norm.block_config(torch.device("cuda"))
    bf16, tab = _t(torch.bfloat16), _t(torch.int64)
    for w, m, n in ((8, 128, 8192), (2, 5, 4100)):
        tag = f"W={w} m={m} n={n}"
        ld = scatter.slot_stride(n)
        for broadcast in (True, False):
            rows = m if broadcast else -(-m // w)
            cases.append(
                Case(
                    f"norm push broadcast={broadcast} {tag}",
                    all_reduce_norm._push_rows_kernel,
                    dict(
                        X=(bf16, n, 1),
                        heap=(
                            tab,
                            tab,
                            signals.channel_offset(signals.CH_DONE, w),
                            signals.channel_offset(signals.CH_RS, w),
                        ),
                        dims=(m, n, 0, ld, rows),
                        rank=w - 2,
                        timeout=TIMEOUT,
                        TILE=cfg.tile(),
                        PROTO=scatter.ScatterProto(w, broadcast, False, True),
                    ),
                    cfg.num_warps,
                    1,
                    narrow=n % 16 == 0,
                )
            )
        # One-shot: the reduce adds the residual; two-shot: each rank adds its own as it gathers the reduced rows.
        reduce_args = reduce_slots_args(tab, None, _t(torch.float32), (m, n, ld, w), False, cfg, TIMEOUT, bf16)
        cases.append(Case(f"norm reduce residual {tag}", scatter._reduce_slots_kernel, reduce_args, cfg.num_warps, 1))
        gather_args = gather_rows_args(tab, _t(torch.float32), (-(-m // w), n, ld, w), cfg, TIMEOUT, residual=bf16)
        cases.append(Case(f"norm gather residual {tag}", all_reduce._gather_rows_kernel, gather_args, cfg.num_warps, 1))
        e4m3 = torch.float8_e4m3fn
        fp8 = all_reduce_norm.Fp8Format(FP8_MAX[e4m3], *FP8_FORMAT[e4m3])
        f32 = _t(torch.float32)
        # QUANT 0: bf16 out; 1: fp32 y32 (tensor mode, quantized after); 2 / 3: FP8 row / block in the kernel.
        for quant, out, block_n in ((0, bf16, 1024), (1, f32, 1024), (2, _t(e4m3), 1024), (3, _t(e4m3), 1024)):
            cases.append(
                Case(
                    f"rmsnorm quant={quant} {tag}",
                    all_reduce_norm._rmsnorm_kernel,
                    dict(
                        H=(f32, n),
                        OUT=(bf16, n, out, n, f32 if quant >= 2 else out, 1 if quant == 2 else -(-n // 128)),
                        weight_ptr=bf16,
                        dims=(m, n),
                        eps=1e-6,
                        BLOCK_M=1,
                        BLOCK_N=block_n,
                        QUANT=quant,
                        FP8=fp8,
                    ),
                    4,
                    1,
                    narrow=n % 16 == 0,
                )
            )
    return cases


def _fp8_cases() -> list[Case]:
    """The FP8 format: every kernel of the FP8 ops, and the fp32 specialization of the shared reductions."""
    import torch

    from kernels.format import fp8

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    dtypes = (e4m3, e4m3, torch.bfloat16)
    cases = []
    # (W, k, n, rows per owner): LLaMA-70B TP8-like aligned shapes, decode-size m, k % 16 == 8.
    for shape in ((8, 8192, 7168, 512), (8, 8192, 7168, 16), (4, 4104, 4100, 1024)):
        aligned, tp8 = shape[1] % 16 == 0, shape[3] > 64
        for mode in ("row", "block") if aligned else ("block",):
            variants = dict(
                # At the TP8 shape also the gathered rows copied out, and the strided rows of gather_dim > 0.
                all_gather=((False, False), (True, False), (True, True)) if tp8 and aligned else ((False, False),),
                push=True,
                scatter=((False, False), (True, False), (False, True))
                if mode == "block" and tp8 and aligned
                else (((False, False), (True, False)) if mode == "block" else ((False, False),)),
            )
            cases += _gemm_cases(fp8(mode), shape, dtypes, variants)
        if aligned and tp8:
            cases += _reduce_cases(shape, (torch.float32, torch.bfloat16), "fp32 ")
    # The local GEMM: every mode, an e5m2 x (gradients), decode-size m.
    for mode, x_dtype, m in (("tensor", e4m3, 4096), ("row", e4m3, 4096), ("block", e4m3, 4096), ("block", e5m2, 16)):
        cases.append(_matmul_case(fp8(mode), m, (x_dtype, e4m3, torch.bfloat16), "tf32", f"x={x_dtype}"))
    return cases


def _table(group: str) -> list[Case]:
    return _plain_cases() + _norm_cases() if group == "plain" else _fp8_cases()


def _compile_case(job: tuple[str, int]) -> tuple[str, int, int, list[str], set[str], bool, Case]:
    """Compile case ``job = (group, index)``: ``(label, registers, spilled bytes, 16-bit accesses, GMMA
    forms, 16-byte cp.async present, case)``. Cases are rebuilt by index in the worker (kernels do not
    pickle)."""
    group, i = job
    case = _table(group)[i]
    kernel = compile_like_launch(case.fn, case.args, case.num_warps, case.num_stages)
    regs, spills = resources(kernel)
    ptx = kernel.asm["ptx"]
    narrow = [m.group(0).strip() for m in _ACCESS_16.finditer(ptx)]
    forms = {name + types for name, _, types in _GMMA.findall(sass(kernel))} if case.gmma else set()
    return case.label, regs, spills, narrow, forms, bool(CP_ASYNC_16.search(ptx)), case._replace(fn=None, args={})


def main(group: str = "plain") -> None:
    import triton

    failures = []
    workers, results = compile_jobs(_compile_case, [(group, i) for i in range(len(_table(group)))])
    print(f"Triton {triton.__version__} ({workers} processes)")
    print(f"{'kernel':70} {'regs':>5} {'spill B':>8} {'16-bit':>7}  GMMA")
    for label, regs, spills, narrow, forms, cp_async_16, case in results:
        print(f"{label:70} {regs:5d} {spills:8d} {len(narrow):7d}  {' '.join(sorted(forms)) or '-'}", flush=True)
        allowed_16, allowed_spill, _ = next(
            (v for p, v in ALLOWED.items() if label.startswith(p)), (ONCE_PER_PROGRAM, 0, "")
        )
        if spills > allowed_spill:
            failures.append(f"{label}: {spills} bytes of register spills")
        if case.narrow and allowed_16 is not None and len(narrow) > allowed_16:
            failures.append(f"{label}: {len(narrow)} 16-bit global accesses, e.g. {narrow[:3]}")
        if case.pipelined and not cp_async_16:
            failures.append(f"{label}: no 16-byte cp.async (operand loads not pipelined)")
        if case.gmma is not None and forms != {case.gmma}:
            failures.append(f"{label}: GMMA forms {sorted(forms)}, want only {case.gmma}")
    report_failures(failures, f"compiled ({group}): no spills, wgmma, no 16-bit global accesses on aligned shapes")


def main_fp8() -> None:
    main("fp8")


def test_fused_kernels_compile_for_sm90():
    run_compile_check("tests.kernels.fused.test_compile_sm90", "compiled (plain): no spills")


def test_fused_fp8_kernels_compile_for_sm90():
    run_compile_check("tests.kernels.fused.test_compile_sm90", "compiled (fp8): no spills", entry="main_fp8")


@pytest.mark.skipif(
    not triton.__version__.startswith(GPU_TRITON + "."),
    reason=f"the tuner's candidates compile under the GPU machine's Triton {GPU_TRITON} (make test-triton36)",
)
def test_gemm_space_compiles_for_sm90():
    """Every config of the GEMM space (kernels/fused/gemm_configs.py), and every tile-core config in the
    fused GEMM kernels, compiles for sm_90a under the GPU machine's Triton: no spills, wgmma, TMA loads for the
    TMA variant, 128-bit loads otherwise (tests/kernels/fused/compile_gemm_space.py). Under a newer Triton the
    on-arrival tuner measures the same space and reports a config that does not compile there instead of
    choosing it, and the default tiles are compiled by the tests above; this sweep (a minute of compiles) runs
    in ``make test-triton36`` only."""
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
    assert blocks.kernel_format(int8("per_group", 128, False), aligned).SCALES == tile.PER_GROUP_ALIGNED
    narrowed = blocks.block_config(int8("per_group", 48, False), cuda, 512, 4096, dtype=f16)
    assert (narrowed.block_k, narrowed.block_m) == (16, 128)
    assert blocks.kernel_format(int8("per_group", 48, False), narrowed).SCALES == tile.PER_GROUP_ALIGNED
    unaligned = int8("per_group", 40, False)
    assert (
        blocks.kernel_format(unaligned, blocks.block_config(unaligned, cuda, 512, 4096, dtype=f16)).SCALES
        == tile.PER_GROUP
    )
    assert [slot_stride(n) for n in (1, 8, 9, 4097)] == [8, 8, 16, 4104]


def test_gpu_triton_is_the_makefiles_oldest() -> None:
    """The version the GEMM-space sweep waits for is the one make test-triton36 installs."""
    import os

    from kernels.testing import REPO_ROOT

    with open(os.path.join(REPO_ROOT, "Makefile"), encoding="utf-8") as f:
        pinned = re.search(r"^TRITON36_VERSION \?= (\S+)$", f.read(), re.M)
    assert pinned and pinned.group(1).startswith(GPU_TRITON + "."), pinned
