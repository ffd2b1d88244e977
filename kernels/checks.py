"""Argument validation shared by every op: one rule, one message, whichever backend runs."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import BACKENDS, PARALLEL_NUMS


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 when torch.distributed is not initialized and no group is given."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def check_group(group: object) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")


def check_backend(backend: object) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not accepted; use None or one of {BACKENDS}")


def check_parallel_num(parallel_num: object) -> None:
    # 2.0 == 2 would pass the membership test, then break the integer split arithmetic downstream.
    if parallel_num is not None and (type(parallel_num) is not int or parallel_num not in PARALLEL_NUMS):
        raise ValueError(f"parallel_num={parallel_num!r} is not accepted; use None or one of {PARALLEL_NUMS}")


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_input_k(x: object, k: int, *, name: str, expected: str) -> None:
    """A layer's input ``[..., k]`` checked before the layer flattens it to rows, so the error
    names the shape the caller passed. ``expected`` says where ``k`` comes from, e.g.
    ``"weight has k=6 (shape (4, 6))"``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != k:
        got = x.shape[-1] if x.dim() else None
        raise ValueError(f"k mismatch: {name} has k={got} (shape {tuple(x.shape)}) but {expected}")


def check_matmul_operands(x: object, weight: object, bias: object, *, weight_dtypes: tuple = ()) -> None:
    """``x [..., k]``, ``weight [n, k]``, ``bias [n]`` or None: same device, same dtype.

    ``weight_dtypes`` lists extra weight dtypes allowed besides ``x.dtype`` (int8 for w8A16).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims [..., k], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be 2-D [n, k] (torch.nn.functional.linear layout), got shape {tuple(weight.shape)}"
        )
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"k mismatch: x has k={x.shape[-1]} (shape {tuple(x.shape)}) but weight has "
            f"k={weight.shape[1]} (shape {tuple(weight.shape)})"
        )
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if weight.dtype != x.dtype and weight.dtype not in weight_dtypes:
        raise TypeError(f"weight dtype {weight.dtype} does not match x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},) = [n], got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias dtype {bias.dtype} does not match x dtype {x.dtype}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
    needs_grad = [
        name
        for name, t in (("x", x), ("weight", weight), ("bias", bias))
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    if torch.is_grad_enabled() and needs_grad:
        # The collectives inside are not differentiable; returning a detached result would drop
        # gradients silently. The autopar linears wrap these ops in autograd Functions.
        raise TypeError(
            f"kernels ops are forward-only and {', '.join(needs_grad)} requires grad; call them under "
            "torch.no_grad() or inside an autograd.Function (as autopar's linears do)"
        )
