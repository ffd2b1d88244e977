"""The weight gradient of the linear Functions: plain, into ``main_grad`` (gradient accumulation fusion) or
deferred (Megatron's deferred embedding wgrad)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

try:  # Apex's fused wgrad GEMM; Megatron uses it for gradient_accumulation_fusion on CUDA.
    import fused_weight_gradient_mlp_cuda  # type: ignore[import-not-found]
except ImportError:
    fused_weight_gradient_mlp_cuda = None

# As Megatron: the backward runs under the autocast state of the forward.
custom_fwd = functools.partial(torch.amp.custom_fwd, device_type="cuda")
custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="cuda")


@dataclass(frozen=True)
class WgradOptions:
    """How the weight gradient is delivered (Megatron's semantics)."""

    gradient_accumulation_fusion: bool = False
    grad_output_buffer: list | None = None
    wgrad_deferral_limit: int = 0


def main_grad_for(weight: torch.Tensor, opts: WgradOptions) -> torch.Tensor | None:
    if not opts.gradient_accumulation_fusion:
        return None
    return getattr(weight, "main_grad", None)


def defer_wgrad(grad_y: torch.Tensor, opts: WgradOptions) -> bool:
    """Megatron's deferred embedding wgrad: stash grad_y for the caller, skip the GEMM here."""
    buf = opts.grad_output_buffer
    if buf is None:
        return False
    if opts.wgrad_deferral_limit == 0 or len(buf) < opts.wgrad_deferral_limit:
        buf.append(grad_y)
        return True
    return False


def weight_grad(ctx: Any, grad_y2d: torch.Tensor | None, x_tokens: Any) -> torch.Tensor | None:
    """``grad_w = grad_y2d.T @ x`` returned (the operand format's GEMM, ``ctx.ops``), or added into
    ``weight.main_grad``.

    ``grad_y2d`` is None when the GEMM was deferred (the caller computes it later); ``x_tokens`` is what the
    format's ``wgrad_input`` made of the input.
    """
    opts, main_grad, weight = ctx.wgrad_opts, ctx.main_grad, ctx.weight_param
    if not opts.gradient_accumulation_fusion:
        if grad_y2d is None:
            return None
        return ctx.ops.wgrad_gemm(grad_y2d, x_tokens, ctx.weight_dtype)
    # Gradient accumulation fusion runs with plain operands only (LinearOptions refuses it with FP8).
    x2d = x_tokens.reshape(-1, x_tokens.shape[-1]) if x_tokens is not None else None
    if main_grad is None:
        raise RuntimeError(
            "gradient_accumulation_fusion=True needs weight.main_grad (the buffer the "
            "weight gradient is added into, e.g. allocated by Megatron's "
            "DistributedDataParallel); this weight had none at forward time"
        )
    # A module reused across layers (e.g. MTP logits) may have its main_grad swapped between
    # forward and backward; Megatron restores the one captured at forward time.
    weight.main_grad = main_grad
    if grad_y2d is not None:
        if main_grad.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise RuntimeError(
                f"Unsupported gradient type for gradient accumulation fusion: main_grad dtype {main_grad.dtype}"
            )
        if fused_weight_gradient_mlp_cuda is not None and main_grad.is_cuda:
            if main_grad.dtype == torch.float32:
                fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x2d, grad_y2d, main_grad)
            else:
                fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(x2d, grad_y2d, main_grad)
        else:
            # Products of low-precision values are exact in fp32, so casting the operands up
            # first gives what Apex's fp32-accumulating GEMM gives.
            main_grad.addmm_(grad_y2d.t().to(main_grad.dtype), x2d.to(main_grad.dtype))
    if hasattr(weight, "grad_added_to_main_grad"):
        # Megatron's DDP with overlap_grad_reduce expects a (dummy) gradient so that its hooks run
        # on the main backward thread, and reads the flag to skip adding .grad to main_grad.
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        weight.grad_added_to_main_grad = True
        return make(main_grad.shape, dtype=x2d.dtype if x2d is not None else weight.dtype, device=main_grad.device)
    return None


def autocast_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """Operands in the autocast dtype when autocast is on for their device.

    A plain ``torch.matmul`` would be autocast by torch; the kernels ops check that x, weight and
    bias share one dtype, so the cast that autocast would apply to the GEMM is made explicit.
    """
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    return (x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None)


def track_main_grad(ctx: Any, weight: torch.Tensor, wgrad_opts: WgradOptions) -> None:
    """What the weight gradient needs of the forward: the options and, with gradient accumulation fusion,
    the parameter itself (main_grad and Megatron's DDP flags live on it, not on a cast copy)."""
    ctx.weight_param = weight if wgrad_opts.gradient_accumulation_fusion else None
    ctx.main_grad = main_grad_for(weight, wgrad_opts)
    ctx.wgrad_opts = wgrad_opts


def wgrad_and_bias_grad(
    ctx: Any, grad_y2d: torch.Tensor | None, x_tokens: Any, grad_b_rows: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_w, grad_b)`` as the Function's inputs need them; ``grad_b_rows`` is summed over rows."""
    need_w, need_b = ctx.needs_input_grad[1:3]
    grad_w = weight_grad(ctx, grad_y2d, x_tokens) if need_w else None
    grad_b = grad_b_rows.sum(dim=0).to(ctx.bias_dtype) if (ctx.has_bias and need_b) else None
    return grad_w, grad_b
