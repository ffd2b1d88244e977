"""``DistTensor``: a local piece + global shape + mesh + placements, with SPMD dispatch and autograd.

Design (why it is not a ``torch.Tensor`` subclass): DTensor's per-op cost comes from routing every
op through ``__torch_dispatch__`` and re-deriving sharding per call. ``DistTensor`` is a slotted
Python object that torch treats as tensor-like through ``__torch_function__``; an op costs one
dict lookup for its cached rule (keyed by op, shapes, placements), the reshards the rule asks for,
the local torch op and one object allocation.

Autograd is this module's own tape, not torch's engine, because gradient *placements* must flow
with the gradients: the gradient of a Replicate tensor is Partial exactly on the mesh dims where
it met sharded data (a sharded batch, sequence or context dim, a sharded output column, ...), and
two gradient contributions with different placements must be unified before they are summed. Each
op records a node holding the local autograd graph of its local computation (inputs detached), so
the local vector-Jacobian product comes from torch; the node's placements give the gradient's.
``loss.backward()`` walks the nodes in reverse creation order, which is the same on every rank,
so the collectives of backward (reshards, cross-mesh sends) match across ranks.

Pipeline non-computation clip: on a rank outside the op's mesh, an op runs only its rule (cached)
and returns an uninitialized DistTensor (zero-element local piece, no storage) with the right
global shape, dtype, mesh and placements; its backward likewise does nothing there.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from . import reshard as _rs
from .mesh import ProcessMesh
from .placements import (PARTIAL_SUM, REPLICATE, Partial, Placement, Replicate, Shard,
                         chunk_bounds, normalize_placements, to_dims_mapping, to_partial_status)
from .rules import RuleResult, broadcast_labels, einsum_rule, matmul_labels, reduction_labels

_SEQ = itertools.count()
_RULE_CACHE: dict[tuple, tuple] = {}
_MM_CACHE: dict[tuple, tuple] = {}
_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


_PIDS: dict[tuple, int] = {}


def _pid(placements: tuple) -> int:
    """A small int naming a placements tuple: rule keys and comparisons then avoid hashing and
    comparing Placement objects (Python-level __hash__/__eq__) on every op."""
    pid = _PIDS.get(placements)
    if pid is None:
        pid = _PIDS[placements] = len(_PIDS)
    return pid


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # On the data's device (zero elements allocate nothing): a clipped rank's placeholder tells a
    # later cross-mesh receive where to put the data (NCCL receives only into CUDA tensors).
    t = _EMPTY.get((dtype, device))
    if t is None:
        t = _EMPTY[(dtype, device)] = torch.empty(0, dtype=dtype, device=device)
    return t


class _Node:
    """One recorded op: how to turn its output's gradient into its inputs' gradients."""

    __slots__ = ("seq", "inputs", "backward", "ctx", "grad")

    def __init__(self, inputs: list, backward: Callable, ctx: Any):
        self.seq = next(_SEQ)
        self.inputs = inputs
        self.backward = backward
        self.ctx = ctx
        self.grad: Optional["DistTensor"] = None


class DistTensor:
    """A distributed tensor: ``to_local()`` is this rank's piece of a ``shape``-sized global tensor."""

    __slots__ = ("_local", "_mesh", "_placements", "_pid", "_shape", "_dtype", "_requires_grad",
                 "_node", "_grad", "_init")

    def __init__(self, local: torch.Tensor, mesh: ProcessMesh, placements: tuple, shape: torch.Size,
                 dtype: torch.dtype, init: bool = True, pid: Optional[int] = None):
        self._local = local
        self._mesh = mesh
        self._placements = placements
        self._pid = _pid(placements) if pid is None else pid
        self._shape = shape
        self._dtype = dtype
        self._requires_grad = False
        self._node: Optional[_Node] = None
        self._grad: Optional[DistTensor] = None
        self._init = init

    # -- construction -----------------------------------------------------------------------------
    @staticmethod
    def from_local(local: torch.Tensor, mesh: ProcessMesh, placements: Sequence[Placement],
                   global_shape: Optional[Sequence[int]] = None) -> "DistTensor":
        """Wrap this rank's piece. Without ``global_shape`` shards are assumed even (as DTensor)."""
        if not isinstance(local, torch.Tensor):
            raise TypeError(f"from_local(local): expected a torch.Tensor, got {type(local).__name__}")
        if not isinstance(mesh, ProcessMesh):
            raise TypeError(f"from_local(mesh): expected a ProcessMesh, got {type(mesh).__name__}")
        pl = normalize_placements(placements, mesh.ndim, local.ndim)
        if mesh.my_coordinate is None:
            if global_shape is None:
                raise ValueError("from_local on a rank outside the mesh needs global_shape")
            return _uninit(mesh, pl, torch.Size(global_shape), local.dtype, local.device)
        if global_shape is None:
            shape = list(local.shape)
            for m, p in enumerate(pl):
                if type(p) is Shard:
                    shape[p.dim] *= mesh.shape[m]
            global_shape = shape
        global_shape = torch.Size(global_shape)
        expect = _rs.local_shape(global_shape, mesh, pl)
        if list(local.shape) != expect:
            raise ValueError(f"from_local(local): local shape {list(local.shape)} does not match "
                             f"global_shape {list(global_shape)} with placements {list(pl)} at mesh "
                             f"coordinate {mesh.my_coordinate} (expected {expect})")
        return DistTensor(local.detach(), mesh, pl, global_shape, local.dtype)

    # -- views ------------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self._shape

    def size(self, dim: Optional[int] = None):
        return self._shape if dim is None else self._shape[dim]

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    def numel(self) -> int:
        return self._shape.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def placements(self) -> tuple:
        return self._placements

    @property
    def process_mesh(self) -> ProcessMesh:
        return self._mesh

    @property
    def dims_mapping(self) -> list[int]:
        return to_dims_mapping(self._placements, len(self._shape))

    @property
    def partial_status(self) -> dict[int, str]:
        return to_partial_status(self._placements)

    def is_initialized(self) -> bool:
        return self._init

    def to_local(self) -> torch.Tensor:
        """This rank's piece (a zero-element tensor on a rank outside the mesh). Not tracked."""
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The global value, gathered and reduced on every rank of the mesh. Not tracked."""
        if not self._init:
            raise ValueError(f"full_tensor(): this rank ({self._mesh._my_rank}) is outside the tensor's "
                             f"mesh {self._mesh}; only ranks of the mesh hold data")
        return _rs.redistribute_local(self._local, self._shape, self._mesh, self._placements,
                                      (REPLICATE,) * self._mesh.ndim)

    def __repr__(self) -> str:
        state = "" if self._init else ", uninitialized"
        return (f"DistTensor(shape={list(self._shape)}, dtype={self._dtype}, placements="
                f"{list(self._placements)}, mesh={list(self._mesh.shape)}{state})")

    # -- autograd ---------------------------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    def requires_grad_(self, requires_grad: bool = True) -> "DistTensor":
        if self._node is not None and not requires_grad:
            raise RuntimeError("requires_grad_(False) on a non-leaf DistTensor; use detach()")
        self._requires_grad = requires_grad
        return self

    @property
    def is_leaf(self) -> bool:
        return self._node is None

    @property
    def grad(self) -> Optional["DistTensor"]:
        return self._grad

    @grad.setter
    def grad(self, value: Optional["DistTensor"]) -> None:
        if value is not None and not isinstance(value, DistTensor):
            raise TypeError(f"grad must be a DistTensor or None, got {type(value).__name__}")
        self._grad = value

    def detach(self) -> "DistTensor":
        return DistTensor(self._local, self._mesh, self._placements, self._shape, self._dtype,
                          self._init, self._pid)

    def backward(self, gradient: Optional["DistTensor"] = None, retain_graph: bool = False) -> None:
        _run_backward(self, gradient, retain_graph)

    # -- torch function protocol ------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        handler = _HANDLERS.get(func)
        if handler is None:
            name = getattr(func, "__name__", repr(func))
            if name in _DATA_DEPENDENT:
                raise NotImplementedError(
                    f"{name} on DistTensor: its output shape depends on the data, which a rank "
                    f"outside the mesh (pipeline non-computation clip) cannot infer; convert with "
                    f"full_tensor() on the ranks of the mesh first")
            raise NotImplementedError(f"{name} has no DistTensor SPMD rule (supported: matmul, +, -, "
                                      f"*, /, linear, gelu, relu, softmax, layer_norm, sum, mean)")
        return handler(*args, **(kwargs or {}))

    # -- python operators / methods ---------------------------------------------------------------
    def __matmul__(self, other):
        return matmul(self, other)

    def __rmatmul__(self, other):
        return matmul(other, self)

    def __add__(self, other):
        return _binary("add", self, other)

    def __radd__(self, other):
        return _binary("add", other, self)

    def __sub__(self, other):
        return _binary("sub", self, other)

    def __rsub__(self, other):
        return _binary("sub", other, self)

    def __mul__(self, other):
        return _binary("mul", self, other)

    def __rmul__(self, other):
        return _binary("mul", other, self)

    def __truediv__(self, other):
        return _binary("div", self, other)

    def __rtruediv__(self, other):
        return _binary("div", other, self)

    def __neg__(self):
        return _scale(self, -1.0)

    def relu(self):
        return _unary("relu", self)

    def gelu(self, approximate: str = "none"):
        return _unary("gelu", self, approximate)

    def softmax(self, dim: int, dtype=None):
        return softmax(self, dim, dtype=dtype)

    def sum(self, dim=None, keepdim: bool = False, dtype=None):
        return _reduce("sum", self, dim, keepdim, dtype)

    def mean(self, dim=None, keepdim: bool = False, dtype=None):
        return _reduce("mean", self, dim, keepdim, dtype)

    def matmul(self, other):
        return matmul(self, other)


def _uninit(mesh: ProcessMesh, placements: tuple, shape: torch.Size, dtype: torch.dtype,
            device: torch.device) -> DistTensor:
    return DistTensor(_empty(dtype, device), mesh, placements, shape, dtype, init=False)


def shard_tensor(data: torch.Tensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> DistTensor:
    """Distribute ``data`` (the global tensor, the same on every rank) as ``placements``.

    ``Partial`` placements keep the value on coordinate 0 (sum) or everywhere (avg/max/min).
    """
    if isinstance(data, DistTensor):
        raise TypeError("shard_tensor(data): data is already a DistTensor; use reshard()")
    if not isinstance(data, torch.Tensor):
        data = torch.as_tensor(data)
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"shard_tensor(mesh): expected a ProcessMesh, got {type(mesh).__name__}")
    pl = normalize_placements(placements, mesh.ndim, data.ndim)
    shape = data.shape
    if mesh.my_coordinate is None:
        return _uninit(mesh, pl, shape, data.dtype, data.device)
    local = data.detach()
    coord = mesh.my_coordinate
    for m, p in enumerate(pl):
        if type(p) is Shard:
            s, e = chunk_bounds(shape[p.dim], mesh.shape[m], coord[m])
            local = local.narrow(p.dim, s, e - s)
        elif type(p) is Partial:
            local = _rs.replicate_to_partial(local, p.reduce_type, coord[m])
    # A private copy: the caller's tensor must not alias a parameter's storage.
    return DistTensor(local.clone(), mesh, pl, shape, data.dtype)


# -- dispatch ---------------------------------------------------------------------------------------

def _as_dist(x: Any, mesh: ProcessMesh) -> DistTensor:
    """A plain tensor mixed into a DistTensor op is the same value on every rank: Replicate."""
    if isinstance(x, DistTensor):
        if x._mesh is not mesh and x._mesh != mesh:
            raise ValueError(f"operands live on different meshes ({x._mesh} and {mesh}); move one "
                             f"with autopar.reshard(t, mesh, placements) first")
        return x
    if isinstance(x, torch.Tensor):
        pl = (REPLICATE,) * mesh.ndim
        if mesh.my_coordinate is None:
            return _uninit(mesh, pl, x.shape, x.dtype, x.device)
        return DistTensor(x, mesh, pl, x.shape, x.dtype)
    raise TypeError(f"expected a DistTensor or torch.Tensor, got {type(x).__name__}")


def _convert(x: DistTensor, placements: tuple) -> DistTensor:
    """Reshard ``x`` on its mesh (recorded for autograd) if the rule needs other placements."""
    if x._placements == placements:
        return x
    return _reshard_same_mesh(x, placements)


def _apply(key: tuple, rule: Callable[[], RuleResult], local_fn: Callable, inputs: list[DistTensor],
           out_dtype: Optional[torch.dtype] = None) -> DistTensor:
    """Run one op: cached rule, reshard inputs, local op (or clip), record the autograd node."""
    entry = _RULE_CACHE.get(key)
    if entry is None:
        res = rule()
        entry = _RULE_CACHE[key] = (res, tuple(_pid(p) for p in res.in_placements),
                                    _pid(res.out_placements))
    res, in_pids, out_pid = entry
    mesh = inputs[0]._mesh
    needs_grad = False
    for i, x in enumerate(inputs):
        if x._pid != in_pids[i]:
            x = inputs[i] = _reshard_same_mesh(x, res.in_placements[i])
        if x._requires_grad:
            needs_grad = True
    needs_grad = needs_grad and torch.is_grad_enabled()
    if mesh._coord is None:
        dtype = out_dtype or _promote(inputs)
        out = DistTensor(_empty(dtype, inputs[0]._local.device), mesh, res.out_placements,
                         res.out_shape, dtype, False, out_pid)
        if needs_grad:
            _record(out, inputs, None, None, res)
        return out
    if not needs_grad:
        local = local_fn(*[x._local for x in inputs])
        return DistTensor(local, mesh, res.out_placements, res.out_shape, local.dtype, True, out_pid)
    leaves = [x._local.detach().requires_grad_() if x._requires_grad else x._local for x in inputs]
    with torch.enable_grad():
        local = local_fn(*leaves)
    out = DistTensor(local.detach(), mesh, res.out_placements, res.out_shape, local.dtype, True,
                     out_pid)
    _record(out, inputs, leaves, local, res)
    return out


def _promote(ins: list[DistTensor]) -> torch.dtype:
    dtype = ins[0]._dtype
    for x in ins[1:]:
        dtype = torch.promote_types(dtype, x._dtype)
    return dtype


def _record(out: DistTensor, ins: list[DistTensor], leaves, local, res: RuleResult) -> None:
    out._requires_grad = True
    out._node = _Node([x if x._requires_grad else None for x in ins], _local_vjp_backward,
                      (leaves, local, res, [x._placements for x in ins], [x._shape for x in ins],
                       [x._dtype for x in ins]))


def _grad_placement(in_pl: tuple, others: list[tuple], out_pl: tuple, g_pl: tuple) -> tuple:
    """Placements of an input's gradient from a local vector-Jacobian product.

    Per mesh dim: a sharded input gets a sharded gradient; a Partial input a Replicate one (the
    caller made the output gradient Replicate there); a Replicate input gets a Replicate gradient
    only if nothing in the op varied along that mesh dim (every operand and the output Replicate,
    the output gradient Replicate), else a Partial one: each rank's product covered only its
    shard of the data, and the true gradient is the sum over the mesh dim, or the mean when the
    output is ``Partial("avg")`` (its value is the mean of the ranks' local results).
    """
    out = []
    for m, p in enumerate(in_pl):
        tp = type(p)
        if tp is Shard:
            out.append(p)
        elif tp is Partial:
            out.append(REPLICATE)
        elif type(g_pl[m]) is Replicate and type(out_pl[m]) is Replicate and \
                all(type(o[m]) is Replicate for o in others):
            out.append(REPLICATE)
        elif out_pl[m] == _PARTIAL_AVG:
            out.append(_PARTIAL_AVG)
        else:
            out.append(PARTIAL_SUM)
    return tuple(out)


_PARTIAL_AVG = Partial("avg")


def _local_vjp_backward(node: _Node, g: DistTensor) -> list[Optional[DistTensor]]:
    leaves, local, res, in_pls, in_shapes, in_dtypes = node.ctx
    out_pl = res.out_placements
    # The gradient of a Partial output is Replicate; of a sharded output sharded the same way.
    want = tuple(REPLICATE if type(o) is Partial else (o if type(o) is Shard else gp)
                 for o, gp in zip(out_pl, g._placements))
    if want != g._placements:
        g = _reshard_nograd(g, want)
    mesh = g._mesh
    grads: list[Optional[DistTensor]] = []
    if mesh._coord is None or not g._init:
        for i, x in enumerate(node.inputs):
            if x is None:
                grads.append(None)
                continue
            pl = _grad_placement(in_pls[i], in_pls[:i] + in_pls[i + 1:], out_pl, g._placements)
            grads.append(_uninit(mesh, pl, in_shapes[i], in_dtypes[i], g._local.device))
        return grads
    want_idx = [i for i, x in enumerate(node.inputs) if x is not None]
    local_grads = torch.autograd.grad(local, [leaves[i] for i in want_idx], g._local,
                                      retain_graph=_RETAIN[0],
                                      allow_unused=True)
    it = iter(local_grads)
    for i, x in enumerate(node.inputs):
        if x is None:
            grads.append(None)
            continue
        lg = next(it)
        if lg is None:
            lg = torch.zeros_like(leaves[i])
        pl = _grad_placement(in_pls[i], in_pls[:i] + in_pls[i + 1:], out_pl, g._placements)
        grads.append(DistTensor(lg, mesh, pl, in_shapes[i], lg.dtype))
    return grads


_RETAIN = [False]


# -- reshard (same mesh and cross-mesh) ---------------------------------------------------------------

def _reshard_nograd(x: DistTensor, placements: tuple) -> DistTensor:
    if not x._init:
        return _uninit(x._mesh, placements, x._shape, x._dtype, x._local.device)
    local = _fused_reduce(x, placements) if type(x) is _PendingMatmul else None
    if local is None:
        local = _rs.redistribute_local(x._local, x._shape, x._mesh, x._placements, placements)
    return DistTensor(local, x._mesh, placements, x._shape, x._dtype)


def _reshard_backward(node: _Node, g: DistTensor) -> list[Optional[DistTensor]]:
    src = node.ctx
    # Back to the input's layout: sharded stays sharded, a Partial input's gradient is Replicate,
    # a Replicate input keeps a Replicate or Partial gradient as it comes (no communication).
    want = tuple(s if type(s) is Shard else
                 (REPLICATE if type(s) is Partial or type(gp) is Shard else gp)
                 for s, gp in zip(src, g._placements))
    return [_reshard_nograd(g, want)]


def _reshard_same_mesh(x: DistTensor, placements: tuple) -> DistTensor:
    _rs.check_placements_reachable(x._placements, placements)
    out = _reshard_nograd(x, placements)
    if x._requires_grad and torch.is_grad_enabled():
        out._requires_grad = True
        out._node = _Node([x], _reshard_backward, x._placements)
    return out


def _move_backward(node: _Node, g: DistTensor) -> list[Optional[DistTensor]]:
    src_mesh, src_pl, shape, dtype = node.ctx
    dst_mesh = g._mesh
    same = src_mesh.shape == dst_mesh.shape
    if not same and any(type(p) is not Replicate for p in g._placements):
        # The forward move carried a Replicate tensor; send back the reduced gradient.
        g = _reshard_nograd(g, (REPLICATE,) * dst_mesh.ndim)
    g_pl = g._placements if same else (REPLICATE,) * src_mesh.ndim
    recv_shape = _rs.local_shape(shape, src_mesh, g_pl) if src_mesh._coord is not None else None
    local = _rs.move_across_meshes(g._local if g._init else None, dst_mesh, src_mesh, recv_shape, dtype,
                                   g._local.device)
    if local is None:
        return [_uninit(src_mesh, g_pl, shape, dtype, g._local.device)]
    return [DistTensor(local, src_mesh, g_pl, shape, dtype)]


def _move(x: DistTensor, mesh: ProcessMesh) -> DistTensor:
    """Same placements (same-shape meshes) or Replicate (different shapes) on another mesh."""
    same = x._mesh.shape == mesh.shape
    pl = x._placements if same else (REPLICATE,) * mesh.ndim
    recv_shape = _rs.local_shape(x._shape, mesh, pl) if mesh._coord is not None else None
    local = _rs.move_across_meshes(x._local if x._init else None, x._mesh, mesh, recv_shape, x._dtype,
                                   x._local.device)
    out = _uninit(mesh, pl, x._shape, x._dtype, x._local.device) if local is None else \
        DistTensor(local, mesh, pl, x._shape, x._dtype)
    if x._requires_grad and torch.is_grad_enabled():
        out._requires_grad = True
        out._node = _Node([x], _move_backward, (x._mesh, x._placements, x._shape, x._dtype))
    return out


def reshard(dt: DistTensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> DistTensor:
    """Move ``dt`` to ``placements`` on ``mesh`` (its own mesh, or another: a pipeline stage).

    Differentiable: the backward moves the gradient back. Across meshes every rank of both meshes
    must call it (all ranks run the same program); a rank in neither does nothing.
    """
    if not isinstance(dt, DistTensor):
        raise TypeError(f"reshard(dt): expected a DistTensor, got {type(dt).__name__}")
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"reshard(mesh): expected a ProcessMesh, got {type(mesh).__name__}")
    pl = normalize_placements(placements, mesh.ndim, dt.ndim)
    if mesh == dt._mesh:
        return _convert(dt, pl)
    if any(type(p) is Partial for p in dt._placements):
        dt = _convert(dt, tuple(REPLICATE if type(p) is Partial else p for p in dt._placements))
    if dt._mesh.shape == mesh.shape:
        return _move(_convert(dt, pl), mesh) if not any(type(p) is Partial for p in pl) else \
            _convert(_move(dt, mesh), pl)
    moved = _move(_convert(dt, (REPLICATE,) * dt._mesh.ndim), mesh)
    return _convert(moved, pl)


# -- backward driver ----------------------------------------------------------------------------------

def _accumulate(a: Optional[DistTensor], b: DistTensor) -> DistTensor:
    if a is None:
        return b
    if a._placements != b._placements:
        # Replicate + Partial -> Partial is free (R->P keeps the value on coordinate 0); anything
        # else follows the first contribution's layout.
        target = tuple(PARTIAL_SUM if (type(pa) is Partial or type(pb) is Partial) and
                       {type(pa), type(pb)} <= {Partial, Replicate} else pa
                       for pa, pb in zip(a._placements, b._placements))
        a = _reshard_nograd(a, target) if a._placements != target else a
        b = _reshard_nograd(b, target) if b._placements != target else b
    if not a._init:
        return a
    return DistTensor(a._local + b._local, a._mesh, a._placements, a._shape, a._dtype)


def _run_backward(root: DistTensor, gradient: Optional[DistTensor], retain_graph: bool) -> None:
    if not root._requires_grad:
        raise RuntimeError("backward(): the DistTensor does not require grad")
    if gradient is None:
        if root.numel() != 1:
            raise RuntimeError(f"backward(): gradient can be omitted only for a one-element "
                               f"DistTensor, got shape {list(root.shape)}")
        # The gradient of a Partial value is Replicate, so a loss of any placement is seeded with
        # ones everywhere.
        pl = (REPLICATE,) * root._mesh.ndim
        gradient = DistTensor(torch.ones_like(root._local), root._mesh, pl, root._shape,
                              root._dtype) if root._init else _uninit(root._mesh, pl, root._shape,
                                                                      root._dtype, root._local.device)
    if root._node is None:
        root._grad = _accumulate(root._grad, gradient)
        return
    nodes: dict[int, _Node] = {}
    stack = [root._node]
    while stack:
        n = stack.pop()
        if n.seq in nodes:
            continue
        nodes[n.seq] = n
        stack.extend(x._node for x in n.inputs if x is not None and x._node is not None)
    root._node.grad = _accumulate(root._node.grad, gradient)
    _RETAIN[0] = retain_graph
    for seq in sorted(nodes, reverse=True):
        n = nodes[seq]
        g = n.grad
        n.grad = None
        if g is None:
            continue
        if n.backward is None:
            raise RuntimeError("backward() through a graph whose buffers were already freed; pass "
                               "retain_graph=True to the first backward() to go through it twice")
        for x, gx in zip(n.inputs, n.backward(n, g)):
            if x is None or gx is None:
                continue
            if x._node is not None:
                x._node.grad = _accumulate(x._node.grad, gx)
            else:
                x._grad = _accumulate(x._grad, gx)
        if not retain_graph:
            n.backward = None
            n.ctx = None


# -- overlapped matmul + collective (kernels) --------------------------------------------------------

class _PendingMatmul(DistTensor):
    """A matmul output that is Partial on one mesh dim and not computed yet.

    If the next thing done to it is a reshard of that mesh dim to Replicate or Shard(0), the
    matmul and the collective run as one overlapped op (``kernels.matmul_all_reduce`` /
    ``kernels.matmul_reduce_scatter``, backend from the COC_* environment); any other use reads
    ``_local``, which computes the plain local product on first access.
    """

    __slots__ = ("_x", "_w", "_mesh_dim")

    @property
    def _local(self) -> torch.Tensor:
        local = _LOCAL_SLOT.__get__(self, DistTensor)
        if local is None:
            local = torch.matmul(self._x, self._w.mT)
            _LOCAL_SLOT.__set__(self, local)
        return local

    @_local.setter
    def _local(self, value: torch.Tensor) -> None:
        _LOCAL_SLOT.__set__(self, value)


_LOCAL_SLOT = DistTensor.__dict__["_local"]


def _pending(x_local: torch.Tensor, w_local: torch.Tensor, mesh: ProcessMesh, placements: tuple,
             shape: torch.Size, dtype: torch.dtype, mesh_dim: int,
             pid: Optional[int] = None) -> "_PendingMatmul":
    """A DistTensor standing for ``x_local @ w_local.T`` (Partial on ``mesh_dim``), not computed."""
    out = _PendingMatmul.__new__(_PendingMatmul)
    DistTensor.__init__(out, None, mesh, placements, shape, dtype, True, pid)
    out._x, out._w, out._mesh_dim = x_local, w_local, mesh_dim
    return out


def _kernels():
    import kernels

    return kernels


def _mm_backward(node: _Node, g: DistTensor) -> list[Optional[DistTensor]]:
    """Explicit vjp of ``y = x @ w.T`` (x [..., k], w [n, k]) for the overlapped paths.

    dgrad ``dx = dy @ w``, wgrad ``dw = dy_2d.T @ x_2d``; placements as any local vjp.
    """
    x_local, w_local, res, in_pls, in_shapes, in_dtypes, transposed = node.ctx
    out_pl = res.out_placements
    want = tuple(REPLICATE if type(o) is Partial else (o if type(o) is Shard else gp)
                 for o, gp in zip(out_pl, g._placements))
    if want != g._placements:
        g = _reshard_nograd(g, want)
    mesh = g._mesh
    grads: list[Optional[DistTensor]] = []
    for i, x in enumerate(node.inputs):
        if x is None:
            grads.append(None)
            continue
        pl = _grad_placement(in_pls[i], in_pls[:i] + in_pls[i + 1:], out_pl, g._placements)
        if not g._init:
            grads.append(_uninit(mesh, pl, in_shapes[i], in_dtypes[i], g._local.device))
            continue
        gl = g._local
        if i == 0:
            partial = [m for m, p in enumerate(pl) if type(p) is Partial]
            if len(partial) == 1 and mesh.shape[partial[0]] > 1 and gl.ndim >= 2 and \
                    _pieces_nonempty(res.out_shape[-1], mesh.shape[partial[0]]):
                # dgrad that is Partial on one mesh dim (e.g. Megatron's sequence-parallel column
                # backward): left pending, so the reshard that follows (reduce-scatter back to
                # Shard(0)) runs as one overlapped matmul_reduce_scatter.
                grads.append(_pending(gl, w_local.mT, mesh, pl, in_shapes[i], in_dtypes[i],
                                      partial[0]))
                continue
            lg = torch.matmul(gl, w_local)
        else:
            lg = gl.flatten(0, -2).T @ x_local.flatten(0, -2)
            if transposed:
                lg = lg.T
        grads.append(DistTensor(lg, mesh, pl, in_shapes[i], lg.dtype))
    return grads


def _record_mm(out: DistTensor, x: DistTensor, b: DistTensor, x_local: torch.Tensor,
               w_local: torch.Tensor, res: RuleResult, transposed: bool) -> None:
    if not (torch.is_grad_enabled() and (x._requires_grad or b._requires_grad)):
        return
    out._requires_grad = True
    out._node = _Node([x if x._requires_grad else None, b if b._requires_grad else None],
                      _mm_backward, (x_local, w_local, res, [x._placements, b._placements],
                                     [x._shape, b._shape], [x._dtype, b._dtype], transposed))


def _matmul_like(key: tuple, rule: Callable[[], RuleResult], local_fn: Callable, a: DistTensor,
                 b: DistTensor, transposed: bool) -> DistTensor:
    """matmul / linear with a 2-D weight: route the two overlappable patterns to ``kernels``.

    ``transposed``: b is ``[k, n]`` (matmul) rather than ``[n, k]`` (linear).
    """
    entry = _MM_CACHE.get(key)
    if entry is None:
        res = rule()
        partial = [m for m, p in enumerate(res.out_placements) if type(p) is Partial]
        pend_dim = partial[0] if len(partial) == 1 and b.ndim == 2 and a.ndim >= 2 and \
            res.out_placements[partial[0]].reduce_type == "sum" else -1
        entry = _MM_CACHE[key] = (res, tuple(_pid(p) for p in res.in_placements),
                                  _pid(res.out_placements), pend_dim)
    res, in_pids, out_pid, pend_dim = entry
    mesh = a._mesh
    if mesh._coord is None or b._pid != in_pids[1]:
        return _apply(key, rule, local_fn, [a, b])
    if a._pid == in_pids[0]:
        if pend_dim >= 0 and mesh.shape[pend_dim] > 1 and \
                _pieces_nonempty(a._shape[-1], mesh.shape[pend_dim]):
            w_local = b._local.mT if transposed else b._local
            out = _pending(a._local, w_local, mesh, res.out_placements, res.out_shape,
                           torch.promote_types(a._dtype, b._dtype), pend_dim, out_pid)
            _record_mm(out, a, b, a._local, w_local, res, transposed)
            return out
        if not ((a._requires_grad or b._requires_grad) and torch.is_grad_enabled()):
            local = local_fn(a._local, b._local)
            return DistTensor(local, mesh, res.out_placements, res.out_shape, local.dtype, True,
                              out_pid)
        return _apply(key, rule, local_fn, [a, b])
    w_local = b._local.mT if transposed else b._local
    # all_gather_matmul: a is Shard(0) on exactly one mesh dim that the rule gathers, b is
    # sharded on the output columns there, and nothing else changes.
    diff = [m for m, (p, q) in enumerate(zip(a._placements, res.in_placements[0])) if p != q]
    if len(diff) != 1:
        return _apply(key, rule, local_fn, [a, b])
    m = diff[0]
    W = mesh.shape[m]
    if a._placements[m] != Shard(0) or type(res.in_placements[0][m]) is not Replicate or \
            res.out_placements[m] != Shard(a.ndim - 1) or a._shape[0] % W:
        return _apply(key, rule, local_fn, [a, b])
    y, gathered = _kernels().all_gather_matmul(a._local, w_local, group=mesh.get_group(m),
                                               return_gathered=True)
    a_full = DistTensor(gathered, mesh, res.in_placements[0], a._shape, a._dtype, True, in_pids[0])
    if a._requires_grad and torch.is_grad_enabled():
        a_full._requires_grad = True
        a_full._node = _Node([a], _reshard_backward, a._placements)
    out = DistTensor(y, mesh, res.out_placements, res.out_shape, y.dtype, True, out_pid)
    _record_mm(out, a_full, b, gathered, w_local, res, transposed)
    return out


def _pieces_nonempty(size: int, world: int) -> bool:
    """Whether every ``torch.chunk`` piece of ``size`` over ``world`` ranks is non-empty.

    The overlapped ops need ``k > 0`` on every rank, and all ranks must choose the same path, so
    the choice is made from the global size of the contracted dim, never from a local piece.
    """
    return -(-size // world) * (world - 1) < size


def _fused_reduce(x: "_PendingMatmul", placements: tuple) -> Optional[torch.Tensor]:
    """The local result of resharding a pending matmul, through one overlapped op, or None."""
    m = x._mesh_dim
    if _LOCAL_SLOT.__get__(x, DistTensor) is not None or x._placements[m] != PARTIAL_SUM:
        # The overlapped ops sum; a Partial("avg") dgrad takes the generic reshard.
        return None
    if any(p != q for k, (p, q) in enumerate(zip(x._placements, placements)) if k != m):
        return None
    dst = placements[m]
    group = x._mesh.get_group(m)
    if type(dst) is Replicate:
        return _kernels().matmul_all_reduce(x._x, x._w, group=group)
    if dst == Shard(0) and x._shape[0] % x._mesh.shape[m] == 0 and x.ndim >= 2:
        return _kernels().matmul_reduce_scatter(x._x, x._w, group=group)
    return None


# -- ops ----------------------------------------------------------------------------------------------

def _mesh_of(*xs) -> ProcessMesh:
    for x in xs:
        if isinstance(x, DistTensor):
            return x._mesh
    raise TypeError("no DistTensor among the operands")


def matmul(a, b) -> DistTensor:
    if not isinstance(a, DistTensor) or not isinstance(b, DistTensor) or a._mesh is not b._mesh:
        mesh = _mesh_of(a, b)
        a, b = _as_dist(a, mesh), _as_dist(b, mesh)
    key = ("matmul", a._shape, b._shape, a._pid, b._pid)

    def rule() -> RuleResult:
        labels, out, forbidden = matmul_labels(a._shape, b._shape)
        return einsum_rule(labels, out, [a._shape, b._shape], [a._placements, b._placements],
                           "linear", forbidden, priority=(1, 0))

    if b.ndim == 2 and a.ndim >= 2:
        return _matmul_like(key, rule, torch.matmul, a, b, True)
    return _apply(key, rule, torch.matmul, [a, b])


def linear(x, weight, bias=None) -> DistTensor:
    """``F.linear``: ``x @ weight.T`` (einsum ``...k,nk->...n``), then ``+ bias`` by the add rule."""
    mesh = _mesh_of(x, weight, bias)
    x, w = _as_dist(x, mesh), _as_dist(weight, mesh)
    key = ("linear", x._shape, w._shape, x._pid, w._pid)

    def rule() -> RuleResult:
        if x.ndim < 1 or w.ndim != 2:
            raise ValueError(f"linear: x {list(x._shape)} and weight {list(w._shape)} (need 2-D weight)")
        lead = "abcdefghij"[:x.ndim - 1]
        return einsum_rule([lead + "k", "nk"], lead + "n", [x._shape, w._shape],
                           [x._placements, w._placements], "linear", priority=(1, 0))

    y = _matmul_like(key, rule, F.linear, x, w, False) if x.ndim >= 2 else \
        _apply(key, rule, F.linear, [x, w])
    return y if bias is None else _binary("add", y, bias)


_BINARY_FNS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
               "div": operator.truediv}


def _binary(op: str, a, b) -> DistTensor:
    a_dt, b_dt = isinstance(a, DistTensor), isinstance(b, DistTensor)
    if a_dt and b_dt and a._mesh is b._mesh:
        return _apply((op, a._shape, b._shape, a._pid, b._pid), _binary_rule(op, a, b),
                      _BINARY_FNS[op], [a, b])
    if not (a_dt and b_dt) and isinstance(a if not a_dt else b, (int, float, bool)):
        scalar = b if a_dt else a
        x = a if a_dt else b
        if op == "mul" or (op == "div" and a_dt):
            return _scale(x, scalar if op == "mul" else 1.0 / scalar)
        return _scalar_op(op, x, scalar, a_dt)
    mesh = _mesh_of(a, b)
    a, b = _as_dist(a, mesh), _as_dist(b, mesh)
    return _apply((op, a._shape, b._shape, a._pid, b._pid), _binary_rule(op, a, b),
                  _BINARY_FNS[op], [a, b])


def _binary_rule(op: str, a: DistTensor, b: DistTensor) -> Callable[[], RuleResult]:
    kind = "add" if op in ("add", "sub") else ("linear" if op == "mul" else "nonlinear")

    def rule() -> RuleResult:
        labels, out, forbidden = broadcast_labels([a._shape, b._shape])
        return einsum_rule(labels, out, [a._shape, b._shape], [a._placements, b._placements], kind,
                           forbidden)

    return rule


def _elementwise_rule(x: DistTensor, kind: str, forbidden_dims: Sequence[int] = ()) -> Callable:
    def rule() -> RuleResult:
        lab = "abcdefghijklmnop"[:x.ndim]
        forbidden = frozenset(lab[d] for d in forbidden_dims)
        return einsum_rule([lab], lab, [x._shape], [x._placements], kind, forbidden)

    return rule


def _scale(x: DistTensor, c: float) -> DistTensor:
    key = ("scale", x._shape, x._pid)
    return _apply(key, _elementwise_rule(x, "linear"), lambda t: t * c, [x])


def _scalar_op(op: str, x: DistTensor, c: float, x_first: bool) -> DistTensor:
    key = ("scalar_" + op, x._shape, x._pid)
    fn = _BINARY_FNS[op]
    local_fn = (lambda t: fn(t, c)) if x_first else (lambda t: fn(c, t))
    return _apply(key, _elementwise_rule(x, "nonlinear"), local_fn, [x])


def _unary(op: str, x: DistTensor, approximate: str = "none") -> DistTensor:
    if not isinstance(x, DistTensor):
        raise TypeError(f"{op}: expected a DistTensor, got {type(x).__name__}")
    key = (op, x._shape, x._pid, approximate)
    local_fn = torch.relu if op == "relu" else (
        F.gelu if approximate == "none" else (lambda t: F.gelu(t, approximate=approximate)))
    return _apply(key, _elementwise_rule(x, "nonlinear"), local_fn, [x])


def softmax(x: DistTensor, dim: int, _stacklevel: int = 3, dtype=None) -> DistTensor:
    d = dim % x.ndim
    key = ("softmax", x._shape, x._pid, d)
    return _apply(key, _elementwise_rule(x, "nonlinear", [d]),
                  lambda t: torch.softmax(t, d, dtype=dtype), [x], dtype)


def _torch_softmax(x: DistTensor, dim: int, dtype=None) -> DistTensor:
    """``torch.softmax(x, dim, dtype)`` / ``Tensor.softmax``: dtype is the third positional."""
    return softmax(x, dim, dtype=dtype)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> DistTensor:
    mesh = _mesh_of(x)
    x = _as_dist(x, mesh)
    normalized_shape = tuple(normalized_shape)
    k = len(normalized_shape)
    if tuple(x._shape[x.ndim - k:]) != normalized_shape:
        raise ValueError(f"layer_norm: normalized_shape {list(normalized_shape)} is not the trailing "
                         f"shape of x {list(x._shape)}")
    ops = [x] + [_as_dist(t, mesh) for t in (weight, bias) if t is not None]
    has_w, has_b = weight is not None, bias is not None
    key = ("layer_norm", normalized_shape, has_w, has_b, eps) + \
        tuple(t._shape for t in ops) + tuple(t._pid for t in ops)

    def rule() -> RuleResult:
        lab = "abcdefghijklmnop"[:x.ndim]
        norm = lab[x.ndim - k:]
        return einsum_rule([lab] + [norm] * (len(ops) - 1), lab, [t._shape for t in ops],
                           [t._placements for t in ops], "nonlinear", frozenset(norm))

    def local_fn(xl, *wb):
        w = wb[0] if has_w else None
        b = wb[-1] if has_b else None
        return F.layer_norm(xl, normalized_shape, w, b, eps)

    return _apply(key, rule, local_fn, ops)


def _reduce(op: str, x: DistTensor, dim, keepdim: bool, dtype: Optional[torch.dtype] = None
            ) -> DistTensor:
    if dim is None:
        dims = tuple(range(x.ndim))
    else:
        dims = tuple(sorted(d % x.ndim for d in ((dim,) if isinstance(dim, int) else dim)))
    key = (op, x._shape, x._pid, dims, keepdim)

    def rule() -> RuleResult:
        lab, out = reduction_labels(x.ndim, dims)
        res = einsum_rule([lab], out, [x._shape], [x._placements], "linear")
        if not keepdim:
            return res
        shape = [1 if i in dims else n for i, n in enumerate(x._shape)]
        kept = [i for i in range(x.ndim) if i not in dims]
        pl = tuple(Shard(kept[p.dim]) if type(p) is Shard else p for p in res.out_placements)
        return RuleResult(res.in_placements, pl, torch.Size(shape))

    if op == "sum":
        def local_fn(t):
            return t.sum(dim=dims, keepdim=keepdim, dtype=dtype)
    else:
        # mean over a sharded dim: each rank sums its piece and divides by the *global* count, so
        # the Partial(sum) of the pieces is the global mean.
        count = 1
        for d in dims:
            count *= x._shape[d]

        def local_fn(t):
            return t.sum(dim=dims, keepdim=keepdim, dtype=dtype) / count
    return _apply(key, rule, local_fn, [x], dtype)


def _sum(x, dim=None, keepdim=False, dtype=None, **kw):
    return _reduce("sum", x, dim, keepdim, dtype)


def _mean(x, dim=None, keepdim=False, dtype=None, **kw):
    return _reduce("mean", x, dim, keepdim, dtype)


def _relu(x, inplace=False):
    return _unary("relu", x)


def _gelu(x, approximate="none"):
    return _unary("gelu", x, approximate)


def _bin(op: str) -> Callable:
    return lambda a, b, *args, **kw: _binary(op, a, b)


def _rbin(op: str) -> Callable:
    return lambda a, b, *args, **kw: _binary(op, b, a)


_HANDLERS: dict[Any, Callable] = {
    torch.matmul: matmul, torch.mm: matmul, torch.Tensor.matmul: matmul,
    torch.Tensor.__matmul__: matmul, torch.Tensor.__rmatmul__: lambda a, b: matmul(b, a),
    F.linear: linear,
    torch.add: _bin("add"), torch.sub: _bin("sub"), torch.mul: _bin("mul"), torch.div: _bin("div"),
    torch.Tensor.__add__: _bin("add"), torch.Tensor.__radd__: _rbin("add"),
    torch.Tensor.__sub__: _bin("sub"), torch.Tensor.__rsub__: _rbin("sub"),
    torch.Tensor.__mul__: _bin("mul"), torch.Tensor.__rmul__: _rbin("mul"),
    torch.Tensor.__truediv__: _bin("div"), torch.Tensor.__rtruediv__: _rbin("div"),
    torch.Tensor.add: _bin("add"), torch.Tensor.sub: _bin("sub"), torch.Tensor.mul: _bin("mul"),
    torch.Tensor.div: _bin("div"),
    torch.relu: _relu, F.relu: _relu, torch.Tensor.relu: _relu,
    F.gelu: _gelu,
    torch.softmax: _torch_softmax, F.softmax: softmax, torch.Tensor.softmax: _torch_softmax,
    F.layer_norm: layer_norm,
    torch.sum: _sum, torch.Tensor.sum: _sum, torch.mean: _mean, torch.Tensor.mean: _mean,
}

_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "argwhere", "unique_consecutive",
                   "__getitem__", "index_select", "where"}
