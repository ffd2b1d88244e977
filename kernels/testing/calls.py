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
        _write_environ(env)
        yield
    finally:
        _write_environ(saved)


def _write_environ(values: dict[str, str | None]) -> None:
    """``values`` written into ``os.environ``, None removing a variable: setting a block's variables and restoring
    the saved ones are the same step."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def backend_calls() -> Iterator[collections.Counter]:
    """Counts every backend run by ``(public op name, backend)`` while the block runs: what the implementations
    executed after the backend choice (a fallback shows up as another backend; the tuner's timing runs count
    too). A dense run with several weights counts as ``"<op>[<n> weights]"`` (one gather feeding several GEMMs);
    a GEMM + all-reduce with the RMSNorm epilogue counts as ``"<op>+<epilogue>"`` (``"matmul_all_reduce+rmsnorm"``).
    Wraps the implementations of every entry of ``kernels.ops.table.OPS`` and restores them after."""
    from kernels.ops.table import OPS

    calls: collections.Counter = collections.Counter()
    saved = {name: dict(spec.impl) for name, spec in OPS.items()}

    def spy(backend: str, fn: Any) -> Any:
        def run(call: Any, ops: Any) -> Any:
            weights = getattr(ops, "weights", ())
            name = call.op if len(weights) <= 1 else f"{call.op}[{len(weights)} weights]"
            epilogue = getattr(call, "epilogue", "")
            calls[(f"{name}+{epilogue}" if epilogue else name, backend)] += 1
            return fn(call, ops)

        return run

    for spec in OPS.values():
        for backend, fn in list(spec.impl.items()):
            spec.impl[backend] = spy(backend, fn)
    try:
        yield calls
    finally:
        for name, entries in saved.items():
            OPS[name].impl.update(entries)


@contextlib.contextmanager
def operator_calls() -> Iterator[list[tuple[Any, tuple]]]:
    """Records ``(operator, args)`` of every registered-operator call the public functions make while the
    block runs (every call goes through its operator meanwhile, none takes the direct path, and it still
    runs): the arguments a test can replay under fake tensors or opcheck."""
    from kernels.ops.table import OPS
    from kernels.protocol import force_operator

    calls: list[tuple[Any, tuple]] = []
    saved = {name: spec.operator for name, spec in OPS.items()}

    def recording(op: Any) -> Any:
        def call(*args: Any) -> Any:
            calls.append((op, args))
            return op(*args)

        return call

    for spec in OPS.values():
        object.__setattr__(spec, "operator", recording(spec.operator))
    old = force_operator(True)
    try:
        yield calls
    finally:
        force_operator(old)
        for name, op in saved.items():
            object.__setattr__(OPS[name], "operator", op)


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
