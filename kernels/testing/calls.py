"""Which op implementations really ran: a counter of the backend runs behind the registered operators."""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

# The environment that picks each backend other than the default (sequential) for calls without backend=:
# a chunked split of 2 (COC_PARALLEL_NUM) or the fused kernels (USE_COC_FUSED_KERNEL, MindSpeed's switches).
BACKEND_ENVS: dict[str, dict[str, str]] = {"chunked": {"COC_PARALLEL_NUM": "2"}, "fused": {"USE_COC_FUSED_KERNEL": "1"}}


@contextlib.contextmanager
def environment(env: dict[str, str | None]) -> Iterator[None]:
    """``env`` set in ``os.environ`` for the block (None unsets a variable), the previous values restored after:
    the backend switches are read per call, so a block picks the backend of the calls inside it."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def backend_calls() -> Iterator[collections.Counter]:
    """Counts every backend run by ``(public op name, backend)`` while the block runs: what the registered
    operators executed after the backend choice (a fallback shows up as another backend; the tuner's
    timing runs count too). A run with several weights counts as ``"<op>[<n> weights]"`` (one gather
    feeding several GEMMs); a GEMM + all-reduce with the RMSNorm epilogue counts as ``"<op>+<epilogue>"``
    (``"matmul_all_reduce+rmsnorm"``). Wraps the entries of ``kernels.call.IMPLEMENTATIONS`` and of
    ``kernels.ops.all_reduce.REDUCED``, which the operators look up at each call, and restores them after."""
    from kernels.call import IMPLEMENTATIONS
    from kernels.ops.all_reduce import REDUCED

    calls: collections.Counter = collections.Counter()
    tables = [*IMPLEMENTATIONS.values(), REDUCED]
    saved = [dict(table) for table in tables]

    def spy(backend: str, fn: Any) -> Any:
        def run(call: Any, ops: Any, group: Any = None, *rest: Any) -> Any:
            n = len(ops.weights)
            name = call.op_name if n == 1 else f"{call.op_name}[{n} weights]"
            calls[(f"{name}+{call.epilogue}" if call.epilogue else name, backend)] += 1
            return fn(call, ops, group, *rest)

        return run

    for table in tables:
        for backend, fn in list(table.items()):
            table[backend] = spy(backend, fn)
    try:
        yield calls
    finally:
        for table, entries in zip(tables, saved, strict=True):
            table.update(entries)


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


def outcomes(calls: list[Callable[[], object]]) -> list[str]:
    """Each call's outcome, in order: ``"no error"``, or ``"<type>: <message>"`` of the ``ValueError`` /
    ``TypeError`` / ``RuntimeError`` it raised (the named-error tests compare these on every rank)."""
    seen = []
    for call in calls:
        try:
            call()
            seen.append("no error")
        except (ValueError, TypeError, RuntimeError) as e:
            seen.append(f"{type(e).__name__}: {e}")
    return seen
