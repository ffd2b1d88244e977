"""All-reduce -> residual add -> RMSNorm in the Inductor pass (docs/inductor.md, "All-reduce, residual add, RMSNorm").

A tensor-parallel decoder layer ends with a row-parallel linear whose all-reduce is added to the residual stream and
RMS-normalized for the next block. Inductor's post-grad graph holds the norm decomposed, as HF's ``LlamaRMSNorm``
writes it (``h`` of dtype ``H``, ``H`` fp32, bf16 or fp16)::

    h  = add(reduced [-> reshape], residual)            # the new residual stream, used by later layers too
    hf = h [-> convert_element_type(fp32) when H is not fp32]
    r  = rsqrt(mean(pow(hf, 2), [-1], keepdim=True) + eps)
    H fp32:  out = mul(mul(hf, r), weight)               # either operand order; F.rms_norm too
    else:    out = mul(weight, convert_element_type(mul(hf, r), H))

which is :mod:`kernels.ops.norm`'s epilogue with ``quant=None``: ``out = (h * rstd).to(H) * weight``,
``residual_out = h``. This module rewrites it

* after a functional all-reduce (sum) of anything: into ``coc.all_reduce_rmsnorm`` (:func:`rewrite_all_reduce`,
  called by the pass when the all-reduce is not a matmul's);
* after a ``coc.matmul_all_reduce`` that the pass has just made of a matmul and its all-reduce: into the GEMM
  epilogue ``coc.matmul_all_reduce_rmsnorm``, the same call with ``epilogue="rmsnorm"`` (:func:`fuse_norm`; plain,
  FP8 and int8 formats alike).

Both ops return ``(out, residual_out, scale)``; ``residual_out`` replaces ``h`` for its other users. The ops add
the residual to the fp32 sum before rounding it and normalize that fp32 ``h``; a bf16 / fp16 graph rounds the sum
and ``h`` first: the rewrite removes those roundings and adds none (docs/inductor.md). Everything that differs
from the form above is left alone with the reason: another reduction than sum, a mean over other dims or without
keepdim, an eps that is not a constant, a weight not ``[n]``, a broadcasting add, an intermediate used outside the
norm, or F.rms_norm's order in bf16 / fp16 (the weight multiplied before the rounding to ``H``, which the op
rounds first).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from ..ops import all_reduce, all_reduce_rmsnorm
from ..ops.gemm import GemmCall
from ..protocol import decide, requested
from .patterns import RESHAPES, LeftAlone, ancestors, arg, meta_val, new_node, resolve_group

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional
_CONVERT = prims.convert_element_type.default
_ADDS = (aten.add.Tensor, aten.add.Scalar)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class NormTail:
    """``out = rmsnorm(reduced [-> view] + residual) * weight`` after a reduced tensor (module docstring)."""

    reduced: fx.Node
    view: fx.Node | None
    add: fx.Node  # h: replaced by the op's residual_out
    residual: fx.Node
    weight: fx.Node
    eps: float
    out: fx.Node  # replaced by the op's out
    nodes: list[fx.Node] = field(default_factory=list)  # the norm's intermediates

    def replaced(self) -> list[fx.Node]:
        """The nodes from ``reduced`` to ``out``, in graph order: erased after the rewrite."""
        return [self.reduced, *([self.view] if self.view is not None else []), self.add, *self.nodes, self.out]


def _users(node: fx.Node) -> list[fx.Node]:
    return list(node.users)


def _other(node: fx.Node, one: fx.Node) -> object:
    """The operand of the binary ``node`` that is not ``one``."""
    a, b = node.args[:2]
    return b if a is one else a


def _square_of(hf: fx.Node) -> fx.Node | None:
    """The user of ``hf`` that squares it (``pow(hf, 2)`` or ``hf * hf``), if any."""
    for u in hf.users:
        if u.target is aten.pow.Tensor_Scalar and u.args[0] is hf and u.args[1] == 2:
            return u
        if u.target is aten.mul.Tensor and u.args[:2] == (hf, hf):
            return u
    return None


def _norm_input(h: fx.Node) -> fx.Node | None:
    """``hf``: ``h`` itself when it is fp32, else its conversion to fp32; None when no square of it follows
    (then no RMSNorm reads ``h``)."""
    if meta_val(h).dtype == torch.float32:
        return h if _square_of(h) is not None else None
    for u in h.users:
        if u.target is _CONVERT and u.args[1] == torch.float32 and _square_of(u) is not None:
            return u
    return None


def _residual_add(reduced: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """``(view, add)``: an add reading ``reduced`` (directly, or through a reshape ``view``) that an RMSNorm reads,
    or ``(None, None)``."""
    for user in reduced.users:
        adds = [user] if user.target is aten.add.Tensor else []
        if user.target in RESHAPES:
            adds = [u for u in user.users if u.target is aten.add.Tensor]
        for add in adds:
            if _norm_input(add) is not None:
                return (None if add is user else user), add
    return None, None


def norm_follows(reduced: fx.Node) -> bool:
    """Whether ``reduced`` (a wait, or a coc reducing op's output) is added to something that an RMSNorm reads: a
    cheap look at the shape of the pattern; :func:`find_norm` checks it."""
    if reduced.target is c10d.all_reduce.default:
        waits = _users(reduced)
        if len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default:
            return False
        reduced = waits[0]
    try:
        return _residual_add(reduced)[1] is not None
    except LeftAlone:
        return False


def _only(node: fx.Node, allowed: set[fx.Node], what: str) -> None:
    extra = [u for u in node.users if u not in allowed]
    if extra:
        raise LeftAlone(f"{what} ({node}) is also used by {', '.join(map(str, extra))}: it would not exist any more")


def _single(node: fx.Node, target: object, what: str) -> fx.Node:
    """The one user of ``node``, a ``target`` (one or a tuple), or :class:`LeftAlone`: each step of the norm feeds
    only the next."""
    users = _users(node)
    if len(users) != 1 or users[0].target not in (target if isinstance(target, tuple) else (target,)):
        raise LeftAlone(f"{node} is not used by exactly one {what} (users: {', '.join(map(str, users)) or 'none'})")
    return users[0]


def _eps(node: fx.Node) -> float:
    eps = node.args[1]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise LeftAlone(f"the norm's eps {eps!r} is not a constant number")
    if not math.isfinite(eps) or eps < 0:
        raise LeftAlone(f"the norm's eps {eps!r} is not finite and >= 0")
    return float(eps)


def find_norm(reduced: fx.Node) -> NormTail:
    """The RMSNorm of the module docstring after ``reduced``, every step checked, or :class:`LeftAlone` naming the
    step that differs."""
    rv = meta_val(reduced)
    dtype, n = rv.dtype, rv.shape[-1]
    if dtype not in _DTYPES:
        raise LeftAlone(f"the reduced tensor is {dtype}; the norm is matched for {_DTYPES}")
    view, add = _residual_add(reduced)
    if add is None:
        raise LeftAlone("no RMSNorm reads the sum of the reduced tensor and a residual")
    start = view if view is not None else reduced
    _only(reduced, {view if view is not None else add}, "the reduced tensor")
    if view is not None:
        _only(view, {add}, "the reshaped reduced tensor")
    if view is not None and (meta_val(view).shape[-1] != n or meta_val(view).numel() != rv.numel()):
        raise LeftAlone(f"the reshape {view} changes the last dim {n} (the norm's)")
    if len(add.args) != 2 or add.kwargs or add.args[0] is add.args[1]:
        raise LeftAlone(f"{add} is not a plain sum of the reduced tensor and a residual")
    residual = _other(add, start)
    hv = meta_val(add)
    if not isinstance(residual, fx.Node):
        raise LeftAlone(f"the residual {residual!r} is not a graph tensor")
    resv = meta_val(residual)
    if tuple(resv.shape) != tuple(hv.shape) or tuple(meta_val(start).shape) != tuple(hv.shape):
        raise LeftAlone(f"{add} broadcasts ({tuple(meta_val(start).shape)} + {tuple(resv.shape)})")
    if resv.dtype != dtype or hv.dtype != dtype or resv.device != rv.device:
        raise LeftAlone(f"the residual is {resv.dtype} on {resv.device}; the sum is {dtype} on {rv.device}")
    hf = _norm_input(add)
    assert hf is not None
    square = _square_of(hf)
    assert square is not None
    mean = _single(square, aten.mean.dim, "mean")
    dims = arg(mean, 1, "dim")
    if mean.args[0] is not square or list(dims or []) not in ([-1], [hv.dim() - 1]) or not arg(mean, 2, "keepdim"):
        raise LeftAlone(f"{mean} is not a mean over the last dim with keepdim (dims {dims})")
    if mean.kwargs.get("dtype") is not None:
        raise LeftAlone(f"{mean} converts to {mean.kwargs['dtype']}")
    plus = _single(mean, _ADDS, "add of eps")
    if plus.args[0] is not mean:
        raise LeftAlone(f"{plus} does not add eps to the mean")
    eps = _eps(plus)
    rsqrt = _single(plus, aten.rsqrt.default, "rsqrt")
    scaled = _single(rsqrt, aten.mul.Tensor, "mul")
    if _other(scaled, rsqrt) is not hf:
        raise LeftAlone(f"{scaled} multiplies the rstd by {_other(scaled, rsqrt)}, not the normalized input")
    nodes = [square, mean, plus, rsqrt, scaled]
    if dtype == torch.float32:
        out = _single(scaled, aten.mul.Tensor, "mul by the weight")
        weight = _other(out, scaled)
    else:
        nxt = _single(scaled, (aten.mul.Tensor, _CONVERT), f"conversion to {dtype}")
        if nxt.target is aten.mul.Tensor:
            raise LeftAlone(
                f"{nxt} multiplies the weight into the fp32 normalized values before rounding to {dtype} "
                "(F.rms_norm's order); the coc ops round to it first, as HF's RMSNorm does"
            )
        if nxt.args[1] != dtype:
            raise LeftAlone(f"{nxt} converts the normalized values to {nxt.args[1]}, not {dtype}")
        nodes.append(nxt)
        out = _single(nxt, aten.mul.Tensor, "mul by the weight")
        weight = _other(out, nxt)
    if not isinstance(weight, fx.Node) or out.kwargs:
        raise LeftAlone(f"{out} multiplies by {weight!r}, not a weight tensor")
    wv = meta_val(weight)
    if tuple(wv.shape) != (n,) or wv.dtype not in _DTYPES or wv.device != rv.device:
        raise LeftAlone(f"the norm weight is {list(wv.shape)} {wv.dtype}, not [{n}] of {_DTYPES}")
    if wv.dtype != dtype and not (dtype == torch.float32 and wv.itemsize < 4):
        raise LeftAlone(f"the {wv.dtype} weight promotes the {dtype} norm output")
    if meta_val(out).dtype != dtype:
        raise LeftAlone(f"the norm output is {meta_val(out).dtype}, not {dtype}")
    if hf is not add:
        nodes.insert(0, hf)
        _only(hf, {square, scaled}, "the fp32 copy of the sum")
    for t, what in ((residual, "residual"), (weight, "norm weight")):
        if reduced in ancestors(t):
            raise LeftAlone(f"the {what} {t} depends on the reduced tensor")
    return NormTail(reduced, view, add, residual, weight, eps, out, nodes)


def _replace(graph: fx.Graph, tail: NormTail, op: fx.Node, new: list[fx.Node]) -> None:
    """Point the norm's output and the residual sum at ``op``'s ``out`` and ``residual_out`` (reshaped back to the
    add's shape when the reduction was viewed), after checking they have the graph's shapes and dtypes."""
    results = []
    for i, old in ((0, tail.out), (1, tail.add)):
        node = new_node(graph, operator.getitem, op, i)
        new.append(node)
        if tail.view is not None:
            node = new_node(graph, aten.reshape.default, node, list(meta_val(old).shape))
            new.append(node)
        nv, ov = meta_val(node), meta_val(old)
        if tuple(nv.shape) != tuple(ov.shape) or nv.dtype != ov.dtype:
            for dead in reversed(new):
                graph.erase_node(dead)
            raise LeftAlone(f"the coc op would give {tuple(nv.shape)} {nv.dtype} where the graph has {tuple(ov.shape)}")
        results.append(node)
    tail.out.replace_all_uses_with(results[0])
    tail.add.replace_all_uses_with(results[1])


def _erase(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` (users after what they read) once nothing uses them."""
    for node in reversed(nodes):
        if not node.users:
            graph.erase_node(node)


def _residual_rows(graph: fx.Graph, tail: NormTail, new: list[fx.Node]) -> fx.Node:
    """The residual in the reduced tensor's shape (the ops' x rows)."""
    if tail.view is None:
        return tail.residual
    node = new_node(graph, aten.reshape.default, tail.residual, list(meta_val(tail.reduced).shape))
    new.append(node)
    return node


def rewrite_all_reduce(graph: fx.Graph, coll: fx.Node) -> str:
    """``coll`` (a functional all-reduce) -> wait -> add -> RMSNorm as ``coc.all_reduce_rmsnorm``, or
    :class:`LeftAlone`. Called when the all-reduce is not a matmul's (else :func:`fuse_norm` fuses it)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    x, reduce_op, name = coll.args[0], arg(coll, 1, "reduce_op"), arg(coll, 2, "group_name")
    if reduce_op != "sum":
        raise LeftAlone(f"the reduction is {reduce_op!r}, not 'sum'")
    group, world = resolve_group(name, None)
    tail = find_norm(_single(coll, c10d.wait_tensor.default, "wait"))
    xv = meta_val(x)
    with unset_fake_temporarily():
        stand_in = torch.empty((), dtype=xv.dtype, device=xv.device).expand(tuple(xv.shape))
        # The eager op's own choices (its backend for this group and device, its size switch), constants of the
        # compiled graph as the matmul ops' backends are.
        algorithm = all_reduce_rmsnorm.choose_algorithm("auto", stand_in, world)
        call = all_reduce_rmsnorm.NormCall(
            op="all_reduce_rmsnorm", group_name=name, world=world, algorithm=algorithm, eps=float(tail.eps)
        )
        call = decide(all_reduce_rmsnorm.SPEC, requested(call, None), xv.device)
    backend = call.backend
    new: list[fx.Node] = []
    with graph.inserting_before(tail.add):
        residual = _residual_rows(graph, tail, new)
        op = new_node(graph, all_reduce_rmsnorm.SPEC.operator, x, residual, tail.weight, call.encode())
        new.append(op)
        _replace(graph, tail, op, new)
    _erase(graph, [coll, *tail.replaced()])
    return (
        f"all_reduce(sum) of {tuple(xv.shape)} -> add residual -> RMSNorm(eps={tail.eps:g}) "
        f"-> coc all_reduce_rmsnorm ({backend}, {algorithm})"
    )


def _fuse(graph: fx.Graph, node: fx.Node) -> str:
    """The ``coc.matmul_all_reduce`` ``node`` and the norm after it as ``coc.matmul_all_reduce_rmsnorm``."""
    tail = find_norm(node)
    call = GemmCall.decode(node.args[-1])
    new: list[fx.Node] = []
    with graph.inserting_before(tail.add):
        residual = _residual_rows(graph, tail, new)
        # The backend was chosen for this call already; the epilogue changes what follows the reduction only, and
        # the epilogue has no chunked backend (the reduction serves decode sizes whole).
        backend = "sequential" if call.backend == "chunked" else call.backend
        text = replace(call, epilogue="rmsnorm", eps=float(tail.eps), backend=backend, parallel_num=1).encode()
        op = new_node(graph, all_reduce.NORM_SPEC.operator, *node.args[:-1], residual, tail.weight, text)
        new.append(op)
        _replace(graph, tail, op, new)
    _erase(graph, tail.replaced())
    return (
        f"-> {tuple(meta_val(tail.add).shape)} + residual -> RMSNorm(eps={tail.eps:g}): "
        "coc matmul_all_reduce_rmsnorm (the GEMM epilogue)"
    )


def fuse_norm(graph: fx.Graph, node: fx.Node, pattern: str, detail: str) -> tuple[str, str]:
    """After the pass made ``node``, a ``coc.matmul_all_reduce`` (``pattern``, its report ``detail``): fuse the
    RMSNorm after it into the GEMM epilogue. Returns the rewrite's pattern and detail for the report, the norm's
    part added (or, when a norm follows and differs, the reason it stays: the matmul all-reduce is rewritten all
    the same), so that the report keeps one entry per collective."""
    if node.target is not all_reduce.SPEC.operator or GemmCall.decode(node.args[-1]).epilogue or not norm_follows(node):
        return pattern, detail
    try:
        return "matmul_all_reduce_rmsnorm", f"{detail}; {_fuse(graph, node)}"
    except LeftAlone as e:
        return pattern, f"{detail}; the RMSNorm after it left alone: {e}"
