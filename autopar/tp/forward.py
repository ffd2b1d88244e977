"""The forwards of the column- and row-parallel linears, shared with patched Megatron modules.

:func:`column_parallel_forward` and :func:`row_parallel_forward` read only attributes that
Megatron's own modules also have (plus ``fp8`` / ``fp8_cache``, which autopar's linears have and
Megatron's lack: those run plain), which is what lets :func:`autopar.patch_megatron` route
Megatron modules (already built ones included) through them. The module's settings become one
:class:`~autopar.tp.options.LinearOptions` for the Functions.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import checks
from kernels.config import get_config
from kernels.protocol import assume_constant_result

from .comm import GatherFromTensorParallelRegion, ScatterToTensorParallelRegion
from .fp8 import Fp8Recipe, Fp8WeightCache
from .functions import (
    ColumnParallelLinearFunction,
    ColumnParallelLinearSPFunction,
    RowParallelLinearFunction,
    RowParallelLinearSPFunction,
)
from .options import LinearOptions
from .wgrad import WgradOptions


@assume_constant_result
def column_settings() -> tuple[bool, bool]:
    """``(recompute_all_gather, enable_coc_in_column_backward)`` from the config; read while tracing
    under ``torch.compile`` and kept as constants of the graph (the config reads files)."""
    config = get_config()
    return config.recompute_all_gather, config.enable_coc_in_column_backward


def _wgrad_options(module: torch.nn.Module, column: bool) -> WgradOptions:
    config = module.config
    defer = column and getattr(config, "defer_embedding_wgrad_compute", False)
    return WgradOptions(
        gradient_accumulation_fusion=bool(module.gradient_accumulation_fusion),
        grad_output_buffer=module.grad_output_buffer if defer else None,
        wgrad_deferral_limit=getattr(config, "wgrad_deferral_limit", 0) if defer else 0,
    )


def _refuse_fp8_unsupported(module: torch.nn.Module, explicit_expert_comm: bool) -> None:
    """Module settings the FP8 recipe does not run, named before anything is computed (the options refuse
    gradient accumulation fusion; deferral is refused here too, since the forward already acts on it)."""
    for name, on in (
        ("defer_embedding_wgrad_compute", bool(getattr(module.config, "defer_embedding_wgrad_compute", False))),
        ("explicit expert communication", explicit_expert_comm),
    ):
        if on:
            raise NotImplementedError(f"{type(module).__name__} with fp8: {name} is not supported with the FP8 recipe")


def _fp8(module: torch.nn.Module) -> tuple[Fp8Recipe | None, Fp8WeightCache | None]:
    """``(recipe, cache)``: the module's FP8 recipe and weight cache; ``(None, None)`` for plain operands
    (Megatron's own modules have neither)."""
    recipe = getattr(module, "fp8", None)
    if recipe is None:
        return None, None
    _refuse_fp8_unsupported(module, bool(getattr(module, "explicit_expert_comm", False)))
    return recipe, module.fp8_cache


def _mark_offloading(config: Any, input_parallel: torch.Tensor) -> None:
    ctx = getattr(config, "_cpu_offloading_context", None)
    if ctx is not None and getattr(ctx, "inside_context", False):
        input_parallel.activation_offloading = getattr(config, "cpu_offloading_activations", False)


def column_parallel_forward(
    module: torch.nn.Module,
    input_: torch.Tensor,
    weight: torch.Tensor | None = None,
    runtime_gather_output: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward of a column-parallel linear (ours or Megatron's) on the overlapped paths.

    Returns ``(output, output_bias)``: ``output`` is ``[s, b, n/W]`` (``[s, b, n]`` when
    gathering the output); ``output_bias`` is the bias when ``skip_bias_add``, else None.
    """
    if weight is None:
        if module.weight is None:
            raise RuntimeError(
                "weight was not supplied to ColumnParallelLinear forward pass and skip_weight_param_allocation is True."
            )
        weight = module.weight
    else:
        expected_shape = (module.output_size_per_partition, module.input_size)
        if tuple(weight.shape) != expected_shape:
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not {expected_shape} as expected")
    checks.check_input_k(
        input_, weight.shape[1], name="input_", expected=f"weight has k={weight.shape[1]} (shape {tuple(weight.shape)})"
    )
    group = module.tp_group
    bias = module.bias if not module.skip_bias_add else None
    config = module.config
    recipe, cache = _fp8(module)
    if getattr(config, "defer_embedding_wgrad_compute", False):
        buf = module.embedding_activation_buffer
        limit = getattr(config, "wgrad_deferral_limit", 0)
        if limit == 0 or len(buf) < limit:
            buf.append(input_)
    _mark_offloading(config, input_)

    recompute_all_gather, coc_in_backward = column_settings()
    explicit_expert_comm = getattr(module, "explicit_expert_comm", False)
    opts = LinearOptions(
        group=group,
        allreduce_dgrad=bool(module.allreduce_dgrad and not explicit_expert_comm),
        coc_in_backward=coc_in_backward,
        recompute_all_gather=recompute_all_gather,
        wgrad=_wgrad_options(module, column=True),
        recipe=recipe,
        cache=cache,
    )
    if module.sequence_parallel and not explicit_expert_comm:
        output_parallel = ColumnParallelLinearSPFunction.apply(input_, weight, bias, opts)
    else:
        output_parallel = ColumnParallelLinearFunction.apply(input_, weight, bias, opts)

    gather_output = module.gather_output if runtime_gather_output is None else runtime_gather_output
    output = GatherFromTensorParallelRegion.apply(output_parallel, group) if gather_output else output_parallel
    return output, (module.bias if module.skip_bias_add else None)


def row_parallel_forward(module: torch.nn.Module, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward of a row-parallel linear (ours or Megatron's) on the overlapped paths.

    Returns ``(output, output_bias)``: ``output`` is ``[s, b, n]`` (``[s/W, b, n]`` with sequence
    parallelism); ``output_bias`` is the bias when ``skip_bias_add``, else None.
    """
    group = module.tp_group
    recipe, cache = _fp8(module)
    k_local = module.weight.shape[1]
    if module.input_is_parallel:
        checks.check_input_k(
            input_, k_local, name="input_", expected=f"weight has k={k_local} (shape {tuple(module.weight.shape)})"
        )
    else:
        checks.check_input_k(
            input_,
            module.input_size,
            name="input_",
            expected=f"input_is_parallel=False needs the full input_size={module.input_size}",
        )
    if module.input_is_parallel:
        input_parallel = input_
    else:
        if module.sequence_parallel:
            raise RuntimeError("To enable `sequence_parallel`, `input_is_parallel` must be `True`")
        input_parallel = ScatterToTensorParallelRegion.apply(input_, group)
    _mark_offloading(module.config, input_parallel)

    explicit_expert_comm = getattr(module, "explicit_expert_comm", False)
    if explicit_expert_comm and not module.skip_bias_add:
        raise RuntimeError(
            "an expert RowParallelLinear with explicit expert communication "
            "needs skip_bias_add=True (its output is not reduced here)"
        )
    bias = None if module.skip_bias_add else module.bias
    opts = LinearOptions(
        group=None if explicit_expert_comm else group,
        wgrad=_wgrad_options(module, column=False),
        recipe=recipe,
        cache=cache,
    )
    if module.sequence_parallel and not explicit_expert_comm:
        output = RowParallelLinearSPFunction.apply(input_parallel, module.weight, bias, opts)
    else:
        output = RowParallelLinearFunction.apply(input_parallel, module.weight, bias, opts)
    return output, (module.bias if module.skip_bias_add else None)
