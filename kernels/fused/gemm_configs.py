"""The GEMM configuration space, per shape family, in one place.

A :class:`GemmConfig` is one launch of the GEMM core: tile sizes, pipeline depth, warps, the grouped
tile order's group size, and the kernel variant:

* ``"tma"``: persistent (grid = SM count), operands loaded through TMA tensor descriptors
  (:mod:`gemm_persistent`); needs 16-byte aligned rows (row-major, ``k * itemsize % 16 == 0``);
* ``"persistent"``: persistent, operands loaded by pointer (cp.async); any strides;
* ``"plain"``: one program per tile (:func:`gemm._matmul_kernel`), the tile core the fused ops use.

The space is bounded on purpose: the tuner (:mod:`bench.tune`) times every entry of a family on
every shape in a few minutes, and the compile test builds every entry for sm_90a. Every GPU entry
has ``block_m >= 64`` (wgmma's M per warpgroup; smaller tiles compile to mma.sync) and fits sm_90's
227 KB of shared memory with the epilogue's staging tile.

Families (by the rows ``m`` of the GEMM; the decode family is the small-``m`` one):

* ``decode``: ``m <= 64``: 64-row tiles of one warpgroup, wide and deep in ``n``/``k``;
* ``medium``: ``64 < m <= 1024``;
* ``large``: ``m > 1024``: the LLaMA-70B TP8 prefill shapes and 8192^3.

Operand formats (:func:`format_space`, :class:`kernels.format.OperandFormat`): plain operands have
the whole space (three variants); FP8 and int8 weights run only the tile core (``"plain"``):

* FP8: the family's tile-core tiles plus 128-deep k steps on GPU (the FP8 defaults of
  :mod:`blocks`: a 128-deep step of 1-byte operands is the shared memory of a 64-deep 16-bit one),
  kept where ``block_n`` and ``block_k`` divide 128 (one scale row per tile and k step, as the
  tuned file requires) and the two fp32 accumulators of the FP8 loop (the promoted sum and the
  128-deep tensor-core sum) need at most 128 registers per thread together;
* int8 weights (w8A16): the family's tile-core tiles, per_group ones with ``block_k`` narrowed to 16
  where it does not divide ``group_size`` (what :func:`blocks.block_config` runs them with, so the
  tuner times the tiles the kernels launch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch

from ..format import OperandFormat

VARIANTS = ("tma", "persistent", "plain")
FAMILIES = ("decode", "medium", "large")
DECODE_MAX_M = 64
MEDIUM_MAX_M = 1024
# dtypes the GPU space is built and tuned for; FP8 entries come with the FP8 kernels.
TUNED_DTYPES = (torch.bfloat16, torch.float16)
SMEM_BYTES = 227 * 1024


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the GEMM core (see the module docstring for ``variant``)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int
    variant: str = "plain"

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant: {self.variant!r} is not one of {VARIANTS}")
        for f in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, f)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{f}: {v} is not a power of two")
        if self.num_stages < 1 or self.group_m < 1:
            raise ValueError(f"num_stages {self.num_stages} and group_m {self.group_m} must be >= 1")

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GemmConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"GemmConfig: unknown keys {sorted(unknown)} (accepted: {sorted(names)})")
        return cls(**d)

    def smem_bytes(self, itemsize: int = 2) -> int:
        """Shared memory of the operand pipeline plus the TMA epilogue's staging tile (upper bound)."""
        stage = (self.block_m + self.block_n) * self.block_k * itemsize
        return self.num_stages * stage + self.block_m * self.block_n * itemsize

    def label(self) -> str:
        return (
            f"{self.variant}:{self.block_m}x{self.block_n}x{self.block_k}"
            f"/w{self.num_warps}/s{self.num_stages}/g{self.group_m}"
        )


def _tiles(*shapes: tuple[int, int, int, int, int, int]) -> list[tuple[int, int, int, int, int, int]]:
    return list(shapes)


# (block_m, block_n, block_k, num_warps, num_stages, group_m) per family. 128x256x64 at 8 warps and 3
# stages is the Hopper tile of CUTLASS's and Triton's fastest bf16 GEMMs (2 warpgroups, 128 fp32
# accumulator registers per thread); the others trade tile area against waves at the family's m.
_GPU_TILES = {
    # One row tile: the group size changes nothing, 8 lets the medium family share the compiled kernel.
    # 64-wide n tiles fill the SMs at decode m (n = 7168: 112 tiles on 132 SMs; 128-wide: 56).
    "decode": _tiles(
        (64, 64, 128, 4, 4, 8),
        (64, 128, 64, 4, 5, 8),
        (64, 128, 128, 4, 4, 8),
    ),
    "medium": _tiles(
        (64, 128, 64, 4, 5, 8),
        (128, 128, 64, 8, 4, 8),
        (128, 256, 64, 8, 3, 8),
    ),
    "large": _tiles(
        (128, 128, 64, 8, 4, 8),
        (128, 256, 64, 8, 3, 8),
        (256, 128, 64, 8, 3, 8),
    ),
}
# Interpreter tiles: small, so the CPU flow (tests, ``--allow-cpu``) crosses tile boundaries in
# shapes of a few dozen rows and costs little per program.
_CPU_TILES = {
    "decode": _tiles((16, 16, 16, 1, 1, 1), (16, 32, 16, 1, 1, 1)),
    "medium": _tiles((16, 16, 16, 1, 1, 2), (32, 32, 16, 1, 1, 2)),
    "large": _tiles((16, 16, 16, 1, 1, 2), (32, 32, 16, 1, 1, 2)),
}
# The variants the bare matmul tries per family; the fused ops' tile core is always "plain".
_GPU_VARIANTS = ("tma", "persistent", "plain")
# FP8 tiles beside the tile-core ones: 128-deep k steps (blocks.GPU_FP8_BLOCKS and its 64-row form).
_GPU_FP8_TILES = {
    "decode": _tiles((64, 128, 128, 4, 4, 8)),
    "medium": _tiles((64, 128, 128, 4, 4, 8), (128, 128, 128, 8, 3, 8)),
    "large": _tiles((128, 128, 128, 8, 3, 8), (128, 128, 128, 8, 4, 8)),
}
# Columns of k (and rows of n in block mode) per FP8 scale: tile.SCALE_BLOCK (not imported: tile
# imports triton, and this module is read by the tuned-file parser).
FP8_SCALE_BLOCK = 128
# blocks.NARROW_BLOCK_K: the k step of int8 per-group scales whose groups a deeper step would straddle.
GROUP_BLOCK_K = 16
# fp32 registers per thread the FP8 loop's two accumulators may take together (a [BLOCK_M, BLOCK_N]
# tile over num_warps * 32 threads each).
FP8_ACC_REGISTERS = 128


def family(m: int) -> str:
    """The shape family of a GEMM with ``m`` rows."""
    if m <= DECODE_MAX_M:
        return "decode"
    return "medium" if m <= MEDIUM_MAX_M else "large"


def space(fam: str, device_type: str = "cuda", variants: tuple[str, ...] = _GPU_VARIANTS) -> list[GemmConfig]:
    """Every config of family ``fam`` for ``device_type`` ("cuda" or "cpu"), in ``variants``."""
    if fam not in FAMILIES:
        raise ValueError(f"family: {fam!r} is not one of {FAMILIES}")
    tiles = (_GPU_TILES if device_type == "cuda" else _CPU_TILES)[fam]
    return [GemmConfig(*t, variant=v) for v in variants for t in tiles]


def full_space(device_type: str = "cuda") -> list[GemmConfig]:
    """The whole space (every family and variant, duplicates removed, in a stable order)."""
    seen: dict[GemmConfig, None] = {}
    for fam in FAMILIES:
        for cfg in space(fam, device_type):
            seen.setdefault(cfg)
    return list(seen)


def tile_core_space(fam: str, device_type: str = "cuda") -> list[GemmConfig]:
    """Configs of the fused ops' tile core (non-persistent, pointer loads) for family ``fam``."""
    return space(fam, device_type, ("plain",))


def fp8_fits(cfg: GemmConfig) -> bool:
    """Whether ``cfg`` can run FP8 operands: ``block_n`` and ``block_k`` divide 128 (one scale row per
    tile and k step) and its two fp32 accumulators take at most :data:`FP8_ACC_REGISTERS` registers
    per thread."""
    per_thread = 2 * cfg.block_m * cfg.block_n // (32 * cfg.num_warps)
    return (
        cfg.variant == "plain"
        and FP8_SCALE_BLOCK % cfg.block_n == 0
        and FP8_SCALE_BLOCK % cfg.block_k == 0
        and per_thread <= FP8_ACC_REGISTERS
    )


def format_space(fmt: OperandFormat, fam: str, device_type: str = "cuda") -> list[GemmConfig]:
    """The configs the tuner times for operands of ``fmt`` in family ``fam`` (module docstring):
    :func:`space` for plain operands, tile-core configs for FP8 and int8 weights."""
    if fmt.kind == "plain":
        return space(fam, device_type)
    tiles = tile_core_space(fam, device_type)
    if fmt.kind == "fp8":
        extra = [GemmConfig(*t) for t in _GPU_FP8_TILES[fam]] if device_type == "cuda" else []
        tiles = [c for c in tiles + extra if fp8_fits(c)]
    elif fmt.mode == "per_group":
        tiles = [
            c if fmt.group_size % c.block_k == 0 else replace(c, block_k=min(c.block_k, GROUP_BLOCK_K)) for c in tiles
        ]
    return list(dict.fromkeys(tiles))
