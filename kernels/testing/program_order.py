"""Run the programs of each interpreted Triton launch in a permuted order (a test mode).

On a GPU the programs of one launch run in any order and concurrently; the interpreter runs them
one at a time in grid order. A program that waits for another program of its own launch passes
under the interpreter whenever grid order runs that one first, yet on a GPU it may spin before the
other starts, and deadlocks once the waiters hold every SM. With ``COC_TEST_PROGRAM_ORDER`` set,
the interpreter runs each launch's programs in another order, so such a wait times out in CI:

* ``grid`` (or unset, or empty): the interpreter's own order;
* ``reverse``: last program first;
* ``shuffle:SEED``: a fresh random permutation per launch, drawn from a generator seeded once
  with ``SEED`` (the same launches in the same order get the same permutations).

The grid loop of ``GridExecutor.__call__`` (Triton 3.6 through 3.9) sets each program's index
through ``InterpreterBuilder.set_grid_idx`` after announcing the grid with ``set_grid_dim``; the
mode maps the loop's ``i``-th index to the ``i``-th entry of the launch's permutation, so the loop
itself is untouched and the kernel sees consistent ``program_id`` values. The variable is read at
every launch, so a rank of a pooled process (:mod:`kernels.testing.ranks`) follows the ``env`` of the call.
"""

from __future__ import annotations

import os
import random
from typing import Any

ENV = "COC_TEST_PROGRAM_ORDER"

_state: dict[str, Any] = {"value": None, "rng": None}


def parse(value: str | None) -> str | None:
    """The validated mode (``None`` for the interpreter's own order); ValueError naming a bad value."""
    if value is None or value in ("", "grid"):
        return None
    if value == "reverse":
        return value
    if value.startswith("shuffle:"):
        try:
            int(value[len("shuffle:") :])
        except ValueError:
            pass
        else:
            return value
    raise ValueError(f"{ENV}={value!r}: expected 'grid', 'reverse' or 'shuffle:SEED' with an integer SEED")


def permutation(n: int) -> list[int] | None:
    """This launch's order of ``n`` linear program indices under the current mode (None: grid order)."""
    mode = parse(os.environ.get(ENV))
    if mode is None:
        return None
    if mode == "reverse":
        return list(range(n - 1, -1, -1))
    if _state["value"] != mode:
        # A new mode (or seed) restarts the sequence, so runs with one seed are reproducible.
        _state["value"], _state["rng"] = mode, random.Random(int(mode[len("shuffle:") :]))
    order = list(range(n))
    _state["rng"].shuffle(order)
    return order


def install() -> None:
    """Patch the interpreter of this process (idempotent); inert while the variable is unset."""
    parse(os.environ.get(ENV))
    from triton.runtime.interpreter import InterpreterBuilder

    if getattr(InterpreterBuilder.set_grid_idx, "_coc_program_order", False):
        return
    set_dim, set_idx = InterpreterBuilder.set_grid_dim, InterpreterBuilder.set_grid_idx

    def set_grid_dim(self: Any, nx: int, ny: int, nz: int) -> None:
        set_dim(self, nx, ny, nz)
        self._coc_order = permutation(nx * ny * nz)

    def set_grid_idx(self: Any, x: int, y: int, z: int) -> None:
        order = getattr(self, "_coc_order", None)
        if order is not None:
            _, ny, nz = self.grid_dim
            linear = order[(x * ny + y) * nz + z]
            x, y, z = linear // (ny * nz), (linear // nz) % ny, linear % nz
        set_idx(self, x, y, z)

    set_grid_idx._coc_program_order = True  # type: ignore[attr-defined]
    InterpreterBuilder.set_grid_dim = set_grid_dim
    InterpreterBuilder.set_grid_idx = set_grid_idx


def install_if_requested() -> None:
    """Install when the variable names a permuted order (called at every rank task and by conftest)."""
    if parse(os.environ.get(ENV)) is not None:
        install()
