"""One op, one table entry (:class:`OpSpec`), one path from its public function to its implementation.

Every public function of every op family makes the same four steps (:func:`submit`)::

    built = build(W)                          # the family's validation: its call value and operands (an error
                                              # here is this rank's outcome, not yet raised)
    call = requested(built.call, shape)       # the backend and split count the environment asks for
    admit(op, W, group, outcome)              # collective, on every call (kernels.protocol.admission)
    call = decide(spec, call, device)         # what runs, among the backends the op really has
    return run(spec, call, operands)          # spec.impl[call.backend](call, operands)

:func:`run` calls the implementation directly where torch does not need the registered operator (eager, plain
tensors, no function or dispatch mode, nothing to differentiate through), and the registered operator
``torch.ops.coc.<name>`` otherwise: under ``torch.compile`` (the graph holds one opaque call with the call
string), under fake tensors or a mode that must see the op. The operator's body admits the call itself when
nothing admitted it before (a compiled graph running, the Inductor pass's rewrites): tracing happens once per
graph, the admission once per call.

A signature (a family's key of what its validation, call value and backend choice read: shapes, dtypes, devices,
options) that resolved before takes :func:`resolved` instead: the admission and the run with the call decided then
(and the implementation bound then, :attr:`OpSpec.bind`), the other steps skipped.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..checks import world_of
from ..config import get_config
from .admission import ERRORS, Outcome, admit
from .backend import ShapeKey, decide, requested, traced_shape
from .call import Call, digest
from .registry import assume_constant_result, define_op

Impl = Callable[[Any, Any], Any]


class Built(NamedTuple):
    """What a family's validation hands the protocol: the call as given, its operands, and for the backend choice
    ``shape = (m, k, n)`` (``customized_coc``'s key; None: no GEMM shape), ``dtypes`` (the output's and the
    weight's, what a tuner times) and the operands' ``device``."""

    call: Call
    operands: Any
    device: torch.device
    shape: ShapeKey | None = None
    dtypes: tuple = ()


@dataclass(frozen=True, eq=False)
class OpSpec:
    """One registered operator: ``name`` (``torch.ops.coc.<name>``), its call class, its ``schema`` (arguments and
    returns, the last argument ``str call``), ``operands`` (the schema's other arguments -> the family's operands
    value) and ``flat`` (its inverse), ``impl`` (backend -> ``impl(call, operands)``, returning the schema's
    outputs: only the backends the op really has), ``fake`` (``fake(call, operands)``: outputs of the right
    shapes and dtypes, nothing run), ``local`` (a local op's kernel policy, :mod:`kernels.protocol.backend`; ``""``
    for communicating ops) and ``tune`` (``tune(call, shape, dtypes, device, allow_fused)`` for
    ``COC_PARALLEL_NUM=auto``, or None) and ``bind`` (``bind(call, operands)``: the implementation of a decided
    call for every call whose operands have the shapes, dtypes and devices of ``operands``, as ``run(operands)``
    with what those fix decided once; None where the backend has none: the resolved signature's eager calls run it
    directly, and it must compute what ``impl`` does, bit for bit). Creating one registers the operator."""

    name: str
    call: type[Call]
    schema: str
    operands: Callable[..., Any]
    flat: Callable[[Any], tuple]
    impl: dict[str, Impl]
    fake: Callable[[Any, Any], Any]
    local: str = ""
    tune: Callable[..., int | str] | None = None
    bind: Callable[[Any, Any], Callable[[Any], Any] | None] | None = None
    # The implementations the op was created with: a resolved signature binds ``bind``'s runner only while its
    # backend's entry of ``impl`` is still this one (a test may wrap an entry to see every run).
    own_impl: dict[str, Impl] = field(init=False)
    operator: Any = field(init=False)
    decide_traced: Callable[..., str] = field(init=False)

    def __post_init__(self) -> None:
        # The codecs now, at import: a traced call's encode must find them made (dataclasses.fields cannot be traced).
        self.call._field_codecs()
        object.__setattr__(self, "own_impl", dict(self.impl))
        if type(self.impl) is not ImplTable:
            object.__setattr__(self, "impl", ImplTable(self.impl))
        object.__setattr__(self, "operator", define_op(f"{self.name}{self.schema}", self._body, self._fake_body))
        object.__setattr__(self, "decide_traced", _traced_decider(self))

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self.impl)

    def _body(self, *args: Any) -> Any:
        call = self.call.decode(args[-1])
        operands = self.operands(*args[:-1])
        if not _state.depth and call.world > 1:
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            heap_device = device if call.backend == "fused" else None
            admit(call.op, call.world, call.group, Outcome(call, operands, heap_device=heap_device))
        _state.depth += 1
        try:
            return self.impl[call.backend](call, operands)
        finally:
            _state.depth -= 1

    def _fake_body(self, *args: Any) -> Any:
        return self.fake(self.call.decode(args[-1]), self.operands(*args[:-1]))


class _State(threading.local):
    # > 0 while an admitted call runs its operator: its body (and any op the implementation calls) needs no
    # admission of its own.
    depth = 0
    # Set by kernels.testing.operator_calls: every call goes through the registered operator.
    force_operator = False


_state = _State()


def force_operator(on: bool) -> bool:
    """Route every call through its registered operator (``on``) or let eager calls skip it; returns the old
    setting (a test hook: what the operator receives can then be recorded and replayed)."""
    old = _state.force_operator
    _state.force_operator = on
    return old


def _plain(args: tuple) -> bool:
    """Whether ``args`` hold only plain tensors (or None, lists of them, non-tensors), none of which needs a
    gradient from this call."""
    grad = torch.is_grad_enabled()
    for a in args:
        if type(a) is torch.Tensor:
            if grad and a.requires_grad:
                return False
        elif isinstance(a, torch.Tensor):
            return False
        elif type(a) is list and not _plain(tuple(a)):
            return False
    return True


def run(
    spec: OpSpec,
    call: Call,
    operands: Any,
    text: str | None = None,
    *,
    runner: Callable[[Any], Any] | None = None,
) -> Any:
    """``spec.impl[call.backend](call, operands)`` (module docstring: directly, or through the operator);
    ``text``: the resolved call's string under ``torch.compile``; ``runner``: a resolved signature's implementation
    (:func:`resolved`: its operands are known to be plain tensors none of which needs a gradient), which a direct
    call runs instead."""
    state = _state
    # A torch function or dispatch mode must see the registered operator (an eager call runs its implementation
    # directly otherwise, as nothing torch tracks would see the difference). Read only when not tracing (text None):
    # Dynamo cannot trace these reads.
    if (
        text is None
        and not (state.force_operator or torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack())
        and (runner is not None or _plain(spec.flat(operands)))
    ):
        if call.world == 1:
            # The depth only tells an operator body inside this call not to admit again; a group of one admits
            # nothing, so its calls (every call of a single-rank model) skip the bookkeeping.
            return runner(operands) if runner is not None else spec.impl[call.backend](call, operands)
        state.depth += 1
        try:
            return runner(operands) if runner is not None else spec.impl[call.backend](call, operands)
        finally:
            state.depth -= 1
    args = spec.flat(operands)
    if text is not None:
        return spec.operator(*args, text)
    state.depth += 1
    try:
        return spec.operator(*args, call.encode())
    finally:
        state.depth -= 1


def tensors_key(*tensors: object) -> tuple | None:
    """``shape, dtype, device`` of each of ``tensors`` in one flat tuple (None stays None), the part of a call's
    signature its tensors make; None where one is not a plain tensor or needs a gradient from this call (such a
    call takes the full path, whose validation says what is wrong or which the autograd or a mode must see)."""
    grad = torch.is_grad_enabled()
    out: list = []
    for t in tensors:
        if t is None:
            out.append(None)
        elif type(t) is not _TENSOR or (grad and t.requires_grad):  # type: ignore[attr-defined]
            return None
        else:
            out += (t.shape, t.dtype, t.device)  # type: ignore[attr-defined]
    return tuple(out)


_TENSOR = torch.Tensor


# Signatures resolved before: a family's key of everything its validation, call value and backend choice read
# (shapes, dtypes, devices, options; never tensor values) -> (the call as requested, as decided, W, the digest the
# admission exchanges, the fused heap's device or None, the config it was resolved under, the bound implementation
# (OpSpec.bind, else the implementation with the call bound), the default group then). A hit (:func:`resolved`)
# skips the validation, the call's construction and the backend choice; the admission still runs on every call,
# with the digest. Bounded: a miss only costs the full path.
_RESOLVED: dict[tuple, tuple] = {}
_RESOLVED_MAX = 4096


def forget_signatures() -> None:
    """Drop every resolved signature, so that the next call of each validates and chooses its backend again
    (the tuner's choices were forgotten, the machine changed under the process, an implementation was replaced)."""
    _RESOLVED.clear()


class ImplTable(dict):
    """An op's ``impl`` (:class:`OpSpec` makes one of a plain dict; an op whose tuner times the same table passes
    one): a dict whose every change forgets the resolved signatures, whose runners hold the entries they were
    resolved with (a test that wraps an entry to see every run then sees the next call's)."""

    def __ior__(self, other: Any) -> ImplTable:
        self.update(other)
        return self

    def __setitem__(self, key: str, value: Impl) -> None:
        super().__setitem__(key, value)
        forget_signatures()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        forget_signatures()

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        forget_signatures()

    def pop(self, *args: Any) -> Any:
        forget_signatures()
        return super().pop(*args)

    def popitem(self) -> tuple[str, Impl]:
        forget_signatures()
        return super().popitem()

    def setdefault(self, key: str, default: Any = None) -> Any:
        forget_signatures()
        return super().setdefault(key, default)

    def clear(self) -> None:
        super().clear()
        forget_signatures()


# torch.compiler.is_compiling, bound once (Dynamo knows the function, however it is reached).
_is_compiling = torch.compiler.is_compiling

# What :func:`resolved` returns for a signature it has not resolved: the caller takes :func:`submit`'s full path.
MISS: Any = object()


def resolved(spec: OpSpec, op: str, group: dist.ProcessGroup | None, key: tuple, operands: Any) -> Any:
    """:func:`submit` of a call whose signature ``key`` (the family's: everything its validation, call value and
    backend choice read) resolved before, with its ``operands`` unvalidated: the admission (W > 1) and the run, the
    validation, the call's construction and the backend choice skipped. :data:`MISS` where the signature is not
    resolved (or was under another config or default group) and while compiling: the caller then calls
    :func:`submit` with ``key``, which resolves it. A family's public function makes this call before it builds
    anything for the full path (the decode path's calls are host-bound)."""
    if _is_compiling():
        return MISS
    entry = _RESOLVED.get(key)
    # A given group never changes; the group None names the default group, or none (a group of one), and the
    # signature holds for the default group it was resolved under (the same object: the same size).
    if (
        entry is None
        or entry[5] is not get_config()
        or (group is None and not spec.local and entry[7] is not (_GROUPS.WORLD if _GROUPS is not None else None))
    ):
        return MISS
    requested_call, call, world, digest, heap_device, _, runner, _ = entry
    if world > 1:
        admit(op, world, group, Outcome(requested_call, operands, heap_device=heap_device, digest=digest))
    elif not (_state.force_operator or torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack()):
        # run()'s direct call of a group of one, inline.
        return runner(operands)
    return run(spec, call, operands, runner=runner)


def submit(
    spec: OpSpec,
    op: str,
    group: dist.ProcessGroup | None,
    build: Callable[[int], Built],
    key: tuple | None = None,
) -> Any:
    """A public function's call of ``spec`` (module docstring). ``build(W)`` validates (raising ``ValueError`` /
    ``TypeError`` naming the argument) and returns the :class:`Built` call. The group itself is checked first, on
    this rank alone (without a valid group there is nobody to tell). ``key``: the call's signature, kept with its
    decided call for :func:`resolved` (None: the call has none, e.g. a tensor that needs a gradient)."""
    built, call, text = admitted(spec, op, group, build, key)
    return run(spec, call, built.operands, text)


# The default group (``dist.group.WORLD``: None before ``init_process_group``) is read through this, None where
# torch.distributed is not built in. WORLD_SIZE is not read on a signature's calls: it is part of the config's key
# (:func:`kernels.config.get_config`), and the entry's config was checked (``check_launched_alone``) when the
# signature was resolved.
_GROUPS = dist.group if dist.is_available() else None


def admitted(
    spec: OpSpec, op: str, group: dist.ProcessGroup | None, build: Callable[[int], Built], key: tuple | None = None
) -> tuple[Built, Call, str | None]:
    """:func:`submit` up to the run: ``(built, the decided call, None)``, or under ``torch.compile`` ``(built, the
    call as built, the decided call's string)`` (the choice is a constant of the graph). For an op whose
    autograd Function runs the call (:func:`run_text` in its forward). ``key``: the call's signature, kept with
    its decided call for the next call of the signature (:func:`resolved`)."""
    # A local op (no communication) has no group to admit with: its errors are its own rank's.
    world = 1 if spec.local else world_of(group)
    try:
        built = build(world)
    except ERRORS as e:
        if world == 1 or torch.compiler.is_compiling():
            raise
        admit(op, world, group, Outcome(None, error=e))
        raise AssertionError("unreachable: the admission raises every rank's error") from e
    if torch.compiler.is_compiling():
        shape = traced_shape(built.call, built.shape) if built.shape is not None else None
        return built, built.call, spec.decide_traced(built.call.encode(), shape, built.dtypes, built.device)
    config = get_config()
    call = requested(built.call, built.shape, config)
    heap_device = built.device if call.backend == "fused" and "fused" in spec.backends else None
    outcome = Outcome(call, built.operands, heap_device=heap_device)
    if world > 1:
        if key is not None:
            outcome = dataclasses.replace(outcome, digest=digest(outcome.items()))
        admit(op, world, group, outcome)
    decided = decide(spec, call, built.device, (built.shape, built.dtypes))
    if key is not None:
        if len(_RESOLVED) >= _RESOLVED_MAX:
            _RESOLVED.clear()
        impl = spec.impl[decided.backend]
        own = spec.bind is not None and impl is spec.own_impl.get(decided.backend)
        runner = spec.bind(decided, built.operands) if own else None  # type: ignore[misc]
        if runner is None:
            runner = partial(impl, decided)
        default = _GROUPS.WORLD if _GROUPS is not None else None
        _RESOLVED[key] = (call, decided, world, outcome.digest, heap_device, config, runner, default)
    return built, decided, None


def call_operator(operator: Any, *args: Any) -> Any:
    """An admitted call through its registered operator (an autograd Function's forward, or an op its backward
    runs as part of the admitted call): the operator's body does not admit it again."""
    if torch.compiler.is_compiling():
        return operator(*args)
    _state.depth += 1
    try:
        return operator(*args)
    finally:
        _state.depth -= 1


def run_text(spec: OpSpec, text: str, operands: Any) -> Any:
    """:func:`run` of an admitted call given as its string (an autograd Function's forward and backward)."""
    if torch.compiler.is_compiling():
        return spec.operator(*spec.flat(operands), text)
    return run(spec, spec.call.decode(text), operands)


def _traced_decider(spec: OpSpec) -> Callable[..., str]:
    @assume_constant_result
    def decide_traced(call_text: str, shape: ShapeKey | None, dtypes: tuple, device: torch.device) -> str:
        call = requested(spec.call.decode(call_text), shape)
        return decide(spec, call, device, (shape, dtypes)).encode()

    return decide_traced
