"""SPMD dispatch of the ops that have rules: matmul, linear, + - * /, gelu, relu, softmax,
layer_norm, sum, mean. Each op: cached rule, reshards the rule asks for, the local torch op, one
wrapper, and (when a gradient is wanted) one autograd node (:mod:`autopar.dtensor.autograd`).

On a rank outside the op's mesh (pipeline non-computation clip) an op runs only its cached rule
and returns an uninitialized DistTensor (zero-element piece, no storage) with the right global
shape, dtype, mesh and placements; its backward likewise does nothing there.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .autograd import (
    grad_placement,
    graph_vjp,
    kernels_api,
    output_grad,
    pieces_nonempty,
    record,
    requires_grad,
    requires_grads,
    reshard_backward,
    reshard_same_mesh,
    vjp_backward,
)
from .mesh import ProcessMesh
from .placements import REPLICATE, Partial, Replicate, Shard
from .rules import RuleResult, broadcast_labels, einsum_rule, matmul_labels, reduction_labels
from .tensor import HANDLERS, UNARY_PLAIN, DistTensor, empty_local, lid_of, make, pending, uninit, wrap

_RULE_CACHE: dict[tuple, tuple] = {}
_MM_CACHE: dict[tuple, tuple] = {}
# (op, input layout ids) -> (mesh, out placements, out shape, out layout id) for calls that need no
# reshard, no overlapped kernel and no autograd: the per-op hot path of inference (and of
# bench.dispatch_overhead). The mesh is compared by identity, so an entry serves one mesh only.
_PLAIN: dict[tuple, tuple] = {}


def _as_dist(x: Any, mesh: ProcessMesh) -> DistTensor:
    """A plain tensor mixed into a DistTensor op is the same value on every rank: Replicate."""
    if isinstance(x, DistTensor):
        if x._mesh is not mesh and x._mesh != mesh:
            raise ValueError(
                f"operands live on different meshes ({x._mesh} and {mesh}); move one "
                f"with autopar.reshard(t, mesh, placements) first"
            )
        return x
    if isinstance(x, torch.Tensor):
        pl = (REPLICATE,) * mesh.ndim
        if mesh.my_coordinate is None:
            return uninit(mesh, pl, x.shape, x.dtype, x.device)
        # Plain tensors are constants of the op: no gradient flows back to them.
        return make(x.detach(), mesh, pl, x.shape, x.dtype)
    raise TypeError(f"expected a DistTensor or torch.Tensor, got {type(x).__name__}")


def _rule_entry(key: tuple, rule: Callable[..., RuleResult], inputs: Sequence[DistTensor]) -> tuple:
    entry = _RULE_CACHE.get(key)
    if entry is None:
        res = rule(*inputs)
        entry = _RULE_CACHE[key] = (
            res,
            tuple(lid_of(x._shape, p) for x, p in zip(inputs, res.in_placements, strict=False)),
            lid_of(res.out_shape, res.out_placements),
        )
    return entry


# The hot paths for one and two inputs (no gradient wanted, rule cached, inputs already in the
# layout the rule wants, this rank in the mesh): bench.dispatch_overhead times exactly these, so
# they do nothing beyond the lookup, the local op and the wrapper, and fill _PLAIN for next time.
_grad_enabled = torch.is_grad_enabled


def _apply1(
    key: tuple,
    rule: Callable[..., RuleResult],
    local_fn: Callable,
    x: DistTensor,
    vjp: Callable | None = None,
    plain: dict[int, tuple] | None = None,
) -> DistTensor:
    """``plain``: the op's UNARY_PLAIN table, for ops whose registered torch functions compute
    ``local_fn(piece)`` when given the piece alone; a call served here enters its layout there."""
    entry = _RULE_CACHE.get(key)
    if entry is not None and not _grad_enabled() and x._lid == entry[1][0] and x._mesh._coord is not None:
        local = local_fn(x._local)
        res = entry[0]
        f = (x._mesh, res.out_placements, res.out_shape, entry[2])
        if plain is not None:
            plain[x._lid] = f
        return wrap(local, *f)
    return _apply(key, rule, local_fn, [x], vjp=vjp)


def _apply2(
    key: tuple,
    rule: Callable[..., RuleResult],
    local_fn: Callable,
    a: DistTensor,
    b: DistTensor,
    vjp: Callable | None = None,
) -> DistTensor:
    entry = _RULE_CACHE.get(key)
    if entry is not None and not _grad_enabled():
        in_lids = entry[1]
        if a._lid == in_lids[0] and b._lid == in_lids[1] and a._mesh._coord is not None:
            local = local_fn(a._local, b._local)
            res = entry[0]
            _PLAIN[key] = (a._mesh, res.out_placements, res.out_shape, entry[2])
            return wrap(local, a._mesh, res.out_placements, res.out_shape, entry[2])
    return _apply(key, rule, local_fn, [a, b], vjp=vjp)


def _apply(
    key: tuple,
    rule: Callable[..., RuleResult],
    local_fn: Callable,
    inputs: list[DistTensor],
    out_dtype: torch.dtype | None = None,
    vjp: Callable | None = None,
) -> DistTensor:
    """Run one op: cached rule, reshard inputs, local op (or clip), record the autograd node.

    ``rule(*inputs)`` is called only when ``key`` is not cached (a module-level function, so the
    hot path allocates no closure). ``vjp(saved_input_pieces, grad_piece, need)``: the op's local
    vector-Jacobian product; without one, the local op is recorded on torch's graph and
    differentiated with ``torch.autograd.grad`` (a reentrant engine call, several times slower).
    """
    res, in_lids, out_lid = _rule_entry(key, rule, inputs)
    for i, x in enumerate(inputs):
        if x._lid != in_lids[i]:
            inputs[i] = reshard_same_mesh(x, res.in_placements[i])
    mesh = inputs[0]._mesh
    need = requires_grads(inputs) if _grad_enabled() else None
    if need is None or not any(need):
        if mesh._coord is None:
            dtype = out_dtype or _promote(inputs)
            return make(
                empty_local(dtype, inputs[0]._local.device),
                mesh,
                res.out_placements,
                res.out_shape,
                dtype,
                False,
                out_lid,
            )
        local = local_fn(*[x._local for x in inputs])
        return wrap(local, mesh, res.out_placements, res.out_shape, out_lid)
    ctx = (
        res,
        [x._placements for x in inputs],
        [x._shape for x in inputs],
        [x._dtype for x in inputs],
        need,
        vjp or graph_vjp,
    )
    if mesh._coord is None:
        dtype = out_dtype or _promote(inputs)
        out = make(
            empty_local(dtype, inputs[0]._local.device), mesh, res.out_placements, res.out_shape, dtype, False, out_lid
        )
        return record(out, inputs, vjp_backward, ctx)
    if vjp is not None:
        pieces = [x._local for x in inputs]
        local = local_fn(*pieces)
        out = make(local, mesh, res.out_placements, res.out_shape, local.dtype, True, out_lid)
        return record(out, inputs, vjp_backward, ctx, pieces)
    leaves = [x._local.detach().requires_grad_() if n else x._local for x, n in zip(inputs, need, strict=False)]
    with torch.enable_grad():
        local = local_fn(*leaves)
    out = make(local.detach(), mesh, res.out_placements, res.out_shape, local.dtype, True, out_lid)
    return record(out, inputs, vjp_backward, ctx, [local] + [leaf for leaf, n in zip(leaves, need, strict=False) if n])


def _promote(ins: list[DistTensor]) -> torch.dtype:
    dtype = ins[0]._dtype
    for x in ins[1:]:
        dtype = torch.promote_types(dtype, x._dtype)
    return dtype


# -- overlapped matmul + collective (kernels) --------------------------------------------------------


def _mm_backward(ctx: tuple, saved: tuple, g: DistTensor) -> list[DistTensor | None]:
    """Explicit vjp of ``y = x @ w.T`` (x [..., k], w [n, k]) for the overlapped paths.

    dgrad ``dx = dy @ w``, wgrad ``dw = dy_2d.T @ x_2d``; placements as any local vjp.
    """
    res, in_pls, in_shapes, in_dtypes, need, transposed = ctx
    x_local, w_local = saved
    out_pl = res.out_placements
    g = output_grad(g, out_pl)
    mesh = g._mesh
    grads: list[DistTensor | None] = []
    for i in range(2):
        if not need[i]:
            grads.append(None)
            continue
        pl = grad_placement(in_pls[i], in_pls[:i] + in_pls[i + 1 :], out_pl, g._placements)
        if not g._init:
            grads.append(uninit(mesh, pl, in_shapes[i], in_dtypes[i], g._local.device))
            continue
        gl = g._local
        if i == 0:
            partial = [m for m, p in enumerate(pl) if type(p) is Partial]
            if (
                len(partial) == 1
                and mesh.shape[partial[0]] > 1
                and gl.ndim >= 2
                and pieces_nonempty(res.out_shape[-1], mesh.shape[partial[0]])
            ):
                # dgrad that is Partial on one mesh dim (e.g. Megatron's sequence-parallel column
                # backward): left pending, so the reshard that follows (reduce-scatter back to
                # Shard(0)) runs as one overlapped matmul_reduce_scatter.
                grads.append(pending(gl, w_local.mT, mesh, pl, in_shapes[i], in_dtypes[i], partial[0]))
                continue
            lg = torch.matmul(gl, w_local)
        else:
            lg = gl.flatten(0, -2).T @ x_local.flatten(0, -2)
            if transposed:
                lg = lg.T
        grads.append(make(lg, mesh, pl, in_shapes[i], lg.dtype))
    return grads


def _record_mm(
    out: DistTensor,
    x: DistTensor,
    b: DistTensor,
    x_local: torch.Tensor,
    w_local: torch.Tensor,
    res: RuleResult,
    transposed: bool,
) -> DistTensor:
    if not torch.is_grad_enabled():
        return out
    need = requires_grads((x, b))
    if not any(need):
        return out
    ctx = (res, [x._placements, b._placements], [x._shape, b._shape], [x._dtype, b._dtype], need, transposed)
    return record(out, [x, b], _mm_backward, ctx, [x_local, w_local])


def _matmul_like(
    key: tuple, rule: Callable[..., RuleResult], local_fn: Callable, a: DistTensor, b: DistTensor, transposed: bool
) -> DistTensor:
    """matmul / linear with a 2-D weight: route the two overlappable patterns to ``kernels``.

    ``transposed``: b is ``[k, n]`` (matmul) rather than ``[n, k]`` (linear).
    """
    entry = _MM_CACHE.get(key)
    if entry is None:
        res = rule(a, b)
        partial = [m for m, p in enumerate(res.out_placements) if type(p) is Partial]
        pend_dim = (
            partial[0]
            if len(partial) == 1 and b.ndim == 2 and a.ndim >= 2 and res.out_placements[partial[0]].reduce_type == "sum"
            else -1
        )
        entry = _MM_CACHE[key] = (
            res,
            (lid_of(a._shape, res.in_placements[0]), lid_of(b._shape, res.in_placements[1])),
            lid_of(res.out_shape, res.out_placements),
            pend_dim,
        )
    res, in_lids, out_lid, pend_dim = entry
    mesh = a._mesh
    if mesh._coord is None or b._lid != in_lids[1]:
        return _apply(key, rule, local_fn, [a, b])
    if a._lid == in_lids[0]:
        if pend_dim >= 0 and mesh.shape[pend_dim] > 1 and pieces_nonempty(a._shape[-1], mesh.shape[pend_dim]):
            w_local = b._local.mT if transposed else b._local
            out = pending(
                a._local,
                w_local,
                mesh,
                res.out_placements,
                res.out_shape,
                torch.promote_types(a._dtype, b._dtype),
                pend_dim,
                out_lid,
            )
            return _record_mm(out, a, b, a._local, w_local, res, transposed)
        local = local_fn(a._local, b._local)
        out = make(local, mesh, res.out_placements, res.out_shape, local.dtype, True, out_lid)
        if not _grad_enabled():
            _PLAIN[key] = (mesh, res.out_placements, res.out_shape, out_lid)
            return out
        return _record_mm(out, a, b, a._local, b._local.mT if transposed else b._local, res, transposed)
    w_local = b._local.mT if transposed else b._local
    # all_gather_matmul: a is Shard(0) on exactly one mesh dim that the rule gathers, b is
    # sharded on the output columns there, and nothing else changes.
    diff = [m for m, (p, q) in enumerate(zip(a._placements, res.in_placements[0], strict=False)) if p != q]
    if len(diff) != 1:
        return _apply(key, rule, local_fn, [a, b])
    m = diff[0]
    W = mesh.shape[m]
    if (
        a._placements[m] != Shard(0)
        or type(res.in_placements[0][m]) is not Replicate
        or res.out_placements[m] != Shard(a.ndim - 1)
        or a._shape[0] % W
    ):
        return _apply(key, rule, local_fn, [a, b])
    y, gathered = kernels_api().all_gather_matmul(a._local, w_local, group=mesh.get_group(m), return_gathered=True)
    a_full = make(gathered, mesh, res.in_placements[0], a._shape, a._dtype, True, in_lids[0])
    if torch.is_grad_enabled() and requires_grad(a):
        a_full = record(a_full, [a], reshard_backward, a._placements)
    out = make(y, mesh, res.out_placements, res.out_shape, y.dtype, True, out_lid)
    return _record_mm(out, a_full, b, gathered, w_local, res, transposed)


# -- ops ----------------------------------------------------------------------------------------------


def _mesh_of(*xs) -> ProcessMesh:
    for x in xs:
        if isinstance(x, DistTensor):
            return x._mesh
    raise TypeError("no DistTensor among the operands")


def _matmul_rule(a: DistTensor, b: DistTensor) -> RuleResult:
    labels, out, forbidden = matmul_labels(a._shape, b._shape)
    return einsum_rule(
        labels, out, [a._shape, b._shape], [a._placements, b._placements], "linear", forbidden, priority=(1, 0)
    )


def matmul(a, b) -> DistTensor:
    if type(a) is DistTensor and type(b) is DistTensor:
        f = _PLAIN.get(("matmul", a._lid, b._lid))
        if f is not None and f[0] is a._mesh and f[0] is b._mesh and not _grad_enabled():
            local = torch.matmul(a._local, b._local)
            return wrap(local, f[0], f[1], f[2], f[3])
    if type(a) is not DistTensor or type(b) is not DistTensor or a._mesh is not b._mesh:
        mesh = _mesh_of(a, b)
        a, b = _as_dist(a, mesh), _as_dist(b, mesh)
    key = ("matmul", a._lid, b._lid)
    if len(b._shape) == 2 and len(a._shape) >= 2:
        return _matmul_like(key, _matmul_rule, torch.matmul, a, b, True)
    return _apply(key, _matmul_rule, torch.matmul, [a, b])


def _linear_rule(x: DistTensor, w: DistTensor) -> RuleResult:
    if x.ndim < 1 or w.ndim != 2:
        raise ValueError(f"linear: x {list(x._shape)} and weight {list(w._shape)} (need 2-D weight)")
    lead = "abcdefghij"[: x.ndim - 1]
    return einsum_rule(
        [lead + "k", "nk"], lead + "n", [x._shape, w._shape], [x._placements, w._placements], "linear", priority=(1, 0)
    )


def linear(x, weight, bias=None) -> DistTensor:
    """``F.linear``: ``x @ weight.T`` (einsum ``...k,nk->...n``), then ``+ bias`` by the add rule."""
    mesh = _mesh_of(x, weight, bias)
    x, w = _as_dist(x, mesh), _as_dist(weight, mesh)
    key = ("linear", x._lid, w._lid)
    y = (
        _matmul_like(key, _linear_rule, F.linear, x, w, False)
        if x.ndim >= 2
        else _apply(key, _linear_rule, F.linear, [x, w])
    )
    return y if bias is None else binary("add", y, bias)


def _broadcast_rule(kind: str) -> Callable[[DistTensor, DistTensor], RuleResult]:
    def rule(a: DistTensor, b: DistTensor) -> RuleResult:
        labels, out, forbidden = broadcast_labels([a._shape, b._shape])
        return einsum_rule(labels, out, [a._shape, b._shape], [a._placements, b._placements], kind, forbidden)

    return rule


def _fit(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A broadcast gradient summed back to the input piece's shape and dtype."""
    if g.shape != x.shape:
        g = g.sum_to_size(x.shape)
    return g if g.dtype == x.dtype else g.to(x.dtype)


def _vjp_add(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    return [_fit(g, saved[0]) if need[0] else None, _fit(g, saved[1]) if need[1] else None]


def _vjp_sub(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    return [_fit(g, saved[0]) if need[0] else None, _fit(-g, saved[1]) if need[1] else None]


def _vjp_mul(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    a, b = saved
    return [_fit(g * b, a) if need[0] else None, _fit(g * a, b) if need[1] else None]


def _vjp_div(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    a, b = saved
    return [_fit(g / b, a) if need[0] else None, _fit(-g * a / (b * b), b) if need[1] else None]


# op -> (local function, rule, local vjp): + and - keep matching Partials, * is linear in each
# operand (one Partial may stay), / is not linear in its divisor.
_BINARY = {
    "add": (operator.add, _broadcast_rule("add"), _vjp_add),
    "sub": (operator.sub, _broadcast_rule("add"), _vjp_sub),
    "mul": (operator.mul, _broadcast_rule("linear"), _vjp_mul),
    "div": (operator.truediv, _broadcast_rule("nonlinear"), _vjp_div),
}


def binary(op: str, a, b) -> DistTensor:
    """``a <op> b`` for DistTensors, plain tensors (Replicate) and Python scalars."""
    if type(a) is not DistTensor or type(b) is not DistTensor or a._mesh is not b._mesh:
        a_dt = isinstance(a, DistTensor)
        if a_dt != isinstance(b, DistTensor) and isinstance(b if a_dt else a, (int, float, bool)):
            return _with_scalar(op, a if a_dt else b, b if a_dt else a, a_dt)
        mesh = _mesh_of(a, b)
        a, b = _as_dist(a, mesh), _as_dist(b, mesh)
    fn, rule, vjp = _BINARY[op]
    return _apply2((op, a._lid, b._lid), rule, fn, a, b, vjp)


def _linear_elementwise_rule(x: DistTensor) -> RuleResult:
    lab = "abcdefghijklmnop"[: x.ndim]
    return einsum_rule([lab], lab, [x._shape], [x._placements], "linear")


def _nonlinear_rule(x: DistTensor, forbidden_dims: Sequence[int] = ()) -> RuleResult:
    lab = "abcdefghijklmnop"[: x.ndim]
    forbidden = frozenset(lab[d] for d in forbidden_dims)
    return einsum_rule([lab], lab, [x._shape], [x._placements], "nonlinear", forbidden)


def _with_scalar(op: str, x: DistTensor, c: float, x_first: bool) -> DistTensor:
    """x * c and x / c scale (linear: a Partial stays Partial); x + c, c - x, c / x do not."""
    if op == "mul" or (op == "div" and x_first):
        c = c if op == "mul" else 1.0 / c
        return _apply(
            ("scale", x._lid),
            _linear_elementwise_rule,
            lambda t: t * c,
            [x],
            vjp=lambda saved, g, need: [_fit(g * c, saved[0])],
        )
    fn = _BINARY[op][0]
    local_fn = (lambda t: fn(t, c)) if x_first else (lambda t: fn(c, t))
    return _apply(("scalar_" + op, x._lid, x_first), _nonlinear_rule, local_fn, [x])


def _neg(x: DistTensor) -> DistTensor:
    return _with_scalar("mul", x, -1.0, True)


_GELU_PLAIN: dict[int, tuple] = {}
_RELU_PLAIN: dict[int, tuple] = {}


def _gelu(x: DistTensor, approximate: str = "none") -> DistTensor:
    if approximate == "none":
        return _apply1(("gelu", x._lid), _nonlinear_rule, F.gelu, x, _vjp_gelu, _GELU_PLAIN)
    return _apply1(
        ("gelu", x._lid, approximate),
        _nonlinear_rule,
        lambda t: F.gelu(t, approximate=approximate),
        x,
        lambda saved, g, need: [torch.ops.aten.gelu_backward(g, saved[0], approximate=approximate)],
    )


def _vjp_gelu(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    return [torch.ops.aten.gelu_backward(g, saved[0])]


def _vjp_relu(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    return [torch.ops.aten.threshold_backward(g, saved[0], 0)]


def _relu(x: DistTensor, inplace: bool = False) -> DistTensor:
    if inplace:
        raise NotImplementedError("relu(inplace=True) on a DistTensor; use relu()")
    return _apply1(("relu", x._lid), _nonlinear_rule, torch.relu, x, _vjp_relu, _RELU_PLAIN)


def softmax(x: DistTensor, dim: int, _stacklevel: int = 3, dtype=None) -> DistTensor:
    d = dim % x.ndim
    key = ("softmax", x._lid, d)
    return _apply(key, lambda t: _nonlinear_rule(t, [d]), lambda t: torch.softmax(t, d, dtype=dtype), [x], dtype)


def _torch_softmax(x: DistTensor, dim: int, dtype=None) -> DistTensor:
    """``torch.softmax(x, dim, dtype)`` / ``Tensor.softmax``: dtype is the third positional."""
    return softmax(x, dim, dtype=dtype)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> DistTensor:
    mesh = _mesh_of(x)
    x = _as_dist(x, mesh)
    normalized_shape = tuple(normalized_shape)
    k = len(normalized_shape)
    if tuple(x._shape[x.ndim - k :]) != normalized_shape:
        raise ValueError(
            f"layer_norm: normalized_shape {list(normalized_shape)} is not the trailing shape of x {list(x._shape)}"
        )
    ops = [x] + [_as_dist(t, mesh) for t in (weight, bias) if t is not None]
    has_w, has_b = weight is not None, bias is not None
    key = ("layer_norm", normalized_shape, has_w, has_b, eps) + tuple(t._lid for t in ops)

    def rule(*_: DistTensor) -> RuleResult:
        lab = "abcdefghijklmnop"[: x.ndim]
        norm = lab[x.ndim - k :]
        return einsum_rule(
            [lab] + [norm] * (len(ops) - 1),
            lab,
            [t._shape for t in ops],
            [t._placements for t in ops],
            "nonlinear",
            frozenset(norm),
        )

    def local_fn(xl, *wb):
        w = wb[0] if has_w else None
        b = wb[-1] if has_b else None
        return F.layer_norm(xl, normalized_shape, w, b, eps)

    return _apply(key, rule, local_fn, ops)


def _reduce(op: str, x: DistTensor, dim, keepdim: bool, dtype: torch.dtype | None = None) -> DistTensor:
    if dim is None:
        dims = tuple(range(x.ndim))
    else:
        dims = tuple(sorted(d % x.ndim for d in ((dim,) if isinstance(dim, int) else dim)))
    key = (op, x._lid, dims, keepdim)

    def rule(*_: DistTensor) -> RuleResult:
        lab, out = reduction_labels(x.ndim, dims)
        res = einsum_rule([lab], out, [x._shape], [x._placements], "linear")
        if not keepdim:
            return res
        shape = [1 if i in dims else n for i, n in enumerate(x._shape)]
        kept = [i for i in range(x.ndim) if i not in dims]
        pl = tuple(Shard(kept[p.dim]) if type(p) is Shard else p for p in res.out_placements)
        return RuleResult(res.in_placements, pl, torch.Size(shape))

    # mean over a sharded dim: each rank sums its piece and divides by the *global* count, so the
    # Partial(sum) of the pieces is the global mean.
    count = 1
    if op == "mean":
        for d in dims:
            count *= x._shape[d]

    def local_fn(t):
        s = t.sum(dim=dims, keepdim=keepdim, dtype=dtype)
        return s if count == 1 else s / count

    def vjp(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
        t = saved[0]
        if not keepdim:
            for d in dims:
                g = g.unsqueeze(d)
        g = g.expand(t.shape)
        return [(g if count == 1 else g / count).to(t.dtype)]

    return _apply(key, rule, local_fn, [x], dtype, vjp)


def _sum(x, dim=None, keepdim=False, dtype=None, **kw):
    return _reduce("sum", x, dim, keepdim, dtype)


def _mean(x, dim=None, keepdim=False, dtype=None, **kw):
    return _reduce("mean", x, dim, keepdim, dtype)


def _operator(op: str) -> Callable[[Any, Any], DistTensor]:
    """``a <op> b`` as a method: the hot path when both are DistTensors of a cached layout."""
    fn = _BINARY[op][0]

    def method(a, b):
        if type(b) is DistTensor and type(a) is DistTensor:
            f = _PLAIN.get((op, a._lid, b._lid))
            if f is not None and f[0] is a._mesh and f[0] is b._mesh and not _grad_enabled():
                local = fn(a._local, b._local)
                return wrap(local, f[0], f[1], f[2], f[3])
        return binary(op, a, b)

    return method


def _reflected(op: str) -> Callable[[Any, Any], DistTensor]:
    return lambda a, b: binary(op, b, a)


def _torch_binary(op: str) -> Callable[..., DistTensor]:
    """``torch.add(a, b, alpha=...)`` and friends; ``alpha`` scales ``b`` as torch does."""

    def fn(a, b, *, alpha=1, out=None, rounding_mode=None):
        if out is not None or rounding_mode is not None:
            raise NotImplementedError(f"torch.{op} on DistTensors with out= or rounding_mode=")
        return binary(op, a, b if alpha == 1 else binary("mul", b, alpha))

    return fn


def _install() -> None:
    """Register the handlers with DistTensor's ``__torch_function__`` and set its operator
    methods (``a @ b``, ``a + b``, ...), which then skip the torch-function round trip."""
    methods: dict[str, Callable] = {
        "__matmul__": matmul,
        "__rmatmul__": lambda a, b: matmul(b, a),
        "__neg__": _neg,
    }
    for op, names in (
        ("add", ("add", "__add__", "__radd__")),
        ("sub", ("sub", "__sub__", "__rsub__")),
        ("mul", ("mul", "__mul__", "__rmul__")),
        ("div", ("div", "__truediv__", "__rtruediv__")),
    ):
        HANDLERS[getattr(torch, op)] = HANDLERS[getattr(torch.Tensor, names[0])] = _torch_binary(op)
        methods[names[1]], methods[names[2]] = _operator(op), _reflected(op)
    for name, fn in methods.items():
        HANDLERS[getattr(torch.Tensor, name)] = fn
        setattr(DistTensor, name, fn)
    HANDLERS.update(
        {
            torch.matmul: matmul,
            torch.mm: matmul,
            torch.Tensor.matmul: matmul,
            torch.Tensor.mm: matmul,
            F.linear: linear,
            torch.neg: _neg,
            torch.Tensor.neg: _neg,
            torch.relu: _relu,
            F.relu: _relu,
            torch.Tensor.relu: _relu,
            F.gelu: _gelu,
            torch.softmax: _torch_softmax,
            F.softmax: softmax,
            torch.Tensor.softmax: _torch_softmax,
            F.layer_norm: layer_norm,
            torch.sum: _sum,
            torch.Tensor.sum: _sum,
            torch.mean: _mean,
            torch.Tensor.mean: _mean,
        }
    )
    # Called with the piece alone, these compute what their handler's local function does (F.relu
    # is not among them: it always passes ``inplace``, so it never takes the short path).
    UNARY_PLAIN.update({F.gelu: _GELU_PLAIN, torch.relu: _RELU_PLAIN, torch.Tensor.relu: _RELU_PLAIN})


_install()
