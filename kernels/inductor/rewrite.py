"""The compiled route: an Inductor post-grad pass that rewrites the functional-collective patterns of a
tensor-parallel graph into ``torch.ops.coc`` calls (docs/inductor.md).

A model parallelized with torch's plain ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel`` and compiled with ``torch.compile`` reaches Inductor as aten graphs (one for the
forward, one for the backward) in which DTensor's redistributions are ``_c10d_functional``
collectives followed by ``wait_tensor``. The pass rewrites, in both graphs::

    all-gather -> wait [-> split / cat for a gather on dim d > 0] [-> reshape] -> mm / addmm (one or more)
        => coc.all_gather_matmul (_gathered when the gathered input is used elsewhere, _multi for several mms)
    mm / addmm [-> reshape] [-> split / cat for a scatter on dim d > 0] -> reduce-scatter(sum) -> wait
        => coc.matmul_reduce_scatter
    mm / addmm [-> reshape] -> all-reduce(sum) -> wait
        => coc.matmul_all_reduce
    (mm + mm + ... of the same rows [each -> reshape]) in place of the mm of the two above
        => the same op on cat(x_i, dim=1) @ cat(b_i, dim=0), one matmul

``mm(a, b)`` is ``a @ b``: the coc weight ``[n, k]`` is ``b``'s transpose (the ``permute`` a linear's
weight went through, or a new one). A bias joins the op where it means the same thing: the bias of an
``addmm`` after a gather; the ``b / W`` that DTensor's Replicate -> Partial turns a row-parallel bias
into, folded back to ``b`` after the reduction; a ``+ b`` right after the reduction.

The same patterns with ``aten._scaled_mm`` (FP8 payloads, tensorwise or rowwise fp32 scales) in place of
the mm become the same operators with an FP8 ``OpCall`` (docs/inductor.md, "FP8 matmuls"); an mm whose weight
is an int8 weight dequantized in the graph becomes them with the int8 format (docs/inductor.md, "int8 weights").

An all-reduce (sum) whose result is added to a residual and RMS-normalized becomes ``coc.all_reduce_rmsnorm``, or
with a matmul before it the GEMM epilogue ``coc.matmul_all_reduce_rmsnorm`` (:mod:`kernels.inductor.norm`).

The patterns are found by :mod:`kernels.inductor.patterns` (FP8: :mod:`kernels.inductor.scaled`, int8 weights:
:mod:`kernels.inductor.int8`); this
module rewrites them, records what it did and switches the pass on and off.

Everything else is left as it was, with the reason logged (logger ``kernels.inductor_pass``, INFO)
and kept in :func:`report`: a collective whose group cannot be resolved or whose size disagrees with
the group, a reduction other than sum, symbolic shapes, mixed dtypes or devices, an intermediate used
outside the pattern, a weight that depends on the gathered input, and a new op whose output shape or
dtype would differ from what it replaces. The backend and split count are decided while the pass
runs (``kernels.dispatch``, the ``COC_*`` environment) and are constants of the compiled graph, as
for an op traced by dynamo.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..format import PLAIN, OperandFormat, fp8
from ..ops import all_gather, all_reduce, reduce_scatter
from ..ops.gemm import PUBLIC_NAMES, GemmCall
from ..protocol import decide, requested
from . import int8 as inductor_int8
from . import norm as inductor_norm
from . import patterns as inductor_patterns
from . import scaled as inductor_scaled
from .int8 import Int8Matmul, int8_consumers, int8_reduced, op_operands
from .patterns import (
    Gather,
    LeftAlone,
    Matmul,
    Reduce,
    find_reduce,
    gather_consumers,
    meta_val,
    reduce_bias,
)
from .patterns import new_node as _call
from .scaled import (
    RowScale,
    ScaledMatmul,
    find_fp8_gather,
    is_fp8_gather,
    payload_gather_of_scales,
    quantized_after,
    scaled_gather_consumers,
    scaled_product,
)

log = logging.getLogger(__name__)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


@dataclass
class Record:
    """One collective the pass looked at: rewritten (``matched``) or left alone, and why."""

    graph: str  # "forward", "backward" or "inference"
    pattern: str  # the coc op it became or would have become, or the collective's name
    matched: bool
    detail: str


_RECORDS: list[Record] = []


def report() -> list[Record]:
    """What the pass did since the last :func:`clear_report`, in the order it looked."""
    return list(_RECORDS)


def clear_report() -> None:
    _RECORDS.clear()


# ---- rewriting -----------------------------------------------------------------------------------------------------


def _weight(graph: fx.Graph, b: fx.Node, new: list[fx.Node]) -> fx.Node:
    """The ``[n, k]`` weight whose transpose is ``b``: the node ``b`` transposed, or a new permute
    (appended to ``new``)."""
    if b.target is aten.permute.default and list(b.args[1]) in ([1, 0], [-1, -2], [-1, 0], [1, -2]):
        return b.args[0]
    if b.target is aten.t.default:
        return b.args[0]
    w = _call(graph, aten.permute.default, b, [1, 0])
    new.append(w)
    return w


_PATTERNS = {
    "all_gather_matmul": "all_gather",
    "matmul_reduce_scatter": "reduce_scatter",
    "matmul_all_reduce": "all_reduce",
}


_SPECS = {
    "all_gather_matmul": all_gather.SPEC,
    "matmul_reduce_scatter": reduce_scatter.SPEC,
    "matmul_all_reduce": all_reduce.SPEC,
}


def _decide(
    op: str,
    x2d: torch.Tensor,
    ws: list[torch.Tensor],
    g: Any,
    return_gathered: bool = False,
    *,
    fmt: OperandFormat = PLAIN,
    out_dtype: torch.dtype | None = None,
) -> GemmCall:
    """The call of the coc op replacing ``op``'s pattern, its backend and split count from the COC_*
    environment, as the eager op would choose.

    The ranks' calls are not compared here: a rank whose compiled graph comes from Inductor's cache runs no
    pass, so a collective here could wait forever. The compiled graph's operators admit every call when they
    run (:mod:`kernels.protocol.admission`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def stand_in(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty((), dtype=dtype or t.dtype, device=t.device).expand(shape)

    dim = g.dim if op != "matmul_all_reduce" else 0
    call = GemmCall(
        op=PUBLIC_NAMES[(_PATTERNS[op], fmt.kind)],
        pattern=_PATTERNS[op],
        fmt=fmt,
        out_dtype=out_dtype,
        return_gathered=return_gathered,
        comm_dim=dim,
        group_name=g.group_name,
        world=g.world,
    )
    with unset_fake_temporarily():
        x = stand_in(x2d, tuple(x2d.shape))
        w_dtype = torch.int8 if fmt.kind == "int8" else None  # the eager int8 op's weights
        weights = tuple(stand_in(w, (w.shape[1], w.shape[0]), w_dtype) for w in ws)
        shape = (x.shape[0], x.shape[1], sum(w.shape[0] for w in weights))
        out = out_dtype or x.dtype
        dtypes = (out, out if fmt.kind == "fp8" else weights[0].dtype)
        return decide(_SPECS[op], requested(call, shape), x.device, (shape, dtypes))


def _check_same(new: fx.Node, old: fx.Node) -> None:
    nv, ov = new.meta["val"], old.meta["val"]
    if tuple(nv.shape) != tuple(ov.shape) or nv.dtype != ov.dtype:
        raise LeftAlone(f"the coc op would give {tuple(nv.shape)} {nv.dtype} where the graph has {tuple(ov.shape)}")


def _erase(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase those of ``nodes`` that nothing uses any more (users first)."""
    left = [n for n in dict.fromkeys(reversed(nodes)) if not getattr(n, "_erased", False)]
    while True:
        dead = [n for n in left if not n.users]
        if not dead:
            return
        for node in dead:
            graph.erase_node(node)
        left = [n for n in left if n not in dead]


def _scalar(graph: fx.Graph, t: fx.Node, new: list[fx.Node]) -> fx.Node:
    """A one-value scale as the 0-dim tensor the coc ops take for a tensorwise scale."""
    if meta_val(t).dim() == 0:
        return t
    out = _call(graph, aten.reshape.default, t, [])
    new.append(out)
    return out


def _gather_scales(
    graph: fx.Graph, mms: list[ScaledMatmul], rows: RowScale | None, new: list[fx.Node]
) -> tuple[fx.Node, list[fx.Node]]:
    """``(x_scale, w_scales)`` of the FP8 all-gather op replacing ``mms``."""
    if rows is None:
        # The graph scales every gathered row by this rank's scale_a; the op scales each rank's rows by that
        # rank's x_scale. With x_scale 1 and scale_a folded into each weight's scale the op computes the
        # graph's product whether or not the ranks' scale_a agree (torch's float8 training makes them agree:
        # the scale comes from an all-reduced amax).
        one = _call(graph, aten.reshape.default, _call(graph, aten.ones_like.default, mms[0].scale_a), [])
        folded = [
            _call(graph, aten.mul.Tensor, _scalar(graph, mm.scale_a, new), _scalar(graph, mm.scale_b, new))
            for mm in mms
        ]
        new.extend([one.args[0], one, *folded])
        return one, folded
    shard = rows.gather.shard
    if rows.reciprocal:
        shard = _call(graph, aten.reciprocal.default, shard)
        new.append(shard)
    x_scale = _call(graph, aten.reshape.default, shard, [meta_val(shard).numel(), 1])
    w_scales = [_call(graph, aten.reshape.default, mm.scale_b, [mm.n, 1]) for mm in mms]
    new.extend([x_scale, *w_scales])
    return x_scale, w_scales


_GATHER_SCALES = {True: "scale_a folded into w_scale", False: "scale rows gathered with the payload"}


def _reduce_scales(graph: fx.Graph, mm: ScaledMatmul, new: list[fx.Node]) -> tuple[fx.Node, fx.Node]:
    """``(x_scale, w_scale)`` of the FP8 reducing op replacing ``mm``: each rank's own, as the graph has them."""
    if mm.mode == "tensor":
        return _scalar(graph, mm.scale_a, new), _scalar(graph, mm.scale_b, new)
    w_scale = _call(graph, aten.reshape.default, mm.scale_b, [mm.n, 1])
    new.append(w_scale)
    return mm.scale_a, w_scale


def _rewrite_gather(graph: fx.Graph, g: Gather, mms: list[Matmul], rows: RowScale | None = None, note: str = "") -> str:
    rv = meta_val(g.result)
    lead = tuple(rv.shape[:-1])
    m = math.prod(lead)
    reshapes = {mm.x2d for mm in mms if mm.x2d is not g.result}
    matched = {mm.node for mm in mms}
    need_gathered = any(u not in reshapes and u not in matched for u in g.result.users) or any(
        u not in matched for r in reshapes for u in r.users
    )
    first = min((u for u in g.result.users), key=lambda n: _order(graph)[n])
    new: list[fx.Node] = []
    with graph.inserting_before(first):
        biases = [mm.bias_in for mm in mms]
        xv = meta_val(g.shard)
        nones: list[Any] = [None] * len(mms)
        x_scale, w_scales, fmt, out_dtype = None, nones, PLAIN, None
        if isinstance(mms[0], Int8Matmul):
            ws, w_scales = map(list, zip(*(op_operands(graph, mm.weight, new) for mm in mms), strict=True))
            fmt = mms[0].weight.fmt
        else:
            ws = [_weight(graph, mm.b, new) for mm in mms]
        if isinstance(mms[0], ScaledMatmul):
            x_scale, w_scales = _gather_scales(graph, mms, rows, new)  # type: ignore[arg-type]
            fmt, out_dtype = fp8(mms[0].mode), mms[0].out_dtype
        call = _decide(
            "all_gather_matmul",
            xv.flatten(0, -2) if xv.dim() > 2 else xv,
            [meta_val(mm.b) for mm in mms],
            g,
            need_gathered,
            fmt=fmt,
            out_dtype=out_dtype,
        )
        backend, num = call.backend, call.parallel_num
        fused = _call(graph, all_gather.SPEC.operator, g.shard, x_scale, ws, w_scales, nones, biases, call.encode())
        new.append(fused)
        y_list = _call(graph, operator.getitem, fused, 0)
        new.append(y_list)
        ys = [_call(graph, operator.getitem, y_list, i) for i in range(len(mms))]
        gathered = _call(graph, operator.getitem, fused, 1) if need_gathered else None
        new.extend(ys + ([gathered] if gathered is not None else []))
        try:
            if gathered is not None:
                _check_same(gathered, g.result)
            for y, mm in zip(ys, mms, strict=True):
                if mm.post is not None or rv.dim() == 2:
                    _check_same(y, mm.post if mm.post is not None else mm.node)
        except LeftAlone:
            _erase(graph, new)
            raise
        for y, mm in zip(ys, mms, strict=True):
            if mm.post is not None:
                mm.post.replace_all_uses_with(y)
                graph.erase_node(mm.post)
            if mm.node.users:
                flat = y if rv.dim() == 2 else _call(graph, aten.reshape.default, y, [m, mm.n])
                mm.node.replace_all_uses_with(flat)
            graph.erase_node(mm.node)
    _erase(graph, [*reshapes, *_dequantization(mms)])
    if gathered is not None:
        g.result.replace_all_uses_with(gathered)
    _erase(graph, g.chain)
    if rows is not None:
        _erase(graph, [*rows.nodes, *rows.gather.chain])
    what = "multi" if len(mms) > 1 else ("gathered" if need_gathered else "single")
    return (
        f"{len(mms)} {_kind(mms[0], _GATHER_SCALES[rows is None])}matmul(s) on all_gather(dim={g.dim}) of "
        f"{tuple(meta_val(g.shard).shape)} "
        f"-> coc {what} (bias: {sum(b is not None for b in biases)}, gathered input "
        f"{'kept' if need_gathered else 'dropped'}; {backend}, parallel_num={num})" + (f"; {note}" if note else "")
    )


def _dequantization(mms: list[Matmul]) -> list[fx.Node]:
    """The nodes that dequantized the int8 weights of ``mms`` in the graph (erased once unused)."""
    return [n for mm in mms if isinstance(mm, Int8Matmul) for n in mm.weight.nodes]


def _kind(mm: Matmul, note: str = "") -> str:
    """How the report names a scaled or int8-weight matmul (empty for a plain one)."""
    if isinstance(mm, Int8Matmul):
        return f"{mm.weight.describe()} "
    if not isinstance(mm, ScaledMatmul):
        return ""
    notes = [str(mm.out_dtype).removeprefix("torch.")] + (["fast accum"] if mm.fast_accum else [])
    if mm.upcast is not None:
        notes.append(f"the {str(mm.upcast).removeprefix('torch.')} product's upcast joined")
    if mm.note:
        notes.append(mm.note)
    return f"FP8 {mm.mode}-scaled ({', '.join(notes + ([note] if note else []))}) "


def _rewrite_reduce(graph: fx.Graph, r: Reduce) -> tuple[str, fx.Node]:
    """The reduce's rewrite: its report detail and the coc op's node."""
    r.mm, note = int8_reduced(r.mm)
    bias, bias_how = reduce_bias(r)
    out_node = r.wait
    if bias is not None and r.mm.bias_in is None:
        out_node = next(iter(r.wait.users))  # the + bias joins the op
    mm, wv = r.mm, meta_val(r.wait)
    new: list[fx.Node] = []
    with graph.inserting_before(r.wait):
        x2d, b = mm.x2d, mm.b
        if mm.parts:
            # sum_i x_i @ b_i == cat(x_i, dim=1) @ cat(b_i, dim=0): one matmul feeds the reduction.
            x2d = _call(graph, aten.cat.default, [p.x2d for p in mm.parts], 1)
            b = _call(graph, aten.cat.default, [p.b for p in mm.parts], 0)
            new += [x2d, b]
        w_scale = None
        if isinstance(mm, Int8Matmul):
            w, w_scale = op_operands(graph, mm.weight, new)
        else:
            w = _weight(graph, b, new)
        xv = meta_val(x2d)
        lead = tuple(meta_val(mm.post).shape[:-1]) if mm.post is not None else (xv.shape[0],)
        x = x2d
        if r.op == "matmul_reduce_scatter" and mm.post is not None:
            x = _call(graph, aten.reshape.default, x2d, [*lead, xv.shape[1]])
            new.append(x)
        x_scale = None
        fmt, out_dtype = (mm.weight.fmt if isinstance(mm, Int8Matmul) else PLAIN), None
        if isinstance(mm, ScaledMatmul):
            x_scale, w_scale = _reduce_scales(graph, mm, new)
            fmt, out_dtype = fp8(mm.mode), mm.out_dtype
        call = _decide(r.op, xv, [meta_val(b)], r, fmt=fmt, out_dtype=out_dtype)
        backend, num = call.backend, call.parallel_num
        target = reduce_scatter.SPEC.operator if r.op == "matmul_reduce_scatter" else all_reduce.SPEC.operator
        y = op = _call(graph, target, x, x_scale, w, w_scale, None, bias, call.encode())
        new.append(y)
        if r.op == "matmul_all_reduce":
            if mm.post is not None:
                y = _call(graph, aten.reshape.default, y, [*lead, mm.n])
                new.append(y)
        try:
            _check_same(y, r.wait)
        except LeftAlone:
            _erase(graph, new)
            raise
    out_node.replace_all_uses_with(y)
    if out_node is not r.wait:
        graph.erase_node(out_node)
    _erase(graph, [*mm.nodes, *([mm.post] if mm.post is not None else []), *r.chain, *_dequantization([mm])])
    what = f"sum of {len(mm.parts)} mm" if mm.parts else ("mm" if mm.bias_in is None else "addmm")
    if isinstance(mm, ScaledMatmul):
        what = f"{_kind(mm)}_scaled_mm"
    elif isinstance(mm, Int8Matmul):
        what = f"{_kind(mm)}{what}"
    return (
        f"{what} {tuple(xv.shape)} x {tuple(meta_val(b).shape)} -> "
        f"{r.op}(dim={r.dim}) -> {tuple(wv.shape)}; {bias_how}; {backend}, parallel_num={num}"
    ) + (f"; {note}" if note else ""), op


def _rewrite_any_gather(graph: fx.Graph, g: Gather) -> str:
    """The gather's rewrite: FP8 payloads into the scaled op, others into the plain one."""
    if is_fp8_gather(g):
        mms, rows = scaled_gather_consumers(g)
        return _rewrite_gather(graph, g, mms, rows)  # type: ignore[arg-type]
    try:
        mms, note = int8_consumers(gather_consumers(g))
        return _rewrite_gather(graph, g, mms, note=note)
    except LeftAlone as e:
        mm = quantized_after(g)
        if mm is None:
            raise
        raise LeftAlone(
            f"{e}: it is quantized after the gather for {mm}, so the gather moves "
            f"{meta_val(g.shard).dtype} rows; quantize before the gather to move FP8 rows"
        ) from None


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def _graph_kind(graph: fx.Graph) -> str:
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    if any(name.startswith("tangents") for name in names):
        return "backward"
    return "forward" if names and all(name.startswith("primals") for name in names) else "inference"


def _record(kind: str, pattern: str, matched: bool, detail: str) -> None:
    _RECORDS.append(Record(kind, pattern, matched, detail))
    log.info("coc inductor pass (%s graph): %s %s: %s", kind, "rewrote" if matched else "left alone", pattern, detail)


def rewrite(graph: fx.Graph) -> None:
    """Rewrite the patterns of ``graph`` in place (the pass itself; module docstring)."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    kind = _graph_kind(graph)
    collectives = [
        n for n in graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
    ]
    changed = False
    deferred: set[fx.Node] = set()
    queue = list(collectives)
    for node in queue:  # a deferred gather is appended: the loop reaches it after the others
        if getattr(node, "_erased", False):
            continue  # part of an earlier rewrite
        name = node.target._opname
        if name == "wait_tensor":
            continue
        if name not in _COLLECTIVES:
            _record(kind, name, False, "not a collective the pass rewrites")
            continue
        pattern = "all_gather_matmul" if name == "all_gather_into_tensor" else None
        pattern = pattern or ("matmul_reduce_scatter" if name == "reduce_scatter_tensor" else "matmul_all_reduce")
        try:
            if name == "all_gather_into_tensor":
                g = find_fp8_gather(node)
                if node in deferred:
                    raise LeftAlone(
                        "it gathers the rowwise scale_a of a scaled matmul, rewritten only with the gather of "
                        "its payload, which was left alone (reported with its reason)"
                    )
                if payload_gather_of_scales(g):
                    deferred.add(node)  # rewritten with its payload's gather, which may come later
                    queue.append(node)
                    continue
                detail = _rewrite_any_gather(graph, g)
            else:
                try:
                    detail, op = _rewrite_reduce(graph, find_reduce(node, scaled_product))
                    # An RMSNorm after a matmul all-reduce joins it as the GEMM epilogue (or says why not).
                    pattern, detail = inductor_norm.fuse_norm(graph, op, pattern, detail)
                except LeftAlone:
                    if name != "all_reduce" or not inductor_norm.norm_follows(node):
                        raise
                    pattern = "all_reduce_rmsnorm"  # not a matmul's, but a residual add and an RMSNorm follow
                    detail = inductor_norm.rewrite_all_reduce(graph, node)
            changed = True
            _record(kind, pattern, True, detail)
        except LeftAlone as e:
            _record(kind, pattern, False, f"{node}: {e}")
    if changed:
        stable_topological_sort(graph)
        graph.lint()


class CocInductorPass:
    """The pass as Inductor's ``post_grad_custom_post_pass`` (a ``CustomGraphPass``: cacheable)."""

    def __call__(self, graph: fx.Graph) -> None:
        rewrite(graph)

    def uuid(self) -> Any:
        from torch._inductor.custom_graph_pass import get_hash_for_files

        from ..config import get_config

        # The chosen backend and split count are constants of the compiled code: a cached graph is
        # valid only for the environment it was compiled in, and for the code that found its patterns.
        files = (__file__, *(m.__file__ for m in (inductor_patterns, inductor_scaled, inductor_int8, inductor_norm)))
        return get_hash_for_files(files, repr(get_config())).hex()


def _as_custom_pass() -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return type("CocInductorPass", (CocInductorPass, CustomGraphPass), {})()


_PASS: Any = None


def _is_ours(p: Any) -> bool:
    return isinstance(p, CocInductorPass)


def enable_inductor_pass() -> None:
    """Run the pass in every Inductor compile from now on, after any post-grad pass already set in
    ``torch._inductor.config.post_grad_custom_post_pass`` (kept: the setting becomes a list)."""
    global _PASS
    from torch._inductor import config

    if _PASS is None:
        _PASS = _as_custom_pass()
    current = config.post_grad_custom_post_pass
    passes = list(current) if isinstance(current, (list, tuple)) else ([] if current is None else [current])
    if any(_is_ours(p) for p in passes):
        return
    config.post_grad_custom_post_pass = passes + [_PASS] if passes else _PASS


def disable_inductor_pass() -> None:
    """Remove the pass from ``post_grad_custom_post_pass``, leaving any other pass in place."""
    from torch._inductor import config

    current = config.post_grad_custom_post_pass
    if _is_ours(current):
        config.post_grad_custom_post_pass = None
    elif isinstance(current, (list, tuple)):
        rest = [p for p in current if not _is_ours(p)]
        config.post_grad_custom_post_pass = None if not rest else rest[0] if len(rest) == 1 else rest


def inductor_pass_enabled() -> bool:
    from torch._inductor import config

    current = config.post_grad_custom_post_pass
    return _is_ours(current) or (isinstance(current, (list, tuple)) and any(_is_ours(p) for p in current))


@contextlib.contextmanager
def use_inductor_pass() -> Iterator[None]:
    """``with kernels.use_inductor_pass(): ...``: the pass on inside the block, as it was after."""
    was = inductor_pass_enabled()
    enable_inductor_pass()
    try:
        yield
    finally:
        if not was:
            disable_inductor_pass()


def enable_from_environment() -> bool:
    """``COC_INDUCTOR_PASS=1``: enable the pass (``import kernels`` calls this); returns whether it did.

    Only this variable is read here, so a bad value of another ``COC_*`` variable still raises at the
    first op call, not at import; a bad value of this one raises ``ValueError`` naming it."""
    from ..config import ENV_INDUCTOR_PASS, build_config

    raw = os.environ.get(ENV_INDUCTOR_PASS)
    if raw is not None and build_config({ENV_INDUCTOR_PASS: raw}).inductor_pass:
        enable_inductor_pass()
        return True
    return False
