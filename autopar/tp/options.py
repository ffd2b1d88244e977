"""The non-tensor arguments of the linear autograd Functions: one frozen value, validated here.

Every Function of :mod:`autopar.tp.functions` (and the shared gather of :mod:`autopar.tp.shared_gather`)
takes ``(x, weight, bias, opts)``; ``opts`` carries the process group, the sequence dim, the backward's
switches and the operand format: plain (the operands as they come, bf16 / fp16 / fp32) or the FP8 recipe
(``recipe`` and the layer's quantized-weight ``cache``). The format's GEMMs are ``opts.operands``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm import Group
from .fp8 import Fp8Operands, Fp8Recipe, Fp8WeightCache
from .operands import CommCall, Operands, PlainOperands
from .wgrad import WgradOptions

_PLAIN_WGRAD = WgradOptions()


@dataclass(frozen=True)
class LinearOptions:
    """How a tensor-parallel linear communicates and which operand format its GEMMs use.

    - ``group``: the tensor-parallel process group; None: one process, no communication.
    - ``seq_dim``: the sequence dim of the sequence-parallel Functions (0: Megatron's ``[s, b, h]``,
      1: Hugging Face's ``[b, s, h]``); the other Functions ignore it.
    - ``allreduce_dgrad``: column without sequence parallelism: all-reduce the input gradient (False:
      Megatron's ``disable_grad_reduce``, explicit expert communication).
    - ``coc_in_backward``: the column dgrad and its collective as one ``kernels`` op
      (``enable_coc_in_column_backward``); plain operands only, the FP8 dgrad always is one op.
    - ``recompute_all_gather``: column with sequence parallelism: gather the input again in the backward
      instead of keeping the gathered one; plain operands only (FP8 keeps its gathered FP8 input).
    - ``wgrad``: how the weight gradient is delivered (gradient accumulation fusion, deferral); plain only.
    - ``recipe``: None for plain operands, an :class:`~autopar.Fp8Recipe` for FP8 GEMMs, with ``cache``
      the layer's :class:`~autopar.tp.fp8.Fp8WeightCache` (required then: the weight is quantized once
      per change, not once per call).
    """

    group: Group = None
    seq_dim: int = 0
    allreduce_dgrad: bool = True
    coc_in_backward: bool = False
    recompute_all_gather: bool = True
    wgrad: WgradOptions = _PLAIN_WGRAD
    recipe: Fp8Recipe | None = None
    cache: Fp8WeightCache | None = None
    operands: Operands = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_types()
        # The attribute is derived from the fields, so setting it once here keeps the value frozen.
        object.__setattr__(self, "operands", self._operand_format())

    def _check_types(self) -> None:
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(f"LinearOptions.group must be a ProcessGroup or None, got {type(self.group).__name__}")
        if not isinstance(self.seq_dim, int) or isinstance(self.seq_dim, bool):
            raise TypeError(f"LinearOptions.seq_dim must be an int, got {self.seq_dim!r}")
        for name in ("allreduce_dgrad", "coc_in_backward", "recompute_all_gather"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LinearOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.wgrad, WgradOptions):
            raise TypeError(f"LinearOptions.wgrad must be a WgradOptions, got {type(self.wgrad).__name__}")

    def _operand_format(self) -> Operands:
        """Plain operands without a recipe; the FP8 recipe's with its cache, refusing what it does not run."""
        if self.recipe is None:
            if self.cache is not None:
                raise ValueError("LinearOptions: an FP8 weight cache without an FP8 recipe")
            return PlainOperands(self.coc_in_backward, self.recompute_all_gather)
        if not isinstance(self.recipe, Fp8Recipe):
            raise TypeError(f"LinearOptions.recipe must be an autopar.Fp8Recipe or None, got {self.recipe!r}")
        if not isinstance(self.cache, Fp8WeightCache):
            raise ValueError(
                "LinearOptions: the FP8 recipe needs the layer's Fp8WeightCache (cache=), which keeps the weight "
                f"quantized between calls; got {self.cache!r}"
            )
        for name, on in (
            ("gradient_accumulation_fusion", self.wgrad.gradient_accumulation_fusion),
            ("defer_embedding_wgrad_compute", self.wgrad.grad_output_buffer is not None),
        ):
            if on:
                raise NotImplementedError(f"{name} is not supported with the FP8 recipe")
        return Fp8Operands(self.recipe, self.cache)

    def comm_call(self, out_dtype: torch.dtype) -> CommCall:
        """The communicating GEMMs' call: over ``group``, along ``seq_dim``, rounded to ``out_dtype``."""
        return CommCall(self.group, out_dtype, self.seq_dim)


__all__ = ["LinearOptions"]
