"""Tuned GEMM configurations: ``configs/tuned/<gpu-name>.yaml``, read at run time.

``python -m bench --mode tune`` (:mod:`bench.tune`) writes one file per GPU model; the kernels read
the file named after the GPU they run on (``gpu_name``: the CUDA device name in lower case, runs of
other characters than letters and digits turned into ``-``, e.g. ``nvidia-h100-80gb-hbm3``). All
ranks of a job read the same file, so they choose the same tiles for the reducing ops, whose tile
counts are signal targets (the all-gather's tiles are each rank's own: it is looked up by ``n``,
which ranks need not share, and its pushed chunks do not follow it). The file is re-read when its
mtime changes; ranks whose tiles for a reducing op differ (another ``COC_TUNED_DIR``, a file
rewritten between their reads) fail that call by name (the call check compares the tile), so do not
rewrite the file while a job that uses it runs. No file (or no entry for an op and dtype): the
built-in defaults. The directory is ``configs/tuned`` (:data:`DEFAULT_DIR`: the checkout's, or the
installed package's copy, :mod:`kernels.paths`); ``COC_TUNED_DIR`` names another, existing one (a
missing directory is a ``ValueError`` naming the variable). A CPU file (``cpu.yaml``, from
``--mode tune --allow-cpu``) is read only from ``COC_TUNED_DIR``, so a CI run of the tuner never
changes the tiles of the CPU test suite.

File layout (``version: 1``)::

    gpu: NVIDIA H100 80GB HBM3          # informational
    entries:
      - op: matmul                      # or all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce,
                                        # grouped_matmul
        dtype: bfloat16
        m: 4096                         # the shape the entry was timed on (grouped_matmul: the rows per
                                        # expert, ceil(m / E), the rows its kernel chooses tiles for)
        n: 8192
        k: 8192
        config: {block_m: 128, block_n: 256, block_k: 64, num_warps: 8, num_stages: 3, group_m: 8, variant: tma}
        ms: 1.234                       # the config's time
        cublas_ms: 1.201                # the unfused baseline on the same shape (bench.tune; null: none ran)
        format: fp8:block               # optional: the operand format (kernels.format), default plain;
                                        # files without it (the tuner before formats) hold plain entries

    all_reduce_gates:                   # optional: all_reduce_rmsnorm's size switch per world size
      - world: 2
        one_shot_max_bytes: 262144      # x's bytes up to which "auto" runs one-shot
        fused_max_bytes: 8388608        # up to which it runs two-shot; above: the unfused torch.distributed path

Gates (:func:`all_reduce_gates`): the entry of the call's world size, else :data:`DEFAULT_GATES`.

Lookup (:func:`lookup`): the entry of the same op, dtype (x's: the FP8 payload's for FP8), operand
format and shape family (:func:`gemm_configs.family`) nearest to the call's shape in
``|log2 m| + |log2 n| + |log2 k|`` (ties: the first in the file). Entries of another format than plain
run the fused tile core ("plain" variant); FP8 entries' ``block_n`` and ``block_k`` divide 128 (one
scale row per tile and k step).
For the fused ops ``k`` is left out of the distance: ranks may hold uneven ``k`` shards, and the tile
counts that become signal targets must not depend on it.

``grouped_matmul`` (the mixture-of-experts grouped GEMM, :mod:`grouped`) is local, like ``matmul``: looked
up by its rows per expert, ``n`` and ``k``. Its kernel is the tile core only, so its entries of another
variant than "plain" (never written by the tuner) are ignored by the lookup: the nearest plain entry, else
the defaults, never a tile the kernel does not run.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..format import OperandFormat
from ..paths import config_path
from .gemm_configs import GemmConfig, family
from .tile import SCALE_BLOCK

ENV_TUNED_DIR = "COC_TUNED_DIR"
FILE_VERSION = 1
OPS = ("matmul", "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "grouped_matmul")
FUSED_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
# Ops whose only kernel is the tile core ("plain" variant): the fused ops (the file refuses other variants)
# and the grouped GEMM (the lookup skips other variants).
TILE_CORE_OPS = (*FUSED_OPS, "grouped_matmul")
DEFAULT_DIR = config_path("tuned")


@dataclass(frozen=True)
class Gates:
    """``all_reduce_rmsnorm``'s size switch at ``world`` ranks: one-shot up to ``one_shot_max_bytes`` of x,
    two-shot up to ``fused_max_bytes``, the unfused torch.distributed exchange above."""

    world: int
    one_shot_max_bytes: int
    fused_max_bytes: int


# Until the tuner measures a machine: one-shot up to the fused GEMM all-reduce's gate (256 KiB), two-shot up to
# 8 MiB (a custom all-reduce's usual ceiling), the collective library above.
DEFAULT_ONE_SHOT_MAX_BYTES = 256 * 1024
DEFAULT_FUSED_MAX_BYTES = 8 * 1024 * 1024


def _parse_gates(doc: dict, source: str) -> dict[int, Gates]:
    raw = doc.get("all_reduce_gates", [])
    if not isinstance(raw, list):
        raise ValueError(f"{source}: all_reduce_gates must be a list, got {type(raw).__name__}")
    out = {}
    for i, g in enumerate(raw):
        where = f"{source}: all_reduce_gates[{i}]"
        if not isinstance(g, dict):
            raise ValueError(f"{where} is not a mapping")
        for key in ("world", "one_shot_max_bytes", "fused_max_bytes"):
            if not isinstance(g.get(key), int) or isinstance(g.get(key), bool) or g[key] < 0:
                raise ValueError(f"{where}.{key}: {g.get(key)!r} is not an integer >= 0")
        if g["one_shot_max_bytes"] > g["fused_max_bytes"]:
            raise ValueError(
                f"{where}: one_shot_max_bytes {g['one_shot_max_bytes']} exceeds fused_max_bytes {g['fused_max_bytes']}"
            )
        out[g["world"]] = Gates(g["world"], g["one_shot_max_bytes"], g["fused_max_bytes"])
    return out


@dataclass(frozen=True)
class Entry:
    op: str
    dtype: str
    m: int
    n: int
    k: int
    config: GemmConfig
    ms: float | None = None
    cublas_ms: float | None = None
    format: str = "plain"

    def to_dict(self) -> dict:
        d = dict(
            op=self.op,
            dtype=self.dtype,
            m=self.m,
            n=self.n,
            k=self.k,
            config=self.config.to_dict(),
            ms=self.ms,
            cublas_ms=self.cublas_ms,
        )
        return d if self.format == "plain" else {**d, "format": self.format}


def gpu_name(device: torch.device) -> str:
    """File stem of ``device``'s tuned file: ``cpu`` or the CUDA device name as a slug."""
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_name(index: int) -> str:
    # Cached: the kernels ask on every call, and a device's name does not change.
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(index).lower()).strip("-")


def tuned_path(device: torch.device) -> Path | None:
    """The tuned file the kernels on ``device`` read (it may not exist), or None (CPU without ``COC_TUNED_DIR``)."""
    path = _path(_env_dir(), device.type, device.index)
    return None if path is None else Path(path)


def _env_dir() -> str | None:
    # Empty or blank means unset, as for the other COC_* variables (kernels/config.py).
    raw = os.environ.get(ENV_TUNED_DIR)
    return raw if raw and raw.strip() else None


@functools.cache
def _path(directory: str | None, device_type: str, index: int | None) -> str | None:
    # Cached per (directory, device): the kernels ask on every call.
    if directory is None:
        if device_type != "cuda":
            return None
        directory = str(DEFAULT_DIR)
    elif not os.path.isdir(directory):
        # Not cached (functools.cache keeps no exceptions): a directory created later is then accepted.
        raise ValueError(
            f"{ENV_TUNED_DIR}={directory!r} is not accepted: no such directory; use an existing directory "
            "holding the tuner's <gpu-name>.yaml files (python -m bench --mode tune --out-dir DIR writes one)"
        )
    return os.path.join(directory, f"{gpu_name(torch.device(device_type, index))}.yaml")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse(doc: object, source: str) -> list[Entry]:
    """Entries of a loaded tuned file; ValueError naming ``source`` and the bad key or value."""
    if not isinstance(doc, dict) or doc.get("version") != FILE_VERSION:
        got = doc.get("version") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{source}: version {got!r} is not {FILE_VERSION}")
    raw = doc.get("entries")
    if not isinstance(raw, list):
        raise ValueError(f"{source}: entries must be a list, got {type(raw).__name__}")
    entries = []
    for i, e in enumerate(raw):
        where = f"{source}: entries[{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where} is not a mapping")
        if e.get("op") not in OPS:
            raise ValueError(f"{where}.op: {e.get('op')!r} is not one of {OPS}")
        for key in ("m", "n", "k"):
            if not isinstance(e.get(key), int) or e[key] < 1:
                raise ValueError(f"{where}.{key}: {e.get(key)!r} is not a positive integer")
        if not isinstance(getattr(torch, str(e.get("dtype")), None), torch.dtype):
            raise ValueError(f"{where}.dtype: {e.get('dtype')!r} is not a torch dtype name")
        try:
            config = GemmConfig.from_dict(e.get("config") or {})
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}.config: {err}") from err
        if e["op"] in FUSED_OPS and config.variant != "plain":
            raise ValueError(f"{where}.config.variant: {config.variant!r}; the fused ops' tile core is 'plain'")
        fmt = _format(e.get("format", "plain"), config, where)
        entries.append(
            Entry(e["op"], e["dtype"], e["m"], e["n"], e["k"], config, e.get("ms"), e.get("cublas_ms"), fmt.encode())
        )
    return entries


def _format(text: object, config: GemmConfig, where: str) -> OperandFormat:
    """The ``format`` of an entry, checked against what its kernels can run."""
    try:
        fmt = OperandFormat.decode(str(text))
    except (ValueError, IndexError, KeyError):
        fmt = None
    if fmt is None or fmt.encode() != text:
        raise ValueError(
            f"{where}.format: {text!r} is not an operand format as kernels.format.OperandFormat.encode writes it "
            "(plain, fp8:block, int8:per_group:128, ...)"
        )
    if fmt.kind != "plain" and config.variant != "plain":
        raise ValueError(f"{where}.config.variant: {config.variant!r}; {fmt.kind} operands run the tile core, 'plain'")
    if fmt.kind == "fp8" and (SCALE_BLOCK % config.block_n or SCALE_BLOCK % config.block_k):
        raise ValueError(
            f"{where}.config: block_n {config.block_n} and block_k {config.block_k} must divide {SCALE_BLOCK} "
            "for FP8 (one scale row per tile and k step)"
        )
    return fmt


_files: dict[str, tuple[int, list[Entry], dict[int, Gates]]] = {}


def _load(path: str) -> tuple[list[Entry], dict[int, Gates]]:
    try:
        mtime = os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return [], {}
    cached = _files.get(path)
    if cached is not None and cached[0] == mtime:
        return cached[1], cached[2]
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f)
    entries = parse(doc, path)
    gates = _parse_gates(doc, path)
    _files[path] = (mtime, entries, gates)
    for key in [key for key in _memo if key[0] == path]:
        del _memo[key]
    return entries, gates


def load(path: Path | str) -> list[Entry]:
    """Entries of ``path`` (empty if it does not exist); re-read when its mtime changes."""
    return _load(str(path))[0]


def all_reduce_gates(device: torch.device, world: int) -> Gates:
    """The size switch of ``all_reduce_rmsnorm`` at ``world`` ranks on ``device`` (module docstring)."""
    path = _path(_env_dir(), device.type, device.index)
    gates = {} if path is None else _load(path)[1]
    return gates.get(world) or Gates(world, DEFAULT_ONE_SHOT_MAX_BYTES, DEFAULT_FUSED_MAX_BYTES)


# (path, op, dtype, format, m, n, k) -> the lookup's answer for the file version in ``_files``.
_memo: dict[tuple, GemmConfig | None] = {}


def _distance(e: Entry, m: int, n: int, k: int | None) -> float:
    d = abs(math.log2(e.m / m)) + abs(math.log2(e.n / max(n, 1)))
    return d if k is None else d + abs(math.log2(e.k / max(k, 1)))


class Query(NamedTuple):
    """What :func:`lookup` looks for: ``op``'s ``m x n x k`` GEMM of an x of ``dtype`` in operand format ``fmt``
    (:meth:`kernels.format.OperandFormat.encode`); ``k`` None leaves it out of the distance."""

    op: str
    dtype: torch.dtype
    m: int
    n: int
    k: int | None = None
    fmt: str = "plain"


def nearest(entries: list[Entry], query: Query) -> Entry | None:
    """The entry :func:`lookup` picks among ``entries`` (see the module docstring), or None."""
    op, m = query.op, query.m
    fam = family(m)
    best, best_d = None, math.inf
    for e in entries:
        if e.op != op or e.dtype != dtype_name(query.dtype) or e.format != query.fmt or family(e.m) != fam:
            continue
        if op in TILE_CORE_OPS and e.config.variant != "plain":
            continue
        d = _distance(e, max(m, 1), query.n, query.k)
        if d < best_d:
            best, best_d = e, d
    return best


def lookup(query: Query, device: torch.device) -> GemmConfig | None:
    """The tuned config of ``query`` on ``device``, or None (use the defaults).

    ``query.k`` is ignored for the fused ops (see the module docstring).
    """
    if query.op not in OPS:
        raise ValueError(f"op: {query.op!r} is not one of {OPS}")
    path = _path(_env_dir(), device.type, device.index)
    if path is None:
        return None
    entries = load(path)
    if not entries:
        return None
    if query.op in FUSED_OPS:
        query = query._replace(k=None)
    key = (path, query)
    if key not in _memo:
        e = nearest(entries, query)
        _memo[key] = None if e is None else e.config
    return _memo[key]


def write(path: Path, entries: list[Entry], meta: dict, gates: list[Gates] | None = None) -> None:
    """Write a tuned file (``meta``'s keys first, then the entries and the gates), creating its directory;
    ``gates`` None keeps the file's own (a GEMM re-tune must not drop the measured size switch)."""
    import yaml

    if gates is None:
        gates = sorted(_load(str(path))[1].values(), key=lambda g: g.world) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(version=FILE_VERSION, **meta, entries=[e.to_dict() for e in entries])
    if gates:
        doc["all_reduce_gates"] = [
            dict(world=g.world, one_shot_max_bytes=g.one_shot_max_bytes, fused_max_bytes=g.fused_max_bytes)
            for g in gates
        ]
    tmp = path.with_suffix(".yaml.tmp")
    with open(tmp, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False, default_flow_style=None, width=120)
    os.replace(tmp, path)


def write_gates(path: Path, gates: list[Gates], meta: dict) -> None:
    """Put ``gates`` into the tuned file at ``path`` (replacing those of the same world sizes), keeping its
    entries, its other gates and its header keys (``meta`` adds to or replaces them)."""
    import yaml

    doc: dict = {}
    if path.exists():
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    kept = _parse_gates(doc, str(path)) if doc else {}
    kept.update({g.world: g for g in gates})
    entries = parse(doc, str(path)) if doc else []
    old_meta = {k: v for k, v in doc.items() if k not in ("version", "entries", "all_reduce_gates")}
    write(path, entries, {**old_meta, **meta}, sorted(kept.values(), key=lambda g: g.world))
