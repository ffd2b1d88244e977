"""Pattern finding for weight-only int8 matmuls (w8A16) in the coc Inductor pass (docs/inductor.md, "int8 weights").

A module that keeps an int8 weight and dequantizes it in its forward, ``F.linear(x, qweight.to(x.dtype) *
scale[:, None])`` or ``F.linear(x, (qweight.float() * scale).to(x.dtype))``, reaches the post-grad graph as a plain
``mm(x2d, permute(W, [1, 0]))`` whose ``W`` is the dequantization::

    W = [convert] [reshape to [n, k]] mul([reshape] convert(qweight int8), [unsqueeze / reshape] scale)

(the reshapes of a per-group layout, ``[n, G, gs]`` or ``[n * G, gs]``, around the mul). The int8 format of the
coc ops (:func:`kernels.format.int8`) dequantizes ``qweight * scale`` in fp32 and rounds to x's dtype. This
module reads ``W`` as that format's operands (:func:`as_int8`) only where the graph computes the same bits:

* the product in fp32, then, when x is narrower, one rounding to x's dtype: the format's own steps;
* the product in x's dtype (bf16 / fp16) with both factors in it: int8 converts exactly, and the product of an
  int8 (at most 8 significant bits) and a bf16 / fp16 scale (8 / 11 bits) is exact in fp32, so the correctly
  rounded narrow product is the fp32 product rounded once to x's dtype, the format's value.

Any other dequantization raises :class:`LeftAlone` with the reason (a product in fp64, or in a narrow dtype
from an fp32 scale the multiply rounds first, a narrow product rounded again, scales along k, zero points, a
constant scale). The pass then rewrites the plain op on the graph's own dequantized weight, which stays in
the graph: the graph's arithmetic, without the int8 format. Like :mod:`kernels.inductor.patterns`, the finders
change nothing; :func:`op_operands` builds the op's operands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..format import OperandFormat, int8
from .patterns import RESHAPES, LeftAlone, Matmul, meta_val, new_node

aten = torch.ops.aten
_CONVERT = torch.ops.prims.convert_element_type.default
_SHAPES = (*RESHAPES, aten.unsqueeze.default, aten.squeeze.dim)
_TRANSPOSES = ([1, 0], [-1, -2], [-1, 0], [1, -2])
_EXACT_FROM_INT8 = (torch.float16, torch.bfloat16, torch.float32)  # every int8 value is one of theirs
_NARROW_BITS = {torch.bfloat16: 8, torch.float16: 11}  # significand bits: int8 (8) times these fits fp32 (24)
_SOURCE_DEPTH = 8  # how far above the matmul's weight operand an int8 tensor counts as its source


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Int8Weight:
    """The dequantized weight ``W [n, k]`` of a matmul as the int8 format's operands: ``qweight`` holds ``n * k``
    int8 values in ``W``'s row-major order, ``scale`` the values the multiply reads (its shape ops stripped)."""

    qweight: fx.Node
    scale: fx.Node
    mode: str
    group_size: int  # per_group only, else 0
    n: int
    k: int
    how: str  # the graph's arithmetic, for the report
    nodes: list[fx.Node] = field(default_factory=list)  # the dequantization, erased once unused

    @property
    def fmt(self) -> OperandFormat:
        return int8(self.mode, self.group_size, False)

    def describe(self) -> str:
        layout = self.mode + (f", group_size {self.group_size}" if self.group_size else "")
        return f"int8-weight {layout} (dequantized {self.how})"


@dataclass
class Int8Matmul(Matmul):
    """A matmul whose ``b`` is the transpose of a dequantized int8 weight (``weight``)."""

    weight: Int8Weight | None = None


def has_int8_source(node: object) -> bool:
    """Whether an int8 (or uint8) tensor feeds ``node`` within a few ops: a weight dequantized in the graph."""
    frontier, seen = [node], set()
    for _ in range(_SOURCE_DEPTH):
        nxt = []
        for cur in frontier:
            if not isinstance(cur, fx.Node) or cur in seen:
                continue
            seen.add(cur)
            val = cur.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype in (torch.int8, torch.uint8):
                return True
            if cur.op == "call_function":
                nxt.extend(cur.all_input_nodes)
        frontier = nxt
    return False


def _peel(node: fx.Node, targets: tuple) -> tuple[fx.Node, list[fx.Node]]:
    """``node`` followed up through ops of ``targets``: ``(the first other node, the nodes passed, top first)``."""
    passed = []
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets:
        passed.append(node)
        node = node.args[0]
    return node, passed


def _rounding(mul: fx.Node, outer: list[fx.Node], x_dtype: torch.dtype) -> str:
    """How the graph rounds the product ``mul`` on its way to the matmul, if it is the format's rounding."""
    prod = meta_val(mul).dtype
    after = [meta_val(c).dtype for c in reversed(outer) if c.target is _CONVERT]
    if prod not in (torch.float32, x_dtype):
        raise LeftAlone(
            f"the dequantization multiplies in {_name(prod)}; the int8 format multiplies in float32 and rounds "
            f"to x's {_name(x_dtype)}"
        )
    if any(d not in (torch.float32, x_dtype) for d in after):
        raise LeftAlone(
            f"the dequantized weight is converted through {', '.join(map(_name, after))} before the matmul: "
            f"roundings other than the format's one to {_name(x_dtype)}"
        )
    if prod == x_dtype and x_dtype != torch.float32:
        return f"in {_name(prod)}, exact in float32 and rounded once"
    return "in float32" + ("" if x_dtype == torch.float32 else f", rounded to {_name(x_dtype)}")


def _factors(mul: fx.Node) -> tuple[fx.Node, list[fx.Node], fx.Node, fx.Node]:
    """``(qweight, its converts and reshapes, the q factor, the scale factor)`` of ``mul``."""
    if len(mul.args) != 2 or mul.kwargs or not all(isinstance(a, fx.Node) for a in mul.args):
        raise LeftAlone(f"{mul} multiplies the int8 weight by a constant, not a scale tensor")
    sides = []
    for a in mul.args:
        src, chain = _peel(a, (_CONVERT, *RESHAPES))
        if isinstance(src, fx.Node) and meta_val(src).dtype == torch.int8:
            sides.append((src, chain, a, mul.args[1] if a is mul.args[0] else mul.args[0]))
    if len(sides) != 1:
        raise LeftAlone(
            f"{mul} is not one int8 weight (through converts and reshapes) times a scale (zero points, q - offset, "
            "are not matched)"
        )
    q, chain, qf, sf = sides[0]
    for c in chain:
        if c.target is _CONVERT and meta_val(c).dtype not in _EXACT_FROM_INT8:
            raise LeftAlone(f"{c} converts the int8 weight to {_name(meta_val(c).dtype)}")
    if tuple(meta_val(qf).shape) != tuple(meta_val(mul).shape):
        raise LeftAlone(f"{mul} broadcasts the int8 weight {tuple(meta_val(qf).shape)} to {tuple(meta_val(mul).shape)}")
    return q, chain, qf, sf


def _narrow_exact(mul: fx.Node, qf: fx.Node, sf: fx.Node) -> None:
    """A product in x's narrow dtype is the format's only when both factors are in that dtype (the multiply
    rounds nothing first)."""
    prod = meta_val(mul).dtype
    if prod not in _NARROW_BITS:
        return
    got = (meta_val(qf).dtype, meta_val(sf).dtype)
    if got not in ((prod, prod), (torch.int8, prod)):
        raise LeftAlone(
            f"{mul} multiplies {_name(got[0])} by a {_name(got[1])} scale in {_name(prod)}: whether the scale is "
            f"rounded to {_name(prod)} first depends on the kernel that runs it, where the int8 format multiplies by "
            "the scale itself in float32"
        )


def _layout(mul: fx.Node, sf: fx.Node, n: int, k: int) -> tuple[str, int]:
    """``(mode, group_size)`` from the shapes ``mul`` multiplies."""
    shape = tuple(meta_val(mul).shape)
    sv = meta_val(sf)
    if sv.dim() > len(shape):
        raise LeftAlone(f"the scale {tuple(sv.shape)} has more dims than the weight {shape}")
    s = (1,) * (len(shape) - sv.dim()) + tuple(sv.shape)
    if sv.numel() == 1:
        return "per_tensor", 0
    if shape == (n, k):
        if s == (n, 1):
            return "per_channel", 0
    elif len(shape) == 3 and shape[0] == n and shape[1] * shape[2] == k:
        if s == (n, 1, 1):
            return "per_channel", 0
        if s == (n, shape[1], 1):
            return "per_group", shape[2]
    elif len(shape) == 2 and shape[1] and k % shape[1] == 0 and shape[0] == n * (k // shape[1]):
        if s == (shape[0], 1):
            return "per_group", shape[1]
    else:
        raise LeftAlone(
            f"the dequantization multiplies the weight as {list(shape)}, neither [n, k] = [{n}, {k}] nor a group "
            "layout of it ([n, G, gs] or [n * G, gs])"
        )
    raise LeftAlone(
        f"the scale {list(sv.shape)} of the weight {list(shape)} is neither one value, one per output row (n = {n}) "
        "nor one per group of k of each row: the int8 format's scales (a scale along k is not one of them)"
    )


def int8_weight(b: fx.Node, x_dtype: torch.dtype) -> Int8Weight | None:
    """The int8 operands of the weight ``b`` transposes (``b [k, n]`` the matmul's right operand), None when no
    int8 tensor feeds ``b``; :class:`LeftAlone` when one does but not as the format's dequantization."""
    if not has_int8_source(b):
        return None
    transposed = (b.target is aten.permute.default and list(b.args[1]) in _TRANSPOSES) or b.target is aten.t.default
    if not transposed:
        raise LeftAlone(f"{b}, an int8 weight dequantized in the graph, is not the transpose of a [n, k] weight")
    w = b.args[0]
    n, k = meta_val(w).shape
    mul, outer = _peel(w, (_CONVERT, *RESHAPES))
    if not (isinstance(mul, fx.Node) and mul.target is aten.mul.Tensor):
        raise LeftAlone(
            f"the int8 weight's dequantization ends in {mul} ({getattr(mul, 'target', mul)}), not qweight * scale "
            "(zero points, q - offset, are not matched)"
        )
    how = _rounding(mul, outer, x_dtype)
    q, chain, qf, sf = _factors(mul)
    _narrow_exact(mul, qf, sf)
    if meta_val(q).numel() != n * k:
        raise LeftAlone(f"the int8 weight {tuple(meta_val(q).shape)} does not hold the [{n}, {k}] weight")
    mode, group_size = _layout(mul, sf, n, k)
    if meta_val(sf).dtype not in _EXACT_FROM_INT8:
        raise LeftAlone(f"the scale is {_name(meta_val(sf).dtype)}; the int8 format reads it in float32")
    scale, shapes = _peel(sf, _SHAPES)
    nodes = [b, *outer, mul, *chain, *shapes]
    return Int8Weight(q, scale, mode, group_size, n, k, how, nodes)


def as_int8(mm: Matmul) -> Matmul:
    """``mm`` as an :class:`Int8Matmul` when its weight is a dequantized int8 weight the format computes, ``mm``
    itself when no int8 tensor feeds it (or it is an FP8 matmul); :class:`LeftAlone` with the reason otherwise."""
    if type(mm) is not Matmul:
        return mm
    if mm.parts:
        if any(has_int8_source(p.b) for p in mm.parts):
            raise LeftAlone("a sum of matmuls of int8 weights (one op multiplies one weight with one scale layout)")
        return mm
    xv = meta_val(mm.x2d)
    w = int8_weight(mm.b, xv.dtype)
    if w is None:
        return mm
    allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if xv.device.type == "cpu" else ())
    if xv.dtype not in allowed:
        raise LeftAlone(
            f"x is {_name(xv.dtype)} on {xv.device.type}; the int8 ops take {', '.join(map(_name, allowed))} there"
        )
    return Int8Matmul(mm.node, mm.x2d, mm.b, mm.bias_in, post=mm.post, nodes=mm.nodes, parts=mm.parts, weight=w)


def _fallback(reason: object) -> str:
    return f"int8 weight kept dequantized in the graph, the plain op multiplies it: {reason}"


def int8_reduced(mm: Matmul) -> tuple[Matmul, str]:
    """The matmul a reduction reads, as an int8 matmul where it is one, and the report's note when an int8
    weight is left to the plain op."""
    try:
        return as_int8(mm), ""
    except LeftAlone as e:
        return mm, _fallback(e)


def int8_consumers(mms: list[Matmul]) -> tuple[list[Matmul], str]:
    """The matmuls of one gather as int8 matmuls when every one is, with one scale layout (one op, one format);
    else as they are, with the report's note when an int8 weight is among them."""
    out, reasons = [], []
    for mm in mms:
        try:
            out.append(as_int8(mm))
        except LeftAlone as e:
            out.append(mm)
            reasons.append(str(e))
    int8s = [mm for mm in out if isinstance(mm, Int8Matmul)]
    if not int8s and not reasons:
        return mms, ""
    if reasons:
        return mms, _fallback("; ".join(reasons))
    if len(int8s) != len(out):
        return mms, _fallback("the gather also feeds matmuls of plain weights (one op, one operand format)")
    layouts = sorted({(mm.weight.mode, mm.weight.group_size) for mm in int8s})  # type: ignore[union-attr]
    if len(layouts) > 1:
        return mms, _fallback(f"the gather's weights differ in scale layout {layouts} (one op, one layout)")
    return out, ""


def op_operands(graph: fx.Graph, w: Int8Weight, new: list[fx.Node]) -> tuple[fx.Node, fx.Node]:
    """``(qweight [n, k], scale)`` as the int8 ops take them (scale ``[]``, ``[n]`` or ``[n, G]``); new nodes are
    appended to ``new``."""
    q = w.qweight
    if tuple(meta_val(q).shape) != (w.n, w.k):
        q = new_node(graph, aten.reshape.default, q, [w.n, w.k])
        new.append(q)
    want = {"per_tensor": [], "per_channel": [w.n], "per_group": [w.n, -(-w.k // max(w.group_size, 1))]}[w.mode]
    scale = w.scale
    if list(meta_val(scale).shape) != want:
        scale = new_node(graph, aten.reshape.default, scale, want)
        new.append(scale)
    return q, scale
