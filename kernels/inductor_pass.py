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

``mm(a, b)`` is ``a @ b``: the coc weight ``[n, k]`` is ``b``'s transpose (the ``permute`` a linear's
weight went through, or a new one). A bias joins the op where it means the same thing: the bias of an
``addmm`` after a gather; the ``b / W`` that DTensor's Replicate -> Partial turns a row-parallel bias
into, folded back to ``b`` after the reduction; a ``+ b`` right after the reduction.

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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from . import dispatch, library

log = logging.getLogger(__name__)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
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


class _LeftAlone(Exception):
    """A pattern the pass does not rewrite; the message says why."""


def _val(node: Any) -> torch.Tensor:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise _LeftAlone(f"{node} has no tensor metadata")
    if not all(isinstance(s, int) for s in val.shape):
        raise _LeftAlone(f"{node} has symbolic shape {tuple(val.shape)} (compile with dynamic=False)")
    return val


def _only_users(node: fx.Node, allowed: set[fx.Node], what: str) -> None:
    extra = [u for u in node.users if u not in allowed]
    if extra:
        raise _LeftAlone(f"{what} ({node}) is also used by {', '.join(map(str, extra))}")


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _group(name: Any, size: int | None) -> tuple[Any, int]:
    if not isinstance(name, str):
        raise _LeftAlone(f"group name {name!r} is not a constant string")
    try:
        group = library.resolve_group(name)
    except Exception as e:  # an unknown name: the graph may come from another process's groups
        raise _LeftAlone(f"group {name!r} cannot be resolved here ({e})") from None
    world = group.size() if group is not None else 1
    if size is not None and size != world:
        raise _LeftAlone(f"group {name!r} has {world} ranks but the collective says {size}")
    return group, world


@dataclass
class _Mm:
    """``out = x2d @ b (+ bias)`` with ``out`` seen by its users as ``post`` (a reshape) if any."""

    node: fx.Node  # the mm / addmm
    x2d: fx.Node
    b: fx.Node  # [k, n]
    bias_in: fx.Node | None  # addmm's first argument as it is in the graph
    post: fx.Node | None = None
    nodes: list[fx.Node] = field(default_factory=list)

    @property
    def n(self) -> int:
        return _val(self.b).shape[1]


def _as_mm(node: Any) -> _Mm:
    if not isinstance(node, fx.Node) or node.target not in (aten.mm.default, aten.addmm.default):
        raise _LeftAlone(f"{node} is not a matmul ({getattr(node, 'target', node)})")
    if node.target is aten.mm.default:
        x2d, b, bias_in = node.args[0], node.args[1], None
    else:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            raise _LeftAlone(f"{node} is an addmm with beta / alpha other than 1")
        bias_in, x2d, b = node.args[0], node.args[1], node.args[2]
    xv, bv, out = _val(x2d), _val(b), _val(node)
    dtypes = {xv.dtype, bv.dtype, out.dtype}
    if len(dtypes) != 1 or not xv.is_floating_point():
        raise _LeftAlone(f"{node} mixes or uses non-float dtypes {sorted(map(str, dtypes))}")
    if xv.device != bv.device:
        raise _LeftAlone(f"{node} has operands on {xv.device} and {bv.device}")
    return _Mm(node, x2d, b, bias_in, nodes=[node])


def _plain_bias(mm: _Mm, bias: Any) -> fx.Node | None:
    """``bias`` when it is a ``[n]`` vector of the op's dtype and device, else None."""
    if not isinstance(bias, fx.Node):
        return None
    try:
        bv, xv = _val(bias), _val(mm.x2d)
    except _LeftAlone:
        return None
    if tuple(bv.shape) != (mm.n,) or bv.dtype != xv.dtype or bv.device != xv.device:
        return None
    return bias


def _is_reshape_to(node: fx.Node, shape: tuple[int, ...]) -> bool:
    return node.target in _RESHAPES and tuple(_val(node).shape) == tuple(shape)


def _ancestors(node: fx.Node, limit: int = 10000) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [node]
    while todo and len(seen) < limit:
        cur = todo.pop()
        for inp in cur.all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                todo.append(inp)
    return seen


# ---- finding the patterns ------------------------------------------------------------------------------------------


def _pieces(pieces: Any, source: fx.Node, dim: int, size: int, world: int) -> list[fx.Node]:
    """The nodes of ``[source.split(size, dim)[i] for i in range(world)]`` (split + getitem, or slices),
    in order; raises if ``pieces`` is anything else."""
    if not isinstance(pieces, (list, tuple)) or len(pieces) != world:
        raise _LeftAlone(
            f"the cat has {len(pieces) if isinstance(pieces, (list, tuple)) else '?'} pieces, not W={world}"
        )
    nodes: list[fx.Node] = []
    split = None
    for i, p in enumerate(pieces):
        if not isinstance(p, fx.Node):
            raise _LeftAlone("a cat piece is not a graph node")
        if p.target is operator.getitem and isinstance(p.args[0], fx.Node) and p.args[0].target in _SPLITS:
            s = p.args[0]
            sizes = s.args[1]
            sdim = _arg(s, 2, "dim", 0)
            ok = s.args[0] is source and sdim == dim and p.args[1] == i
            ok = ok and (sizes == size if isinstance(sizes, int) else list(sizes) == [size] * world)
            if not ok or (split is not None and s is not split):
                raise _LeftAlone(f"cat piece {p} is not piece {i} of a split of {source} by {size} on dim {dim}")
            split = s
        elif p.target is aten.slice.Tensor:
            start, end = _arg(p, 2, "start", None), _arg(p, 3, "end", None)
            if p.args[0] is not source or _arg(p, 1, "dim", 0) != dim or (start, end) != (i * size, (i + 1) * size):
                raise _LeftAlone(f"cat piece {p} is not rows {i * size}:{(i + 1) * size} of {source} on dim {dim}")
            if _arg(p, 4, "step", 1) != 1:
                raise _LeftAlone(f"cat piece {p} is a strided slice")
        else:
            raise _LeftAlone(f"cat piece {p} is neither a split piece nor a slice")
        nodes.append(p)
    if split is not None:
        _only_users(split, set(nodes), "the split")
        nodes.insert(0, split)
    return nodes


@dataclass
class _Gather:
    result: fx.Node  # equals all_gather(shard, dim)
    shard: fx.Node
    dim: int
    group_name: str
    world: int
    group: Any
    chain: list[fx.Node]  # collective, wait, [split pieces, cat]: erased once unused


def _split_source(pieces: Any) -> tuple[fx.Node, int, int]:
    """``(source, dim, size)`` of the split / slice that the first of ``pieces`` comes from."""
    first = pieces[0] if isinstance(pieces, (list, tuple)) and pieces else None
    if isinstance(first, fx.Node) and first.target is operator.getitem and isinstance(first.args[0], fx.Node):
        split = first.args[0]
        if split.target in _SPLITS and isinstance(split.args[0], fx.Node):
            sizes = split.args[1]
            return split.args[0], _arg(split, 2, "dim", 0), sizes if isinstance(sizes, int) else sizes[0]
    if isinstance(first, fx.Node) and first.target is aten.slice.Tensor and isinstance(first.args[0], fx.Node):
        start, end = _arg(first, 2, "start", None), _arg(first, 3, "end", None)
        if isinstance(start, int) and isinstance(end, int):
            return first.args[0], _arg(first, 1, "dim", 0), end - start
    raise _LeftAlone("the cat's pieces are not a split or slices of one tensor")


def _cat_after(wait: fx.Node) -> fx.Node | None:
    """The cat that reassembles ``wait``'s split pieces (a gather on dim > 0), if that is its use."""
    users = list(wait.users)
    if len(users) == 1 and users[0].target in _SPLITS:
        after = {u for piece in users[0].users for u in piece.users}
    elif users and all(u.target is aten.slice.Tensor for u in users):
        after = {u for piece in users for u in piece.users}
    else:
        return None
    cat = next(iter(after)) if len(after) == 1 else None
    return cat if cat is not None and cat.target is aten.cat.default else None


def _find_gather(ag: fx.Node) -> _Gather:
    shard, size, name = ag.args[0], _arg(ag, 1, "group_size"), _arg(ag, 2, "group_name")
    group, world = _group(name, size)
    waits = list(ag.users)
    if len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default:
        raise _LeftAlone("the all-gather is not waited on exactly once")
    wait = waits[0]
    sv = _val(shard)
    cat = _cat_after(wait)
    if cat is None:
        return _Gather(wait, shard, 0, name, world, group, [ag, wait])
    dim = _arg(cat, 1, "dim", 0) % sv.dim()
    pieces = _pieces(cat.args[0], wait, 0, sv.shape[0], world)
    for p in pieces:
        _only_users(p, {cat, *pieces}, "a gathered piece")
    _only_users(wait, set(pieces), "the gathered tensor")
    return _Gather(cat, shard, dim, name, world, group, [ag, wait, *pieces, cat])


def _gather_consumers(g: _Gather) -> list[_Mm]:
    """The matmuls whose left operand is the gathered tensor (directly when 2-D, else through a
    reshape to ``[m, k]``)."""
    rv = _val(g.result)
    lead, k = tuple(rv.shape[:-1]), rv.shape[-1]
    m = math.prod(lead)
    if g.dim == rv.dim() - 1:
        raise _LeftAlone(f"the gather is on the last dim ({g.dim}), the contracted k of a matmul")
    candidates: list[tuple[fx.Node, fx.Node | None]] = []  # (mm node, the reshape it reads)
    for user in g.result.users:
        if user.target in (aten.mm.default, aten.addmm.default) and rv.dim() == 2:
            candidates.append((user, None))
        elif user.target in _RESHAPES and rv.dim() > 2 and tuple(_val(user).shape) == (m, k):
            candidates.extend((u, user) for u in user.users if u.target in (aten.mm.default, aten.addmm.default))
    found = []
    for node, reshape in candidates:
        x2d = reshape if reshape is not None else g.result
        try:
            mm = _as_mm(node)
            if mm.x2d is not x2d:
                continue  # the gathered tensor is the right operand (a weight gradient): not this pattern
            if g.result in _ancestors(mm.b) or (mm.bias_in is not None and g.result in _ancestors(mm.bias_in)):
                raise _LeftAlone(f"{node}'s weight depends on the gathered input")
            if mm.bias_in is not None and _plain_bias(mm, mm.bias_in) is None:
                raise _LeftAlone(f"{node}'s addmm bias is not a [n] vector")
            if rv.dim() > 2:
                mm.post = next((u for u in node.users if _is_reshape_to(u, (*lead, mm.n))), None)
            found.append(mm)
        except _LeftAlone as e:
            log.info("coc inductor pass: all-gather consumer %s left alone: %s", node, e)
    if not found:
        raise _LeftAlone("no matmul consumes the gathered tensor")
    return found


@dataclass
class _Reduce:
    op: str  # "matmul_reduce_scatter" or "matmul_all_reduce"
    wait: fx.Node
    mm: _Mm
    dim: int
    group_name: str
    world: int
    group: Any
    chain: list[fx.Node]


def _find_reduce(coll: fx.Node) -> _Reduce:
    scatter = coll.target is c10d.reduce_scatter_tensor.default
    inp, reduce_op = coll.args[0], _arg(coll, 1, "reduce_op")
    name = _arg(coll, 3 if scatter else 2, "group_name")
    group, world = _group(name, _arg(coll, 2, "group_size") if scatter else None)
    if reduce_op != "sum":
        raise _LeftAlone(f"the reduction is {reduce_op!r}, not 'sum'")
    waits = list(coll.users)
    if len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default:
        raise _LeftAlone("the collective is not waited on exactly once (its unwaited result is used elsewhere)")
    wait = waits[0]
    chain = [coll, wait]
    dim = 0
    source = inp
    if scatter and isinstance(inp, fx.Node) and inp.target is aten.cat.default:
        if _arg(inp, 1, "dim", 0) != 0:
            raise _LeftAlone("the reduce-scatter's input is a cat on a dim other than 0")
        source, dim, size = _split_source(inp.args[0])
        sv = _val(source)
        dim %= sv.dim()
        if size * world != sv.shape[dim]:
            raise _LeftAlone(f"the cat cuts dim {dim} of {tuple(sv.shape)} in pieces of {size}, not W={world}")
        pieces = _pieces(inp.args[0], source, dim, size, world)
        for p in pieces:
            _only_users(p, {inp, *pieces}, "a scattered piece")
        _only_users(inp, {coll}, "the reduce-scatter's cat")
        chain = [*pieces, inp, *chain]
    if not isinstance(source, fx.Node):
        raise _LeftAlone(f"the reduced tensor {source!r} is not a graph node")
    producer = source
    post = None
    if producer.target in _RESHAPES:
        post, producer = producer, producer.args[0]
    mm = _as_mm(producer)
    sv = _val(post if post is not None else producer)
    if post is not None:
        if sv.shape[-1] != mm.n or math.prod(sv.shape[:-1]) != _val(mm.x2d).shape[0]:
            raise _LeftAlone(f"the reshape after the matmul gives {tuple(sv.shape)}, not [..., n] of its rows")
        mm.post = post
    if dim == sv.dim() - 1:
        raise _LeftAlone(f"the reduction scatters the last dim ({dim}), the matmul's n")
    consumers = {n for n in chain if source in n.all_input_nodes}
    _only_users(mm.node, consumers if post is None else {post}, "the matmul's output")
    if post is not None:
        _only_users(post, consumers, "the reshaped matmul output")
    op = "matmul_reduce_scatter" if scatter else "matmul_all_reduce"
    return _Reduce(op, wait, mm, dim, name, world, group, chain)


def _reduce_bias(r: _Reduce) -> tuple[fx.Node | None, str]:
    """The bias to add once after the reduction, and how it was found."""
    mm = r.mm
    if mm.bias_in is not None:
        b = mm.bias_in
        if b.target is aten.div.Tensor and b.args[1] == r.world and len(b.users) == 1:
            plain = _plain_bias(mm, b.args[0])
            if plain is not None:
                mm.nodes.insert(0, b)
                return plain, f"bias {plain} (split as b / {r.world} before the reduction) added after it"
        raise _LeftAlone(
            f"the addmm adds bias {b} on every rank before the reduction (not the b / W of a replicated bias)"
        )
    adds = list(r.wait.users)
    if len(adds) == 1 and adds[0].target is aten.add.Tensor and adds[0].args[0] is r.wait:
        add = adds[0]
        plain = _plain_bias(mm, add.args[1]) if len(add.args) == 2 and not add.kwargs else None
        if plain is not None:
            return plain, f"bias {plain} added after the reduction"
    return None, "no bias"


# ---- rewriting -----------------------------------------------------------------------------------------------------


def _fake_run(node: fx.Node) -> None:
    """Set ``node.meta['val']`` by running its target on its inputs' fake values."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    vals = [n.meta["val"] for n in node.all_input_nodes]
    mode = torch._guards.detect_fake_mode(vals)
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = node.target(*args, **kwargs)


def _call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    node = graph.call_function(target, args)
    _fake_run(node)
    return node


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


def _decide(op: str, x2d: torch.Tensor, ws: list[torch.Tensor], bias: Any, flag: bool, g: Any, dim: int) -> tuple:
    """``(backend, parallel_num)`` from the COC_* environment, as the eager op would choose."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def stand_in(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty((), dtype=t.dtype, device=t.device).expand(shape)

    with unset_fake_temporarily():
        x = stand_in(x2d, tuple(x2d.shape))
        w = stand_in(ws[0], (ws[0].shape[1], ws[0].shape[0]))
        b = None if bias is None else stand_in(bias.meta["val"], (w.shape[0],))
        n = sum(t.shape[1] for t in ws)
        backend, num, _ = dispatch.decide(op, None, None, x, w, b, flag, g.group, g.world, comm_dim=dim, n=n)
    return backend, num


def _check_same(new: fx.Node, old: fx.Node) -> None:
    nv, ov = new.meta["val"], old.meta["val"]
    if tuple(nv.shape) != tuple(ov.shape) or nv.dtype != ov.dtype:
        raise _LeftAlone(f"the coc op would give {tuple(nv.shape)} {nv.dtype} where the graph has {tuple(ov.shape)}")


def _erase(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase those of ``nodes`` that nothing uses any more (users first)."""
    left = [n for n in reversed(nodes) if not getattr(n, "_erased", False)]
    while True:
        dead = [n for n in left if not n.users]
        if not dead:
            return
        for node in dead:
            graph.erase_node(node)
        left = [n for n in left if n not in dead]


def _rewrite_gather(graph: fx.Graph, g: _Gather, mms: list[_Mm]) -> str:
    rv = _val(g.result)
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
        ws = [_weight(graph, mm.b, new) for mm in mms]
        biases = [mm.bias_in for mm in mms]
        xv = _val(g.shard)
        backend, num = _decide(
            "all_gather_matmul",
            xv.flatten(0, -2) if xv.dim() > 2 else xv,
            [_val(mm.b) for mm in mms],
            biases[0],
            need_gathered,
            g,
            g.dim,
        )
        common = (g.group_name, g.world, backend, num, g.dim)
        if len(mms) == 1:
            target = library.all_gather_matmul_gathered if need_gathered else library.all_gather_matmul
            fused = _call(graph, target, g.shard, ws[0], biases[0], *common)
            new.append(fused)
            ys = [_call(graph, operator.getitem, fused, 0)] if need_gathered else [fused]
            gathered = _call(graph, operator.getitem, fused, 1) if need_gathered else None
        else:
            fused = _call(graph, library.all_gather_matmul_multi, g.shard, ws, biases, *common, need_gathered)
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
        except _LeftAlone:
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
    _erase(graph, list(reshapes))
    if gathered is not None:
        g.result.replace_all_uses_with(gathered)
    _erase(graph, g.chain)
    what = "multi" if len(mms) > 1 else ("gathered" if need_gathered else "single")
    return (
        f"{len(mms)} matmul(s) on all_gather(dim={g.dim}) of {tuple(_val(g.shard).shape)} -> coc {what} "
        f"(bias: {sum(b is not None for b in biases)}, gathered input {'kept' if need_gathered else 'dropped'}; "
        f"{backend}, parallel_num={num})"
    )


def _rewrite_reduce(graph: fx.Graph, r: _Reduce) -> str:
    bias, bias_how = _reduce_bias(r)
    out_node = r.wait
    if bias is not None and r.mm.bias_in is None:
        out_node = next(iter(r.wait.users))  # the + bias joins the op
    mm, wv = r.mm, _val(r.wait)
    new: list[fx.Node] = []
    with graph.inserting_before(r.wait):
        w = _weight(graph, mm.b, new)
        xv = _val(mm.x2d)
        lead = tuple(_val(mm.post).shape[:-1]) if mm.post is not None else (xv.shape[0],)
        x = mm.x2d
        if r.op == "matmul_reduce_scatter" and mm.post is not None:
            x = _call(graph, aten.reshape.default, mm.x2d, [*lead, xv.shape[1]])
            new.append(x)
        backend, num = _decide(r.op, xv, [_val(mm.b)], bias, False, r, r.dim)
        if r.op == "matmul_reduce_scatter":
            y = _call(
                graph, library.matmul_reduce_scatter, x, w, bias, r.group_name, r.world, backend, num, False, r.dim
            )
            new.append(y)
        else:
            y = _call(graph, library.matmul_all_reduce, x, w, bias, r.group_name, r.world, backend, num, False)
            new.append(y)
            if mm.post is not None:
                y = _call(graph, aten.reshape.default, y, [*lead, mm.n])
                new.append(y)
        try:
            _check_same(y, r.wait)
        except _LeftAlone:
            _erase(graph, new)
            raise
    out_node.replace_all_uses_with(y)
    if out_node is not r.wait:
        graph.erase_node(out_node)
    _erase(graph, [*mm.nodes, *([mm.post] if mm.post is not None else []), *r.chain])
    return (
        f"{'mm' if mm.bias_in is None else 'addmm'} {tuple(xv.shape)} x {tuple(_val(mm.b).shape)} -> "
        f"{r.op}(dim={r.dim}) -> {tuple(wv.shape)}; {bias_how}; {backend}, parallel_num={num}"
    )


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
    for node in collectives:
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
                g = _find_gather(node)
                detail = _rewrite_gather(graph, g, _gather_consumers(g))
            else:
                detail = _rewrite_reduce(graph, _find_reduce(node))
            changed = True
            _record(kind, pattern, True, detail)
        except _LeftAlone as e:
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

        from .config import get_config

        # The chosen backend and split count are constants of the compiled code: a cached graph is
        # valid only for the environment it was compiled in.
        return get_hash_for_files((__file__,), repr(get_config())).hex()


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
    from .config import ENV_INDUCTOR_PASS, build_config

    raw = os.environ.get(ENV_INDUCTOR_PASS)
    if raw is not None and build_config({ENV_INDUCTOR_PASS: raw}).inductor_pass:
        enable_inductor_pass()
        return True
    return False
