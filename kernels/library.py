"""The ops as registered torch operators, namespace ``coc``.

Each public op of :mod:`kernels` validates its arguments, decides the backend and split count in
Python, then makes one call to an operator defined here::

    coc::all_gather_matmul(Tensor x, Tensor weight, Tensor? bias, str group_name, int world,
                           str backend, int parallel_num) -> Tensor
    coc::all_gather_matmul_gathered(... same ...) -> (Tensor y, Tensor x_gathered)
    coc::matmul_reduce_scatter(Tensor x, Tensor weight, Tensor? bias, str group_name, int world,
                               str backend, int parallel_num, bool deterministic) -> Tensor
    coc::matmul_all_reduce(... same as matmul_reduce_scatter ...) -> Tensor
    coc::quantized_matmul_all_reduce(Tensor x, Tensor qweight, Tensor scale, Tensor? bias,
                                     Tensor? offset, str quant_mode, int group_size, str group_name,
                                     int world, str backend, int parallel_num, bool deterministic)
                                     -> Tensor

``x`` is 2-D (leading dims are the wrapper's business). The process group travels as its name
(``ProcessGroup.group_name``, resolved inside the op as torch's functional collectives do; ``""``
is "no group": a single process without torch.distributed), so a traced graph holds a string
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

from typing import Any

import torch
import torch.distributed as dist

from . import backends, quant

_LIB = torch.library.Library("coc", "FRAGMENT")

_COMM = "str group_name, int world, str backend, int parallel_num"
_LIB.define(f"all_gather_matmul(Tensor x, Tensor weight, Tensor? bias, {_COMM}) -> Tensor")
_LIB.define(f"all_gather_matmul_gathered(Tensor x, Tensor weight, Tensor? bias, {_COMM}) -> (Tensor, Tensor)")
_LIB.define(f"matmul_reduce_scatter(Tensor x, Tensor weight, Tensor? bias, {_COMM}, bool deterministic) -> Tensor")
_LIB.define(f"matmul_all_reduce(Tensor x, Tensor weight, Tensor? bias, {_COMM}, bool deterministic) -> Tensor")
_LIB.define(
    "quantized_matmul_all_reduce(Tensor x, Tensor qweight, Tensor scale, Tensor? bias, Tensor? offset, "
    f"str quant_mode, int group_size, {_COMM}, bool deterministic) -> Tensor"
)


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


def _all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
) -> torch.Tensor:
    return backends.run(
        "all_gather_matmul", backend, parallel_num, x, weight, bias, resolve_group(group_name), world, False
    )


def _all_gather_matmul_gathered(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, x_gathered = backends.run(
        "all_gather_matmul", backend, parallel_num, x, weight, bias, resolve_group(group_name), world, True
    )
    if x_gathered.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        # A group of one gathers nothing and the sequential path returns x itself; an operator's
        # output must not alias its input (autograd and compile assume fresh outputs).
        x_gathered = x_gathered.clone(memory_format=torch.contiguous_format)
    return y, x_gathered


def _matmul_reduce_scatter(
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
        "matmul_reduce_scatter", backend, parallel_num, x, weight, bias, resolve_group(group_name), world, deterministic
    )


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
        "matmul_all_reduce", backend, parallel_num, x, weight, bias, resolve_group(group_name), world, deterministic
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


_IMPLS = {
    "all_gather_matmul": _all_gather_matmul,
    "all_gather_matmul_gathered": _all_gather_matmul_gathered,
    "matmul_reduce_scatter": _matmul_reduce_scatter,
    "matmul_all_reduce": _matmul_all_reduce,
    "quantized_matmul_all_reduce": _quantized_matmul_all_reduce,
}
for _name, _impl in _IMPLS.items():
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")


@torch.library.register_fake("coc::all_gather_matmul", lib=_LIB)
def _all_gather_matmul_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
) -> torch.Tensor:
    return x.new_empty((world * x.shape[0], weight.shape[0]))


@torch.library.register_fake("coc::all_gather_matmul_gathered", lib=_LIB)
def _all_gather_matmul_gathered_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty((world * x.shape[0], weight.shape[0])), x.new_empty((world * x.shape[0], x.shape[1])))


@torch.library.register_fake("coc::matmul_reduce_scatter", lib=_LIB)
def _matmul_reduce_scatter_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    deterministic: bool,
) -> torch.Tensor:
    return x.new_empty((x.shape[0] // world, weight.shape[0]))


@torch.library.register_fake("coc::matmul_all_reduce", lib=_LIB)
def _matmul_all_reduce_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    backend: str,
    parallel_num: int,
    deterministic: bool,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("coc::quantized_matmul_all_reduce", lib=_LIB)
def _quantized_matmul_all_reduce_fake(
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
    return x.new_empty((x.shape[0], qweight.shape[0]))


all_gather_matmul = torch.ops.coc.all_gather_matmul.default
all_gather_matmul_gathered = torch.ops.coc.all_gather_matmul_gathered.default
matmul_reduce_scatter = torch.ops.coc.matmul_reduce_scatter.default
matmul_all_reduce = torch.ops.coc.matmul_all_reduce.default
quantized_matmul_all_reduce = torch.ops.coc.quantized_matmul_all_reduce.default


def call(
    op: str,
    backend: str,
    parallel_num: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    world: int,
    flag: bool,
) -> Any:
    """Call ``op``'s operator on 2-D ``x``; ``flag`` is ``return_gathered`` for the all-gather op
    and ``deterministic`` for the reducing ops."""
    if op == "all_gather_matmul":
        fn = all_gather_matmul_gathered if flag else all_gather_matmul
        return fn(x, weight, bias, group_name, world, backend, parallel_num)
    return _OPS[op](x, weight, bias, group_name, world, backend, parallel_num, flag)


_OPS = {"matmul_reduce_scatter": matmul_reduce_scatter, "matmul_all_reduce": matmul_all_reduce}
