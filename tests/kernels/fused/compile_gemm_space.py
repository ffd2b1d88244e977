"""Compile every config of the GEMM space (:mod:`kernels.fused.gemm_configs`) for sm_90a; run by
``test_compile_sm90.py`` in a subprocess per installed Triton (no ``TRITON_INTERPRET``).

Each config is compiled in its variant's kernel, as :func:`kernels.fused.matmul.linear` launches it on
an H100 (bf16 operands; fp16 for one TMA config: the same instructions with another type
suffix), on a shape of its family with 16-byte aligned rows. The SASS must show

* 0 bytes of local memory (spills),
* wgmma (``HGMMA``): the tile reaches Hopper's tensor cores, not mma.sync,
* ``UTMALDG`` for the TMA variant (operand tiles by TMA), and for the pointer variants 128-bit global
  loads (``LDGSTS...128``: cp.async of 16 bytes, or ``LDG...128``).

``python -m tests.kernels.fused.compile_gemm_space`` prints one line per config.
"""

from __future__ import annotations

import re
import sys
import time

_WGMMA = re.compile(r"\bHGMMA\.")
_TMA_LOAD = re.compile(r"\bUTMALDG\b")
_LOAD_128 = re.compile(r"\b(?:LDGSTS|LDG)\.E(?:\.[A-Z0-9_]+)*\.128\b")
# (m, n, k) compiled per family: LLaMA-70B TP8 widths; m only matters through its divisibility.
FAMILY_SHAPE = {"decode": (16, 8192, 8192), "medium": (512, 8192, 1024), "large": (4096, 7168, 8192)}


def _args(cfg, shape, dtype) -> tuple[object, dict]:
    """``(kernel, example arguments)`` of a launch of ``cfg`` on ``shape`` in ``dtype``."""
    import torch
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kernels.fused import gemm_persistent, matmul, tile

    m, n, k = shape

    def t(dt=dtype):
        return torch.empty(64, dtype=dt)

    common = dict(
        dims=(m, n, k),
        TILE=tile.Tile(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m),
        MATH=tile.Math(tl.float32, "tf32"),
    )
    if cfg.variant == "tma":
        base = t()
        descs = dict(
            a_desc=TensorDescriptor(base, [m, k], [k, 1], [cfg.block_m, cfg.block_k]),
            b_desc=TensorDescriptor(base, [n, k], [k, 1], [cfg.block_n, cfg.block_k]),
            c_desc=TensorDescriptor(base, [m, n], [n, 1], [cfg.block_m, cfg.block_n]),
        )
        return gemm_persistent._tma_kernel, dict(**descs, bias_ptr=t(), walk_ptr=None, num_programs=132, **common)
    if cfg.variant == "persistent":
        return gemm_persistent._pointer_kernel, dict(
            A=(t(), k, 1), B=(t(), k, 1), OUT=(t(), n, 1, t()), walk_ptr=None, num_programs=132, **common
        )
    return matmul._matmul_kernel, dict(
        X=(t(), k, 1, None, 0, 0),
        W=(t(), k, 1, None, None, 0, 0, 1),
        OUT=(t(), n, 1, t()),
        FMT=tile.Format(tile.PLAIN, 0, False),
        ROUND=tile.CAST,
        **common,
    )


def cases():
    """``(label, config, shape, dtype)`` for every config of the space."""
    import torch

    from kernels.fused import gemm_configs

    out = []
    fp16_done = set()
    for fam in gemm_configs.FAMILIES:
        for cfg in gemm_configs.space(fam):
            out.append((f"{fam} {cfg.label()} bfloat16", cfg, FAMILY_SHAPE[fam], torch.bfloat16))
            # fp16 is the same code with another type suffix: one TMA config keeps CI time bounded.
            if cfg.variant == "tma" and cfg.variant not in fp16_done:
                fp16_done.add(cfg.variant)
                out.append((f"{fam} {cfg.label()} float16", cfg, FAMILY_SHAPE[fam], torch.float16))
    return out


# The fused kernels whose GEMM runs a tuned tile-core config (blocks.block_config(op=...)): each plain tile
# of the space is compiled into them too, at the TP8 shape with the most peer traffic per tile.
FUSED_LABELS = (
    "all_gather plain W=8 k=8192 n=4096 rows=512 store",
    "scatter plain broadcast W=8 k=8192 n=4096 rows=512",
)


def fused_cases():
    """``(label, kernel, args, num_warps, num_stages)``: the plain fused GEMM kernels of
    ``test_compile_sm90``'s table built with each plain tile of the space instead of the default."""
    import torch

    from kernels.fused import blocks, gemm_configs
    from tests.kernels.fused import test_compile_sm90

    tiles = {c for fam in gemm_configs.FAMILIES for c in gemm_configs.tile_core_space(fam)}
    out = []
    real = blocks.block_config
    try:
        for cfg in sorted(tiles, key=lambda c: c.label()):
            tiled = blocks.as_blocks(cfg, 4)
            # The table asks block_config for its tiles; answer with this config's (no GPU here to tune on).
            blocks.block_config = lambda fmt, device, rows=None, k=None, b=tiled, **kw: (
                b if device.type == "cuda" else real(fmt, device, rows, k, **kw)
            )
            for case in test_compile_sm90._plain_cases():
                if case.label in FUSED_LABELS:
                    out.append(
                        (
                            f"{case.label.split(' W=')[0]} {cfg.label()}",
                            case.fn,
                            case.args,
                            case.num_warps,
                            case.num_stages,
                        )
                    )
    finally:
        blocks.block_config = real
    assert len(out) == len(FUSED_LABELS) * len(tiles), (len(out), torch.__version__)
    return out


def check(kernel, variant: str) -> list[str]:
    """What ``kernel`` (compiled for sm_90a) lacks of the module docstring's properties."""
    from tests.kernels.fused.sm90 import resources, sass

    problems = []
    _, spilled = resources(kernel)
    code = sass(kernel)
    if spilled:
        problems.append(f"{spilled} bytes spilled")
    if not _WGMMA.search(code):
        problems.append("no wgmma (HGMMA) in the SASS")
    if variant == "tma" and not _TMA_LOAD.search(code):
        problems.append("no TMA load (UTMALDG) in the SASS")
    if variant != "tma" and not _LOAD_128.search(code):
        problems.append("no 128-bit global load in the SASS")
    return problems


def _jobs() -> list[tuple[str, int]]:
    """``("space", i)`` per distinct (config, dtype) of :func:`cases` and ``("fused", i)`` per fused case."""
    jobs, seen = [], set()
    for i, (_, cfg, _, dtype) in enumerate(cases()):
        if (cfg, dtype) not in seen:  # a tile shared by two families compiles to the same kernel
            seen.add((cfg, dtype))
            jobs.append(("space", i))
    return jobs + [("fused", i) for i in range(len(fused_cases()))]


def _run_job(job: tuple[str, int]) -> tuple[str, int, int, list[str]]:
    """Compile one job; ``(label, registers, spilled bytes, problems)``."""
    from tests.kernels.fused.sm90 import compile_like_launch, resources

    kind, i = job
    if kind == "space":
        label, cfg, shape, dtype = cases()[i]
        fn, args = _args(cfg, shape, dtype)
        warps, stages, variant = cfg.num_warps, cfg.num_stages, cfg.variant
    else:
        label, fn, args, warps, stages = fused_cases()[i]
        variant = "plain"
    try:
        kernel = compile_like_launch(fn, args, warps, stages)
    except Exception as err:
        return label, 0, 0, [f"does not compile ({type(err).__name__}: {str(err)[:300]})"]
    regs, spilled = resources(kernel)
    return label, regs, spilled, check(kernel, variant)


def main() -> None:
    import triton

    from tests.kernels.fused.sm90 import compile_jobs

    start = time.time()
    jobs = _jobs()
    failures = []
    workers, results = compile_jobs(_run_job, jobs)
    print(f"Triton {triton.__version__}: {'config':58} {'regs':>5} {'spill B':>8}  sass ({workers} processes)")
    for label, regs, spilled, problems in results:
        print(f"{label:66} {regs:5d} {spilled:8d}  {'ok' if not problems else '; '.join(problems)}", flush=True)
        failures += [f"{label}: {p}" for p in problems]
    print(f"{len(jobs)} kernels in {time.time() - start:.1f} s")
    if failures:
        print("FAILED\n" + "\n".join(failures))
        sys.exit(1)
    print("gemm space compiled: no spills, wgmma everywhere, TMA / 128-bit loads as the variant says")


if __name__ == "__main__":
    main()
