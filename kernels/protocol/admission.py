"""Admission: before any rank of a group communicates for a call, every rank learns that every rank made it.

Every call of every op is admitted, collectively, on every rank of its group (W > 1)::

    status = this rank's validation: passed, or its ValueError / TypeError       # never raised alone
    health = fused requests: this rank's heap of the group (healthy, failed unreported, retired after a failure)
    bytes  = fused requests: the data bytes of this rank's live heap of the group (0: none)
    table  = all_gather([status, digest(call.items(operands)), health, bytes])   # 4 int64 per rank, a CPU group
                                            # (a fused request waits at most COC_TIMEOUT, as its kernels would)
    any status refused    -> every rank raises the refusal, naming the refusing rank (an earlier admission on the
                              group timed out there: the group is refused on every rank from then on)
    any status failed     -> every rank raises the first failed rank's error, naming that rank
    digests differ        -> every rank raises RuntimeError naming the op, the field and each rank's value
    any health not healthy -> every rank retires its heap of the group (the next fused call builds a new one
                              together); a failure not yet reported is raised on every rank
    bytes differ          -> every rank retires its heap of the group, with a warning, and the call runs (its
                              heap is built on every rank at once); else one rank would create or grow a heap,
                              a collective, while its peers wait in the call's kernels
    else                   -> the call runs
    (a second exchange, of the full values, only when a rank failed or the digests differ, or under COC_CHECK=1)

So no rank enters a data collective, a heap exchange or a kernel wait unless every rank admitted the same call,
and ranks never fall out of step: a rank's local error, a changed shape or a retired heap, at any call, gives the
same outcome on every rank. What travels is host data (the digest of shapes, dtypes and options; a validation
outcome), on the group itself where it carries CPU tensors (gloo), else on a gloo group of the same ranks made at
the group's first admission: no device synchronization, none inside a CUDA-graph capture either (a captured
call is admitted once, at capture; its replays are not). ``COC_CHECK=0`` skips the admission (a local error then
raises on its rank alone: the documented risk of the opt-out; the fused kernels still compare each call's digest
in the heap's check); ``COC_CHECK=1`` exchanges the full values of every call, not only their digest.

Under ``torch.compile`` a call is admitted when the compiled graph runs it: the registered operator's body
admits the call it receives (:mod:`kernels.protocol.spec`), since tracing happens once per graph, not per call.
"""

from __future__ import annotations

import dataclasses
import datetime
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .. import comm
from ..config import get_config
from ..heap import FAILED, group_health, heap_bytes, reset_group
from .call import Call, Items, digest

# The exception classes a local error travels as; anything else is not a validation outcome and raises alone.
ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, NotImplementedError, RuntimeError)
_OK, _FAILED, _REFUSED = 0, 1, 2
# What each rank sends: status, digest, heap health, heap bytes.
_COLUMNS = 4
# Exchanges made, by op: a test hook (kernels.testing) and the benchmark's count.
counts: dict[str, int] = {}
# group name -> the admission channel of the group.
_channels: dict[str, _Channel] = {}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """This rank's side of one admission: the call and its operands when they validated, else the error."""

    call: Call | None
    operands: Any = None
    error: BaseException | None = None
    # The device whose heap of the group a fused request uses (None: not a fused request, or not known).
    heap_device: torch.device | None = None
    # The digest of the call's items when the caller knows it already (a signature resolved before).
    digest: int | None = None

    def items(self) -> Items | None:
        return None if self.call is None else self.call.items(self.operands)


@dataclasses.dataclass
class _Channel:
    """What one group's admissions travel on: the group itself or a gloo group of its ranks, and two CPU buffers
    reused by every admission (read through NumPy: host data, never a torch value read)."""

    group: dist.ProcessGroup
    side: dist.ProcessGroup
    local: torch.Tensor
    table: torch.Tensor
    local_view: Any
    table_view: Any
    # Set when an admission on the group timed out: its ranks are out of step from then on.
    failed: str | None = None


def _labels(group: dist.ProcessGroup | None, world: int) -> list[str]:
    """Rank names for messages: the group rank, and the global one where it differs."""
    if group is None or group == dist.group.WORLD:
        return [str(r) for r in range(world)]
    return [str(r) if r == g else f"{r} (global {g})" for r, g in enumerate(dist.get_process_group_ranks(group))]


def exchange_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The group an admission's host data travels on: ``group`` where its backend moves CPU tensors, else a gloo
    group of the same ranks, made at the group's first admission (every rank admits the same calls, so every
    rank makes it at the same call)."""
    group = group if group is not None else dist.group.WORLD
    if "gloo" in str(dist.get_backend(group)):
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)


def _channel(group: dist.ProcessGroup | None, world: int) -> _Channel:
    group = group if group is not None else dist.group.WORLD
    channel = _channels.get(group.group_name)
    if channel is None or channel.group is not group:
        local = torch.zeros(_COLUMNS, dtype=torch.int64)
        table = torch.zeros(_COLUMNS * world, dtype=torch.int64)
        side = exchange_group(group)
        channel = _Channel(group, side, local, table, local.numpy(), table.numpy().reshape(world, _COLUMNS))
        _channels[group.group_name] = channel
    return channel


def _status(outcome: Outcome) -> list[int]:
    if outcome.error is not None or outcome.call is None:
        return [_FAILED, 0, 0, 0]
    digest_ = outcome.digest if outcome.digest is not None else digest(outcome.items())
    if outcome.heap_device is None:
        return [_OK, digest_, 0, 0]
    group = outcome.call.group
    return [_OK, digest_, group_health(group, outcome.heap_device)[0], heap_bytes(group, outcome.heap_device)]


def admit(op: str, world: int, group: dist.ProcessGroup | None, outcome: Outcome) -> None:
    """Admit one call (module docstring): return when every rank of ``group`` made the same call and validated it,
    else raise the same error on every rank. ``world == 1`` raises this rank's own error, if any, and exchanges
    nothing. A fused request waits at most ``COC_TIMEOUT`` for its peers (as its kernels would): a peer that never
    comes makes this rank raise by name, and the group is refused from then on (its ranks are out of step), on
    every rank: a refusing rank posts its row marked refused and raises at once, and every peer that makes the call
    raises the refusal too (:func:`_post_refusal`). The scripted backends wait as their collectives would."""
    if world == 1 or torch.compiler.is_compiling():
        # Under compile the validation runs while tracing (its error raises there, as any tracing error does);
        # the compiled graph's operator admits each call when it runs.
        if outcome.error is not None:
            raise outcome.error
        return
    config = get_config()
    if config.check is False:
        if outcome.error is not None:
            raise outcome.error
        return
    counts[op] = counts.get(op, 0) + 1
    channel = _channel(group, world)
    if channel.failed is not None:
        _post_refusal(channel, world)
        raise RuntimeError(
            f"{op}: an earlier call on this process group failed at its admission ({channel.failed}); its ranks "
            "are out of step, so every call on it is refused. Create a new process group (or restart the job)"
        )
    channel.local_view[:] = _status(outcome)
    # W > 1 here: torch's collective itself, not comm's wrapper for a group of one.
    work = comm.all_gather_single(channel.table, channel.local, group=channel.side, async_op=True)
    if outcome.heap_device is None:
        work.wait()
    else:
        try:
            work.wait(timeout=datetime.timedelta(seconds=config.timeout))
        except RuntimeError:
            channel.failed = _late_peers(op, group, world, config.timeout)
            raise RuntimeError(channel.failed) from None
    rows = channel.table_view.tolist()
    refusing = [r for r, row in enumerate(rows) if row[0] == _REFUSED]
    if refusing:
        # Before any other exchange: a refusing rank joins none.
        refuser = _labels(group, world)[refusing[0]]
        channel.failed = f"rank {refuser} refused it: an earlier call timed out there"
        raise RuntimeError(
            f"{op}: rank {refuser} refuses every call on this process group since an "
            "earlier call on it failed at its admission there (a peer came later than COC_TIMEOUT); its ranks are out "
            "of step, so every rank raised this error at this call and refuses every later one. Create a new process "
            "group (or restart the job)"
        )
    failed = any(row[0] != _OK for row in rows)
    differ = any(row[1] != rows[0][1] for row in rows)
    unhealthy = any(row[2] != 0 or row[3] != rows[0][3] for row in rows)
    if not (failed or differ or unhealthy or config.check is True):
        return
    _settle(op, (group, channel.side, world), outcome, rows)


def _post_refusal(channel: _Channel, world: int) -> None:
    """This rank's row of a refused call, posted and not waited for: a peer that makes the call learns of the
    refusal from it and raises too, instead of waiting for this rank in the exchange until the group's own timeout;
    a peer that never comes leaves it pending (the group is refused anyway). Its own buffers: the pending exchange
    writes into them whenever it completes."""
    row = torch.tensor([_REFUSED] + [0] * (_COLUMNS - 1), dtype=torch.int64)
    comm.all_gather_single(row.new_empty(_COLUMNS * world), row, group=channel.side, async_op=True)


def _late_peers(op: str, group: dist.ProcessGroup | None, world: int, timeout: float) -> str:
    labels = _labels(group, world)
    me = dist.get_rank(group)
    others = ", ".join(f"rank {label}" for r, label in enumerate(labels) if r != me)
    return (
        f"{op}: rank {labels[me]} waited more than COC_TIMEOUT={timeout:g} s at the admission of this fused call for "
        f"the other ranks of its group ({others}); a peer is dead, stuck, or did not make the same call"
    )


def _error_record(error: BaseException | None) -> tuple[int, str] | None:
    if error is None:
        return None
    kind = next((i for i, cls in enumerate(ERRORS) if type(error) is cls), len(ERRORS) - 1)
    return kind, str(error)


def _settle(op: str, where: tuple, outcome: Outcome, rows: list[list[int]]) -> None:
    """The second exchange, of full values: raise what every rank raises alike, and retire heaps together.
    ``where = (the op's group, the group the exchange travels on, W)``."""
    group, side, world = where
    health_message = ""
    if outcome.heap_device is not None and rows[dist.get_rank(side)][2] == FAILED:
        # A failure this rank's kernels recorded and nobody raised yet (a GPU learns of it after the call
        # returned): every rank raises it now. One already raised here (RETIRED) only has the heaps rebuilt.
        health_message = group_health(outcome.call.group, outcome.heap_device)[1]
    mine = (outcome.items(), _error_record(outcome.error), health_message)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=side)
    labels = _labels(group, world)
    if outcome.heap_device is not None:
        _reset_heaps(op, rows, outcome, labels)
    failed = [r for r, (_, err, _) in enumerate(gathered) if err is not None]
    if failed:
        kind, message = gathered[failed[0]][1]
        message = message.removeprefix(f"{op}: ")
        also = f"; rank(s) {', '.join(labels[r] for r in failed[1:])} refused theirs too" if failed[1:] else ""
        raised = ERRORS[kind](
            f"{op}: rank {labels[failed[0]]} refused its arguments: {message} (every rank raised this error before "
            f"any communication of the op{also}; the group stays usable)"
        )
        raise raised from outcome.error
    mismatch = first_mismatch([g[0] for g in gathered], labels)
    if mismatch is not None:
        raise RuntimeError(
            f"{op}: {mismatch} (found by the admission before any communication of the op; every rank raised this "
            "error and the group stays usable)"
        )
    reported = [(r, g[2]) for r, g in enumerate(gathered) if g[2]]
    if reported:
        rank, message = reported[0]
        raise RuntimeError(
            f"{op}: an earlier fused call on this group failed (reported by rank {labels[rank]}): {message}. Every "
            "rank retired the group's symmetric heap at this call, which did not run; the next fused call builds "
            "a new heap on every rank"
        )


def _reset_heaps(op: str, rows: list[list[int]], outcome: Outcome, labels: list[str]) -> None:
    """Every rank stops using its heap of the group at this same call when any rank's is unhealthy or the ranks'
    sizes differ; the next fused call makes a new one on every rank at once (the old ones stay mapped: a slow peer
    may still store into them)."""
    sizes = [row[3] for row in rows]
    # Sizes are compared only for a call that runs: a refused one (a rank's error, digests that differ) builds
    # nothing, and a refusing rank's row carries no size.
    runs = all(row[0] == _OK and row[1] == rows[0][1] for row in rows)
    if any(row[2] != 0 for row in rows):
        reset_group(outcome.call.group, outcome.heap_device)
    elif runs and any(size != sizes[0] for size in sizes):
        shown = ", ".join(f"rank {labels[r]}: {size or 'none'}" for r, size in enumerate(sizes))
        warnings.warn(
            f"{op}: the ranks' symmetric heaps of this group differ (data bytes {shown}), as after a heap freed on "
            "some ranks only (destroy_heap is local); every rank retired its heap at this call, which builds a new "
            "one on every rank at once",
            RuntimeWarning,
            stacklevel=4,
        )
        reset_group(outcome.call.group, outcome.heap_device)


def first_mismatch(tables: list[Items | None], labels: list[str]) -> str | None:
    """``"ranks disagree: rank 0 has <field>=<value>, rank 1 has <field>=<value>; ..."`` for the first field whose
    values differ across the ranks' items (in the order the call declares them), else None."""
    names: list[str] = []
    for table in tables:
        for name, _ in table or ():
            if name not in names:
                names.append(name)
    for name in names:
        values = [dict(table or ()).get(name, "(not given)") for table in tables]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"rank {labels[r]} has {name}={_shown(v)}" for r, v in enumerate(values))
            return f"ranks disagree: {shown}; every rank of the group must make this call with the same {name}"
    return None


def _shown(value: object) -> str:
    if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
        return f"({', '.join(map(str, value))})" if len(value) > 1 else f"({value[0]},)"
    return str(value)
