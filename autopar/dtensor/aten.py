"""What reaches ATen (``__torch_dispatch__``): PyTorch's own machinery working on DistTensors.

User-level ops with SPMD rules never get here (``__torch_function__`` serves them). What does:

* the autograd engine: ``ones_like`` to seed ``backward()``, ``add`` to sum two gradient
  contributions (placements unified, :func:`autopar.dtensor.autograd.accumulate`), ``detach``;
* ``nn.Parameter`` / ``state_dict``: ``detach``, ``alias``; ``load_state_dict``: ``copy_``, which
  reshards a DistTensor source on the same mesh and slices a plain (global) tensor;
* ``module.to(dtype)``: ``_to_copy``; ``zero_grad``: ``zero_``; ``deepcopy``: ``clone``;
* optimizers: elementwise ops, mostly in place (``add_``, ``mul_``, ``addcdiv_``, ``lerp_``,
  ``sqrt``, ...), on the parameter, its gradient and its state, which share one layout; with
  ``foreach=True`` the ``_foreach_*`` forms of the same, checked per list position.

Elementwise ops apply to the local pieces when every DistTensor operand has the same mesh, global
shape and placements and none is Partial (a nonlinear function of a Partial value is not the
Partial of the function): then the result has that layout too. Anything else raises
``NotImplementedError`` naming the op, never a silently wrong result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .autograd import accumulate, reshard_nograd
from .placements import REPLICATE, Partial
from .redistribute import check_placements_reachable
from .tensor import ATEN, ATEN_DEFAULT, DistTensor, local_piece, make

aten = torch.ops.aten


def _locals(args: tuple, kwargs: dict) -> tuple[list[DistTensor], tuple, dict]:
    flat, spec = tree_flatten((args, kwargs))
    dts = [a for a in flat if isinstance(a, DistTensor)]
    flat = [a._local if isinstance(a, DistTensor) else a for a in flat]
    largs, lkwargs = tree_unflatten(flat, spec)
    return dts, largs, lkwargs


def _like(func: Any, args: tuple, kwargs: dict) -> DistTensor:
    """``*_like`` keep the layout; ``ones_like`` / ``full_like`` make Partial dims Replicate (a
    Partial of ones would sum to W): the gradient that seeds ``backward()`` is Replicate."""
    x = args[0]
    pl = x._placements
    if func not in (aten.zeros_like.default, aten.empty_like.default):
        pl = tuple(REPLICATE if type(p) is Partial else p for p in pl)
    local = func(x._local, *args[1:], **kwargs)
    return make(local, x._mesh, pl, x._shape, local.dtype, init=x._init)


def _same_layout(func: Any, args: tuple, kwargs: dict) -> DistTensor:
    """detach / alias / clone / _to_copy: the same layout around the op's local result."""
    x = args[0]
    local = func(x._local, *args[1:], **kwargs)
    return make(local, x._mesh, x._placements, x._shape, local.dtype, init=x._init)


def _zero(func: Any, args: tuple, kwargs: dict) -> DistTensor:
    # Zero is zero under every placement, Partial ones included (zero_grad on unsynced grads).
    args[0]._local.zero_()
    return args[0]


def _add(func: Any, args: tuple, kwargs: dict) -> DistTensor:
    a, b = args[0], args[1]
    if (
        isinstance(a, DistTensor)
        and isinstance(b, DistTensor)
        and kwargs.get("alpha", 1) == 1
        and a._mesh == b._mesh
        and a._shape == b._shape
    ):
        # Also the engine summing two gradient contributions (placements may differ).
        out = accumulate(a, b)
        if func is aten.add_.Tensor:
            a._local, a._placements, a._lid, a._init = out._local, out._placements, out._lid, out._init
            return a
        return out
    return _pointwise(func, args, kwargs)


def _copy(func: Any, args: tuple, kwargs: dict) -> DistTensor:
    """``dst.copy_(src)`` (``load_state_dict``): a DistTensor source on the same mesh is resharded
    to ``dst``'s placements; a plain tensor is the global value and is sliced."""
    dst, src = args[0], args[1]
    if isinstance(src, DistTensor):
        if src._mesh != dst._mesh:
            raise ValueError(
                f"copy_: the source lives on mesh {src._mesh} but the destination on "
                f"{dst._mesh}; move it with autopar.reshard(src, mesh, placements)"
            )
        if src._shape != dst._shape:
            raise ValueError(f"copy_: source shape {list(src._shape)} != destination shape {list(dst._shape)}")
        if src._placements != dst._placements:
            check_placements_reachable(src._placements, dst._placements)
            src = reshard_nograd(src, dst._placements)
        if dst._init:
            dst._local.copy_(src._local, **kwargs)
        return dst
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"copy_: source must be a tensor, got {type(src).__name__}")
    if src.dim() != 0 and src.shape != dst._shape:
        raise ValueError(
            f"copy_: a plain source tensor must have the global shape "
            f"{list(dst._shape)} (or be a scalar), got {list(src.shape)}"
        )
    if src.dim() == 0 and any(type(p) is Partial for p in dst._placements):
        raise NotImplementedError(f"copy_ of a scalar into a Partial DistTensor ({list(dst._placements)})")
    if dst._init:
        piece = src if src.dim() == 0 else local_piece(src.to(dst._local.device), dst._mesh, dst._placements)
        dst._local.copy_(piece, **kwargs)
    return dst


def _check_layouts(func: Any, dts: list[DistTensor]) -> None:
    if not dts:
        return
    x = dts[0]
    for d in dts[1:]:
        if d._mesh != x._mesh or d._shape != x._shape or d._placements != x._placements:
            raise NotImplementedError(
                f"{func}: DistTensor operands must share mesh, global shape and placements here, got "
                f"{list(x._shape)} {list(x._placements)} and {list(d._shape)} {list(d._placements)}"
                f" (an optimizer step needs synced gradients: call autopar.sync_gradients first)"
            )
    if any(type(p) is Partial for p in x._placements):
        raise NotImplementedError(
            f"{func} on a Partial DistTensor ({list(x._placements)}): reduce it first "
            f"(autopar.sync_gradients for gradients, autopar.reshard otherwise)"
        )


def _check_no_plain(func: Any, args: Any) -> None:
    for a in tree_flatten(args)[0]:
        if isinstance(a, torch.Tensor) and not isinstance(a, DistTensor) and a.dim() != 0:
            raise NotImplementedError(
                f"{func}: mixing a plain tensor of shape {list(a.shape)} with "
                f"DistTensors; wrap it with autopar.shard_tensor first"
            )


def _pointwise(func: Any, args: tuple, kwargs: dict) -> Any:
    dts, largs, lkwargs = _locals(args, kwargs)
    _check_layouts(func, dts)
    _check_no_plain(func, (args, kwargs))
    x = dts[0]
    out = func(*largs, **lkwargs)
    if func._schema.is_mutable:
        return args[0]
    return make(out, x._mesh, x._placements, x._shape, out.dtype, init=x._init)


_FOREACH_OVERLOAD = {
    "List": "Tensor",
    "ScalarList": "Scalar",
    "Tensor": "Tensor",
    "Scalar": "Scalar",
    "default": "default",
}


def _foreach(func: Any, args: tuple, kwargs: dict) -> Any:
    """``torch._foreach_*`` (optimizers with ``foreach=True``): the same checks as one elementwise
    op per list position, then one foreach call over the local pieces. Only the forms of
    elementwise ops (and ``zero_``): a reduction such as ``_foreach_norm`` of the pieces is not
    the norm of the tensors."""
    base = func._schema.name[len("aten::_foreach_") :]
    if base == "zero_":
        for t in args[0]:
            t._local.zero_()
        return None
    # The single-tensor overload this foreach overload applies per position (List -> Tensor).
    packet = getattr(aten, base, None)
    name = _FOREACH_OVERLOAD.get(func._overloadname, func._overloadname)
    single = None if packet is None else getattr(packet, name if name in packet.overloads() else "default", None)
    if single is None or torch.Tag.pointwise not in single.tags:
        raise NotImplementedError(
            f"{func} has no DistTensor SPMD rule (only the foreach forms of elementwise ops are supported)"
        )
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    for i in range(len(lists[0])):
        _check_layouts(func, [lst[i] for lst in lists if isinstance(lst[i], DistTensor)])
    _check_no_plain(func, (args, kwargs))
    _, largs, lkwargs = _locals(args, kwargs)
    out = func(*largs, **lkwargs)
    if func._schema.is_mutable:
        return None if out is None else list(lists[0])
    return [
        make(o, x._mesh, x._placements, x._shape, o.dtype, init=x._init) for o, x in zip(out, lists[0], strict=False)
    ]


def _default(func: Any, args: tuple, kwargs: dict) -> Any:
    if func._schema.name.startswith("aten::_foreach_"):
        return _foreach(func, args, kwargs)
    if torch.Tag.pointwise in func.tags:
        return _pointwise(func, args, kwargs)
    if func in (aten._local_scalar_dense.default, aten.is_nonzero.default):
        raise NotImplementedError(
            "item() / bool() of a DistTensor: this rank holds only a piece; "
            "use t.full_tensor().item() (collective over the mesh)"
        )
    raise NotImplementedError(
        f"{func} has no DistTensor SPMD rule (supported: matmul, linear, +, -, *, /, pow, gelu, relu, "
        f"silu, sigmoid, tanh, exp, log, sqrt, rsqrt, sin, cos, softmax, layer_norm, sum, mean, view, "
        f"reshape, flatten, (un)squeeze, permute, transpose, expand, basic indexing, cat, embedding, "
        f"scaled_dot_product_attention, cross_entropy, and elementwise ops on operands of one layout; "
        f"see docs/dtensor.md)"
    )


def _install() -> None:
    table: dict[Any, Callable] = {
        aten.detach.default: _same_layout,
        aten.alias.default: _same_layout,
        aten.clone.default: _same_layout,
        aten._to_copy.default: _same_layout,
        aten.ones_like.default: _like,
        aten.zeros_like.default: _like,
        aten.empty_like.default: _like,
        aten.full_like.default: _like,
        aten.zero_.default: _zero,
        aten.copy_.default: _copy,
        aten.add.Tensor: _add,
        aten.add_.Tensor: _add,
    }
    ATEN.update({id(op): fn for op, fn in table.items()})
    ATEN_DEFAULT[:] = [_default]


_install()
