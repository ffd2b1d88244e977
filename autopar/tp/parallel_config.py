"""``ParallelConfig``: the Megatron ``ModelParallelConfig`` fields the TP linears read.

Users with Megatron pass their ``ModelParallelConfig``; users without it pass this dataclass. The
linears only read attributes, so any object with these names works.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class ParallelConfig:
    """Settings of :class:`autopar.ColumnParallelLinear` / :class:`autopar.RowParallelLinear`.

    Field names, meanings and defaults are Megatron-core's ``ModelParallelConfig``:

    - ``sequence_parallel``: activations outside the TP region are sharded along the sequence
      dim (dim 0 of ``[s, b, h]``); column forward all-gathers, row forward reduce-scatters.
    - ``params_dtype``: dtype of the weights and biases.
    - ``use_cpu_initialization``: build the full ("master") weight on the CPU with
      ``init_method`` and keep this rank's slice. Without CUDA the linears always do this.
    - ``perform_initialization``: run ``init_method`` at all (biases are zeroed).
    - ``gradient_accumulation_fusion``: add the weight gradient into ``weight.main_grad`` in the
      backward instead of returning it as ``weight.grad``.
    - ``expert_model_parallel_size``: > 1 marks expert layers (``is_expert=True``) as
      communicating explicitly (no TP collective inside the linear).
    - ``defer_embedding_wgrad_compute`` / ``wgrad_deferral_limit``: column linears append their
      input and output gradient to the caller's buffers and skip the weight gradient, which the
      caller computes later (Megatron's output-layer optimisation).
    """

    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    use_cpu_initialization: bool = False
    perform_initialization: bool = True
    gradient_accumulation_fusion: bool = False
    expert_model_parallel_size: int = 1
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(f"ParallelConfig.{f.name} must be a bool, got {value!r}")
        if self.params_dtype not in _FLOAT_DTYPES:
            raise TypeError(f"ParallelConfig.params_dtype must be one of {_FLOAT_DTYPES}, got {self.params_dtype!r}")
        for name in ("expert_model_parallel_size", "wgrad_deferral_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"ParallelConfig.{name} must be an int, got {value!r}")
        if self.expert_model_parallel_size < 1:
            raise ValueError(
                f"ParallelConfig.expert_model_parallel_size must be >= 1, got {self.expert_model_parallel_size}"
            )
        if self.wgrad_deferral_limit < 0:
            raise ValueError(f"ParallelConfig.wgrad_deferral_limit must be >= 0, got {self.wgrad_deferral_limit}")
        if self.defer_embedding_wgrad_compute and not self.gradient_accumulation_fusion:
            # Same rule as Megatron: the deferred weight gradient is accumulated into main_grad.
            raise ValueError(
                "ParallelConfig.defer_embedding_wgrad_compute=True requires gradient_accumulation_fusion=True"
            )
