"""The one op protocol: every op family's public function goes request -> admit -> decide -> run.

* :mod:`.call`: :class:`Call`, the base of every family's call value (fields declared once; encode / decode, the
  items the ranks compare and their digest derived from them).
* :mod:`.admission`: the collective admission of every call (a rank's local error, a call that differs, a heap
  that failed: the same outcome on every rank).
* :mod:`.backend`: the one backend resolver.
* :mod:`.spec`: :class:`OpSpec` (one registered operator: its call class, schema, fake and implementations by
  backend), :func:`submit` (the four steps) and :func:`run`.
* :mod:`.registry`: registering a ``coc`` operator by hand.

The table of every op is ``kernels.ops.OPS``.
"""

from .admission import Outcome, admit
from .backend import decide, kernel_runs_on, requested, warn_once
from .call import Call, check_words, digest, group_name, resolve_group
from .registry import assume_constant_result, define_op, unaliased
from .spec import (
    MISS,
    Built,
    ImplTable,
    OpSpec,
    admitted,
    call_operator,
    force_operator,
    resolved,
    run,
    run_text,
    submit,
    tensors_key,
)

__all__ = [
    "MISS",
    "Built",
    "ImplTable",
    "Call",
    "OpSpec",
    "Outcome",
    "admit",
    "admitted",
    "assume_constant_result",
    "call_operator",
    "check_words",
    "decide",
    "define_op",
    "digest",
    "force_operator",
    "group_name",
    "kernel_runs_on",
    "requested",
    "resolve_group",
    "resolved",
    "run",
    "run_text",
    "submit",
    "tensors_key",
    "unaliased",
    "warn_once",
]
