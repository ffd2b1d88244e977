"""Gradient synchronization by "Partial -> the parameter's placements" (Paddle PR 59057).

After ``loss.backward()`` a parameter's gradient is a DistTensor that is Partial on exactly the
mesh dims on which the parameter met sharded data it does not itself shard: the batch dim for data
parallel, the sequence dim for sequence parallel, the context dim for context parallel, an output
column for tensor parallel, whichever tensor dim that is. :func:`sync_gradients` reshards each
gradient to its parameter's placements, which all-reduces (or reduce-scatters) over those mesh dims
and nothing else. No tensor dim is assumed to be "the batch".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .autograd import reshard_nograd
from .placements import Partial, Replicate
from .tensor import DistTensor, make


def _collect(module_or_params: torch.nn.Module | Iterable) -> list[DistTensor]:
    if isinstance(module_or_params, DistTensor):
        items: Iterable = [module_or_params]
    elif isinstance(module_or_params, torch.nn.Module):
        # Registered parameters, and DistTensors set as plain attributes (not nn.Parameter).
        items = list(module_or_params.parameters()) + [v for m in module_or_params.modules() for v in vars(m).values()]
    else:
        items = module_or_params
    seen, out = set(), []
    for p in items:
        if isinstance(p, DistTensor) and p.requires_grad and p.is_leaf and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def sync_gradients(module_or_params: torch.nn.Module | Iterable | DistTensor) -> list[tuple[str, ...]]:
    """Reshard every DistTensor parameter's gradient to the parameter's placements.

    ``module_or_params``: a module (its DistTensor parameters and attributes, recursively), or
    DistTensors. Then ``optimizer.step()`` updates each parameter's local piece.
    Gradients that only need all-reduces are coalesced into one flat buffer per (mesh, layout,
    dtype), so a model costs a few collectives, not one per parameter. Returns, per parameter, the
    names of the mesh dims that were reduced (empty when nothing was to do).
    """
    params = _collect(module_or_params)
    reduced: list[tuple[str, ...]] = []
    buckets: dict[tuple, list[DistTensor]] = {}
    for p in params:
        g = p.grad
        if g is None or g.placements == p.placements:
            reduced.append(())
            continue
        diff = [m for m, (a, b) in enumerate(zip(g.placements, p.placements, strict=False)) if a != b]
        reduced.append(tuple(p.process_mesh.dim_names[m] for m in diff if isinstance(g.placements[m], Partial)))
        all_reduce_only = all(
            isinstance(g.placements[m], Partial)
            and g.placements[m].reduce_op == "sum"
            and isinstance(p.placements[m], Replicate)
            for m in diff
        )
        if all_reduce_only and g.is_initialized():
            buckets.setdefault((p.process_mesh, g.placements, p.placements, g.dtype), []).append(p)
        else:
            p.grad = reshard_nograd(g, p.placements)
    for (mesh, g_pl, p_pl, dtype), ps in buckets.items():
        flat = torch.cat([p.grad._local.reshape(-1) for p in ps])
        flat_pl = tuple(pl if isinstance(pl, Partial) else Replicate() for pl in g_pl)
        dst_pl = tuple(Replicate() for _ in p_pl)
        # The flat buffer is elementwise-aligned across ranks (same local shapes along every
        # reduced mesh dim), so one all-reduce per reduced mesh dim serves every parameter.
        flat_dt = make(flat, mesh, flat_pl, flat.shape, dtype)
        flat = reshard_nograd(flat_dt, dst_pl)._local
        offset = 0
        for p in ps:
            local = p.grad._local
            n = local.numel()
            p.grad = make(flat[offset : offset + n].view_as(local), mesh, p.placements, p.shape, dtype)
            offset += n
    return reduced


def attach_local_grads(module_or_params: torch.nn.Module | Iterable | DistTensor) -> list[torch.Tensor]:
    """Expose synced gradients to an optimizer built over the local pieces.

    Not needed with ``torch.optim`` on the DistTensor parameters themselves (they are tensors);
    this serves code that keeps an optimizer over the local pieces (``p.to_local()`` under
    ``torch.no_grad()``: with grad mode on it is a tracked view, as DTensor's). It sets each
    local piece's ``.grad`` to the local piece of ``p.grad`` (call it after
    :func:`sync_gradients`) and returns the local pieces, in order. Ranks outside a parameter's
    mesh get zero-element pieces, which optimizers skip harmlessly.
    """
    locals_ = []
    for p in _collect(module_or_params):
        local = p._local
        if p.grad is not None and p.is_initialized():
            if p.grad.placements != p.placements:
                raise ValueError(
                    f"attach_local_grads: the gradient is {list(p.grad.placements)} "
                    f"but the parameter is {list(p.placements)}; call "
                    f"sync_gradients first"
                )
            local.grad = p.grad._local
        locals_.append(local)
    return locals_
