"""Inference-only row-parallel linear with w8A16 weights (``kernels.quantized_matmul_all_reduce``, or
``kernels.quantized_matmul_reduce_scatter`` with sequence parallelism).

Build one from a trained :class:`autopar.RowParallelLinear` (or Megatron-core's own
``RowParallelLinear``: only the public attributes ``weight``, ``bias``, ``input_is_parallel``,
``skip_bias_add``, ``tp_group`` and ``config.sequence_parallel`` are read)::

    qlinear = autopar.quantize_row_parallel_linear(linear, mode="per_group", group_size=128)
    with torch.no_grad():
        output, output_bias = qlinear(input_)       # same contract as linear.forward

Each rank quantizes its own shard ``weight [output_size, input_size / W]``, so per-group groups
never straddle two ranks. Forward only: the int8 weight has no gradient, and a backward through
the layer raises ``RuntimeError``. With ``sequence_parallel`` (read from the layer's config, as
Megatron's layer does) the output is reduce-scattered along the sequence dim (dim 0 of ``[s, b, h]``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import kernels


class _QuantizedRowParallelFunction(torch.autograd.Function):
    """``y = all_reduce(x_shard_k @ dequant(qweight_shard_k).T) + bias``, or with sequence parallelism
    ``y_shard_s = reduce_scatter_dim0(x_shard_k @ dequant(qweight_shard_k).T) + bias``; no backward.

    Shapes: ``x_shard_k [s, b, k/W]``, ``qweight_shard_k int8 [n, k/W]``, ``bias [n]`` (whole),
    ``y [s, b, n]`` (``y_shard_s [s/W, b, n]``). dgrad / wgrad: not provided (inference only).
    """

    @staticmethod
    def forward(
        ctx: Any, x_shard_k: torch.Tensor, layer: QuantizedRowParallelLinear, bias: torch.Tensor | None
    ) -> torch.Tensor:
        op = kernels.quantized_matmul_reduce_scatter if layer.sequence_parallel else kernels.quantized_matmul_all_reduce
        return op(
            x_shard_k.detach(),
            layer.qweight,
            layer.scale,
            None if bias is None else bias.detach(),
            group_size=layer.group_size,
            offset=layer.offset,
            group=layer.tp_group,
        )

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, None, None]:
        raise RuntimeError(
            "QuantizedRowParallelLinear is inference-only: its int8 weights have no "
            "gradient and no backward exists; run it under torch.no_grad() or keep the "
            "float RowParallelLinear for training"
        )


class QuantizedRowParallelLinear(torch.nn.Module):
    """Row-parallel linear holding ``qweight int8 [output_size, input_size / W]`` and its scale.

    ``forward(input_) -> (output, output_bias)`` as :class:`autopar.RowParallelLinear`:
    ``input_ [s, b, input_size / W]`` (or ``[s, b, input_size]`` when ``input_is_parallel=False``;
    this rank's slice of the last dim is used), ``output [s, b, output_size]`` reduced over
    ``tp_group``, or with ``sequence_parallel`` this rank's ``[s / W, b, output_size]`` (``s % W != 0``
    raises ``ValueError``); ``output_bias`` is ``bias`` when ``skip_bias_add`` else ``None``.
    ``input_`` must be fp16 / bf16 (fp32 on CPU).
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        input_is_parallel: bool,
        skip_bias_add: bool,
        tp_group: dist.ProcessGroup | None = None,
        group_size: int | None = None,
        offset: torch.Tensor | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        kernels.quant.quant_spec(qweight, scale, group_size, offset)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.register_buffer("bias", bias)
        self.group_size = group_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            world = kernels.checks.group_size(self.tp_group)
            rank = 0 if world == 1 else dist.get_rank(self.tp_group)
            k_local = self.qweight.shape[1]
            if input_.shape[-1] != k_local * world:
                raise ValueError(
                    f"input_is_parallel=False needs the full input [..., {k_local * world}], "
                    f"got shape {tuple(input_.shape)}"
                )
            input_ = input_[..., rank * k_local : (rank + 1) * k_local]
        bias = None if self.skip_bias_add else self.bias
        output = _QuantizedRowParallelFunction.apply(input_, self, bias)
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (
            f"qweight={tuple(self.qweight.shape)}, scale={tuple(self.scale.shape)}, "
            f"bias={self.bias is not None}, group_size={self.group_size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


def quantize_row_parallel_linear(
    module: torch.nn.Module, mode: str = "per_channel", group_size: int | None = None
) -> QuantizedRowParallelLinear:
    """A :class:`QuantizedRowParallelLinear` from a float RowParallelLinear (local, no communication).

    ``mode`` / ``group_size`` as :func:`kernels.quantize_weight`, applied to this rank's shard.
    """
    config = getattr(module, "config", None)
    sequence_parallel = bool(getattr(config, "sequence_parallel", False) or getattr(module, "sequence_parallel", False))
    if getattr(module, "explicit_expert_comm", False):
        raise NotImplementedError(
            "quantize_row_parallel_linear: expert layers with explicit expert communication are not supported"
        )
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(
            f"quantize_row_parallel_linear needs a RowParallelLinear with a 2-D weight, got {type(module).__name__}"
        )
    qweight, scale = kernels.quantize_weight(weight.detach(), mode, group_size)
    bias = getattr(module, "bias", None)
    return QuantizedRowParallelLinear(
        qweight,
        scale,
        None if bias is None else bias.detach().clone(),
        input_is_parallel=bool(module.input_is_parallel),
        skip_bias_add=bool(module.skip_bias_add),
        tp_group=getattr(module, "tp_group", None),
        group_size=group_size if mode == "per_group" else None,
        sequence_parallel=sequence_parallel,
    )
