"""A spy on the public ``kernels`` ops, for tests that check which ops the autopar linears ran."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

FP8_OPS = ("all_gather_scaled_matmul", "scaled_matmul_reduce_scatter", "scaled_matmul_all_reduce", "scaled_matmul")
PLAIN_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


@contextlib.contextmanager
def public_op_counter() -> Iterator[collections.Counter]:
    """Counts calls of the public ``kernels`` ops by name while the block runs (the autopar Functions look
    them up on the module at each call)."""
    import kernels

    calls: collections.Counter = collections.Counter()
    saved = {name: getattr(kernels, name) for name in FP8_OPS + PLAIN_OPS}

    def spy(name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(kernels, name, spy(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)
