"""Registering a ``coc`` torch operator by hand: its schema, its implementation for every device and its
fake (meta) implementation in one call, and the copy that keeps an operator's outputs fresh.

Used by the pattern modules of :mod:`kernels.ops`, one operator each. The schema is written by hand
rather than inferred by ``torch.library.custom_op``: inference and its wrapper cost host time on
every call, and an op called per layer per step is host-bound at small shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

LIB = torch.library.Library("coc", "FRAGMENT")
# Each operator's Python implementation, for tools that run an op's body under their own torch function
# mode (the dispatcher pops such modes before the implementation runs).
IMPLEMENTATION_OF: dict[torch._ops.OpOverload, Callable[..., Any]] = {}


def assume_constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo``: that import takes
    about a second of every ``import kernels``, in every rank a launcher starts. torch's decorator
    only marks ``fn`` (``_dynamo_marked_constant``), which Dynamo reads when it traces a call;
    tests/kernels/test_compile.py checks that torch's decorator still sets exactly this mark."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def define_op(schema: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> torch._ops.OpOverload:
    """Define ``coc::<schema>``, register ``impl`` for every device (``CompositeExplicitAutograd``: the
    op is forward-only; autograd Functions wrap it) and ``fake`` (output shapes, dtypes and devices
    from the inputs alone, so ``torch.compile`` never runs the op), and return the operator. A fake
    may end in ``*_`` for the trailing arguments its shapes do not read."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"coc::{name}", fake, lib=LIB)
    op = getattr(torch.ops.coc, name).default
    IMPLEMENTATION_OF[op] = impl
    return op


def unaliased(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``out``, or a contiguous copy of it where it shares storage with one of ``inputs``: a group of one
    gathers nothing and a backend may hand back its input, but an operator's output must not alias
    its inputs (autograd and compile assume fresh outputs)."""
    ptr = out.untyped_storage().data_ptr()
    if any(ptr == t.untyped_storage().data_ptr() for t in inputs):
        return out.clone(memory_format=torch.contiguous_format)
    return out
