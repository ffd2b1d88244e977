"""``ColumnParallelLinear`` and ``RowParallelLinear``: drop-in tensor-parallel linears with
Megatron-core's signatures, on the overlapped ops.

``ColumnParallelLinear`` (weight split along the output dim) and ``RowParallelLinear`` (weight split
along the input dim) take the constructor and forward arguments of
``megatron.core.tensor_parallel`` and return ``(output, output_bias)`` as Megatron does. Their
forward and backward are four autograd Functions (:mod:`autopar.tp.functions`), one per (layer,
sequence parallel) case, plain or with the FP8 recipe (``fp8=``) as their operand format, whose
communication runs through :mod:`kernels`, so the backend (sequential, chunked, fused) follows the
``COC_*`` environment at call time.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parameter import Parameter

from . import convert
from .comm import Group, megatron_module, rank_of, resolve_tp_group, world_size
from .forward import column_parallel_forward, row_parallel_forward
from .fp8 import Fp8Recipe, Fp8WeightCache, resolve_recipe


def _set_tp_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Megatron's ``set_tensor_model_parallel_attributes`` (read by its optimizer, checkpointing
    and gradient-norm code)."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size W={denominator}")
    return numerator // denominator


def _use_device_init(config: Any) -> bool:
    """Megatron's GPU initialization (per-shard init under the model-parallel CUDA RNG).

    Only with CUDA and Megatron's RNG tracker seeded (``model_parallel_cuda_manual_seed``);
    otherwise the master-weight initialization runs: it gives every rank its own slice of one
    full weight, where initializing shards from one unforked RNG would repeat them across ranks.
    """
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return False
    random = megatron_module("megatron.core.tensor_parallel.random")
    return random is not None and random.get_cuda_rng_tracker().is_initialized()


def _param_device(config: Any) -> torch.device:
    if not getattr(config, "use_cpu_initialization", False) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _new_param(config: Any, *shape: int) -> Parameter:
    """An uninitialized parameter where and in the dtype Megatron's config puts them."""
    return Parameter(
        torch.empty(*shape, device=_param_device(config), dtype=getattr(config, "params_dtype", torch.float32))
    )


class _ParallelLinearMixin:
    """What the two layers share: the settings read from their common arguments, Megatron's weight and bias
    initialization, and Megatron/TE state-dict compatibility: Megatron's ``_extra_state`` entries load (and
    are ignored), ``state_dict()`` holds no ``None`` (safetensors and ``save_pretrained`` refuse one),
    ``sharded_state_dict()`` has the entry Megatron's own modules put there."""

    def _setup(self, input_size: int, output_size: int, *, config: Any, is_expert: bool, tp_group: Group) -> int:
        """The attributes both layers derive from their common arguments; returns the group's size W."""
        self.input_size = input_size
        self.output_size = output_size
        self.config = config
        self.is_expert = is_expert
        self.expert_parallel = getattr(config, "expert_model_parallel_size", 1) > 1
        self.gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        self.tp_group = resolve_tp_group(tp_group, is_expert=is_expert)
        world = world_size(self.tp_group)
        self.explicit_expert_comm = self.is_expert and (world > 1 or self.expert_parallel)
        return world

    def _perform_init(self) -> bool:
        return getattr(self.config, "perform_initialization", True)

    def _allreduce(self) -> bool:
        """Megatron's ``param.allreduce``: False for the experts' own parameters under expert parallelism."""
        return not (self.is_expert and self.expert_parallel)

    def _add_weight(self, dim: int, stride: int, init_method: Callable, keep_master: bool) -> None:
        """``self.weight``, this rank's shard of ``[output_size, input_size]`` split along ``dim``, and
        ``self.master_weight`` (the full weight when ``keep_master`` and initialized on the CPU, else None)."""
        shape = [self.output_size, self.input_size]
        shape[dim] //= world_size(self.tp_group)
        self.weight = _new_param(self.config, *shape)
        self.master_weight = None
        _set_tp_attributes(self.weight, True, dim, stride)
        if self._perform_init():
            self.master_weight = self._init_weight(dim, stride, init_method, keep_master)
        self.weight.allreduce = self._allreduce()

    def _init_weight(self, dim: int, stride: int, init_method: Callable, return_master: bool) -> torch.Tensor | None:
        """Megatron's ``_initialize_affine_weight_cpu`` / ``_gpu``: same values for the same seed."""
        if _use_device_init(self.config):
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

            tracker = get_cuda_rng_tracker()
            with tracker.fork(get_expert_parallel_rng_tracker_name()) if self.is_expert else tracker.fork():
                init_method(self.weight)
            return None
        master = torch.empty(self.output_size, self.input_size, dtype=torch.float, requires_grad=False)
        init_method(master)
        master = master.to(dtype=self.weight.dtype)
        per_stride = _divide(self.weight.shape[dim], stride, "per-partition size / stride")
        pieces = torch.split(master, per_stride, dim=dim)[rank_of(self.tp_group) :: world_size(self.tp_group)]
        with torch.no_grad():
            self.weight.data.copy_(torch.cat(pieces, dim=dim))
        return master if return_master else None

    def _new_bias(self, size: int) -> Parameter:
        bias = _new_param(self.config, size)
        if self._perform_init():
            with torch.no_grad():
                bias.zero_()
        bias.allreduce = self._allreduce()
        return bias

    def _finish(self, fp8: Fp8Recipe | None) -> None:
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state")
        )
        # Opt-in FP8 GEMMs (autopar.tp.fp8): fp8=Fp8Recipe(...) or COC_FP8=1 at construction.
        self.fp8 = resolve_recipe(fp8)
        self.fp8_cache = Fp8WeightCache()

    def set_extra_state(self, state: Any) -> None:
        """Extra state is ignored (Megatron's modules save None there)."""

    def _sharded_state_dict(
        self, prefix: str, sharded_offsets: tuple, metadata: dict | None, tp_axis_map: dict[str, int]
    ) -> dict:
        # Megatron's distributed checkpointing calls this on every submodule that has it and
        # otherwise treats the parameters as replicated over TP, which would save one rank's
        # shard as the whole tensor; so the TP axes must be declared as Megatron's modules do.
        try:
            from megatron.core.transformer.utils import (
                ensure_metadata_has_dp_cp_group,
                make_sharded_tensors_for_checkpoint,
            )
        except ImportError as e:
            raise ImportError(
                "sharded_state_dict() is Megatron's distributed checkpointing and "
                f"needs megatron-core (pip install megatron-core): {e}"
            ) from e
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.state_dict(prefix="", keep_vars=True)
        state["_extra_state"] = None  # as Megatron's modules: checkpoints interchange both ways
        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            tp_axis_map,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


class ColumnParallelLinear(_ParallelLinearMixin, torch.nn.Module):
    """``Y = X A^T + b`` with ``A [output_size, input_size]`` split along its rows (the output
    features): each rank holds ``weight [output_size / W, input_size]`` and ``bias [output_size / W]``.

    Constructor and forward arguments are Megatron-core's
    ``megatron.core.tensor_parallel.ColumnParallelLinear``; ``tp_comm_buffer_name`` is accepted and
    unused (as in Megatron's non-TE module). ``forward(input_, weight=None,
    runtime_gather_output=None) -> (output, output_bias)``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: list | None = None,
        grad_output_buffer: list | None = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        tp_group: Group = None,
        fp8: Fp8Recipe | None = None,
    ) -> None:
        super().__init__()
        world = self._setup(input_size, output_size, config=config, is_expert=is_expert, tp_group=tp_group)
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        self.disable_grad_reduce = disable_grad_reduce
        self.output_size_per_partition = _divide(output_size, world, "output_size")
        if skip_weight_param_allocation:
            self.weight = None
            self.master_weight = None
        else:
            self._add_weight(0, stride, init_method, keep_master_weight_for_test)
        if bias:
            self.bias = self._new_bias(self.output_size_per_partition)
            _set_tp_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        if self.sequence_parallel and world <= 1:
            warnings.warn(
                "`sequence_parallel` is set to `True`, but tensor model parallel size "
                f"is {world}. Disabling sequence parallel.",
                stacklevel=2,
            )
            self.sequence_parallel = False
        self.allreduce_dgrad = world > 1 and not self.sequence_parallel and not disable_grad_reduce
        self._finish(fp8)

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ [s, b, input_size]`` (``[s/W, b, input_size]`` with sequence parallelism) ->
        ``(output [s, b, output_size / W] or [s, b, output_size] when gathering, output_bias)``."""
        return column_parallel_forward(self, input_, weight, runtime_gather_output)

    def backward_dw(self) -> None:
        """Delayed weight-gradient computation is not supported (as in Megatron's module)."""

    @classmethod
    def from_linear(
        cls, linear: torch.nn.Module, *, config: Any, stride: int = 1, tp_group: Group = None, **kwargs: Any
    ) -> ColumnParallelLinear:
        """This rank's slice of an ``nn.Linear`` / transformers ``Conv1D``: weight rows and bias
        (``stride``: Megatron's strided slices, 3 for a packed q/k/v). ``kwargs``: the other
        constructor arguments (``gather_output``, ``skip_bias_add``, ...). A weight tied to another
        module (an input embedding) raises ``ValueError`` (see ``autopar.parallelize_hf``)."""
        convert.check_untied(linear.weight, "linear.weight")
        weight, bias = convert.linear_weight(linear)
        return cls.from_weight(weight, bias, config=config, stride=stride, tp_group=tp_group, **kwargs)

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        config: Any,
        stride: int = 1,
        tp_group: Group = None,
        **kwargs: Any,
    ) -> ColumnParallelLinear:
        """This rank's slice of a full ``weight [output_size, input_size]`` and ``bias [output_size]``."""
        return convert.from_weight(cls, weight, bias, config=config, stride=stride, tp_group=tp_group, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Megatron distributed checkpointing: weight and bias sharded along axis 0 over TP."""
        return self._sharded_state_dict(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0})

    def __repr__(self) -> str:
        tp = self.output_size // self.output_size_per_partition
        return (
            f"{type(self).__name__}(in_features={self.input_size}, "
            f"out_features={self.output_size}, bias={self.bias is not None}, TP={tp})"
        )


class RowParallelLinear(_ParallelLinearMixin, torch.nn.Module):
    """``Y = X A^T + b`` with ``A [output_size, input_size]`` split along its columns (the input
    features): each rank holds ``weight [output_size, input_size / W]``; ``bias [output_size]`` is
    whole and added once, after the reduction.

    Constructor and forward arguments are Megatron-core's
    ``megatron.core.tensor_parallel.RowParallelLinear``. ``forward(input_) -> (output, output_bias)``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: Group = None,
        fp8: Fp8Recipe | None = None,
    ) -> None:
        super().__init__()
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        if self.sequence_parallel and not input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel`, `input_is_parallel` must be `True`")
        world = self._setup(input_size, output_size, config=config, is_expert=is_expert, tp_group=tp_group)
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.input_size_per_partition = _divide(input_size, world, "input_size")
        self._add_weight(1, stride, init_method, keep_master_weight_for_test)
        if bias:
            self.bias = self._new_bias(output_size)
            # With sequence parallelism each rank's bias gradient covers its own rows only; the
            # trainer all-reduces gradients of parameters carrying this flag over the TP group.
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)
        self._finish(fp8)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ [s, b, input_size / W]`` (or ``[s, b, input_size]`` when not
        ``input_is_parallel``) -> ``(output [s, b, output_size] or [s/W, b, output_size] with
        sequence parallelism, output_bias)``."""
        return row_parallel_forward(self, input_)

    @classmethod
    def from_linear(
        cls,
        linear: torch.nn.Module,
        *,
        config: Any,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        stride: int = 1,
        tp_group: Group = None,
        **kwargs: Any,
    ) -> RowParallelLinear:
        """This rank's slice of an ``nn.Linear`` / transformers ``Conv1D``: weight columns, the
        whole bias. A weight tied to another module raises ``ValueError``."""
        convert.check_untied(linear.weight, "linear.weight")
        weight, bias = convert.linear_weight(linear)
        return cls.from_weight(
            weight,
            bias,
            config=config,
            input_is_parallel=input_is_parallel,
            skip_bias_add=skip_bias_add,
            stride=stride,
            tp_group=tp_group,
            **kwargs,
        )

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        config: Any,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        stride: int = 1,
        tp_group: Group = None,
        **kwargs: Any,
    ) -> RowParallelLinear:
        """This rank's slice of a full ``weight [output_size, input_size]`` (columns) and the whole ``bias``."""
        return convert.from_weight(
            cls,
            weight,
            bias,
            config=config,
            input_is_parallel=input_is_parallel,
            skip_bias_add=skip_bias_add,
            stride=stride,
            tp_group=tp_group,
            **kwargs,
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Megatron distributed checkpointing: weight sharded along axis 1 over TP, bias whole."""
        return self._sharded_state_dict(prefix, sharded_offsets, metadata, {"weight": 1})

    def __repr__(self) -> str:
        tp = self.input_size // self.input_size_per_partition
        return (
            f"{type(self).__name__}(in_features={self.input_size}, "
            f"out_features={self.output_size}, bias={self.bias is not None}, TP={tp})"
        )
