"""Route Megatron-core's own tensor-parallel linears through the overlapped paths.

:func:`patch_megatron` replaces ``forward`` on the classes
``megatron.core.tensor_parallel.ColumnParallelLinear`` and ``RowParallelLinear`` (the same class
objects ``megatron.core.tensor_parallel.layers`` defines, so every import alias and every subclass
that does not override ``forward`` follows). Because the method lives on the class, modules built
before the call switch too. Construction, parameters, state dicts and everything else stay
Megatron's; only the forward (and with it the backward) changes. :func:`unpatch_megatron` puts the
original methods back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .forward import column_parallel_forward, row_parallel_forward

__all__ = ["patch_megatron", "unpatch_megatron", "is_megatron_patched"]

_ORIGINAL_FORWARDS: dict[type, Callable] = {}


def _column_forward(
    self: torch.nn.Module,
    input_: torch.Tensor,
    weight: torch.Tensor | None = None,
    runtime_gather_output: bool | None = None,
) -> Any:
    """Megatron ``ColumnParallelLinear.forward`` on autopar's overlapped paths."""
    return column_parallel_forward(self, input_, weight, runtime_gather_output)


def _row_forward(self: torch.nn.Module, input_: torch.Tensor) -> Any:
    """Megatron ``RowParallelLinear.forward`` on autopar's overlapped paths."""
    return row_parallel_forward(self, input_)


def _megatron_classes() -> tuple[tuple[type, Callable], ...]:
    try:
        from megatron.core.tensor_parallel import layers
    except ImportError as e:
        raise ImportError(
            "patch_megatron() needs megatron-core (pip install megatron-core); "
            f"importing megatron.core.tensor_parallel failed: {e}"
        ) from e
    return ((layers.ColumnParallelLinear, _column_forward), (layers.RowParallelLinear, _row_forward))


def patch_megatron() -> None:
    """Make Megatron's ColumnParallelLinear / RowParallelLinear run autopar's overlapped
    forward and backward. Idempotent; modules built before the call are switched too."""
    for cls, forward in _megatron_classes():
        if cls.__dict__.get("forward") is forward:
            continue
        _ORIGINAL_FORWARDS[cls] = cls.__dict__["forward"]
        cls.forward = forward


def unpatch_megatron() -> None:
    """Restore Megatron's original forwards. A no-op when not patched."""
    for cls, original in list(_ORIGINAL_FORWARDS.items()):
        cls.forward = original
        del _ORIGINAL_FORWARDS[cls]


def is_megatron_patched() -> bool:
    """True while :func:`patch_megatron` is in effect."""
    return bool(_ORIGINAL_FORWARDS)
