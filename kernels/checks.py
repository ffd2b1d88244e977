"""Argument validation shared by every op: one rule, one message, whichever backend runs."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import BACKENDS, PARALLEL_NUMS, env_value


def check_launched_alone() -> None:
    """Without an initialized default group, refuse to run as a group of one where the environment says
    the job has more processes (``WORLD_SIZE`` > 1, as torchrun sets it): every rank would return its
    own unreduced partial, with the right shape."""
    raw = (env_value("WORLD_SIZE") or "").strip()
    if raw.isdigit() and int(raw) > 1:
        raise RuntimeError(
            f"torch.distributed is not initialized but WORLD_SIZE={raw} in the environment (a launcher such as "
            "torchrun started several processes): without a process group each rank would compute alone and "
            "return its own partial result. Call torch.distributed.init_process_group(...) before the first op "
            "or layer, or unset WORLD_SIZE (or set it to 1) to run a single process"
        )


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 when torch.distributed is not initialized and no group is given (refused
    by :func:`check_launched_alone` when the environment says the job has several processes)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        check_launched_alone()
        return 1
    return dist.get_world_size(group)


def check_group(group: object) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")


def world_of(group: object) -> int:
    """The size of the group an op communicates over, after checking ``group`` itself (these errors
    raise on this rank alone: without a valid group there is nobody to tell)."""
    check_group(group)
    return group_size(group)  # type: ignore[arg-type]


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


def check_options(backend: object, parallel_num: object, flag_name: str, flag: object) -> None:
    """The options every communicating op takes: ``backend``, ``parallel_num`` and its bool flag
    (``return_gathered`` or ``deterministic``)."""
    check_backend(backend)
    check_parallel_num(parallel_num)
    check_flag(flag_name, flag)


def check_input_k(x: object, k: int, *, name: str, expected: str) -> None:
    """A layer's input ``[..., k]`` checked before the layer flattens it to rows, so the error
    names the shape the caller passed. ``expected`` says where ``k`` comes from, e.g.
    ``"weight has k=6 (shape (4, 6))"``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != k:
        got = x.shape[-1] if x.dim() else None
        raise ValueError(f"k mismatch: {name} has k={got} (shape {tuple(x.shape)}) but {expected}")


def k_mismatch_message(x: torch.Tensor, weight: torch.Tensor, weight_name: str = "weight") -> str:
    """The error for ``weight [n, k]`` whose ``k`` is not ``x``'s last dim; a weight given as
    ``[k, n]`` (the ``x @ weight`` layout) gets the hint to pass its transpose."""
    k = x.shape[-1]
    message = (
        f"k mismatch: x has k={k} (shape {tuple(x.shape)}) but {weight_name} has k={weight.shape[1]} "
        f"(shape {tuple(weight.shape)}); {weight_name} must be [n, k] (the torch.nn.functional.linear layout)"
    )
    if weight.dim() == 2 and weight.shape[0] == k:
        message += f": {weight_name} looks like [k, n] (the x @ w layout), pass {weight_name}.T"
    return message


def normalize_dim(name: str, dim: object, x: torch.Tensor) -> int:
    """``dim`` (``gather_dim`` / ``scatter_dim``) as a non-negative index of ``x``'s dims.

    Negative values count from the end as in torch. The last dim is ``k``, the contracted one,
    which a gather or scatter cannot split, so it is refused by name.
    """
    if type(dim) is not int:
        raise TypeError(f"{name} must be an int, got {dim!r}")
    ndim = x.dim()
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for x of shape {tuple(x.shape)} (valid: {-ndim} .. {ndim - 2})")
    d = dim % ndim
    if d == ndim - 1:
        raise ValueError(
            f"{name}={dim} is the last dim of x (shape {tuple(x.shape)}), the contracted k dim of the GEMM; "
            f"use a dim in {-ndim} .. {ndim - 2}"
        )
    return d


def check_matmul_operands(
    x: object,
    weight: object,
    bias: object,
    *,
    weight_dtypes: tuple = (),
    weight_name: str = "weight",
    bias_name: str = "bias",
) -> None:
    """``x [..., k]``, ``weight [n, k]``, ``bias [n]`` or None: same device, same dtype.

    ``weight_dtypes`` lists extra weight dtypes allowed besides ``x.dtype`` (int8 for w8A16);
    ``weight_name`` / ``bias_name`` name them in messages (``weight[1]`` for one of a list).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{weight_name} must be a torch.Tensor, got {type(weight).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims [..., k], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(
            f"{weight_name} must be 2-D [n, k] (torch.nn.functional.linear layout), got shape {tuple(weight.shape)}"
        )
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(k_mismatch_message(x, weight, weight_name))
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if weight.dtype != x.dtype and weight.dtype not in weight_dtypes:
        raise TypeError(f"{weight_name} dtype {weight.dtype} does not match x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{weight_name} is on {weight.device} but x is on {x.device}")
    if bias is not None:
        _check_bias(bias, x, weight, weight_name, bias_name)
    _check_forward_only((("x", x), (weight_name, weight), (bias_name, bias)))


def _check_bias(bias: object, x: torch.Tensor, weight: torch.Tensor, weight_name: str, bias_name: str) -> None:
    """A bias is added to the GEMM's output ``[..., n]``: one entry per weight row, in x's dtype and device."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{bias_name} must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias.shape != (weight.shape[0],):
        raise ValueError(
            f"{bias_name} must have shape ({weight.shape[0]},) = [n] of {weight_name}, got {tuple(bias.shape)}"
        )
    if bias.dtype != x.dtype:
        raise TypeError(f"{bias_name} dtype {bias.dtype} does not match x dtype {x.dtype}")
    if bias.device != x.device:
        raise ValueError(f"{bias_name} is on {bias.device} but x is on {x.device}")


def _check_forward_only(named_operands: tuple[tuple[str, object], ...]) -> None:
    """Refuse operands that require grad while autograd records: the ops have no backward."""
    needs_grad = [name for name, t in named_operands if isinstance(t, torch.Tensor) and t.requires_grad]
    if torch.is_grad_enabled() and needs_grad:
        # The collectives inside are not differentiable; returning a detached result would drop
        # gradients silently. The autopar linears wrap these ops in autograd Functions.
        raise TypeError(
            f"kernels ops are forward-only and {', '.join(needs_grad)} requires grad; call them under "
            "torch.no_grad() or inside an autograd.Function (as autopar's linears do)"
        )
