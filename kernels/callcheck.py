"""When the ranks of a group compare a call before it communicates, and how a local error reaches every rank.

Every public op admits its call through :func:`admit` before choosing a backend::

    descriptor = validate()            # this rank's argument checks (shapes, dtypes, devices), then its
                                       # descriptor (kernels.agree); a ValueError / TypeError is this
                                       # rank's local error
    values()                           # checks that read values (FP8 scales), after the descriptor
    if checked:                        # COC_CHECK=1: every call; unset: a signature this rank has not
                                       # seen pass a check on this group; COC_CHECK=0: never
        rows = all_gather([descriptor, status, message])   # one small fixed-size collective
        any rank's local error -> every rank raises it, naming that rank
        descriptors that disagree -> every rank raises RuntimeError naming the fields (kernels.agree)
    else: a local error raises on this rank only

Only a checked call can tell the peers anything: a rank that raises alone leaves its peers in the
op's next collective. The signature of a call is its descriptor's fields the ranks must agree on
(:func:`kernels.agree.signature`: not the reducing ops' k nor the all-gather's n, which may differ), with
the group and device, so in a program whose ranks call alike every rank sees a new signature at the
same call and they all check it together; the first call of every shape is checked by default. What
a signature cached on some ranks cannot show (one rank's call changes while the others repeat theirs)
only ``COC_CHECK=1`` catches.

Fused calls are compared by the kernels themselves at every call once the group's heap exists (its
first fused call creates it on every rank at once): a fused request is host-checked only before that,
so a local error at a group's first fused call reaches every rank, and later ones time out by name in
the peers' kernels.

A rank whose arguments cannot even be described (a wrong dtype, a missing tensor) joins the check
when ``COC_CHECK=1`` or when it has not yet passed a check of this op on this group (the peers,
making the same first call, check it too); otherwise it raises at once, since entering a check
alone would pair its small message with a peer's data collective.

Under ``torch.compile`` the check runs while tracing (once per graph, the usual lockstep of ranks
compiling the same code), with the dims the graph keeps dynamic described as unknown; a validation
error raises there on its own rank, as any tracing error does. Inside CUDA-graph capture no host
exchange is possible: ``COC_CHECK=1`` refuses by name, and an unseen signature is left unchecked with
a one-time warning (warm up before capturing, as collectives need anyway).
"""

from __future__ import annotations

import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import agree, capture, comm
from .call import group_name, resolve_group
from .config import get_config
from .op_registration import assume_constant_result

# The exception classes a local error may travel as; anything else travels as RuntimeError.
_ERRORS: tuple[type[Exception], ...] = (RuntimeError, ValueError, TypeError, NotImplementedError)
# UTF-8 bytes of a local error's message carried in the exchange (longer messages are cut).
MESSAGE_BYTES = 504
_MESSAGE_WORDS = MESSAGE_BYTES // 8
ROW_WORDS = agree.DESCRIPTOR_LEN + 1 + _MESSAGE_WORDS
# Signatures that passed a check, most recent last. Bounded: a decode loop may see many lengths. Ranks
# that call alike insert and evict alike, so the bound keeps them in step.
_SEEN_MAX = 4096
_seen: OrderedDict[tuple, None] = OrderedDict()
# (group name, op) pairs with a passed check on this rank.
_seen_ops: set[tuple[str, str]] = set()
_warned_capture: set[str] = set()


def reset() -> None:
    """Start over as a new program: no signature seen (the next call of each is checked again), no warning shown."""
    _seen.clear()
    _seen_ops.clear()
    _warned_capture.clear()


def _labels(group: dist.ProcessGroup | None, world: int) -> list[str]:
    """Rank names for messages: the group rank, and the global one where it differs."""
    if group is None or group == dist.group.WORLD:
        return [str(r) for r in range(world)]
    return [str(r) if r == g else f"{r} (global {g})" for r, g in enumerate(dist.get_process_group_ranks(group))]


def _exchange_device(group: dist.ProcessGroup | None, device: torch.device | None) -> torch.device:
    """Where the check's message lives: the op's device when known, else the group's (NCCL needs CUDA)."""
    if device is not None:
        return device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(descriptor: agree.Descriptor | None, error: BaseException | None) -> list[int]:
    row = list(descriptor) if descriptor is not None else [0] * agree.DESCRIPTOR_LEN
    if error is None:
        return row + [0] + [0] * _MESSAGE_WORDS
    kind = next((i + 1 for i, cls in enumerate(_ERRORS) if type(error) is cls), 1)
    raw = str(error).encode("utf-8")
    cut = raw[:MESSAGE_BYTES]
    if len(raw) > MESSAGE_BYTES:
        cut = cut[: MESSAGE_BYTES - 4] + b" ..."
    padded = cut.ljust(MESSAGE_BYTES, b"\0")
    words = torch.frombuffer(bytearray(padded), dtype=torch.int64).tolist()
    return row + [kind] + words


def _decode(row: list[int]) -> tuple[type[Exception], str]:
    kind = row[agree.DESCRIPTOR_LEN]
    raw = torch.tensor(row[agree.DESCRIPTOR_LEN + 1 :], dtype=torch.int64).numpy().tobytes()
    return _ERRORS[kind - 1], raw.rstrip(b"\0").decode("utf-8", errors="replace")


def exchange(
    op: str,
    group: dist.ProcessGroup | None,
    world: int,
    device: torch.device | None,
    *,
    descriptor: agree.Descriptor | None,
    error: BaseException | None = None,
) -> None:
    """Compare this call with every rank of ``group`` (one all-gather of :data:`ROW_WORDS` int64 per
    rank); raise on every rank when any rank has a local ``error`` or the descriptors disagree.

    Every rank holds the same table, so all of them raise the same error: the first erring rank's
    (its own exception class, naming that rank), else the first disagreement :mod:`kernels.agree` finds.
    """
    local = torch.tensor([_encode(descriptor, error)], dtype=torch.int64, device=_exchange_device(group, device))
    table = local.new_empty((world, ROW_WORDS))
    comm.all_gather(table, local, group)
    rows = table.tolist()
    failed = [r for r, row in enumerate(rows) if row[agree.DESCRIPTOR_LEN] != 0]
    if failed:
        labels = _labels(group, world)
        cls, message = _decode(rows[failed[0]])
        message = message.removeprefix(f"{op}: ")  # said once, at the start of the raised message
        also = f"; rank(s) {', '.join(labels[r] for r in failed[1:])} refused theirs too" if failed[1:] else ""
        raised = cls(
            f"{op}: rank {labels[failed[0]]} refused its arguments: {message} (every rank of the group raised this "
            f"error before any communication of the op{also}; the group stays usable)"
        )
        raise raised from error
    table_desc = [row[: agree.DESCRIPTOR_LEN] for row in rows]
    # Identical rows (the usual case) need no field-by-field comparison.
    if any(row != table_desc[0] for row in table_desc[1:]) and agree.first_mismatch(op, table_desc) is not None:
        # Group and global ranks are looked up only for the message, off the agreeing path.
        message = agree.first_mismatch(op, table_desc, _labels(group, world))
        raise RuntimeError(
            f"{message} (found by the call check before any communication of the op; every rank refused the "
            "call, and the group stays usable)"
        )


def _fused_compares(group: dist.ProcessGroup | None, device: torch.device | None) -> bool:
    """Whether the fused kernels compare this group's calls themselves: its heap exists (the group's first
    fused call made it, on every rank at once), and every later fused call starts with the kernels' own
    check of every field. A host check there would only cost, and a rank alone with a new signature
    would wait in it for peers that are waiting in the kernels' check."""
    heap = sys.modules.get("kernels.heap")
    if heap is None or device is None:
        return False
    return heap.peek_heap(group if group is not None else dist.group.WORLD, device) is not None


def _remember(key: tuple, name: str, op: str) -> None:
    _seen[key] = None
    if len(_seen) > _SEEN_MAX:
        _seen.popitem(last=False)
    _seen_ops.add((name, op))


def _unchecked_in_capture(op: str, device: torch.device | None, always: bool) -> bool:
    """True when the check must be skipped because ``device``'s stream is capturing (raises under COC_CHECK=1)."""
    if device is None or not capture.capturing(device):
        return False
    if always:
        # The check reads every rank's descriptor on the host: capture cannot hold that (it would
        # fail with a raw CUDA error).
        raise RuntimeError(
            f"{op}: COC_CHECK=1 inside CUDA-graph capture; the check reads every rank's call descriptor on the "
            "host, which cannot be captured. Run the checked call once before capturing (the usual warm-up) and "
            "capture with COC_CHECK unset"
        )
    if op not in _warned_capture:
        _warned_capture.add(op)
        warnings.warn(
            f"{op}: a call signature first seen inside CUDA-graph capture is not compared across ranks (the check "
            "needs a host read); make each call once before capturing (the usual warm-up) to have it checked "
            "(this warning is shown once per op)",
            RuntimeWarning,
            stacklevel=4,
        )
    return True


def check_compiled(
    op: str, group: dist.ProcessGroup | None, world: int, device: torch.device, descriptor: agree.Descriptor
) -> None:
    """The check of a call Dynamo traces into a graph: while tracing, once per graph (every rank traces its
    own graphs; no local error travels: one found while tracing raises on its rank, as any tracing error
    does). Not for Inductor's graph passes: a rank whose compiled graph comes from Inductor's cache runs
    no pass, so a collective there would wait for it forever."""
    config = get_config()
    check = config.check
    if world == 1 or check is False:
        return
    descriptor = agree.resolve_request(descriptor, config)
    name = group_name(group)
    key = (name, str(device), agree.signature(descriptor))
    if check is None and key in _seen:
        return
    exchange(op, group, world, device, descriptor=descriptor)
    _remember(key, name, op)


@assume_constant_result
def _admit_traced(op: str, name: str, world: int, device: str, descriptor: tuple[int, ...]) -> bool:
    """:func:`check_compiled` of a call Dynamo traces: run now, on constants only, kept out of the graph."""
    check_compiled(op, resolve_group(name), world, torch.device(device), descriptor)
    return True


def admit(
    op: str,
    group: dist.ProcessGroup | None,
    world: int,
    device: torch.device | None,
    validate: Callable[[], agree.Descriptor],
    *,
    values: Callable[[], None] | None = None,
    backend: object = None,
) -> None:
    """Validate this rank's call and, when it is checked, compare it with every rank (module docstring).

    ``validate`` raises ``ValueError`` / ``TypeError`` for bad arguments and returns the call's
    descriptor, made with the call's own ``backend`` / ``parallel_num`` (:func:`kernels.agree.resolve_request`
    reads the environment's here); ``values`` runs the checks that read tensor values. ``world`` is the group's size;
    ``device`` the op's (None when ``x`` is not even a tensor); ``backend`` the call's ``backend`` argument (the
    backend the peers asked for decides whether they check when this rank cannot describe its call).
    """
    if world == 1:
        validate()
        if values is not None:
            values()
        return
    if torch.compiler.is_compiling():
        descriptor = validate()
        _admit_traced(op, group_name(group), world, str(device), descriptor)
        return
    config = get_config()
    check = config.check
    name = group_name(group)
    try:
        descriptor = agree.resolve_request(validate(), config)
    except _ERRORS as e:
        fused = backend == "fused" or (backend is None and config.use_fused)
        joins = check is True or (
            check is None and (name, op) not in _seen_ops and not (fused and _fused_compares(group, device))
        )
        if not joins or _unchecked_in_capture(op, device, check is True):
            raise
        exchange(op, group, world, device, descriptor=None, error=e)
        raise AssertionError("unreachable: the exchange raises this rank's error") from e
    key = (name, str(device), agree.signature(descriptor))
    wanted = check is True or (
        check is None and key not in _seen and not (agree.requests_fused(descriptor) and _fused_compares(group, device))
    )
    error: Exception | None = None
    if values is not None:
        try:
            values()
        except _ERRORS as e:
            if not wanted:
                raise
            error = e
    if not wanted or _unchecked_in_capture(op, device, check is True):
        if error is not None:
            raise error
        return
    exchange(op, group, world, device, descriptor=descriptor, error=error)
    _remember(key, name, op)
