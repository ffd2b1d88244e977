"""Shape suites (``configs/bench/*.yaml``) and the benchmark cases they expand to.

A suite names tensor-parallel linear layers by their GLOBAL dims (``k`` in, ``n`` out) and lists
token counts ``M`` (rows across the TP group), world sizes, dtypes and operand formats (``format:``,
default ``plain``). Each (layer, op, M, W, dtype, format) becomes one :class:`Case` whose per-rank
shapes follow the op's contract (docs/api.md section 1):

* ``all_gather_matmul`` (column parallel, sequence parallel): x ``[M / W, k]``, weight ``[n / W, k]``;
  the local GEMM is ``[M, k] x [k, n / W]`` and the collective gathers ``M x k`` elements.
* ``matmul_reduce_scatter`` / ``matmul_all_reduce`` / ``quantized_matmul_all_reduce`` (row
  parallel): x ``[M, k / W]``, weight ``[n, k / W]``; the local GEMM is ``[M, k / W] x [k / W, n]`` and
  the collective reduces ``M x n`` elements.

An op names a communication pattern; the format picks which public function of that pattern runs
(docs/api.md section 1, "Operand formats"): ``plain`` (``all_gather_matmul`` ...), ``fp8:<mode>``
(``all_gather_scaled_matmul`` ...; ``dtype`` is then the output dtype) or ``int8:<mode>``
(``quantized_all_gather_matmul`` ...; ``dtype`` is x's). The op name ``quantized_matmul_all_reduce``
(``qar``) of older suites stays accepted: it is ``matmul_all_reduce`` in ``int8:per_channel``,
whatever the suite's formats.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import yaml

from kernels.paths import config_path

# The folder above the bench package (bench/harness/suites.py): the checkout, or site-packages of a wheel.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITE_DIR = str(config_path("bench"))

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "quantized_matmul_all_reduce")
OP_ALIASES = {
    "ag": "all_gather_matmul",
    "rs": "matmul_reduce_scatter",
    "ar": "matmul_all_reduce",
    "qar": "quantized_matmul_all_reduce",
}
OP_SHORT = {v: k for k, v in OP_ALIASES.items()}
# Which collective the op's sequential reference runs after (or before) its GEMM.
OP_COLLECTIVE = {
    "all_gather_matmul": "all_gather",
    "matmul_reduce_scatter": "reduce_scatter",
    "matmul_all_reduce": "all_reduce",
    "quantized_matmul_all_reduce": "all_reduce",
}
# Operand formats (bench.dense.formats): plain, fp8:<mode>, int8:<mode>[:<group size>].
FP8_MODES = ("tensor", "row", "block")
INT8_MODES = ("per_tensor", "per_channel", "per_group")
DEFAULT_GROUP_SIZE = 128  # int8:per_group without a size
FORMATS = ("plain",) + tuple(f"fp8:{m}" for m in FP8_MODES) + tuple(f"int8:{m}" for m in INT8_MODES)
# The fixed-format op name older suites use, and the (op, format) it stands for.
QUANTIZED_OPS = {"quantized_matmul_all_reduce": ("matmul_all_reduce", "int8:per_channel")}
DTYPES = ("fp32", "fp16", "bf16")
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
BACKENDS = ("sequential", "chunked1", "chunked2", "chunked4", "chunked8", "fused")
DEFAULT_BACKENDS = ("sequential", "chunked2", "chunked4", "chunked8", "fused")

_SUITE_KEYS = {
    "name",
    "description",
    "tokens",
    "world_sizes",
    "dtypes",
    "format",
    "backends",
    "warmup",
    "repeats",
    "layers",
}
_LAYER_KEYS = {"name", "op", "k", "n"}


def parse_format(text: str) -> str:
    """A format as the suites and ``--operand-formats`` spell it -> its canonical name (``plain``,
    ``fp8:block``, ``int8:per_channel``, ``int8:per_group:128``); ValueError naming what is accepted."""
    parts = str(text).strip().split(":")
    kind, mode, rest = parts[0], parts[1] if len(parts) > 1 else None, parts[2:]
    if kind == "plain" and mode is None:
        return "plain"
    if kind == "fp8" and mode in FP8_MODES and not rest:
        return f"fp8:{mode}"
    if kind == "int8" and mode in INT8_MODES and not rest:
        return f"int8:per_group:{DEFAULT_GROUP_SIZE}" if mode == "per_group" else f"int8:{mode}"
    if kind == "int8" and mode == "per_group" and len(rest) == 1 and rest[0].isdigit() and int(rest[0]) > 0:
        return f"int8:per_group:{int(rest[0])}"
    raise ValueError(
        f"unknown format {text!r}; accepted: {', '.join(FORMATS)} (int8:per_group:<group size>, "
        f"default {DEFAULT_GROUP_SIZE})"
    )


@dataclass(frozen=True)
class Case:
    """One op at one global shape, world size, dtype and operand format; timed for every selected backend."""

    suite: str
    layer: str
    op: str  # the pattern's plain op name (OPS); the format picks the public function
    tokens: int  # M: rows across the TP group
    k: int  # global in-features
    n: int  # global out-features
    world: int
    dtype: str  # plain: x's dtype; fp8: the output's; int8: x's
    fmt: str = "plain"  # canonical format name (parse_format)

    @property
    def kind(self) -> str:
        """``plain``, ``fp8`` or ``int8``."""
        return self.fmt.split(":")[0]

    @property
    def mode(self) -> str | None:
        """The FP8 scaling mode or the int8 scale layout (None for plain)."""
        parts = self.fmt.split(":")
        return parts[1] if len(parts) > 1 else None

    @property
    def group_size(self) -> int | None:
        """int8 per_group columns per scale, else None."""
        parts = self.fmt.split(":")
        return int(parts[2]) if len(parts) > 2 else None

    @property
    def row_parallel(self) -> bool:
        return self.op != "all_gather_matmul"

    @property
    def x_shape(self) -> tuple[int, int]:
        if self.row_parallel:
            return (self.tokens, self.k // self.world)
        return (self.tokens // self.world, self.k)

    @property
    def w_shape(self) -> tuple[int, int]:
        if self.row_parallel:
            return (self.n, self.k // self.world)
        return (self.n // self.world, self.k)

    @property
    def gemm_shape(self) -> tuple[int, int, int]:
        """(m, k, n) of the GEMM one rank runs."""
        if self.row_parallel:
            return (self.tokens, self.k // self.world, self.n)
        return (self.tokens, self.k, self.n // self.world)

    @property
    def collective(self) -> str:
        return OP_COLLECTIVE[self.op]

    @property
    def comm_elems(self) -> int:
        """Elements of the collective's full tensor (gathered output, or tensor reduced)."""
        if self.row_parallel:
            return self.tokens * self.n
        return self.tokens * self.k

    @property
    def flops(self) -> int:
        m, k, n = self.gemm_shape
        return 2 * m * k * n

    @property
    def label(self) -> str:
        fmt = "" if self.fmt == "plain" else f" {self.fmt}"
        return f"{self.suite}/{self.layer}/{OP_SHORT[self.op]} M={self.tokens} W={self.world} {self.dtype}{fmt}"

    def invalid_reason(self) -> str | None:
        """Why this case cannot run (shapes not divisible by W), or None."""
        w = self.world
        if self.tokens % w:
            return f"M={self.tokens} is not divisible by W={w}"
        if self.row_parallel and self.k % w:
            return f"k={self.k} is not divisible by W={w}"
        if not self.row_parallel and self.n % w:
            return f"n={self.n} is not divisible by W={w}"
        return None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["format"] = d.pop("fmt")
        d.update(
            x_shape=list(self.x_shape),
            w_shape=list(self.w_shape),
            gemm_shape=list(self.gemm_shape),
            collective=self.collective,
        )
        return d


@dataclass
class Suite:
    name: str
    description: str
    tokens: list[int]
    world_sizes: list[int]
    dtypes: list[str]
    layers: list[dict[str, Any]]
    formats: list[str] = field(default_factory=lambda: ["plain"])
    backends: list[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))
    warmup: int | None = None
    repeats: int | None = None
    path: str = ""

    def cases(
        self,
        *,
        ops: list[str] | None = None,
        tokens: list[int] | None = None,
        world_sizes: list[int] | None = None,
        dtypes: list[str] | None = None,
        formats: list[str] | None = None,
    ) -> list[Case]:
        """Every (world, dtype, format, M, layer, op) of the suite, or of the axes given instead; ``ops``
        filters by the names the layers list (``quantized_matmul_all_reduce`` selects its int8 cases)."""
        out: list[Case] = []
        for world in world_sizes or self.world_sizes:
            for dtype in dtypes or self.dtypes:
                for fmt in formats or self.formats:
                    for m in tokens or self.tokens:
                        for layer in self.layers:
                            for op in layer["op"]:
                                if ops is not None and op not in ops:
                                    continue
                                pattern, case_fmt = QUANTIZED_OPS.get(op, (op, fmt))
                                case = Case(self.name, layer["name"], pattern, m, layer["k"], layer["n"], world, dtype)
                                case = replace(case, fmt=case_fmt)
                                if case not in out:  # a fixed-format op runs once, not once per format
                                    out.append(case)
        return out


def list_suites() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(SUITE_DIR) if f.endswith(".yaml"))


def _positive_ints(value: Any, key: str, where: str) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(f"{where}: {key} must be a positive integer or a non-empty list of them, got {value!r}")
    return list(value)


def parse_op(name: str) -> str:
    op = OP_ALIASES.get(name, name)
    if op not in OPS:
        raise ValueError(f"unknown op {name!r}; accepted: {', '.join(OPS)} or {', '.join(OP_ALIASES)}")
    return op


def parse_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; accepted: {', '.join(BACKENDS)}")
    return name


def backend_args(name: str) -> tuple[str, int | None]:
    """Bench backend label -> (ops' ``backend=``, ``parallel_num=``)."""
    if name.startswith("chunked"):
        return "chunked", int(name[len("chunked") :])
    return name, None


def load_suite(name_or_path: str) -> Suite:
    """Load ``configs/bench/<name>.yaml`` or a YAML file path; validates every key."""
    path = _suite_path(name_or_path)
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    where = os.path.relpath(path, REPO_ROOT) if path.startswith(REPO_ROOT) else path
    _check_suite_keys(raw, where)
    dtypes = raw["dtypes"] if isinstance(raw["dtypes"], list) else [raw["dtypes"]]
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"{where}: dtype {d!r} not in {DTYPES}")
    backends = [parse_backend(b) for b in raw.get("backends", DEFAULT_BACKENDS)]
    formats = _suite_formats(raw, where)
    layers = _suite_layers(raw, where)
    for key in ("warmup", "repeats"):
        if key in raw and not (isinstance(raw[key], int) and raw[key] >= (0 if key == "warmup" else 1)):
            raise ValueError(f"{where}: {key} must be an integer (>= 1 for repeats), got {raw[key]!r}")
    return Suite(
        name=str(raw["name"]),
        description=str(raw.get("description", "")),
        tokens=_positive_ints(raw["tokens"], "tokens", where),
        world_sizes=_positive_ints(raw["world_sizes"], "world_sizes", where),
        dtypes=list(dtypes),
        layers=layers,
        formats=formats,
        backends=backends,
        warmup=raw.get("warmup"),
        repeats=raw.get("repeats"),
        path=path,
    )


def _suite_path(name_or_path: str) -> str:
    """A suite is named by a file path, or by its name under ``configs/bench/`` when no such file exists."""
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(SUITE_DIR, f"{name_or_path}.yaml")
    if not os.path.exists(path):
        raise ValueError(
            f"suite {name_or_path!r} not found; known suites: {', '.join(list_suites())} "
            f"(or give a path to a YAML file)"
        )
    return path


def _check_suite_keys(raw: object, where: str) -> None:
    """The suite file is a mapping with every required key and no unknown one (a typo would be ignored)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a suite must be a mapping, got {type(raw).__name__}")
    unknown = set(raw) - _SUITE_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; accepted: {sorted(_SUITE_KEYS)}")
    for key in ("name", "tokens", "world_sizes", "dtypes", "layers"):
        if key not in raw:
            raise ValueError(f"{where}: missing key {key!r}")


def _suite_formats(raw: dict, where: str) -> list[str]:
    """The suite's ``format``: one format or a non-empty list of them (default plain), parsed."""
    raw_formats = raw.get("format", ["plain"])
    if not isinstance(raw_formats, list):
        raw_formats = [raw_formats]
    if not raw_formats:
        raise ValueError(f"{where}: format must be a format or a non-empty list of them")
    try:
        return [parse_format(f) for f in raw_formats]
    except ValueError as e:
        raise ValueError(f"{where}: format: {e}") from e


def _suite_layers(raw: dict, where: str) -> list[dict[str, Any]]:
    """The suite's ``layers``, each ``{name, op, k, n}`` with its ops parsed and one k and one n."""
    layers = []
    if not isinstance(raw["layers"], list) or not raw["layers"]:
        raise ValueError(f"{where}: layers must be a non-empty list")
    for i, layer in enumerate(raw["layers"]):
        if not isinstance(layer, dict) or set(layer) != _LAYER_KEYS:
            raise ValueError(f"{where}: layers[{i}] must have exactly the keys {sorted(_LAYER_KEYS)}, got {layer!r}")
        ops = layer["op"] if isinstance(layer["op"], list) else [layer["op"]]
        k = _positive_ints(layer["k"], "k", f"{where} layers[{i}]")
        n = _positive_ints(layer["n"], "n", f"{where} layers[{i}]")
        if len(k) != 1 or len(n) != 1:
            raise ValueError(f"{where}: layers[{i}] k and n must be single integers")
        layers.append({"name": str(layer["name"]), "op": [parse_op(o) for o in ops], "k": k[0], "n": n[0]})
    return layers
