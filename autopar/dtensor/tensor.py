"""``DistTensor``: a ``torch.Tensor`` subclass holding this rank's piece of a global tensor.

The wrapper is made with ``torch.Tensor._dtensor__new__`` (DTensor's own constructor, the cheapest
per op; ``_make_wrapper_subclass`` where torch lacks it): to PyTorch it is a tensor of the *global*
shape, the piece's dtype and device, with no storage of its own, so ``nn.Parameter``,
``module.parameters()``, ``state_dict()``, ``torch.optim`` and the autograd engine accept it. The
piece lives in ``_local``; the layout (mesh, placements, global shape) in slots.

Two entry points, chosen by measurement (docs/dtensor.md, "Design"):

* ``__torch_function__`` (and the ``@``/``+``/... dunders, overridden directly) handles the ops
  that have SPMD rules (:mod:`autopar.dtensor.ops`, one module per op family) at the Python
  level, before the dispatcher:
  one dict lookup, the cached rule, the local op and one wrapper (a cached no-grad ``F.gelu`` or
  ``relu`` is served inside ``__torch_function__`` itself). Reaching ``__torch_dispatch__``
  instead (through the dispatcher and the autograd layer, as DTensor does for every op) costs
  about 2.4 times as much before any work is done: with the wrapper, most of a budget of half
  DTensor's added time.
* ``__torch_dispatch__`` serves what reaches ATen from PyTorch's own machinery: the autograd
  engine summing gradients, optimizers' in-place updates, ``module.to``, ``load_state_dict``'s
  ``copy_`` (:mod:`autopar.dtensor.aten`).

Both tables are filled by those modules, and ``ops`` sets the operator methods (``__matmul__``,
``__add__``, ...) on the class: this module imports neither, so there is no cycle.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import redistribute as _rd
from .mesh import ProcessMesh, rebuild_mesh
from .placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    chunk_bounds,
    normalize_placements,
    to_dims_mapping,
    to_partial_status,
)

HANDLERS: dict[Any, Callable] = {}  # torch-level function -> handler(*args, **kwargs)
# torch-level function of one tensor -> {input layout id: (mesh, out placements, out shape, out
# layout id)} for calls that need only ``func(piece)`` and a wrapper (no gradient, the rule's input
# layout already): __torch_function__ serves them without the handler's frame and argument
# repacking. Filled by ops.py on a call the handler found to be such a call.
UNARY_PLAIN: dict[Any, dict[int, tuple]] = {}
ATEN: dict[int, Callable] = {}  # id(aten overload) -> handler(func, args, kwargs)
ATEN_DEFAULT: list[Callable] = []  # handler for aten ops not in ATEN (set by aten.py)
# The autograd-tracked forms of the conversions between a DistTensor and plain tensors
# ("to_local", "full_tensor", "from_local"), set by autograd.py: this module cannot import it.
TRACKED_CONVERSIONS: dict[str, Callable] = {}

_DATA_DEPENDENT = {
    "nonzero",
    "masked_select",
    "unique",
    "argwhere",
    "unique_consecutive",
    "__getitem__",
    "index_select",
    "where",
}

_LAYOUT_ID_BY_KEY: dict[tuple, int] = {}
_EMPTY_PIECES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_MAKE_WRAPPER_SUBCLASS = torch.Tensor._make_wrapper_subclass
# DTensor's own wrapper constructor (None in a torch without it). It takes every argument
# positionally and reads dtype, device and layout off the piece, where _make_wrapper_subclass parses
# keyword arguments: 0.72 us instead of 1.07 per wrapper made and freed, the largest single cost of
# a cached op (docs/dtensor.md). It stores the piece and ``spec`` as ``_local_tensor`` / ``_spec``.
_DTENSOR_NEW: Callable | None = getattr(torch.Tensor, "_dtensor__new__", None)


class Layout:
    """One layout's global size and contiguous strides, built once per layout id and shared by
    every wrapper of that layout: ``_dtensor__new__`` reads ``spec.tensor_meta.shape`` and
    ``.stride`` (DTensor's spec attribute names; tuples)."""

    __slots__ = ("tensor_meta", "shape", "stride")

    def __init__(self, shape: torch.Size):
        self.tensor_meta = self
        self.shape = shape
        stride = []
        n = 1
        for d in reversed(shape):
            stride.append(n)
            n *= max(d, 1)
        self.stride = tuple(reversed(stride))


_LAYOUTS: list[Layout] = []  # by layout id


def lid_of(shape: Sequence[int], placements: tuple) -> int:
    """A small int naming a layout (global shape, placements): rule-cache keys and layout checks
    then hash and compare ints, not sizes and Placement objects (Python __hash__/__eq__)."""
    key = (tuple(shape), placements)
    lid = _LAYOUT_ID_BY_KEY.get(key)
    if lid is None:
        lid = _LAYOUT_ID_BY_KEY[key] = len(_LAYOUT_ID_BY_KEY)
        _LAYOUTS.append(Layout(torch.Size(shape)))
    return lid


def empty_local(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # On the data's device (zero elements allocate nothing): a clipped rank's placeholder tells a
    # later cross-mesh receive where to put the data (NCCL receives only into CUDA tensors).
    t = _EMPTY_PIECES.get((dtype, device))
    if t is None:
        t = _EMPTY_PIECES[(dtype, device)] = torch.empty(0, dtype=dtype, device=device)
    return t


class DistTensor(torch.Tensor):
    """A distributed tensor: ``to_local()`` is this rank's piece of a ``shape``-sized global tensor."""

    # ``_local_tensor`` and ``_spec`` (a Layout) are the names ``_dtensor__new__`` stores into;
    # ``_local`` (set below) reads the same slot.
    __slots__ = ("_local_tensor", "_spec", "_mesh", "_placements", "_lid", "_shape", "_dtype", "_init")

    def __new__(cls, *args: Any, **kwargs: Any):
        raise TypeError(
            "DistTensor(...): build one with autopar.shard_tensor(data, mesh, placements) "
            "or DistTensor.from_local(local, mesh, placements)"
        )

    # -- construction -----------------------------------------------------------------------------
    @staticmethod
    def from_local(
        local: torch.Tensor,
        mesh: ProcessMesh,
        placements: Sequence[Placement],
        global_shape: Sequence[int] | None = None,
    ) -> DistTensor:
        """Wrap this rank's piece (no copy). Without ``global_shape`` shards are assumed even."""
        if not isinstance(local, torch.Tensor) or isinstance(local, DistTensor):
            raise TypeError(f"from_local(local): expected a plain torch.Tensor, got {type(local).__name__}")
        if not isinstance(mesh, ProcessMesh):
            raise TypeError(f"from_local(mesh): expected a ProcessMesh, got {type(mesh).__name__}")
        local = _dense(local, "from_local(local)")
        pl = normalize_placements(placements, mesh.ndim, local.ndim)
        if mesh.my_coordinate is None:
            if global_shape is None:
                raise ValueError("from_local on a rank outside the mesh needs global_shape")
            return uninit(mesh, pl, torch.Size(global_shape), local.dtype, local.device)
        if global_shape is None:
            shape = list(local.shape)
            for m, p in enumerate(pl):
                if type(p) is Shard:
                    shape[p.dim] *= mesh.shape[m]
            global_shape = shape
        global_shape = torch.Size(global_shape)
        expect = _rd.local_shape(global_shape, mesh, pl)
        if list(local.shape) != expect:
            raise ValueError(
                f"from_local(local): local shape {list(local.shape)} does not match "
                f"global_shape {list(global_shape)} with placements {list(pl)} at mesh "
                f"coordinate {mesh.my_coordinate} (expected {expect})"
            )
        out = make(local.detach(), mesh, pl, global_shape, local.dtype)
        if _grad_enabled() and torch.Tensor.requires_grad.__get__(local):
            return TRACKED_CONVERSIONS["from_local"](out, local)
        return out

    # -- views (Python properties: the C++ ones would go through __torch_function__) ----------------
    @property
    def shape(self) -> torch.Size:
        return self._shape

    def size(self, dim: int | None = None):
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

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's piece (a zero-element tensor on a rank outside the mesh).

        Differentiable, as DTensor's: with grad mode on and ``self`` requiring grad it returns a
        view of the piece whose gradient flows back as a DistTensor with ``grad_placements``
        (default: ``self``'s placements with Partial made Replicate); otherwise the piece itself.
        """
        if _grad_enabled() and torch.Tensor.requires_grad.__get__(self):
            return TRACKED_CONVERSIONS["to_local"](self, grad_placements)
        return self._local

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The global value, gathered and reduced on every rank of the mesh.

        Differentiable, as DTensor's: the gradient (on every rank the gradient of the global value,
        or ``grad_placements`` when each rank holds another part of it) goes back sharded like
        ``self``, Replicate where ``self`` is Partial.
        """
        if not self._init:
            raise ValueError(
                f"full_tensor(): this rank ({self._mesh._my_rank}) is outside the tensor's "
                f"mesh {self._mesh}; only ranks of the mesh hold data"
            )
        if _grad_enabled() and torch.Tensor.requires_grad.__get__(self):
            return TRACKED_CONVERSIONS["full_tensor"](self, grad_placements)
        return _rd.redistribute_local(
            self._local, self._shape, self._mesh, self._placements, tuple(Replicate() for _ in self._placements)
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        state = "" if self._init else ", uninitialized"
        grad = ", requires_grad=True" if torch.Tensor.requires_grad.__get__(self) else ""
        return (
            f"DistTensor(shape={list(self._shape)}, dtype={self._dtype}, placements="
            f"{list(self._placements)}, mesh={list(self._mesh.shape)}{state}{grad})"
        )

    def backward(
        self,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        torch.autograd.backward(self, gradient, retain_graph, create_graph, inputs=inputs)

    # -- the two dispatch protocols -----------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        plain = UNARY_PLAIN.get(func)
        if plain is not None and not kwargs and len(args) == 1:
            x = args[0]
            f = plain.get(x._lid)
            if f is not None and f[0] is x._mesh and not _grad_enabled():
                return wrap(func(x._local), f[0], f[1], f[2], f[3])
        handler = HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs) if kwargs else handler(*args)
        name = getattr(func, "__name__", "")
        if name in _DATA_DEPENDENT:
            raise NotImplementedError(
                f"{name} on DistTensor: its output shape depends on the data, which a rank outside "
                f"the mesh (pipeline non-computation clip) cannot infer; convert with full_tensor() "
                f"on the ranks of the mesh first"
            )
        # Tensor plumbing (properties, requires_grad_, ...) and ops without a rule go down to ATen,
        # where __torch_dispatch__ serves or rejects them.
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Keyed by id: OpOverloads are singletons, and their __hash__ is Python-level.
        handler = ATEN.get(id(func))
        if handler is None:
            handler = ATEN_DEFAULT[0]
        return handler(func, args, kwargs or {})

    # -- copy, pickle, tracing --------------------------------------------------------------------
    def __deepcopy__(self, memo: dict) -> DistTensor:
        if id(self) in memo:
            return memo[id(self)]
        if not torch.Tensor.is_leaf.__get__(self):
            raise RuntimeError("deepcopy of a DistTensor that is not a graph leaf; detach() it first")
        new = make(self._local.clone(), self._mesh, self._placements, self._shape, self._dtype, init=self._init)
        memo[id(self)] = new
        if torch.Tensor.requires_grad.__get__(self):
            torch.Tensor.requires_grad_(new)
        grad = torch.Tensor.grad.__get__(self)
        if grad is not None:
            torch.Tensor.grad.__set__(new, copy.deepcopy(grad, memo))
        if self.__dict__:
            new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __reduce_ex__(self, protocol: int):
        return (
            _rebuild_dist_tensor,
            (
                self._local,
                self._mesh,
                self._placements,
                self._shape,
                self._dtype,
                self._init,
                torch.Tensor.requires_grad.__get__(self),
                bool(getattr(self, "_is_param", False)),
            ),
        )

    def __tensor_flatten__(self):
        # Makes DistTensor a traceable wrapper subclass: module.to() then swaps parameters whole
        # instead of shallow-copying TensorImpl metadata (which would leave ``_local`` behind).
        return ["_local"], (self._mesh, self._placements, self._shape, self._init)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> DistTensor:
        local = inner["_local"]
        mesh, placements, shape, init = meta
        return make(local, mesh, placements, shape, local.dtype, init=init)


_grad_enabled = torch.is_grad_enabled
_LOCAL_SLOT = DistTensor.__dict__["_local_tensor"]
# The whole package says ``x._local``: the same slot under a shorter name (a slot descriptor
# reads its offset, whatever name finds it).
DistTensor._local = _LOCAL_SLOT


def _private_constructor_works() -> bool:
    """Whether this torch's ``_dtensor__new__`` (a private API) builds what ``make`` relies on: the
    global size and strides of the spec, the piece's dtype and device, the piece in ``_local_tensor``,
    no gradient. Checked once at import, so a torch whose private API differs (another release than
    the one tested) takes the public ``_make_wrapper_subclass`` path instead of failing or
    returning a wrong tensor."""
    if _DTENSOR_NEW is None:
        return False
    piece = torch.zeros(2, 3, dtype=torch.float64)
    layout = Layout(torch.Size((4, 3)))
    try:
        r = _DTENSOR_NEW(DistTensor, piece, layout, False)
        # torch.Tensor's own accessors: DistTensor overrides some to read its slots, unset here.
        base = torch.Tensor
        return (
            tuple(base.size(r)) == (4, 3)
            and base.stride(r) == (3, 1)
            and base.dtype.__get__(r) == torch.float64
            and base.device.__get__(r) == piece.device
            and _LOCAL_SLOT.__get__(r) is piece
            and not base.requires_grad.__get__(r)
        )
    except Exception:  # noqa: BLE001 - any failure of a private API means: do not use it
        return False


if not _private_constructor_works():
    _DTENSOR_NEW = None


def make(
    local: torch.Tensor,
    mesh: ProcessMesh,
    placements: tuple,
    shape: torch.Size,
    dtype: torch.dtype,
    *,
    init: bool = True,
    lid: int | None = None,
    cls: type = DistTensor,
) -> DistTensor:
    """A DistTensor around ``local`` (not copied), of global ``shape`` and ``dtype``."""
    if lid is None:
        lid = lid_of(shape, placements)
    if _DTENSOR_NEW is not None and dtype is local.dtype:
        r = _DTENSOR_NEW(cls, local, _LAYOUTS[lid], False)
    else:
        r = _MAKE_WRAPPER_SUBCLASS(cls, shape, dtype=dtype, device=local.device)
        _LOCAL_SLOT.__set__(r, local)
    r._mesh = mesh
    r._placements = placements
    r._lid = lid
    r._shape = shape
    r._dtype = dtype
    r._init = init
    return r


def wrap(local: torch.Tensor, mesh: ProcessMesh, placements: tuple, shape: torch.Size, lid: int) -> DistTensor:
    """``make`` for the per-op hot path: an initialized DistTensor whose dtype is its piece's and
    whose layout id is known."""
    if _DTENSOR_NEW is None:
        return make(local, mesh, placements, shape, local.dtype, lid=lid)
    r = _DTENSOR_NEW(DistTensor, local, _LAYOUTS[lid], False)
    r._mesh = mesh
    r._placements = placements
    r._lid = lid
    r._shape = shape
    r._dtype = local.dtype
    r._init = True
    return r


def uninit(
    mesh: ProcessMesh, placements: tuple, shape: torch.Size, dtype: torch.dtype, device: torch.device
) -> DistTensor:
    return make(empty_local(dtype, device), mesh, placements, shape, dtype, init=False)


class PendingMatmul(DistTensor):
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

    def is_computed(self) -> bool:
        return _LOCAL_SLOT.__get__(self, DistTensor) is not None


def pending(
    x_local: torch.Tensor,
    w_local: torch.Tensor,
    mesh: ProcessMesh,
    placements: tuple,
    shape: torch.Size,
    *,
    dtype: torch.dtype,
    mesh_dim: int,
    lid: int | None = None,
) -> PendingMatmul:
    """A DistTensor standing for ``x_local @ w_local.T`` (Partial on ``mesh_dim``), not computed."""
    out = _MAKE_WRAPPER_SUBCLASS(PendingMatmul, shape, dtype=dtype, device=x_local.device)
    _LOCAL_SLOT.__set__(out, None)
    out._mesh, out._placements, out._shape, out._dtype, out._init = mesh, placements, shape, dtype, True
    out._lid = lid_of(shape, placements) if lid is None else lid
    out._x, out._w, out._mesh_dim = x_local, w_local, mesh_dim
    return out


def local_piece(data: torch.Tensor, mesh: ProcessMesh, placements: tuple) -> torch.Tensor:
    """This rank's piece of the global tensor ``data`` (a view where possible; no collective)."""
    local = data
    coord = mesh.my_coordinate
    for m, p in enumerate(placements):
        if type(p) is Shard:
            s, e = chunk_bounds(data.shape[p.dim], mesh.shape[m], coord[m])
            local = local.narrow(p.dim, s, e - s)
        elif type(p) is Partial:
            local = _rd.replicate_to_partial(local, p.reduce_op, coord[m])
    return local


def _dense(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` with lazy conjugate / negative bits materialized; a sparse or other non-strided layout
    is refused. A wrapper copies those bits off its piece under one constructor and not the other
    (``make``), and the SPMD rules assume dense pieces."""
    if t.layout != torch.strided:
        raise TypeError(f"{what}: only dense (strided) tensors can be distributed, got layout {t.layout}")
    return t.resolve_conj().resolve_neg()


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
    data = _dense(data, "shard_tensor(data)")
    pl = normalize_placements(placements, mesh.ndim, data.ndim)
    if mesh.my_coordinate is None:
        return uninit(mesh, pl, data.shape, data.dtype, data.device)
    # A private copy: the caller's tensor must not alias a parameter's storage.
    local = local_piece(data.detach(), mesh, pl).clone()
    return make(local, mesh, pl, data.shape, data.dtype)


# torch.load calls this with the positional arguments __reduce_ex__ pickled: every saved file holds
# that call, so its parameters stay positional (and in this order) for the files saved so far.
def _rebuild_dist_tensor(
    local: torch.Tensor,
    mesh: ProcessMesh,
    placements: tuple,
    shape: torch.Size,
    dtype: torch.dtype,
    init: bool,
    requires_grad: bool,
    is_param: bool,
) -> torch.Tensor:
    t = make(local, mesh, tuple(placements), torch.Size(shape), dtype, init=init)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return torch.Tensor.requires_grad_(t, requires_grad) if requires_grad else t


torch.serialization.add_safe_globals([_rebuild_dist_tensor, rebuild_mesh, Shard, Replicate, Partial])
# Files saved while autopar had placement classes of its own name them under this module; the
# pickled calls (Shard(dim), Replicate(), Partial(reduce_type)) build torch's equal placements.
torch.serialization.add_safe_globals(
    [(c, f"autopar.dtensor.placements.{c.__name__}") for c in (Shard, Replicate, Partial)]
)
