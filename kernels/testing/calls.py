"""Which op implementations really ran: a counter of the backend runs behind the registered operators."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

# The environment that picks each backend other than the default (sequential) for calls without backend=:
# a chunked split of 2 (COC_PARALLEL_NUM) or the fused kernels (USE_COC_FUSED_KERNEL, MindSpeed's switches).
BACKEND_ENVS: dict[str, dict[str, str]] = {"chunked": {"COC_PARALLEL_NUM": "2"}, "fused": {"USE_COC_FUSED_KERNEL": "1"}}


@contextlib.contextmanager
def backend_calls() -> Iterator[collections.Counter]:
    """Counts every backend run by ``(public op name, backend)`` while the block runs: what the registered
    operators executed after the backend choice (a fallback shows up as another backend; the tuner's
    timing runs count too). A run with several weights counts as ``"<op>[<n> weights]"`` (one gather
    feeding several GEMMs). Wraps the entries of ``kernels.call.IMPLEMENTATIONS``, which the operators
    look up at each call, and restores them after."""
    from kernels.call import IMPLEMENTATIONS

    calls: collections.Counter = collections.Counter()
    saved = {pattern: dict(table) for pattern, table in IMPLEMENTATIONS.items()}

    def spy(backend: str, fn: Any) -> Any:
        def run(call: Any, ops: Any, group: Any = None) -> Any:
            n = len(ops.weights)
            calls[(call.op_name if n == 1 else f"{call.op_name}[{n} weights]", backend)] += 1
            return fn(call, ops, group)

        return run

    for table in IMPLEMENTATIONS.values():
        for backend, fn in list(table.items()):
            table[backend] = spy(backend, fn)
    try:
        yield calls
    finally:
        for pattern, table in saved.items():
            IMPLEMENTATIONS[pattern].update(table)


@contextlib.contextmanager
def operator_calls() -> Iterator[list[tuple[Any, tuple]]]:
    """Records ``(operator, args)`` of every registered-operator call the public functions make while the
    block runs (and still makes them): the arguments a test can replay under fake tensors or opcheck."""
    from kernels.ops import all_gather, all_reduce, matmul, reduce_scatter

    modules = (all_gather, all_reduce, matmul, reduce_scatter)
    calls: list[tuple[Any, tuple]] = []
    saved = {module: module.operator for module in modules}

    def recording(op: Any) -> Any:
        def call(*args: Any) -> Any:
            calls.append((op, args))
            return op(*args)

        return call

    for module in modules:
        module.operator = recording(module.operator)
    try:
        yield calls
    finally:
        for module, op in saved.items():
            module.operator = op
