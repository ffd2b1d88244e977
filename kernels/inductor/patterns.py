"""Pattern finding for the coc Inductor pass (kernels/inductor/rewrite.py, docs/inductor.md).

Each finder starts from one ``_c10d_functional`` collective of a post-grad aten graph and returns
what a rewrite needs (:class:`Gather` and the :class:`Matmul` nodes consuming it, or a
:class:`Reduce`), or raises :class:`LeftAlone` with the reason the pattern is not rewritten. Nothing
here changes the graph; :func:`new_node` is the one builder the rewrites share.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..protocol import resolve_group as resolve_group_name

log = logging.getLogger("kernels.inductor_pass")

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


class LeftAlone(Exception):
    """A pattern the pass does not rewrite; the message says why."""


def meta_val(node: Any) -> torch.Tensor:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise LeftAlone(f"{node} has no tensor metadata")
    if not all(isinstance(s, int) for s in val.shape):
        raise LeftAlone(
            f"{node} has symbolic shape {tuple(val.shape)}: a dynamic-shape graph (dynamic=True, or the recompile "
            "for a second size under the default automatic dynamic shapes); compile with dynamic=False for static "
            "graphs, one per shape"
        )
    return val


def new_node(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    """A ``call_function`` node of ``target`` on ``args``, its ``meta['val']`` from running ``target`` on its
    inputs' fake values (at the graph's insertion point)."""
    node = graph.call_function(target, args)
    fake_args, fake_kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    mode = torch._guards.detect_fake_mode([n.meta["val"] for n in node.all_input_nodes])
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def only_users(node: fx.Node, allowed: set[fx.Node], what: str) -> None:
    extra = [u for u in node.users if u not in allowed]
    if extra:
        raise LeftAlone(f"{what} ({node}) is also used by {', '.join(map(str, extra))}")


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def resolve_group(name: Any, size: int | None) -> tuple[Any, int]:
    if not isinstance(name, str):
        raise LeftAlone(f"group name {name!r} is not a constant string")
    try:
        group = resolve_group_name(name)
    except Exception as e:  # an unknown name: the graph may come from another process's groups
        raise LeftAlone(f"group {name!r} cannot be resolved here ({e})") from None
    world = group.size() if group is not None else 1
    if size is not None and size != world:
        raise LeftAlone(f"group {name!r} has {world} ranks but the collective says {size}")
    return group, world


@dataclass
class Matmul:
    """``out = x2d @ b (+ bias)`` with ``out`` seen by its users as ``post`` (a reshape) if any."""

    node: fx.Node  # the mm / addmm
    x2d: fx.Node
    b: fx.Node  # [k, n]
    bias_in: fx.Node | None  # addmm's first argument as it is in the graph
    post: fx.Node | None = None
    nodes: list[fx.Node] = field(default_factory=list)
    # A sum of matmuls of the same rows, ``x_0 @ b_0 + x_1 @ b_1 + ...``: the rewrite computes it as one
    # matmul of ``cat(x_i, dim=1)`` and ``cat(b_i, dim=0)`` (``node`` is then the root add, ``x2d`` and
    # ``b`` the first part's).
    parts: list[Matmul] = field(default_factory=list)

    @property
    def n(self) -> int:
        return meta_val(self.b).shape[1]

    def accepts_bias(self, bias: torch.Tensor) -> bool:
        """Whether the op adds ``bias`` (``[n]``) in the arithmetic of the graph: one of x's dtype."""
        return bias.dtype == meta_val(self.x2d).dtype


def as_matmul_or_sum(node: Any) -> Matmul:
    """``node`` as a matmul, or as a tree of ``add``s of plain matmuls (no bias, same rows, n and dtype,
    each used only by its add): the backward of several column linears reading one input."""
    if not (isinstance(node, fx.Node) and node.target is aten.add.Tensor):
        return as_matmul(node)
    adds: list[fx.Node] = []
    leaves: list[fx.Node] = []
    todo = [node]
    while todo:
        cur = todo.pop()
        if isinstance(cur, fx.Node) and cur.target is aten.add.Tensor:
            if len(cur.args) != 2 or cur.kwargs or not all(isinstance(a, fx.Node) for a in cur.args):
                raise LeftAlone(f"{cur} is not a plain sum of two tensors")
            if cur is not node:
                only_users(cur, set(adds), "a partial sum of matmuls")
            adds.append(cur)
            todo.extend(reversed(cur.args))
        else:
            leaves.append(cur)
    parts = []
    reshapes = []
    shape = tuple(meta_val(node).shape)
    for leaf in leaves:
        mm_node = leaf
        if isinstance(leaf, fx.Node) and leaf.target in RESHAPES and tuple(meta_val(leaf).shape) == shape:
            only_users(leaf, set(adds), "a summed, reshaped matmul")
            reshapes.append(leaf)
            mm_node = leaf.args[0]
        if not (isinstance(mm_node, fx.Node) and mm_node.target is aten.mm.default):
            raise LeftAlone(f"{leaf} (in the sum reduced) is not a matmul ({getattr(leaf, 'target', leaf)})")
        part = as_matmul(mm_node)
        only_users(mm_node, {leaf} if mm_node is not leaf else set(adds), "a summed matmul")
        parts.append(part)
    if reshapes and len(reshapes) != len(parts):
        raise LeftAlone("some summed matmuls are reshaped and some are not")
    first = parts[0]
    rows, n, dtype = meta_val(first.x2d).shape[0], first.n, meta_val(first.x2d).dtype
    for p in parts:
        if meta_val(p.x2d).shape[0] != rows or p.n != n or meta_val(p.x2d).dtype != dtype:
            raise LeftAlone(f"the summed matmuls differ in rows, n or dtype ({p.node} vs {first.node})")
    if reshapes and (shape[-1] != n or math.prod(shape[:-1]) != rows):
        raise LeftAlone(f"the summed matmuls are reshaped to {shape}, not [..., n] of their rows")
    inner = [*adds[1:], *reshapes, *(p.node for p in parts)]
    if reshapes:
        # The root add is the [..., n] view of the summed product the reduction reads: the rewrite's post.
        return Matmul(node, first.x2d, first.b, None, post=node, nodes=inner, parts=parts)
    return Matmul(node, first.x2d, first.b, None, nodes=[node, *inner], parts=parts)


def as_matmul(node: Any) -> Matmul:
    if not isinstance(node, fx.Node) or node.target not in (aten.mm.default, aten.addmm.default):
        raise LeftAlone(f"{node} is not a matmul ({getattr(node, 'target', node)})")
    if node.target is aten.mm.default:
        x2d, b, bias_in = node.args[0], node.args[1], None
    else:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            raise LeftAlone(f"{node} is an addmm with beta / alpha other than 1")
        bias_in, x2d, b = node.args[0], node.args[1], node.args[2]
    xv, bv, out = meta_val(x2d), meta_val(b), meta_val(node)
    dtypes = {xv.dtype, bv.dtype, out.dtype}
    if len(dtypes) != 1 or not xv.is_floating_point():
        raise LeftAlone(f"{node} mixes or uses non-float dtypes {sorted(map(str, dtypes))}")
    if xv.device != bv.device:
        raise LeftAlone(f"{node} has operands on {xv.device} and {bv.device}")
    return Matmul(node, x2d, b, bias_in, nodes=[node])


def plain_bias(mm: Matmul, bias: Any) -> fx.Node | None:
    """``bias`` when it is a ``[n]`` vector of the op's dtype and device, else None."""
    if not isinstance(bias, fx.Node):
        return None
    try:
        bv, xv = meta_val(bias), meta_val(mm.x2d)
    except LeftAlone:
        return None
    if tuple(bv.shape) != (mm.n,) or not mm.accepts_bias(bv) or bv.device != xv.device:
        return None
    return bias


def is_reshape_to(node: fx.Node, shape: tuple[int, ...]) -> bool:
    return node.target in RESHAPES and tuple(meta_val(node).shape) == tuple(shape)


def ancestors(node: fx.Node, limit: int = 10000) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [node]
    while todo and len(seen) < limit:
        cur = todo.pop()
        for inp in cur.all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                todo.append(inp)
    return seen


def split_pieces(pieces: Any, source: fx.Node, dim: int, size: int, world: int) -> list[fx.Node]:
    """The nodes of ``[source.split(size, dim)[i] for i in range(world)]`` (split + getitem, or slices),
    in order; raises if ``pieces`` is anything else."""
    if not isinstance(pieces, (list, tuple)) or len(pieces) != world:
        raise LeftAlone(
            f"the cat has {len(pieces) if isinstance(pieces, (list, tuple)) else '?'} pieces, not W={world}"
        )
    nodes: list[fx.Node] = []
    split = None
    for i, p in enumerate(pieces):
        if not isinstance(p, fx.Node):
            raise LeftAlone("a cat piece is not a graph node")
        if p.target is operator.getitem and isinstance(p.args[0], fx.Node) and p.args[0].target in SPLITS:
            s = p.args[0]
            sizes = s.args[1]
            sdim = arg(s, 2, "dim", 0)
            ok = s.args[0] is source and sdim == dim and p.args[1] == i
            ok = ok and (sizes == size if isinstance(sizes, int) else constant_sizes(sizes) == [size] * world)
            if not ok or (split is not None and s is not split):
                raise LeftAlone(f"cat piece {p} is not piece {i} of a split of {source} by {size} on dim {dim}")
            split = s
        elif p.target is aten.slice.Tensor:
            start, end = arg(p, 2, "start", None), arg(p, 3, "end", None)
            if p.args[0] is not source or arg(p, 1, "dim", 0) != dim or (start, end) != (i * size, (i + 1) * size):
                raise LeftAlone(f"cat piece {p} is not rows {i * size}:{(i + 1) * size} of {source} on dim {dim}")
            if arg(p, 4, "step", 1) != 1:
                raise LeftAlone(f"cat piece {p} is a strided slice")
        else:
            raise LeftAlone(f"cat piece {p} is neither a split piece nor a slice")
        nodes.append(p)
    if split is not None:
        only_users(split, set(nodes), "the split")
        nodes.insert(0, split)
    return nodes


@dataclass
class Gather:
    result: fx.Node  # equals all_gather(shard, dim)
    shard: fx.Node
    dim: int
    group_name: str
    world: int
    group: Any
    chain: list[fx.Node]  # collective, wait, [split pieces, cat]: erased once unused


def constant_sizes(sizes: Any) -> list[int]:
    """A split's sizes as ints; in a dynamic-shape graph they are nodes (``sym_size`` and arithmetic on it)."""
    if isinstance(sizes, int):
        return [sizes]
    if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) for s in sizes):
        return list(sizes)
    raise LeftAlone(f"the split sizes {sizes} are not constants (symbolic shapes; compile with dynamic=False)")


def split_source(pieces: Any) -> tuple[fx.Node, int, int]:
    """``(source, dim, size)`` of the split / slice that the first of ``pieces`` comes from."""
    first = pieces[0] if isinstance(pieces, (list, tuple)) and pieces else None
    if isinstance(first, fx.Node) and first.target is operator.getitem and isinstance(first.args[0], fx.Node):
        split = first.args[0]
        if split.target in SPLITS and isinstance(split.args[0], fx.Node):
            return split.args[0], arg(split, 2, "dim", 0), constant_sizes(split.args[1])[0]
    if isinstance(first, fx.Node) and first.target is aten.slice.Tensor and isinstance(first.args[0], fx.Node):
        start, end = arg(first, 2, "start", None), arg(first, 3, "end", None)
        if isinstance(start, int) and isinstance(end, int):
            return first.args[0], arg(first, 1, "dim", 0), end - start
    raise LeftAlone("the cat's pieces are not a split or slices of one tensor")


def cat_after(wait: fx.Node) -> fx.Node | None:
    """The cat that reassembles ``wait``'s split pieces (a gather on dim > 0), if that is its use."""
    users = list(wait.users)
    if len(users) == 1 and users[0].target in SPLITS:
        after = {u for piece in users[0].users for u in piece.users}
    elif users and all(u.target is aten.slice.Tensor for u in users):
        after = {u for piece in users for u in piece.users}
    else:
        return None
    cat = next(iter(after)) if len(after) == 1 else None
    return cat if cat is not None and cat.target is aten.cat.default else None


def find_gather(ag: fx.Node) -> Gather:
    shard, size, name = ag.args[0], arg(ag, 1, "group_size"), arg(ag, 2, "group_name")
    group, world = resolve_group(name, size)
    waits = list(ag.users)
    if len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default:
        raise LeftAlone("the all-gather is not waited on exactly once")
    wait = waits[0]
    sv = meta_val(shard)
    cat = cat_after(wait)
    if cat is None:
        return Gather(wait, shard, 0, name, world, group, [ag, wait])
    dim = arg(cat, 1, "dim", 0) % sv.dim()
    pieces = split_pieces(cat.args[0], wait, 0, sv.shape[0], world)
    for p in pieces:
        only_users(p, {cat, *pieces}, "a gathered piece")
    only_users(wait, set(pieces), "the gathered tensor")
    return Gather(cat, shard, dim, name, world, group, [ag, wait, *pieces, cat])


def gather_consumers(g: Gather) -> list[Matmul]:
    """The matmuls whose left operand is the gathered tensor (directly when 2-D, else through a
    reshape to ``[m, k]``)."""
    rv = meta_val(g.result)
    lead, k = tuple(rv.shape[:-1]), rv.shape[-1]
    m = math.prod(lead)
    if g.dim == rv.dim() - 1:
        raise LeftAlone(f"the gather is on the last dim ({g.dim}), the contracted k of a matmul")
    candidates: list[tuple[fx.Node, fx.Node | None]] = []  # (mm node, the reshape it reads)
    for user in g.result.users:
        if user.target in (aten.mm.default, aten.addmm.default) and rv.dim() == 2:
            candidates.append((user, None))
        elif user.target in RESHAPES and rv.dim() > 2 and tuple(meta_val(user).shape) == (m, k):
            candidates.extend((u, user) for u in user.users if u.target in (aten.mm.default, aten.addmm.default))
    found = []
    for node, reshape in candidates:
        x2d = reshape if reshape is not None else g.result
        try:
            mm = as_matmul(node)
            if mm.x2d is not x2d:
                continue  # the gathered tensor is the right operand (a weight gradient): not this pattern
            if g.result in ancestors(mm.b) or (mm.bias_in is not None and g.result in ancestors(mm.bias_in)):
                raise LeftAlone(f"{node}'s weight depends on the gathered input")
            if mm.bias_in is not None and plain_bias(mm, mm.bias_in) is None:
                raise LeftAlone(f"{node}'s addmm bias is not a [n] vector")
            if rv.dim() > 2:
                mm.post = next((u for u in node.users if is_reshape_to(u, (*lead, mm.n))), None)
            found.append(mm)
        except LeftAlone as e:
            log.info("coc inductor pass: all-gather consumer %s left alone: %s", node, e)
    if not found:
        raise LeftAlone("no matmul consumes the gathered tensor")
    return found


@dataclass
class Reduce:
    op: str  # "matmul_reduce_scatter" or "matmul_all_reduce"
    wait: fx.Node
    mm: Matmul
    dim: int
    group_name: str
    world: int
    group: Any
    chain: list[fx.Node]


def find_reduce(coll: fx.Node, product: Callable[[Any], Matmul] = as_matmul_or_sum) -> Reduce:
    """The matmul (as ``product`` reads the reduced tensor's producer) feeding ``coll``, a reduce-scatter or
    all-reduce, and the nodes between."""
    scatter = coll.target is c10d.reduce_scatter_tensor.default
    inp, reduce_op = coll.args[0], arg(coll, 1, "reduce_op")
    name = arg(coll, 3 if scatter else 2, "group_name")
    group, world = resolve_group(name, arg(coll, 2, "group_size") if scatter else None)
    if reduce_op != "sum":
        raise LeftAlone(f"the reduction is {reduce_op!r}, not 'sum'")
    waits = list(coll.users)
    if len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default:
        raise LeftAlone("the collective is not waited on exactly once (its unwaited result is used elsewhere)")
    wait = waits[0]
    if isinstance(inp, fx.Node):
        meta_val(inp)  # a symbolic shape is left alone here, before the split / cat helpers read its sizes
    chain = [coll, wait]
    dim = 0
    source = inp
    if scatter and isinstance(inp, fx.Node) and inp.target is aten.cat.default:
        if arg(inp, 1, "dim", 0) != 0:
            raise LeftAlone("the reduce-scatter's input is a cat on a dim other than 0")
        source, dim, size = split_source(inp.args[0])
        sv = meta_val(source)
        dim %= sv.dim()
        if size * world != sv.shape[dim]:
            raise LeftAlone(f"the cat cuts dim {dim} of {tuple(sv.shape)} in pieces of {size}, not W={world}")
        pieces = split_pieces(inp.args[0], source, dim, size, world)
        for p in pieces:
            only_users(p, {inp, *pieces}, "a scattered piece")
        only_users(inp, {coll}, "the reduce-scatter's cat")
        chain = [*pieces, inp, *chain]
    if not isinstance(source, fx.Node):
        raise LeftAlone(f"the reduced tensor {source!r} is not a graph node")
    producer = source
    post = None
    if producer.target in RESHAPES:
        post, producer = producer, producer.args[0]
    mm = product(producer)
    sv = meta_val(post if post is not None else producer)
    if post is not None:
        if sv.shape[-1] != mm.n or math.prod(sv.shape[:-1]) != meta_val(mm.x2d).shape[0]:
            raise LeftAlone(f"the reshape after the matmul gives {tuple(sv.shape)}, not [..., n] of its rows")
        if mm.post is not None:
            mm.nodes.append(mm.post)  # a sum's own [..., n] view, now inside the pattern
        mm.post = post
    if dim == sv.dim() - 1:
        raise LeftAlone(f"the reduction scatters the last dim ({dim}), the matmul's n")
    consumers = {n for n in chain if source in n.all_input_nodes}
    only_users(mm.node, consumers if post is None else {post}, "the matmul's output")
    if post is not None:
        only_users(post, consumers, "the reshaped matmul output")
    op = "matmul_reduce_scatter" if scatter else "matmul_all_reduce"
    return Reduce(op, wait, mm, dim, name, world, group, chain)


def reduce_bias(r: Reduce) -> tuple[fx.Node | None, str]:
    """The bias to add once after the reduction, and how it was found."""
    mm = r.mm
    if mm.bias_in is not None:
        b = mm.bias_in
        if b.target is aten.div.Tensor and b.args[1] == r.world and len(b.users) == 1:
            plain = plain_bias(mm, b.args[0])
            if plain is not None:
                mm.nodes.insert(0, b)
                return plain, f"bias {plain} (split as b / {r.world} before the reduction) added after it"
        raise LeftAlone(
            f"the matmul adds bias {b} on every rank before the reduction (not the b / W of a replicated bias)"
        )
    adds = list(r.wait.users)
    if len(adds) == 1 and adds[0].target is aten.add.Tensor and adds[0].args[0] is r.wait:
        add = adds[0]
        plain = plain_bias(mm, add.args[1]) if len(add.args) == 2 and not add.kwargs else None
        # A bias of another dtype promotes the sum: the op's result would have another dtype.
        if plain is not None and meta_val(plain).dtype == meta_val(r.wait).dtype:
            return plain, f"bias {plain} added after the reduction"
    return None, "no bias"
