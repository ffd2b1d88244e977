"""Rank agreement: the ranks of a group must call an op with matching descriptors.

A descriptor is a fixed-length tuple of ints describing one call as a rank sees it (op, shapes,
dtype, bias, flags, backend request, split count, quantization layout, the fused reducing ops' GEMM
tile), so every rank can
publish it in one small fixed-size message whatever its shapes are, and ranks that disagree can
be told apart before any collective sized from those shapes is entered (mismatched sizes abort
gloo and hang or corrupt NCCL).

Not every field must be equal: column-parallel weights may be sharded unevenly along n, so
``all_gather_matmul`` ranks may differ in n; row-parallel weights may be sharded unevenly along
k (even to an empty shard), so the reducing ops' ranks may differ in k. Those differences are
valid calls and are never reported.

Exchanged by :mod:`kernels.callcheck` before any backend communicates (on every backend, when a
call is checked) and, with the same descriptor and message, by the fused path, which carries the
descriptor in its own signals at every call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import CocConfig

DESCRIPTOR_VERSION = 3
OPS = (
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "quantized_matmul_all_reduce",
    "all_gather_scaled_matmul",
    "scaled_matmul_reduce_scatter",
    "scaled_matmul_all_reduce",
    "quantized_all_gather_matmul",
    "quantized_matmul_reduce_scatter",
    "all_reduce_rmsnorm",
    "all_gather_grouped_matmul",
    "grouped_matmul_reduce_scatter",
    "moe_dispatch",
    "moe_combine",
)
# all_reduce_rmsnorm's algorithms, its "comm_dim" word (it communicates along no dim).
NORM_ALGORITHMS = ("auto", "one_shot", "two_shot", "unfused")
# The GEMM + all-reduce ops' epilogue after the reduction (kernels.call.OpCall.epilogue), their "comm_dim"
# word: none (-1), residual + RMSNorm, and that with the normalized output quantized to FP8.
EPILOGUES = ("rmsnorm", "rmsnorm:tensor", "rmsnorm:row", "rmsnorm:block")
_ALL_REDUCING = ("matmul_all_reduce", "scaled_matmul_all_reduce", "quantized_matmul_all_reduce")
FIELDS = (
    "version",
    "op",
    "m",
    "k",
    "n",
    "dtype",
    "bias",
    "return_gathered",
    "deterministic",
    "backend",
    "parallel_num",
    "quant_mode",
    "group_size",
    # gather_dim of all_gather_matmul / scatter_dim of matmul_reduce_scatter (normalized to >= 0).
    "comm_dim",
    # FP8 ops: the weight's and the output's dtype in one word (the check kernel takes
    # kernels.fused.signals.DESC_WORDS words; the x payload's dtype is "dtype", the scaling mode
    # "quant_mode").
    "fp8_dtypes",
    # Fused reducing ops: the GEMM tile (block_m, block_n) in one word. Its tile counts are the
    # signal targets, and the tuned file a rank reads may differ from a peer's (another
    # COC_TUNED_DIR, a file rewritten between the ranks' reads): a difference must be named, not
    # counted wrong. Not applicable elsewhere (the all-gather's tiles are each rank's own).
    "tiles",
    # all_gather_matmul / matmul_reduce_scatter: the product of x's dims before gather_dim /
    # scatter_dim, the row blocks gathered or scattered on their own (with m and comm_dim it fixes
    # where every row goes; x [2, 4, k] and [4, 2, k] with dim 1 flatten to the same m).
    "outer",
)
DESCRIPTOR_LEN = len(FIELDS)
_M, _K, _N = FIELDS.index("m"), FIELDS.index("k"), FIELDS.index("n")
_BACKEND, _PARALLEL_NUM = FIELDS.index("backend"), FIELDS.index("parallel_num")

_BACKENDS = (None, "sequential", "chunked", "fused")
_QUANT_MODES = (None, "per_tensor", "per_channel", "per_group", "tensor", "row", "block")
# Every dtype torch defines, in a fixed order: identical on ranks running the same torch build.
_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
_NOT_APPLICABLE = -1
_AUTO = -1
# One word for (block_m, block_n): block_m * _TILE_CODE + block_n (tile sides are below it).
_TILE_CODE = 1 << 16

_COMMON = ("version", "op", "dtype", "bias", "backend", "parallel_num")
_REDUCING = _COMMON + ("m", "n", "deterministic", "tiles")
_MUST_AGREE = {
    "all_gather_matmul": _COMMON + ("m", "k", "return_gathered", "comm_dim", "outer"),
    "matmul_reduce_scatter": _REDUCING + ("comm_dim", "outer"),
    "matmul_all_reduce": _REDUCING + ("comm_dim",),
    "quantized_matmul_all_reduce": _REDUCING + ("quant_mode", "group_size", "comm_dim"),
    "all_gather_scaled_matmul": _COMMON
    + ("m", "k", "return_gathered", "comm_dim", "outer", "quant_mode", "fp8_dtypes"),
    "scaled_matmul_reduce_scatter": _REDUCING + ("comm_dim", "outer", "quant_mode", "fp8_dtypes"),
    "scaled_matmul_all_reduce": _REDUCING + ("quant_mode", "fp8_dtypes", "comm_dim"),
    "quantized_all_gather_matmul": _COMMON
    + ("m", "k", "return_gathered", "comm_dim", "outer", "quant_mode", "group_size"),
    "quantized_matmul_reduce_scatter": _REDUCING + ("comm_dim", "outer", "quant_mode", "group_size"),
    "all_reduce_rmsnorm": _REDUCING + ("comm_dim", "quant_mode"),
    # The MoE ops: "group_size" holds the expert count E and "comm_dim" the top-k (_MOE_NAMES). The gather's
    # n_local and the reducing op's n_local (its k) may differ between ranks, as for the dense ops. Their FP8
    # format: the scaling mode and the weight / output dtypes (plain: not applicable on every rank).
    "all_gather_grouped_matmul": _COMMON + ("m", "k", "group_size", "comm_dim", "quant_mode", "fp8_dtypes"),
    "grouped_matmul_reduce_scatter": _COMMON
    + ("m", "n", "deterministic", "group_size", "comm_dim", "quant_mode", "fp8_dtypes"),
}
_MOE_NAMES = {"group_size": "num_experts", "comm_dim": "topk", "n": "k_out"}
# The expert-parallel ops (kernels.ops.moe_ep): m is the rank's own token count (it may differ between ranks), k
# the row width (dispatch: x's k, combine: y's n), "n" the bounded mode's max_tokens (0: exact mode), "quant_mode"
# an FP8 dispatch's scale layout (row / block; dtype is the payload's).
_MUST_AGREE["moe_dispatch"] = _COMMON + ("k", "n", "group_size", "comm_dim", "quant_mode")
_MUST_AGREE["moe_combine"] = _COMMON + ("k", "n", "deterministic", "group_size", "comm_dim")
_EP_WORDS = {"group_size": "num_experts", "comm_dim": "topk", "n": "max_tokens (0: exact mode)", "m": "m_local"}
_EP_NAMES = {
    "moe_dispatch": {**_EP_WORDS, "dtype": "x.dtype", "quant_mode": "x_scale layout"},
    "moe_combine": {**_EP_WORDS, "k": "n (y.shape[1])"},
}
_GATHERING = ("all_gather_matmul", "all_gather_scaled_matmul", "quantized_all_gather_matmul")

Descriptor = tuple[int, ...]


def describe_call(
    op: str,
    m: int,
    k: int,
    n: int,
    dtype: torch.dtype,
    *,
    bias: bool,
    flag: bool,
    backend: str | None = None,
    parallel_num: int | str | None = None,
    quant_mode: str | None = None,
    group_size: int = 0,
    comm_dim: int = 0,
    weight_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    tiles: tuple[int, int] | None = None,
    outer: int | None = None,
    epilogue: str = "",
) -> Descriptor:
    """The descriptor of one call: ``DESCRIPTOR_LEN`` ints in the order of :data:`FIELDS`.

    ``m`` is the row count the op sees (``m_local`` for ``all_gather_matmul``); ``flag`` is
    ``return_gathered`` for ``all_gather_matmul`` and ``deterministic`` otherwise; ``backend``
    and ``parallel_num`` are what the call asks for before resolution (None: no request,
    ``"auto"``: tuned); ``group_size`` is the per_group quantization group (0 otherwise);
    ``comm_dim`` is the normalized ``gather_dim`` / ``scatter_dim`` (ignored by the other ops);
    ``weight_dtype`` / ``out_dtype``: the FP8 ops' weight payload and output dtypes (``dtype`` is x's);
    ``tiles``: ``(block_m, block_n)`` of a fused reducing op's GEMM (None: not applicable);
    ``outer``: the product of x's dims before ``comm_dim`` (None: not known, as for the 2-D rows a
    compiled graph's pass decides on; every rank of one call site knows it alike or not at all);
    ``epilogue``: the all-reduce ops' (:data:`EPILOGUES`, ``""`` none), carried in the ``comm_dim`` word.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is not accepted; use one of {OPS}")
    m, k, n, outer = _known(m), _known(k), _known(n), None if outer is None else _known(outer)
    gathers = op in _GATHERING
    has_dim = op in _GATHERING + (
        "matmul_reduce_scatter",
        "scaled_matmul_reduce_scatter",
        "quantized_matmul_reduce_scatter",
        "all_reduce_rmsnorm",
        "all_gather_grouped_matmul",
        "grouped_matmul_reduce_scatter",
        "moe_dispatch",
        "moe_combine",
    )
    if parallel_num == "auto":
        num = _AUTO
    elif parallel_num is None:
        num = 0
    else:
        num = int(parallel_num)
    fp8_dtypes = _NOT_APPLICABLE
    if weight_dtype is not None:
        fp8_dtypes = _DTYPES.index(weight_dtype) * len(_DTYPES) + _DTYPES.index(out_dtype)
    return (
        DESCRIPTOR_VERSION,
        OPS.index(op),
        int(m),
        int(k),
        int(n),
        _DTYPES.index(dtype),
        int(bool(bias)),
        int(flag) if gathers else _NOT_APPLICABLE,
        _NOT_APPLICABLE if gathers else int(flag),
        _BACKENDS.index(backend),
        num,
        _QUANT_MODES.index(quant_mode),
        int(group_size),
        int(comm_dim) if has_dim else _epilogue_word(op, epilogue),
        fp8_dtypes,
        _NOT_APPLICABLE if tiles is None else tiles[0] * _TILE_CODE + tiles[1],
        int(outer) if has_dim and outer is not None else _NOT_APPLICABLE,
    )


def _epilogue_word(op: str, epilogue: str) -> int:
    if not epilogue:
        return _NOT_APPLICABLE
    if op not in _ALL_REDUCING or epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r} is not one of {EPILOGUES} of the all-reduce ops (op {op!r})")
    return EPILOGUES.index(epilogue)


def _known(size: object) -> int:
    """A size as a descriptor word: ``-1`` for a dim ``torch.compile`` keeps dynamic (reading it as an
    int would specialize the graph to this size)."""
    return size if isinstance(size, int) else _NOT_APPLICABLE


def resolve_request(descriptor: Descriptor, config: CocConfig) -> Descriptor:
    """``descriptor`` (made with the call's own ``backend`` / ``parallel_num`` arguments) with the backend
    and split count the call requests once the environment is read: the argument, else the environment.
    Ranks compare the request, not its outcome: resolving may tune (``COC_PARALLEL_NUM=auto``), which
    runs collectives sized from the shapes."""
    out = list(descriptor)
    backend = _BACKENDS[out[_BACKEND]]
    if backend is None and config.use_fused:
        backend = "fused"
    out[_BACKEND] = _BACKENDS.index(backend)
    if backend == "sequential":
        out[_PARALLEL_NUM] = 1  # a sequential request ignores every split count
    elif out[_PARALLEL_NUM] == 0:
        num = config.parallel_num_for(out[_M], out[_K], out[_N])
        out[_PARALLEL_NUM] = _AUTO if num == "auto" else int(num)
    return tuple(out)


def signature(descriptor: Descriptor) -> Descriptor:
    """The descriptor with only the fields its op needs equal on every rank (the others -1): what makes a
    call new. A field that may differ between ranks (the reducing ops' k, the all-gather's n) must not,
    or one rank's resharded weight would make its call new while its peers repeat theirs."""
    op = descriptor[1]
    needed = _MUST_AGREE[OPS[op]] if 0 <= op < len(OPS) else _COMMON
    return tuple(v if name in needed else _NOT_APPLICABLE for name, v in zip(FIELDS, descriptor, strict=True))


def requests_fused(descriptor: Descriptor) -> bool:
    """Whether the call asks for the fused backend (after :func:`resolve_request`)."""
    return _BACKENDS[descriptor[_BACKEND]] == "fused"


def _shown(name: str, code: int) -> str:
    """A descriptor field as the user wrote it (dtype names, flags as bools, ``auto``)."""
    lookup: dict[str, Sequence[object]] = {
        "op": OPS,
        "dtype": _DTYPES,
        "backend": _BACKENDS,
        "quant_mode": _QUANT_MODES,
    }
    if name in lookup:
        table = lookup[name]
        return str(table[code]) if 0 <= code < len(table) else f"<unknown code {code}>"
    if name in ("bias", "return_gathered", "deterministic"):
        return "n/a" if code == _NOT_APPLICABLE else str(bool(code))
    if name in ("outer", "m", "k", "n"):
        return ("n/a" if name == "outer" else "dynamic") if code == _NOT_APPLICABLE else str(code)
    if name == "parallel_num":
        return {_AUTO: "auto", 0: "None"}.get(code, str(code))
    if name == "fp8_dtypes":
        if code == _NOT_APPLICABLE:
            return "n/a"
        return "/".join(_shown("dtype", c) for c in divmod(code, len(_DTYPES)))
    if name == "tiles":
        return "n/a" if code == _NOT_APPLICABLE else "x".join(str(side) for side in divmod(code, _TILE_CODE))
    return str(code)


_SCALED = ("all_gather_scaled_matmul", "scaled_matmul_reduce_scatter", "scaled_matmul_all_reduce")


def _field_name(name: str, op_code: int) -> str:
    """A descriptor field under the name the caller of ``op`` knows it by."""
    op = OPS[op_code] if 0 <= op_code < len(OPS) else None
    if name in _EP_NAMES.get(op, {}):  # type: ignore[arg-type]
        return _EP_NAMES[op][name]  # type: ignore[index]
    if op in ("all_gather_grouped_matmul", "grouped_matmul_reduce_scatter") and name in _MOE_NAMES:
        return _MOE_NAMES[name]
    if op in ("all_gather_grouped_matmul", "grouped_matmul_reduce_scatter") and name == "quant_mode":
        return "scaling mode (from the scale shapes)"
    if op == "all_gather_grouped_matmul" and name == "m":
        return "m_local"
    # all_gather_matmul's m is the local row count (the gathered one is W times larger).
    if name == "m" and op in _GATHERING:
        return "m_local"
    if name == "comm_dim":
        if op == "all_reduce_rmsnorm":
            return "algorithm"
        if op in _ALL_REDUCING:
            return "epilogue"
        return "gather_dim" if op in _GATHERING else "scatter_dim"
    if name == "outer":
        return "prod(x.shape[:gather_dim])" if op in _GATHERING else "prod(x.shape[:scatter_dim])"
    if op in _SCALED and name in ("dtype", "quant_mode"):
        # The FP8 ops' mode is what the scale shapes say; their x is the FP8 payload.
        return "x.dtype" if name == "dtype" else "scaling mode (from the scale shapes)"
    return name


def _differences(name: str, op_code: int, a: int, b: int) -> list[tuple[str, str, str]]:
    """``(field as the caller names it, value a, value b)`` for each part of field ``name`` that differs."""
    op = OPS[op_code] if 0 <= op_code < len(OPS) else None
    if name == "comm_dim" and op in ("all_reduce_rmsnorm",) + _ALL_REDUCING:
        names = NORM_ALGORITHMS if op == "all_reduce_rmsnorm" else EPILOGUES
        shown = ["none" if v == _NOT_APPLICABLE else names[v] if 0 <= v < len(names) else str(v) for v in (a, b)]
        return [(_field_name(name, op_code), *shown)]
    if name != "fp8_dtypes" or _NOT_APPLICABLE in (a, b):
        return [(_field_name(name, op_code), _shown(name, a), _shown(name, b))]
    pairs = zip(("weight.dtype", "out_dtype"), divmod(a, len(_DTYPES)), divmod(b, len(_DTYPES)), strict=True)
    return [(field, _shown("dtype", x), _shown("dtype", y)) for field, x, y in pairs if x != y]


def format_mismatch(
    op: str, rank_a: int | str, desc_a: Sequence[int], rank_b: int | str, desc_b: Sequence[int]
) -> str | None:
    """The error message for two ranks' descriptors, or None when they agree.

    Only the fields the op needs equal are compared (see the module docstring); when the ops
    themselves differ, the fields both ops need equal are. Ranks are named as given (an int or a
    label such as ``"1 (global 3)"``).
    """
    if len(desc_a) != DESCRIPTOR_LEN or len(desc_b) != DESCRIPTOR_LEN or desc_a[0] != desc_b[0]:
        return (
            f"{op}: ranks disagree: rank {rank_a} and rank {rank_b} sent call descriptors of "
            f"different versions ({list(desc_a)} vs {list(desc_b)}); run the same build on every rank"
        )
    needed = set(FIELDS)
    for code in (desc_a[1], desc_b[1]):
        needed &= set(_MUST_AGREE[OPS[code]] if 0 <= code < len(OPS) else _COMMON)
    parts = [
        f"rank {rank_a} has {field}={a}, rank {rank_b} has {field}={b}"
        for i, name in enumerate(FIELDS)
        if name in needed and desc_a[i] != desc_b[i]
        for field, a, b in _differences(name, desc_a[1], desc_a[i], desc_b[i])
    ]
    if not parts:
        return None
    hint = ""
    if "tiles" in needed and desc_a[FIELDS.index("tiles")] != desc_b[FIELDS.index("tiles")]:
        # Every other field agrees or is named too: the tiles come from the tuned file a rank read.
        hint = " (GEMM tiles block_m x block_n; give every rank the same tuned file: COC_TUNED_DIR, configs/tuned)"
    return f"{op}: ranks disagree: " + "; ".join(parts) + hint


def first_mismatch(op: str, table: Sequence[Sequence[int]], labels: Sequence[str] | None = None) -> str | None:
    """The message comparing group rank 0's descriptor with the first rank that disagrees, or None.

    Every rank that holds the same table gets the same message, so all of them raise alike.
    """
    labels = labels if labels is not None else [str(r) for r in range(len(table))]
    for r in range(1, len(table)):
        message = format_mismatch(op, labels[0], table[0], labels[r], table[r])
        if message is not None:
            return message
    return None
