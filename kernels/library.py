"""The ops as registered torch operators, namespace ``coc``.

Each public op of :mod:`kernels` validates its arguments, decides the backend and split count in
Python, then makes one call to an operator defined here::

    coc::all_gather_matmul(Tensor x, Tensor weight, Tensor? bias, str group_name, int world,
                           str backend, int parallel_num, int gather_dim=0) -> Tensor
    coc::all_gather_matmul_gathered(... same ...) -> (Tensor y, Tensor x_gathered)
    coc::all_gather_matmul_multi(Tensor x, Tensor[] weights, Tensor?[] biases, str group_name,
                                 int world, str backend, int parallel_num, int gather_dim=0,
                                 bool return_gathered=False) -> (Tensor[] ys, Tensor? x_gathered)
    coc::matmul_reduce_scatter(Tensor x, Tensor weight, Tensor? bias, str group_name, int world,
                               str backend, int parallel_num, bool deterministic,
                               int scatter_dim=0) -> Tensor
    coc::matmul_all_reduce(... same as matmul_reduce_scatter ...) -> Tensor
    coc::quantized_matmul_all_reduce(Tensor x, Tensor qweight, Tensor scale, Tensor? bias,
                                     Tensor? offset, str quant_mode, int group_size, str group_name,
                                     int world, str backend, int parallel_num, bool deterministic)
                                     -> Tensor

``x`` has any number of leading dims, and the outputs have them too; ``gather_dim`` /
``scatter_dim`` index ``x``'s dims (the last one, ``k``, excluded: the wrappers refuse it by name).
``matmul_all_reduce`` and the quantized op take 2-D ``x`` (leading dims are the wrapper's business).
The process group travels as its name (``ProcessGroup.group_name``, resolved inside the op as
torch's functional collectives do; ``""`` is "no group": a single process without
torch.distributed), so a traced graph holds a string
constant, not a Python object. ``world`` is passed because the fake implementations need it for
the output shapes, and they must not touch the process group. The backend and split count are
arguments too: decided before the call, they are constants of a compiled graph, which therefore
holds one opaque call per op whatever the backend does inside (async collectives, Triton
launches, host-side waits).

The operators are registered for every device (``CompositeExplicitAutograd``) with fake (meta)
implementations that give the outputs' shapes, dtypes and devices from the inputs alone, so
``torch.compile`` never runs an op to learn its output. They are forward-only; the autopar linears
put them inside autograd Functions. Outputs never alias inputs (a custom operator's contract):
where a backend would hand back its input (the gathered ``x`` of a group of one), the op copies.

Cost: the dispatcher adds about 2 µs per call over a direct Python call (``bench/host_cost.py``);
a ``torch.library.custom_op`` would add about 8 µs, which is why the schema is defined by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import backends, quant
from .op_registration import define_op, unaliased

_COMM = "str group_name, int world, str backend, int parallel_num"


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name an op resolves ``group`` by; ``""`` for no group without torch.distributed."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return ""
        group = dist.group.WORLD
    return group.group_name


def resolve_group(name: str) -> dist.ProcessGroup | None:
    """The process group an op was given by name (``None`` for ``""``)."""
    if not name:
        return None
    return dist.distributed_c10d._resolve_process_group(name)


def blocks_before(x: torch.Tensor, dim: int) -> int:
    """``outer``: how many row blocks of the flattened ``x`` are gathered / scattered on their own,
    the product of the dims before ``dim`` (1 for dim 0, and for an empty ``x``)."""
    outer = 1
    for size in x.shape[:dim]:
        outer *= size
    return outer if outer > 0 else 1


def _resized(shape: Sequence[int], dim: int, size: int, last: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    out[-1] = last
    return tuple(out)


def _gathered_shape(x: torch.Tensor, gather_dim: int, world: int, last: int) -> tuple[int, ...]:
    d = gather_dim % x.dim()
    return _resized(x.shape, d, x.shape[d] * world, last)


def _scattered_shape(x: torch.Tensor, scatter_dim: int, world: int, last: int) -> tuple[int, ...]:
    d = scatter_dim % x.dim()
    return _resized(x.shape, d, x.shape[d] // world, last)


def _all_gather_matmul_gathered(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    gather_dim: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    d = gather_dim % x.dim()
    y, x_gathered = backends.run(
        "all_gather_matmul",
        backend,
        parallel_num,
        x.flatten(0, -2),
        weight,
        bias,
        resolve_group(group_name),
        world,
        return_gathered=True,
        outer=blocks_before(x, d),
        comm_dim=d,
    )
    return (
        y.view(_gathered_shape(x, d, world, weight.shape[0])),
        unaliased(x_gathered, x).view(_gathered_shape(x, d, world, x.shape[-1])),
    )


def _all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    gather_dim: int = 0,
) -> torch.Tensor:
    d = gather_dim % x.dim()
    y = backends.run(
        "all_gather_matmul",
        backend,
        parallel_num,
        x.flatten(0, -2),
        weight,
        bias,
        resolve_group(group_name),
        world,
        return_gathered=False,
        outer=blocks_before(x, d),
        comm_dim=d,
    )
    return y.view(_gathered_shape(x, d, world, weight.shape[0]))


def _all_gather_matmul_multi(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    gather_dim: int = 0,
    return_gathered: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    d = gather_dim % x.dim()
    ys, x_gathered = backends.run_all_gather_multi(
        backend,
        parallel_num,
        x.flatten(0, -2),
        weights,
        biases,
        resolve_group(group_name),
        world,
        return_gathered=return_gathered,
        outer=blocks_before(x, d),
        comm_dim=d,
    )
    ys = [y.view(_gathered_shape(x, d, world, w.shape[0])) for y, w in zip(ys, weights, strict=True)]
    if not return_gathered:
        return ys, None
    return ys, unaliased(x_gathered, x).view(_gathered_shape(x, d, world, x.shape[-1]))


def _matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    deterministic: bool,
    scatter_dim: int = 0,
) -> torch.Tensor:
    d = scatter_dim % x.dim()
    if x.shape[d] % world:
        raise ValueError(f"matmul_reduce_scatter: x.shape[scatter_dim={d}]={x.shape[d]} is not divisible by W={world}")
    out = backends.run(
        "matmul_reduce_scatter",
        backend,
        parallel_num,
        x.flatten(0, -2),
        weight,
        bias,
        resolve_group(group_name),
        world,
        deterministic=deterministic,
        outer=blocks_before(x, d),
        comm_dim=d,
    )
    return out.view(_scattered_shape(x, d, world, weight.shape[0]))


def _matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    deterministic: bool,
) -> torch.Tensor:
    return backends.run(
        "matmul_all_reduce",
        backend,
        parallel_num,
        x,
        weight,
        bias,
        resolve_group(group_name),
        world,
        deterministic=deterministic,
    )


def _quantized_matmul_all_reduce(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    offset: torch.Tensor | None,
    quant_mode: str,
    group_size: int,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    deterministic: bool,
) -> torch.Tensor:
    groups = scale.shape[1] if quant_mode == "per_group" else 1
    spec = quant.QuantSpec(quant_mode, group_size, groups)
    return quant.matmul_all_reduce(
        x, qweight, scale, bias, spec, offset, resolve_group(group_name), world, deterministic, backend, parallel_num
    )


def _all_gather_matmul_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    gather_dim: int = 0,
) -> torch.Tensor:
    return x.new_empty(_gathered_shape(x, gather_dim, world, weight.shape[0]))


def _all_gather_matmul_gathered_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    gather_dim: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        x.new_empty(_gathered_shape(x, gather_dim, world, weight.shape[0])),
        x.new_empty(_gathered_shape(x, gather_dim, world, x.shape[-1])),
    )


def _all_gather_matmul_multi_fake(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    gather_dim: int = 0,
    return_gathered: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    ys = [x.new_empty(_gathered_shape(x, gather_dim, world, w.shape[0])) for w in weights]
    return ys, x.new_empty(_gathered_shape(x, gather_dim, world, x.shape[-1])) if return_gathered else None


def _matmul_reduce_scatter_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    deterministic: bool,
    scatter_dim: int = 0,
) -> torch.Tensor:
    return x.new_empty(_scattered_shape(x, scatter_dim, world, weight.shape[0]))


def _matmul_all_reduce_fake(x: torch.Tensor, weight: torch.Tensor, *_: Any) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _quantized_matmul_all_reduce_fake(x: torch.Tensor, qweight: torch.Tensor, *_: Any) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


all_gather_matmul = define_op(
    f"all_gather_matmul(Tensor x, Tensor weight, Tensor? bias, {_COMM}, int gather_dim=0) -> Tensor",
    _all_gather_matmul,
    _all_gather_matmul_fake,
)
all_gather_matmul_gathered = define_op(
    f"all_gather_matmul_gathered(Tensor x, Tensor weight, Tensor? bias, {_COMM}, int gather_dim=0) -> (Tensor, Tensor)",
    _all_gather_matmul_gathered,
    _all_gather_matmul_gathered_fake,
)
all_gather_matmul_multi = define_op(
    f"all_gather_matmul_multi(Tensor x, Tensor[] weights, Tensor?[] biases, {_COMM}, int gather_dim=0, "
    "bool return_gathered=False) -> (Tensor[], Tensor?)",
    _all_gather_matmul_multi,
    _all_gather_matmul_multi_fake,
)
matmul_reduce_scatter = define_op(
    f"matmul_reduce_scatter(Tensor x, Tensor weight, Tensor? bias, {_COMM}, bool deterministic, "
    "int scatter_dim=0) -> Tensor",
    _matmul_reduce_scatter,
    _matmul_reduce_scatter_fake,
)
matmul_all_reduce = define_op(
    f"matmul_all_reduce(Tensor x, Tensor weight, Tensor? bias, {_COMM}, bool deterministic) -> Tensor",
    _matmul_all_reduce,
    _matmul_all_reduce_fake,
)
quantized_matmul_all_reduce = define_op(
    "quantized_matmul_all_reduce(Tensor x, Tensor qweight, Tensor scale, Tensor? bias, Tensor? offset, "
    f"str quant_mode, int group_size, {_COMM}, bool deterministic) -> Tensor",
    _quantized_matmul_all_reduce,
    _quantized_matmul_all_reduce_fake,
)


def call(
    op: str,
    backend: str,
    parallel_num: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    *,
    return_gathered: bool = False,
    deterministic: bool = False,
) -> Any:
    """Call ``op``'s operator on ``x`` (``return_gathered`` applies to the all-gather op,
    ``deterministic`` to the reducing ops)."""
    if op == "all_gather_matmul":
        fn = all_gather_matmul_gathered if return_gathered else all_gather_matmul
        return fn(x, weight, bias, group_name, world, backend, parallel_num)
    return _OPS[op](x, weight, bias, group_name, world, backend, parallel_num, deterministic)


_OPS = {"matmul_reduce_scatter": matmul_reduce_scatter, "matmul_all_reduce": matmul_all_reduce}
