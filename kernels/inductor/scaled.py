"""Pattern finding for FP8 matmuls, ``aten._scaled_mm``, in the coc Inductor pass (docs/inductor.md, "FP8 matmuls").

``_scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)`` is
``(a * scale_a) @ (b * scale_b) + bias`` rounded to ``out_dtype``, with ``a [m, k]`` and ``b [k, n]`` FP8
(``b`` the weight transposed) and fp32 scales, tensorwise (one value, ``[]`` or ``[1]``) or rowwise
(``scale_a [m, 1]``, ``scale_b [1, n]``): the operands of the coc FP8 ops in mode ``tensor`` or ``row``
(``w_scale`` is ``scale_b`` as ``[n, 1]``). This module finds, from one collective, what the rewrite
of :mod:`kernels.inductor.rewrite` needs:

* an all-gather of an FP8 payload feeding ``_scaled_mm``\\ s as their ``a`` (:func:`find_fp8_gather`,
  :func:`scaled_gather_consumers`); rowwise, ``scale_a`` must be the all-gather of each rank's scale rows
  on the same dim and group (:class:`RowScale`), which the coc op moves with the rows;
* a ``_scaled_mm`` feeding a reduce-scatter or all-reduce (:func:`scaled_product`, the producer
  :func:`kernels.inductor.patterns.find_reduce` is given).

Like :mod:`kernels.inductor.patterns`, it changes nothing and raises :class:`LeftAlone` with the reason.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..fp8.scales import FP8_DTYPES, OUT_DTYPES
from .patterns import (
    RESHAPES,
    SPLITS,
    Gather,
    LeftAlone,
    Matmul,
    ancestors,
    arg,
    as_matmul_or_sum,
    find_gather,
    is_reshape_to,
    meta_val,
    only_users,
    split_pieces,
    split_source,
)

log = logging.getLogger("kernels.inductor_pass")

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional
SCALED_MM = aten._scaled_mm.default
_CONVERT = prims.convert_element_type.default
_VIEW_DTYPE = aten.view.dtype
# How far past a gather the report looks for a _scaled_mm that quantizes the gathered tensor itself.
_QUANTIZE_DEPTH = 12


@dataclass
class ScaledMatmul(Matmul):
    """``out = _scaled_mm(x2d, b, scale_a, scale_b, bias_in, None, out_dtype)`` (``node``, or its upcast when
    ``upcast`` is set: ``node`` is then the ``convert_element_type`` and ``out_dtype`` its dtype)."""

    scale_a: fx.Node | None = None
    scale_b: fx.Node | None = None
    mode: str = "tensor"
    out_dtype: torch.dtype = torch.bfloat16
    fast_accum: bool = False
    upcast: torch.dtype | None = None  # the _scaled_mm's own out_dtype when an upcast follows it
    note: str = ""  # how the report describes a form other than one _scaled_mm

    def accepts_bias(self, bias: torch.Tensor) -> bool:
        return bias.dtype in (self.out_dtype, torch.float32)


@dataclass
class RowScale:
    """Rowwise ``scale_a`` of a gathered payload: ``gather`` all-gathers each rank's scale rows (``shard``) on
    the payload's dim and group; ``reciprocal`` when ``scale_a`` is their reciprocal (an odd count of them)."""

    gather: Gather
    reciprocal: bool
    nodes: list[fx.Node] = field(default_factory=list)  # between the gathered scales and scale_a


def as_scaled_matmul(node: object) -> ScaledMatmul:
    """``node`` (a ``_scaled_mm``) as an FP8 matmul the coc ops compute, or :class:`LeftAlone` saying why not."""
    if not (isinstance(node, fx.Node) and node.target is SCALED_MM):
        raise LeftAlone(f"{node} is not a scaled matmul ({getattr(node, 'target', node)})")
    a, b, scale_a, scale_b = node.args[:4]
    bias, scale_result = arg(node, 4, "bias"), arg(node, 5, "scale_result")
    out_dtype, fast = arg(node, 6, "out_dtype"), arg(node, 7, "use_fast_accum", False)
    if scale_result is not None:
        raise LeftAlone(f"{node} sets scale_result (an FP8 output); the coc FP8 ops return {_names(OUT_DTYPES)}")
    if out_dtype not in OUT_DTYPES:
        raise LeftAlone(
            f"{node} returns {out_dtype or 'its FP8 input dtype'}; the coc FP8 ops return {_names(OUT_DTYPES)}"
        )
    av, bv, sav, sbv = (meta_val(t) for t in (a, b, scale_a, scale_b))
    if av.dtype not in FP8_DTYPES or bv.dtype not in FP8_DTYPES:
        raise LeftAlone(f"{node} multiplies {av.dtype} by {bv.dtype}; the coc FP8 ops take {_names(FP8_DTYPES)}")
    if sav.dtype != torch.float32 or sbv.dtype != torch.float32:
        raise LeftAlone(f"{node}'s scales are {sav.dtype} and {sbv.dtype}, not torch.float32")
    if len({av.device, bv.device, sav.device, sbv.device}) != 1:
        raise LeftAlone(f"{node} has operands on several devices")
    (m, _), n = av.shape, bv.shape[1]
    if sav.numel() == 1 and sbv.numel() == 1 and sav.dim() <= 1 and sbv.dim() <= 1:
        mode = "tensor"
    elif tuple(sav.shape) == (m, 1) and tuple(sbv.shape) == (1, n):
        mode = "row"
    else:
        raise LeftAlone(
            f"{node}'s scales {list(sav.shape)} and {list(sbv.shape)} are neither tensorwise ([] or [1] each) nor "
            f"rowwise ([m, 1] = [{m}, 1] and [1, n] = [1, {n}])"
        )
    mm = ScaledMatmul(node, a, b, bias, nodes=[node], scale_a=scale_a, scale_b=scale_b, mode=mode)
    mm.out_dtype, mm.fast_accum = out_dtype, bool(fast)
    if bias is not None:
        biv = meta_val(bias)
        if tuple(biv.shape) != (n,) or not mm.accepts_bias(biv) or biv.device != av.device:
            raise LeftAlone(f"{node}'s bias is {tuple(biv.shape)} {biv.dtype}, not [n] in {out_dtype} or torch.float32")
    return mm


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _is_one(node: object) -> bool:
    """A constant scale of 1 (``new_ones(())``, ``full([], 1)``, as the graph holds it)."""
    if not isinstance(node, fx.Node):
        return False
    if node.target is aten.full.default:
        return node.args[1] == 1
    return node.target in (aten.ones.default, aten.ones_like.default)


def _post_scaled(node: fx.Node) -> ScaledMatmul | None:
    """torchao's rowwise product without fast accumulation: ``_scaled_mm(a, b, 1, 1) * (scale_a * scale_b)``
    (the scales' outer product ``[m, 1] x [1, n]``) [-> converts], the row scales applied after a unit-scaled
    ``_scaled_mm``. None when ``node`` is not that form."""
    converts = []
    top = node
    while node.target is _CONVERT and isinstance(node.args[0], fx.Node):
        converts.append(node)
        node = node.args[0]
    if node.target is not aten.mul.Tensor or len(node.args) != 2:
        return None
    smm = next((a for a in node.args if isinstance(a, fx.Node) and a.target is SCALED_MM), None)
    outer = next((a for a in node.args if a is not smm), None)
    if smm is None or not isinstance(outer, fx.Node) or outer.target is not aten.mul.Tensor:
        return None
    if not (_is_one(smm.args[2]) and _is_one(smm.args[3])):
        return None
    mm = as_scaled_matmul(smm)
    (m, _), n = meta_val(mm.x2d).shape, mm.n
    shapes = [tuple(meta_val(t).shape) if isinstance(t, fx.Node) else None for t in outer.args]
    if shapes not in ([(m, 1), (1, n)], [(1, n), (m, 1)]):
        raise LeftAlone(f"{outer} is not the outer product of [m, 1] = [{m}, 1] and [1, n] = [1, {n}] row scales")
    scale_a, scale_b = outer.args if shapes[0] == (m, 1) else outer.args[::-1]
    if any(meta_val(t).dtype != torch.float32 for t in (scale_a, scale_b)):
        raise LeftAlone(f"{outer}'s row scales are not torch.float32")
    to = meta_val(top).dtype
    if to not in OUT_DTYPES:
        raise LeftAlone(f"{top} is {to}; the coc FP8 ops return {_names(OUT_DTYPES)}")
    inner = [node, *reversed(converts)]
    for cur, nxt in zip([smm, *inner[:-1]], inner, strict=True):
        only_users(cur, {nxt}, "a node of the row-scaled product")
    mm.node, mm.mode, mm.scale_a, mm.scale_b = top, "row", scale_a, scale_b
    mm.nodes = [*reversed(inner), smm, outer, *smm.args[2:4]]
    mm.upcast, mm.out_dtype = (mm.out_dtype if to != mm.out_dtype else None), to
    mm.note = "row scales applied after a unit-scaled _scaled_mm"
    return mm


def scaled_product(node: object) -> Matmul:
    """The product a reduction reads: a ``_scaled_mm``, its upcast to a wider float (torch's float8
    training computes a rowwise fp32 layer in bf16 and converts), torchao's rowwise product applied after a
    unit-scaled ``_scaled_mm`` (:func:`_post_scaled`), else what :func:`kernels.inductor.patterns.as_matmul_or_sum`
    finds."""
    post = _post_scaled(node) if isinstance(node, fx.Node) else None
    if post is not None:
        return post
    if isinstance(node, fx.Node) and node.target is _CONVERT and isinstance(node.args[0], fx.Node):
        inner = node.args[0]
        if inner.target is SCALED_MM:
            mm = as_scaled_matmul(inner)
            to = node.args[1]
            if to not in OUT_DTYPES or torch.finfo(to).bits <= torch.finfo(mm.out_dtype).bits:
                raise LeftAlone(
                    f"{node} converts the scaled matmul's {mm.out_dtype} result to {to}, not wider (or not one the "
                    f"coc FP8 ops return: {_names(OUT_DTYPES)})"
                )
            only_users(inner, {node}, "the scaled matmul's output")
            mm.node, mm.nodes, mm.upcast, mm.out_dtype = node, [node, inner], mm.out_dtype, to
            return mm
    if isinstance(node, fx.Node) and node.target is SCALED_MM:
        return as_scaled_matmul(node)
    return as_matmul_or_sum(node)


# ---- gathers ---------------------------------------------------------------------------------------------------


def find_fp8_gather(ag: fx.Node) -> Gather:
    """:func:`kernels.inductor.patterns.find_gather`, and the form DTensor gives an FP8 gather on dim d > 0:
    the gathered pieces viewed as ``uint8`` for the cat (CPU has no FP8 cat) and the cat viewed back."""
    g = find_gather(ag)
    if g.result is not g.chain[1]:
        return g
    wait, sv = g.result, meta_val(g.shard)
    users = list(wait.users)
    if sv.dtype not in FP8_DTYPES or len(users) != 1 or users[0].target not in SPLITS:
        return g
    views = [v for piece in users[0].users for v in piece.users]
    cats = {u for v in views for u in v.users}
    if not views or not all(v.target is _VIEW_DTYPE for v in views) or len(cats) != 1:
        return g
    cat = next(iter(cats))
    backs = list(cat.users)
    if cat.target is not aten.cat.default or len(backs) != 1 or backs[0].target is not _VIEW_DTYPE:
        return g
    back = backs[0]
    if meta_val(back).dtype != sv.dtype:
        return g
    views_in_order = cat.args[0]
    if not isinstance(views_in_order, (list, tuple)) or any(
        not (isinstance(v, fx.Node) and v.target is _VIEW_DTYPE) for v in views_in_order
    ):
        return g
    pieces = split_pieces([v.args[0] for v in views_in_order], wait, 0, sv.shape[0], g.world)
    dim = arg(cat, 1, "dim", 0) % sv.dim()
    for v in views_in_order:
        only_users(v, {cat}, "a gathered piece's bytes")
    for p in pieces:
        only_users(p, {*pieces, *views_in_order}, "a gathered piece")
    only_users(cat, {back}, "the cat of the gathered bytes")
    return Gather(back, g.shard, dim, g.group_name, g.world, g.group, [ag, wait, *pieces, *views_in_order, cat, back])


def is_fp8_gather(g: Gather) -> bool:
    return meta_val(g.shard).dtype in FP8_DTYPES


def _gather_ending_at(node: fx.Node) -> Gather:
    """The gather whose result is ``node`` (a wait, or the cat of a gather on dim d > 0)."""
    wait = node
    if node.target is aten.cat.default:
        wait = split_source(node.args[0])[0]
    if wait.target is not c10d.wait_tensor.default or wait.args[0].target is not c10d.all_gather_into_tensor.default:
        raise LeftAlone(f"{node} is not the result of an all-gather")
    g = find_gather(wait.args[0])
    if g.result is not node:
        raise LeftAlone(f"{node} is not the whole result of the all-gather {wait.args[0]}")
    return g


def row_scale(mm: ScaledMatmul, g: Gather) -> RowScale:
    """The gathered scale rows behind a rowwise ``scale_a`` of the gathered payload ``g``: reshapes and
    reciprocals of the all-gather of each rank's ``[..., 1]`` scales on ``g``'s dim and group."""
    cur, flips, between = mm.scale_a, 0, []
    while isinstance(cur, fx.Node) and (cur.target in RESHAPES or cur.target is aten.reciprocal.default):
        flips += cur.target is aten.reciprocal.default
        between.append(cur)
        cur = cur.args[0]
    if not isinstance(cur, fx.Node):
        raise LeftAlone(f"{mm.node}'s scale_a is not a graph node")
    try:
        sg = _gather_ending_at(cur)
    except LeftAlone as e:
        raise LeftAlone(
            f"{mm.node}'s rowwise scale_a is not the all-gather of each rank's scale rows ({e}): the gathered rows "
            "would not be scaled by the scales they were quantized with"
        ) from None
    xv, sv = meta_val(g.shard), meta_val(sg.shard)
    if (sg.group_name, sg.dim) != (g.group_name, g.dim) or tuple(sv.shape) != (*xv.shape[:-1], 1):
        raise LeftAlone(
            f"{mm.node}'s scale rows are gathered on dim {sg.dim} of {sg.group_name!r} from {tuple(sv.shape)}, the "
            f"payload on dim {g.dim} of {g.group_name!r} from {tuple(xv.shape)}"
        )
    return RowScale(sg, bool(flips % 2), between)


def _scale_key(mm: ScaledMatmul, rows: RowScale | None) -> tuple:
    return (mm.mode, mm.out_dtype, None if rows is None else (rows.gather.shard, rows.reciprocal))


def scaled_gather_consumers(g: Gather) -> tuple[list[ScaledMatmul], RowScale | None]:
    """The ``_scaled_mm``\\ s whose ``a`` is the gathered FP8 tensor (directly when 2-D, else through a reshape to
    ``[m, k]``) and share one mode, out_dtype and, rowwise, one gathered ``scale_a``; the others are logged
    and left as they are."""
    rv = meta_val(g.result)
    lead, k = tuple(rv.shape[:-1]), rv.shape[-1]
    m = math.prod(lead)
    if g.dim == rv.dim() - 1:
        raise LeftAlone(f"the gather is on the last dim ({g.dim}), the contracted k of a matmul")
    candidates: list[tuple[fx.Node, fx.Node]] = []
    for user in g.result.users:
        if user.target is SCALED_MM and rv.dim() == 2:
            candidates.append((user, g.result))
        elif user.target in RESHAPES and tuple(meta_val(user).shape) == (m, k):
            candidates.extend((u, user) for u in user.users if u.target is SCALED_MM)
    found: list[tuple[ScaledMatmul, RowScale | None]] = []
    for node, x2d in candidates:
        try:
            mm = as_scaled_matmul(node)
            if mm.x2d is not x2d:
                continue  # the gathered tensor is the right operand (a weight gradient): not this pattern
            rows = row_scale(mm, g) if mm.mode == "row" else None
            inputs = [mm.b, mm.scale_b] + ([mm.scale_a] if rows is None else [rows.gather.shard])
            if any(g.result in ancestors(t) for t in inputs + [mm.bias_in] if t is not None):
                raise LeftAlone(f"{node}'s weight, scales or bias depend on the gathered input")
            if rv.dim() > 2:
                mm.post = next((u for u in node.users if is_reshape_to(u, (*lead, mm.n))), None)
            if found and _scale_key(mm, rows) != _scale_key(*found[0]):
                raise LeftAlone(f"{node} differs in mode, out_dtype or scale_a from {found[0][0].node}")
            found.append((mm, rows))
        except LeftAlone as e:
            log.info("coc inductor pass: FP8 all-gather consumer %s left alone: %s", node, e)
    if not found:
        raise LeftAlone("no scaled matmul multiplies the gathered FP8 tensor (as its left operand, scales valid)")
    return [mm for mm, _ in found], found[0][1]


def payload_gather_of_scales(g: Gather) -> bool:
    """Whether ``g`` gathers the rowwise scales of a ``_scaled_mm``: the pass rewrites it with its payload's
    gather, so it waits until that one was tried."""
    todo, seen = [g.result], set()
    while todo:
        cur = todo.pop()
        for user in cur.users:
            if user.target is SCALED_MM and len(user.args) > 2 and user.args[2] is cur:
                return True
            if (user.target in RESHAPES or user.target is aten.reciprocal.default) and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def quantized_after(g: Gather) -> str | None:
    """The ``_scaled_mm`` a gathered high-precision tensor is quantized for, if one is close: the reason the
    report gives (the gather moves bf16 / fp32 rows, the FP8 payload exists only after it)."""
    frontier, seen = [g.result], {g.result}
    for _ in range(_QUANTIZE_DEPTH):
        frontier = [u for cur in frontier for u in cur.users if u not in seen]
        seen.update(frontier)
        hit = next((u for u in frontier if u.target is SCALED_MM), None)
        if hit is not None:
            return str(hit)
    return None
