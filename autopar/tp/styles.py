"""ParallelStyles for ``torch.distributed.tensor.parallel.parallelize_module`` that run the CoC ops.

``CocColwiseParallel``, ``CocRowwiseParallel``, ``CocSequenceParallel`` take the constructor
arguments of torch's ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` and shard the
parameters exactly as they do (PyTorch DTensors: ``Shard(0)`` / ``Shard(1)`` / ``Replicate()``),
so state dicts, distributed checkpoints, optimizers and ``clip_grad_norm_`` see what torch's styles
give them. The forward and backward differ: they run on the local shards through the autograd
Functions of :mod:`autopar.tp.functions`, whose communication is the overlapped ``kernels`` ops
(backend from the ``COC_*`` environment); ``fp8=autopar.Fp8Recipe()`` (or ``COC_FP8=1``) makes their GEMMs
the FP8 recipe's (the FP8 ops, same layouts):

- column, input ``Shard(d)`` (sequence parallel): ``all_gather_matmul(gather_dim=d)``;
  backward ``reduce_scatter(dim=d)`` of the dgrad overlapped with the wgrad GEMM.
- column, input ``Replicate``: a local GEMM; backward all-reduce of the dgrad overlapped with the wgrad.
- row, output ``Replicate``: ``matmul_all_reduce``; local backward.
- row, output ``Shard(d)``: ``matmul_reduce_scatter(scatter_dim=d)``; backward ``all_gather_matmul(gather_dim=d)``.

The layout of an incoming DTensor wins over ``input_layouts`` (as for torch's styles, which
redistribute from it): a sequence length that does not divide by the mesh size makes the styles
keep that forward replicated (generation's one-token steps), with a one-time warning.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from . import comm, decode, strided_load
from .comm import GatherFromTensorParallelRegion, ScatterToTensorParallelRegion
from .forward import column_settings
from .fp8 import Fp8Recipe, Fp8WeightCache, resolve_recipe
from .functions import (
    ColumnParallelLinearFunction,
    ColumnParallelLinearSPFunction,
    RowParallelLinearFunction,
    RowParallelLinearSPFunction,
)
from .options import LinearOptions
from .shared_gather import SharedGather, sharing_applies
from .style_common import (
    AllReduceGrad,
    StridedShard,
    distribute_param,
    install_forward,
    is_conv1d,
    local_input,
    local_of,
    mesh_group,
    replicate_param,
)

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _one(layout: Placement | tuple | None, default: Placement, name: str) -> Placement:
    if layout is None:
        return default
    if isinstance(layout, tuple):
        if len(layout) != 1:
            raise ValueError(f"{name} must be one Placement for a 1-D mesh, got {layout}")
        layout = layout[0]
    if not isinstance(layout, Placement):
        raise TypeError(f"{name} must be a torch.distributed.tensor Placement, got {layout!r}")
    return layout


def _dim(placement: Placement, ndim: int) -> int | None:
    """The (non-negative) dim of a Shard placement on a tensor of ``ndim`` dims; None if not a shard."""
    if isinstance(placement, Shard):
        return placement.dim % ndim
    return None


def _conv1d_class(module: nn.Module) -> type | None:
    return next((c for c in type(module).__mro__ if c.__name__ == "Conv1D" and "forward" in vars(c)), None)


def _check_stock_forward(module: nn.Module, style: str) -> None:
    """The linear styles compute ``x @ W.T + b`` themselves (the CoC ops fuse it with the communication), in
    place of the module's forward: only a forward that computes exactly that may be replaced. A subclass of
    ``nn.Linear`` / ``Conv1D`` with its own ``forward`` (a scale, an adapter, a quantized product) or a
    forward set on the instance (hooks of other libraries) would be dropped without a word: refused."""
    stock = _conv1d_class(module) if is_conv1d(module) else nn.Linear
    cls = type(module)
    own = "forward" in vars(module)
    if own or stock is None or cls.forward is not stock.forward:
        where = "a forward set on the instance" if own else f"its own forward ({cls.__qualname__}.forward)"
        raise NotImplementedError(
            f"{style}: {cls.__name__} has {where}; this style computes the plain linear in the module's place and "
            "would drop that computation (silently wrong). Use torch's ColwiseParallel / RowwiseParallel for it, "
            "or leave the module out of the plan"
        )


def _vocab_start(num_embeddings: int, world: int, rank: int) -> int:
    """First row of ``rank``'s shard of a ``Shard(0)`` embedding (torch's chunking: ceil-sized pieces)."""
    sizes = [len(c) for c in torch.arange(num_embeddings).chunk(world)]
    return sum(sizes[:rank])


def _linear_weight(module: nn.Module) -> torch.Tensor:
    """The local weight in ``F.linear`` layout ``[n, k]``."""
    w = local_of(module.weight)
    return w.t() if is_conv1d(module) else w


class _ReduceToLayout(torch.autograd.Function):
    """Partial sums (the vocabulary-parallel embedding's lookups) reduced to a layout.

    - ``dim=None``: ``y = all_reduce(partial)``; backward: identity (the gradient is replicated).
    - ``dim=d``: ``y_shard = reduce_scatter(partial, dim=d)``; backward: ``all_gather(grad, dim=d)``.
    """

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: dist.ProcessGroup, dim: int | None) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        if comm.world_size(group) == 1:
            return partial
        if dim is None:
            return comm.wait(comm.start_all_reduce(partial.contiguous(), group))
        return comm.wait(comm.start_reduce_scatter(partial, group, dim))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.dim is None or comm.world_size(ctx.group) == 1:
            return grad, None, None
        return comm.gather_rows(grad, ctx.group, ctx.dim), None, None


def _check_embedding(module: nn.Embedding) -> None:
    """What the vocabulary-parallel forward cannot keep exact: ``max_norm`` renormalizes the rows it looks up in
    place, ``sparse`` gradients, ``scale_grad_by_freq`` (the ids outside a rank's rows count as row 0), and
    parameters besides the weight (their gradient would cover each rank's tokens only)."""
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise NotImplementedError(
            f"CocRowwiseParallel: {type(module).__name__} with max_norm, sparse=True or scale_grad_by_freq=True "
            "(the vocabulary-parallel lookup would not be exact)"
        )
    extra = [n for n, _ in module.named_parameters() if n != "weight"]
    if extra:
        raise NotImplementedError(
            f"CocRowwiseParallel: {type(module).__name__} has parameters besides its weight ({', '.join(extra)}); "
            "each rank's forward covers its own tokens only, so their gradients would be partial"
        )


def _linear_style_repr(style: ParallelStyle, **extra: Any) -> str:
    fields = {
        "input_layouts": style.input_layouts,
        "output_layouts": style.output_layouts,
        "use_local_output": style.use_local_output,
        **extra,
        "fp8": style.fp8,
    }
    return f"{type(style).__name__}({', '.join(f'{k}={v}' for k, v in fields.items())})"


def _wrap(y: torch.Tensor, mesh: DeviceMesh, layout: Placement, use_local_output: bool) -> torch.Tensor:
    if use_local_output:
        return y
    return DTensor.from_local(y, mesh, [layout], run_check=False)


def _sequence_layout(seq_dim: int, y_shape: torch.Size, world: int, who: str) -> tuple[int | None, Placement]:
    """``(dim, Shard(dim))`` when ``y_shape[dim]`` divides by W, else ``(None, Replicate())`` (warned once)."""
    if y_shape[seq_dim] % world == 0:
        return seq_dim, Shard(seq_dim)
    _warn_once(
        f"uneven:{who}",
        f"{who}: the sequence dim (dim {seq_dim}, size {y_shape[seq_dim]}) does not divide by the mesh size "
        f"W={world}; this forward keeps the sequence replicated (matmul_all_reduce instead of "
        "matmul_reduce_scatter; same result). Shown once.",
    )
    return None, Replicate()


def _attach_fp8(module: nn.Module, recipe: Fp8Recipe | None) -> None:
    """The module's quantized-weight cache (``module.fp8_cache``: one per module, the style may serve many)."""
    if recipe is not None:
        module.fp8_cache = Fp8WeightCache()


def _options(module: nn.Module, recipe: Fp8Recipe | None, group: dist.ProcessGroup, seq_dim: int) -> LinearOptions:
    cache = None
    if recipe is not None:
        cache = module.fp8_cache
        # The Functions see the weight's local shard, which in-place updates of the DTensor leave at version
        # 0; the cache must follow the parameter the module holds now (a re-tied head holds another).
        cache.track(module.weight)
    recompute, coc_in_backward = column_settings()
    return LinearOptions(
        group=group,
        seq_dim=seq_dim,
        coc_in_backward=coc_in_backward,
        recompute_all_gather=recompute,
        recipe=recipe,
        cache=cache,
    )


class CocColwiseParallel(ParallelStyle):
    """torch's ``ColwiseParallel`` (same arguments and parameter layouts) on the CoC ops.

    ``nn.Linear`` weight and bias ``Shard(0)`` (Hugging Face ``Conv1D``: weight ``Shard(1)``, its
    ``[in, out]`` layout). ``input_layouts`` (default ``Replicate()``): ``Shard(d)`` means the input
    is sequence-sharded on dim ``d`` and the forward is ``kernels.all_gather_matmul(gather_dim=d)``.
    ``output_layouts`` (default ``Shard(-1)``): ``Replicate()`` gathers the output features.
    ``packed=p``: the output features are ``p`` equal blocks each sharded on its own (GPT-2's
    q/k/v in ``c_attn``, a fused gate/up): weight ``_StridedShard(split_factor=p)`` as transformers'
    ``PackedColwiseParallel``, so each rank holds its slice of every block. ``fp8``: an
    :class:`~autopar.Fp8Recipe` for FP8 forward, dgrad and wgrad GEMMs (None: the default recipe when
    ``COC_FP8=1``, else the parameter dtype).
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        packed: int = 1,
        fp8: Fp8Recipe | None = None,
    ) -> None:
        super().__init__()
        self.input_layouts = (_one(input_layouts, Replicate(), "input_layouts"),)
        self.output_layouts = (_one(output_layouts, Shard(-1), "output_layouts"),)
        self.use_local_output = use_local_output
        if not isinstance(packed, int) or packed < 1:
            raise ValueError(f"packed must be an int >= 1 (blocks in the output features), got {packed!r}")
        self.packed = packed
        self.fp8 = resolve_recipe(fp8)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise NotImplementedError(
                f"CocColwiseParallel shards nn.Linear and transformers' Conv1D, got {type(module).__name__}"
            )
        _check_stock_forward(module, "CocColwiseParallel")
        world = device_mesh.size()
        n = module.nf if is_conv1d(module) else module.out_features
        if n % (world * self.packed) != 0:
            raise ValueError(
                f"CocColwiseParallel: out_features={n} must divide by mesh size W={world} times packed={self.packed}"
            )
        wdim = 1 if is_conv1d(module) else 0
        if self.packed > 1:
            if StridedShard is None:
                raise RuntimeError("packed > 1 needs torch's _StridedShard placement (torch >= 2.5)")
            strided_load.install()
            distribute_param(
                module, "weight", device_mesh, StridedShard(wdim, split_factor=self.packed), self.src_data_rank
            )
            distribute_param(module, "bias", device_mesh, StridedShard(0, split_factor=self.packed), self.src_data_rank)
        else:
            distribute_param(module, "weight", device_mesh, Shard(wdim), self.src_data_rank)
            distribute_param(module, "bias", device_mesh, Shard(0), self.src_data_rank)
        _attach_fp8(module, self.fp8)
        module._coc_style = self
        return install_forward(module, functools.partial(self._forward, device_mesh))

    def _forward(self, mesh: DeviceMesh, module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = mesh_group(mesh)
        link = sharing_applies(module)
        source = x
        if link is not None:
            waiting = link.take(module, source)
            if waiting is not None:
                return _wrap(waiting, mesh, self.output_layouts[0], self.use_local_output)
        x, layout = local_input(x, self.input_layouts[0])
        weight = _linear_weight(module)
        bias = local_of(module.bias) if module.bias is not None else None
        d = _dim(layout, x.dim())
        if link is not None and link.idle and d is not None and d != x.dim() - 1:
            params = [_linear_weight(m) for m in link.members]
            params += [local_of(m.bias) if m.bias is not None else None for m in link.members]
            members = tuple(_options(m, m._coc_style.fp8, group, d) for m in link.members)
            y = link.compute(module, source, x, params, members)
            return _wrap(y, mesh, self.output_layouts[0], self.use_local_output)
        if d is None:
            y = ColumnParallelLinearFunction.apply(x, weight, bias, _options(module, self.fp8, group, 0))
        elif d == x.dim() - 1:
            raise ValueError(
                f"CocColwiseParallel: input layout {layout} shards the features (last dim); a column-parallel "
                "linear takes a replicated or sequence-sharded input"
            )
        else:
            y = ColumnParallelLinearSPFunction.apply(x, weight, bias, _options(module, self.fp8, group, d))
        out = self.output_layouts[0]
        if isinstance(out, Replicate):
            y = GatherFromTensorParallelRegion.apply(y, group)
        elif _dim(out, y.dim()) != y.dim() - 1:
            y = DTensor.from_local(y, mesh, [Shard(-1)], run_check=False).redistribute(placements=[out])
            return y.to_local() if self.use_local_output else y
        return _wrap(y, mesh, out, self.use_local_output)

    def __repr__(self) -> str:
        return _linear_style_repr(self, packed=self.packed)


class CocRowwiseParallel(ParallelStyle):
    """torch's ``RowwiseParallel`` (same arguments and parameter layouts) on the CoC ops.

    ``nn.Linear``: weight ``Shard(1)``, bias ``Replicate()`` (``Conv1D``: weight ``Shard(0)``).
    ``output_layouts`` ``Replicate()`` (default): ``kernels.matmul_all_reduce``; ``Shard(d)``
    (sequence parallel): ``kernels.matmul_reduce_scatter(scatter_dim=d)``, and the bias gradient
    (each rank's rows) is summed over the mesh in the backward. ``input_layouts`` default
    ``Shard(-1)``; ``Replicate()`` slices this rank's input features (transformers'
    ``rowwise_split_input``).

    ``fp8``: an :class:`~autopar.Fp8Recipe` for FP8 GEMMs (``kernels.scaled_matmul_all_reduce`` /
    ``scaled_matmul_reduce_scatter``; None: the default recipe when ``COC_FP8=1``).

    ``fuse_norm=True`` (an ``nn.Linear`` with ``Replicate()`` output and no FP8 recipe): under
    ``torch.no_grad()`` the output is returned pending (:mod:`autopar.tp.decode`), so the residual add and an
    RMSNorm installed with :func:`autopar.tp.decode.fuse_rmsnorm` after it run fused with the all-reduce.

    On ``nn.Embedding`` (vocabulary-parallel, as torch's): weight ``Shard(0)``, token ids
    replicated; each rank looks up its rows and the partial sums are all-reduced (``Replicate``) or
    reduce-scattered along the sequence (``Shard(d)``) with torch's collectives (no GEMM to fuse,
    so ``fp8`` does not apply: the lookup stays in the parameter dtype).
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        fp8: Fp8Recipe | None = None,
        fuse_norm: bool = False,
    ) -> None:
        super().__init__()
        self.input_layouts = (_one(input_layouts, Shard(-1), "input_layouts"),)
        self.output_layouts = (_one(output_layouts, Replicate(), "output_layouts"),)
        self.use_local_output = use_local_output
        self.fp8 = resolve_recipe(fp8)
        self.fuse_norm = fuse_norm

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        world = device_mesh.size()
        if isinstance(module, nn.Embedding):
            _check_embedding(module)
            distribute_param(module, "weight", device_mesh, Shard(0), self.src_data_rank)
            return install_forward(module, functools.partial(self._embedding_forward, device_mesh, module.forward))
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise NotImplementedError(
                "CocRowwiseParallel shards nn.Linear, transformers' Conv1D and nn.Embedding, "
                f"got {type(module).__name__}"
            )
        _check_stock_forward(module, "CocRowwiseParallel")
        k = module.weight.shape[0] if is_conv1d(module) else module.in_features
        if k % world != 0:
            raise ValueError(f"CocRowwiseParallel: in_features={k} must divide by the mesh size W={world}")
        distribute_param(module, "weight", device_mesh, Shard(0 if is_conv1d(module) else 1), self.src_data_rank)
        distribute_param(module, "bias", device_mesh, Replicate(), self.src_data_rank)
        _attach_fp8(module, self.fp8)
        return install_forward(module, functools.partial(self._forward, device_mesh))

    def _forward(self, mesh: DeviceMesh, module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = mesh_group(mesh)
        x = self._local_input(x, group)
        weight = _linear_weight(module)
        bias = local_of(module.bias) if module.bias is not None else None
        d, out = self._output_layout(x, mesh.size())
        if d is None:
            pending = self._pending(module, x, weight, bias, group)
            if pending is not None:
                return pending
            y = RowParallelLinearFunction.apply(x, weight, bias, _options(module, self.fp8, group, 0))
        else:
            if bias is not None:
                bias = AllReduceGrad.apply(bias, group)
            y = RowParallelLinearSPFunction.apply(x, weight, bias, _options(module, self.fp8, group, d))
        return _wrap(y, mesh, out, self.use_local_output)

    def _local_input(self, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """This rank's input features: a DTensor's own shard of them, a replicated plain tensor's slice."""
        if isinstance(x, DTensor):
            if _dim(x.placements[0], x.dim()) != x.dim() - 1:
                x = x.redistribute(placements=[Shard(x.dim() - 1)])
            return x.to_local()
        if isinstance(self.input_layouts[0], Replicate):
            return ScatterToTensorParallelRegion.apply(x, group)
        if _dim(self.input_layouts[0], x.dim()) != x.dim() - 1:
            raise ValueError(
                f"CocRowwiseParallel: input_layouts {self.input_layouts[0]} on a local tensor; a row-parallel linear "
                "takes its input sharded on the last dim (Shard(-1)) or replicated"
            )
        return x

    def _output_layout(self, x: torch.Tensor, world: int) -> tuple[int | None, Placement]:
        """``(the sequence dim the output is scattered along or None, the output's layout)``."""
        out = self.output_layouts[0]
        d = _dim(out, x.dim())
        if d is None:
            return None, out
        if d == x.dim() - 1:
            raise ValueError(f"CocRowwiseParallel: output_layouts {out} shards the output features; use Replicate()")
        return _sequence_layout(d, x.shape, world, "CocRowwiseParallel")

    def _pending(
        self,
        module: nn.Module,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
    ) -> Any:
        """The output left pending for the fused norm (``fuse_norm``), or None where that path does not apply."""
        if not (self.fuse_norm and self.use_local_output and self.fp8 is None and isinstance(module, nn.Linear)):
            return None
        if torch.is_autocast_enabled(x.device.type):
            return None
        return decode.defer(x, weight, bias, group)

    def _embedding_forward(
        self, mesh: DeviceMesh, inner: Any, module: nn.Embedding, ids: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        """The module's own forward (``inner``) on this rank's rows of the vocabulary, the token ids outside
        them looked up as row 0 and their outputs zeroed, then the partial outputs summed over the mesh:
        each token is kept by the one rank that holds its row, so what the forward does to each token after
        the lookup (Gemma's ``embed_scale``) is kept."""
        group = mesh_group(mesh)
        world, rank = mesh.size(), mesh.get_local_rank()
        ids = ids.full_tensor() if isinstance(ids, DTensor) else ids
        weight = local_of(module.weight)
        lo = _vocab_start(module.num_embeddings, world, rank)
        outside = (ids < lo) | (ids >= lo + weight.shape[0])
        local_ids = (ids - lo).masked_fill(outside, 0)
        pad = module.padding_idx
        saved = module._parameters["weight"], pad
        # Bypasses Module.__setattr__: the forward reads the local shard (and its padding row) for one call.
        module._parameters["weight"] = weight
        module.padding_idx = pad - lo if pad is not None and lo <= pad < lo + weight.shape[0] else None
        try:
            y = inner(local_ids, *args, **kwargs)
        finally:
            module._parameters["weight"], module.padding_idx = saved
        if not isinstance(y, torch.Tensor) or isinstance(y, DTensor) or y.shape[: ids.dim()] != ids.shape:
            raise TypeError(
                f"CocRowwiseParallel: {type(module).__name__}'s forward returned "
                f"{getattr(y, 'shape', type(y).__name__)} for token ids of shape {tuple(ids.shape)}; the "
                "vocabulary-parallel embedding needs one output per token (a plain tensor) to sum the ranks' rows"
            )
        partial = y.masked_fill(outside.view(*ids.shape, *[1] * (y.dim() - ids.dim())), 0)
        out = self.output_layouts[0]
        d = _dim(out, partial.dim())
        if d is not None:
            d, out = _sequence_layout(d, partial.shape, world, "CocRowwiseParallel(nn.Embedding)")
        y = _ReduceToLayout.apply(partial, group, d)
        return _wrap(y, mesh, out, self.use_local_output)

    def __repr__(self) -> str:
        return _linear_style_repr(self)


class CocSequenceParallel(ParallelStyle):
    """torch's ``SequenceParallel`` (same arguments, ``Replicate()`` DTensor parameters) for norms,
    dropout and other row-wise modules, run on the local rows.

    The input's layout: a DTensor's own; a plain tensor is this rank's ``Shard(sequence_dim)``
    rows (as torch's). The module runs on the local tensor with its parameters' local values; when
    the input is sequence-sharded, their gradients (each rank's rows only) are summed over the mesh
    in the backward, so the replicated norm weights train as in one process with nothing to add
    to the training loop. A replicated input (uneven sequence length) runs with no sum.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicate_param(module, name, param, device_mesh)
        return install_forward(module, functools.partial(self._forward, device_mesh, module.forward))

    def _forward(
        self, mesh: DeviceMesh, inner: Any, module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        group = mesh_group(mesh)
        x, layout = local_input(x, self.sequence_sharding[0])
        sharded = isinstance(layout, Shard)
        saved = dict(module._parameters)
        try:
            for name, p in saved.items():
                if isinstance(p, DTensor):
                    local = p.to_local()
                    # Bypasses Module.__setattr__: the forward reads a plain tensor for one call.
                    module._parameters[name] = AllReduceGrad.apply(local, group) if sharded else local
            y = inner(x, *args, **kwargs)
        finally:
            module._parameters.update(saved)
        return _wrap(y, mesh, layout, self.use_local_output)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sequence_dim={self.sequence_sharding[0].dim}, "
            f"use_local_output={self.use_local_output})"
        )


def share_input_gather(modules: list[nn.Module]) -> SharedGather:
    """Link column-parallel ``modules`` that always read the same input so that, with a sequence-sharded
    input, they share one all-gather (:mod:`autopar.tp.shared_gather`). Each must have been parallelized with
    ``CocColwiseParallel`` with the same layouts and recipe (output sharded on the features, not packed)."""
    if len(modules) < 2:
        raise ValueError(f"share_input_gather links two or more modules, got {len(modules)}")
    styles = [getattr(m, "_coc_style", None) for m in modules]
    if not all(isinstance(s, CocColwiseParallel) for s in styles):
        raise ValueError("share_input_gather: every module must be parallelized with CocColwiseParallel first")
    first = styles[0]
    for s in styles:
        if s.packed != 1 or repr(s) != repr(first):
            raise ValueError(f"share_input_gather: the modules' styles differ or are packed: {s!r} vs {first!r}")
    out = first.output_layouts[0]
    if not (isinstance(out, Shard) and out.dim == -1):
        raise ValueError(f"share_input_gather: the outputs must stay sharded on the features (Shard(-1)), got {out}")
    link = SharedGather(list(modules))
    for m in modules:
        m._coc_shared_gather = link
    return link
