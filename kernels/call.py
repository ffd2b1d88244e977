"""A call is one value: :class:`OpCall` holds what the layers below the public function need, :class:`Operands`
its tensors.

The public function builds both once; the call check describes them (:mod:`kernels.callcheck`), the
dispatcher resolves the backend (one ``dataclasses.replace``), the registered operator receives the
call as one string (:meth:`OpCall.encode`, a constant of a compiled graph: it holds no shape, so a
graph compiled with dynamic shapes stays dynamic) and the backends receive ``(call, operands)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import agree
from .format import PLAIN, OperandFormat

PATTERNS = ("all_gather", "reduce_scatter", "all_reduce", "matmul")
# The public function of each (pattern, format kind): the op the user called, as messages name it.
PUBLIC_NAMES = {
    ("all_gather", "plain"): "all_gather_matmul",
    ("reduce_scatter", "plain"): "matmul_reduce_scatter",
    ("all_reduce", "plain"): "matmul_all_reduce",
    ("all_gather", "fp8"): "all_gather_scaled_matmul",
    ("reduce_scatter", "fp8"): "scaled_matmul_reduce_scatter",
    ("all_reduce", "fp8"): "scaled_matmul_all_reduce",
    ("all_gather", "int8"): "quantized_all_gather_matmul",
    ("reduce_scatter", "int8"): "quantized_matmul_reduce_scatter",
    ("all_reduce", "int8"): "quantized_matmul_all_reduce",
    ("matmul", "plain"): "matmul",
    ("matmul", "fp8"): "scaled_matmul",
    ("matmul", "int8"): "quantized_matmul",
}
# pattern -> {backend: implementation(call, operands, group)}: filled by the pattern modules of kernels.ops
# (one entry each, at import), read by their registered operators and the tuner. A table here, below
# everything that reads it, keeps the imports one way.
IMPLEMENTATIONS: dict[str, dict[str, Callable[..., Any]]] = {}
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


@dataclass(frozen=True, kw_only=True)
class OpCall:
    """One call of an op, without its tensors.

    ``pattern``: the communication (:data:`PATTERNS`); ``fmt``: the operands' format; ``out_dtype``:
    the output's dtype (None: x's); ``return_gathered`` (all-gather) / ``deterministic`` (reducing);
    ``comm_dim``: the normalized ``gather_dim`` / ``scatter_dim``; ``group_name`` / ``world``: the
    process group (``""``: none, W == 1 without torch.distributed); ``backend`` / ``parallel_num``:
    as requested until :func:`kernels.dispatch.decide` resolves them.
    """

    pattern: str
    fmt: OperandFormat = PLAIN
    out_dtype: torch.dtype | None = None
    return_gathered: bool = False
    deterministic: bool = False
    comm_dim: int = 0
    group_name: str = ""
    world: int = 1
    backend: str | None = None
    parallel_num: int | str | None = None
    # all_reduce: what follows the reduction (kernels.agree.EPILOGUES; "": nothing).
    epilogue: str = ""

    @property
    def op_name(self) -> str:
        """The public function the user called."""
        return PUBLIC_NAMES[(self.pattern, self.fmt.kind)]

    def encode(self) -> str:
        """The call as one string (every field; parsed back by :func:`decode`)."""
        out = "" if self.out_dtype is None else str(self.out_dtype).removeprefix("torch.")
        return "|".join(
            (
                self.pattern,
                self.fmt.encode(),
                out,
                str(int(self.return_gathered)),
                str(int(self.deterministic)),
                str(self.comm_dim),
                self.group_name,
                str(self.world),
                self.backend or "",
                "" if self.parallel_num is None else str(self.parallel_num),
                self.epilogue,
            )
        )

    def descriptor(self, operands: Operands, tiles: tuple[int, int] | None = None) -> agree.Descriptor:
        """This rank's descriptor of the call (:mod:`kernels.agree`) with its backend and split count as they
        stand (requested ones: ``agree.resolve_request`` reads the environment's); ``tiles``: the fused
        reducing GEMM's ``(block_m, block_n)``, whose tile counts peers count."""
        x = operands.x
        d = self.comm_dim
        m = 1
        for size in x.shape[:-1]:
            m *= size
        outer = None
        if self.pattern in ("all_gather", "reduce_scatter"):
            outer = 1
            for size in x.shape[:d]:
                outer *= size
            outer = outer if outer > 0 else 1
        fp8 = self.fmt.kind == "fp8"
        return agree.describe_call(
            self.op_name,
            m,
            x.shape[-1],
            sum(w.shape[0] for w in operands.weights),
            x.dtype,
            bias=operands.biases[0] is not None,
            flag=self.return_gathered if self.pattern == "all_gather" else self.deterministic,
            backend=self.backend,
            parallel_num=self.parallel_num,
            quant_mode=self.fmt.mode,
            group_size=self.fmt.group_size,
            comm_dim=d,
            weight_dtype=operands.weights[0].dtype if fp8 else None,
            out_dtype=self.out_dtype if fp8 else None,
            tiles=tiles,
            outer=outer,
            epilogue=self.epilogue,
        )


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name a call gives its group by (``ProcessGroup.group_name``, resolved inside the op as torch's
    functional collectives do, so a traced graph holds a string); ``""`` for no group without
    torch.distributed (W == 1)."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return ""
        group = dist.group.WORLD
    return group.group_name


def resolve_group(name: str) -> dist.ProcessGroup | None:
    """The process group a call names (``None`` for ``""``)."""
    if not name:
        return None
    return dist.distributed_c10d._resolve_process_group(name)


@functools.lru_cache(maxsize=4096)
def decode(text: str) -> OpCall:
    """Inverse of :meth:`OpCall.encode` (cached: the registered operators decode their string at each call)."""
    pattern, fmt, out, rg, det, dim, group_name, world, backend, num, epilogue = text.split("|")
    parallel_num: int | str | None = None
    if num:
        parallel_num = num if num == "auto" else int(num)
    return OpCall(
        pattern=pattern,
        fmt=OperandFormat.decode(fmt),
        out_dtype=_DTYPES[out] if out else None,
        return_gathered=rg == "1",
        deterministic=det == "1",
        comm_dim=int(dim),
        group_name=group_name,
        world=int(world),
        backend=backend or None,
        parallel_num=parallel_num,
        epilogue=epilogue,
    )


@dataclass(frozen=True)
class Operands:
    """A call's tensors: ``x`` (any leading dims), one or more weights ``[n_i, k]`` with their biases, and the
    scales of a scaled format (``x_scale`` in rows layout ``[m, G]`` or 0-dim; per weight ``w_scales`` and
    int8 ``w_offsets``)."""

    x: torch.Tensor
    weights: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]
    x_scale: torch.Tensor | None = None
    w_scales: tuple[torch.Tensor | None, ...] = ()
    w_offsets: tuple[torch.Tensor | None, ...] = ()

    def scale_of(self, i: int) -> torch.Tensor | None:
        return self.w_scales[i] if self.w_scales else None

    def offset_of(self, i: int) -> torch.Tensor | None:
        return self.w_offsets[i] if self.w_offsets else None
