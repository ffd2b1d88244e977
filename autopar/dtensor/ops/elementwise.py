"""Elementwise ops: ``+ - * /`` (DistTensor, plain tensor or Python scalar operands, with
broadcasting), negation, ``gelu`` and ``relu``, and the operator methods of ``DistTensor``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..rules import RuleResult, broadcast_labels, einsum_rule
from ..tensor import HANDLERS, UNARY_PLAIN, DistTensor, wrap
from .dispatch import PLAIN, Op, apply, apply1, apply2, as_dist, mesh_of

_grad_enabled = torch.is_grad_enabled


def _broadcast_rule(kind: str) -> Callable[[DistTensor, DistTensor], RuleResult]:
    def rule(a: DistTensor, b: DistTensor) -> RuleResult:
        labels, out, forbidden = broadcast_labels([a._shape, b._shape])
        return einsum_rule(labels, out, [a._shape, b._shape], [a._placements, b._placements], kind, forbidden=forbidden)

    return rule


def fit(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A broadcast gradient summed back to the input piece's shape and dtype."""
    if g.shape != x.shape:
        g = g.sum_to_size(x.shape)
    return g if g.dtype == x.dtype else g.to(x.dtype)


def _vjp_add(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    return [fit(g, saved[0]) if need[0] else None, fit(g, saved[1]) if need[1] else None]


def _vjp_sub(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    return [fit(g, saved[0]) if need[0] else None, fit(-g, saved[1]) if need[1] else None]


def _vjp_mul(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    a, b = saved
    return [fit(g * b, a) if need[0] else None, fit(g * a, b) if need[1] else None]


def _vjp_div(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    a, b = saved
    return [fit(g / b, a) if need[0] else None, fit(-g * a / (b * b), b) if need[1] else None]


# + and - keep matching Partials, * is linear in each operand (one Partial may stay), / is not linear in
# its divisor.
_BINARY = {
    "add": Op(_broadcast_rule("add"), operator.add, _vjp_add),
    "sub": Op(_broadcast_rule("add"), operator.sub, _vjp_sub),
    "mul": Op(_broadcast_rule("linear"), operator.mul, _vjp_mul),
    "div": Op(_broadcast_rule("nonlinear"), operator.truediv, _vjp_div),
}


def binary(op: str, a, b) -> DistTensor:
    """``a <op> b`` for DistTensors, plain tensors (Replicate) and Python scalars."""
    if type(a) is not DistTensor or type(b) is not DistTensor or a._mesh is not b._mesh:
        a_dt = isinstance(a, DistTensor)
        if a_dt != isinstance(b, DistTensor) and isinstance(b if a_dt else a, (int, float, bool)):
            return with_scalar(op, a if a_dt else b, b if a_dt else a, a_dt)
        mesh = mesh_of(a, b)
        a, b = as_dist(a, mesh), as_dist(b, mesh)
    return apply2((op, a._lid, b._lid), _BINARY[op], a, b)


def linear_elementwise_rule(x: DistTensor) -> RuleResult:
    lab = "abcdefghijklmnop"[: x.ndim]
    return einsum_rule([lab], lab, [x._shape], [x._placements], "linear")


def nonlinear_rule(x: DistTensor, forbidden_dims: Sequence[int] = ()) -> RuleResult:
    lab = "abcdefghijklmnop"[: x.ndim]
    forbidden = frozenset(lab[d] for d in forbidden_dims)
    return einsum_rule([lab], lab, [x._shape], [x._placements], "nonlinear", forbidden=forbidden)


def with_scalar(op: str, x: DistTensor, c: float, x_first: bool) -> DistTensor:
    """x * c and x / c scale (linear: a Partial stays Partial); x + c, c - x, c / x do not."""
    if op == "mul" or (op == "div" and x_first):
        c = c if op == "mul" else 1.0 / c
        scale = Op(linear_elementwise_rule, lambda t: t * c, lambda saved, g, need: [fit(g * c, saved[0])])
        return apply(("scale", x._lid), scale, [x])
    fn = _BINARY[op].local_fn
    local_fn = (lambda t: fn(t, c)) if x_first else (lambda t: fn(c, t))
    return apply(("scalar_" + op, x._lid, x_first), Op(nonlinear_rule, local_fn), [x])


def neg(x: DistTensor) -> DistTensor:
    return with_scalar("mul", x, -1.0, True)


def _vjp_gelu(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    return [torch.ops.aten.gelu_backward(g, saved[0])]


def _vjp_relu(saved: tuple, g: torch.Tensor, need: list[bool]) -> list:
    return [torch.ops.aten.threshold_backward(g, saved[0], 0)]


_GELU = Op(nonlinear_rule, F.gelu, _vjp_gelu)
_RELU = Op(nonlinear_rule, torch.relu, _vjp_relu)
_GELU_PLAIN: dict[int, tuple] = {}
_RELU_PLAIN: dict[int, tuple] = {}


def _gelu(x: DistTensor, approximate: str = "none") -> DistTensor:
    if approximate == "none":
        return apply1(("gelu", x._lid), _GELU, x, plain=_GELU_PLAIN)
    return apply1(
        ("gelu", x._lid, approximate),
        Op(
            nonlinear_rule,
            lambda t: F.gelu(t, approximate=approximate),
            lambda saved, g, need: [torch.ops.aten.gelu_backward(g, saved[0], approximate=approximate)],
        ),
        x,
    )


def _relu(x: DistTensor, inplace: bool = False) -> DistTensor:
    if inplace:
        raise NotImplementedError("relu(inplace=True) on a DistTensor; use relu()")
    return apply1(("relu", x._lid), _RELU, x, plain=_RELU_PLAIN)


# Unary functions with a rule (nonlinear: a Partial input is reduced first, shards stay) and the
# local graph's vjp, so a Partial gradient flowing back through them stays Partial (a vjp is
# linear in the gradient). Other elementwise ATen ops run on one layout only (aten.py).
_UNARY: dict[str, Callable] = {
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "sin": torch.sin,
    "cos": torch.cos,
    "reciprocal": torch.reciprocal,
}


def _unary(name: str, fn: Callable) -> Callable[..., DistTensor]:
    op = Op(nonlinear_rule, fn)

    def handler(x: DistTensor, inplace: bool = False) -> DistTensor:
        if inplace:
            raise NotImplementedError(f"{name}(inplace=True) on a DistTensor; use {name}()")
        return apply1((name, x._lid), op, x)

    return handler


def pow_(x, exponent) -> DistTensor:
    """``x ** c`` for a Python number ``c`` (nonlinear); a tensor exponent has no rule."""
    if not isinstance(x, DistTensor) or isinstance(exponent, torch.Tensor):
        raise NotImplementedError("pow on DistTensors: only DistTensor ** (Python number) has an SPMD rule")
    return apply1(("pow", x._lid, exponent), Op(nonlinear_rule, lambda t: torch.pow(t, exponent)), x)


def _operator(op: str) -> Callable[[Any, Any], DistTensor]:
    """``a <op> b`` as a method: the hot path when both are DistTensors of a cached layout."""
    fn = _BINARY[op].local_fn

    def method(a, b):
        if type(b) is DistTensor and type(a) is DistTensor:
            f = PLAIN.get((op, a._lid, b._lid))
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


def install() -> None:
    """Register the handlers with DistTensor's ``__torch_function__`` and set its operator
    methods (``a + b``, ...), which then skip the torch-function round trip."""
    methods: dict[str, Callable] = {"__neg__": neg}
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
            torch.neg: neg,
            torch.Tensor.neg: neg,
            torch.relu: _relu,
            F.relu: _relu,
            torch.Tensor.relu: _relu,
            F.gelu: _gelu,
            torch.pow: pow_,
            torch.Tensor.pow: pow_,
            torch.Tensor.__pow__: pow_,
        }
    )
    for name, fn in _UNARY.items():
        handler = _unary(name, fn)
        HANDLERS[fn] = handler
        for owner in (torch, torch.Tensor):
            if hasattr(owner, name):
                HANDLERS[getattr(owner, name)] = handler
    DistTensor.__pow__ = pow_
    # Called with the piece alone, these compute what their handler's local function does (F.relu
    # is not among them: it always passes ``inplace``, so it never takes the short path).
    UNARY_PLAIN.update({F.gelu: _GELU_PLAIN, torch.relu: _RELU_PLAIN, torch.Tensor.relu: _RELU_PLAIN})
