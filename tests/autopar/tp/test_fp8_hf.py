"""The FP8 recipe on the CoC styles: a tiny Hugging Face Llama parallelized with ``autopar.parallelize_hf(...,
fp8=autopar.Fp8Recipe())`` at W = 2, sequence parallelism off and on.

Compared as tests/autopar/tp/test_fp8_linear.py compares the linears: against the same FP8 operands, here a
one-process run of the same recipe (the same styles on a mesh of one rank). Every sharded size is a multiple
of 128 (hidden, q/k/v/o and MLP widths, vocabulary: 256; W = 2 gives shards of 128), so the 1 x 128
activation / gradient blocks and the 128 x 128 weight blocks of the shards are exactly blocks of the whole
tensors, and both runs quantize the same values in the same blocks: they differ by fp32 summation order and
by what a rounding flip of an intermediate costs (one FP8 step of one element), hence test_fp8_linear.py's
1e-2 relative in norm. Against one process without FP8 the gap is FP8's rounding itself: a GEMM of two
quantized operands is within 2 u8 + u8^2 = 12.9 % of sum |x||w| (docs/fp8.md, e4m3fn) and about 5 % in
norm for random signs; the checks below only bound it loosely (0.25, far below the O(1) of a misplaced shard
or a missing reduction) and require it to be there (above 1e-4, where fp32 summation order is 1e-7).
A spy on the public ``kernels`` ops shows the FP8 ops ran and no bf16 op did.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from kernels.testing import run_ranks
from tests.autopar.tp.hf_cases import build
from tests.autopar.tp.spies import PLAIN_OPS, public_op_counter

pytest.importorskip("transformers")

B, S, STEPS, LR = 2, 8, 2, 0.1
SIZES = dict(
    hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, vocab_size=256
)  # every shard 128 wide at W = 2: whole FP8 blocks
SAME_RECIPE = 1e-2  # tests/autopar/tp/test_fp8_linear.py: rounding flips of intermediates, in norm
FP8_VS_FP32 = (1e-4, 0.25)  # FP8's own rounding must show, and stay far from a sharding error's O(1)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double()


def _train(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """Logits, loss and gradients of the first step; the parameters after STEPS SGD steps; the FP8 op calls
    of the first forward and of the first backward."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {}
    for step in range(STEPS):
        with public_op_counter() as fwd_calls:
            result = model(input_ids=ids, labels=ids)
        with public_op_counter() as bwd_calls:
            result.loss.backward()
        if step == 0:
            out.update(logits=_full(result.logits), loss=_full(result.loss), fwd=fwd_calls, bwd=bwd_calls)
            out["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    model(input_ids=ids)  # quantizes the stepped weights once more
    cache = getattr(model.model.layers[0].self_attn.q_proj, "fp8_cache", None)
    out["quantizations"] = None if cache is None else cache.quantizations
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def fp8_llama_rank(rank: int, world: int, sp: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    base = build("llama", layers=1, **SIZES)
    ids = torch.randint(1, SIZES["vocab_size"], (B, S), generator=torch.Generator().manual_seed(1))
    one_rank = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))["tp"]
    all_ranks = init_device_mesh("cpu", (world,))
    runs = {"fp32": _train(copy.deepcopy(base), ids)}
    for name, mesh in (("fp8_one_rank", one_rank), ("fp8", all_ranks)):
        model = autopar.parallelize_hf(copy.deepcopy(base), mesh, sequence_parallel=sp, fp8=autopar.Fp8Recipe())
        runs[name] = _train(model, ids)
    got = runs["fp8"]
    errors: dict[str, dict[str, float]] = {}
    for ref in ("fp8_one_rank", "fp32"):
        want = runs[ref]
        errors[ref] = {
            "logits": _rel(got["logits"], want["logits"]),
            "loss": _rel(got["loss"], want["loss"]),
            "grads": max(_rel(g, want["grads"][n]) for n, g in got["grads"].items()),
            "params": max(_rel(p, want["params"][n]) for n, p in got["params"].items()),
        }
    return {
        "errors": errors,
        "fwd": dict(got["fwd"]),
        "bwd": dict(got["bwd"]),
        "quantizations": got["quantizations"],
    }


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_fp8_llama_matches_one_process_of_the_same_recipe(sp: bool) -> None:
    for res in run_ranks(fp8_llama_rank, 2, sp, timeout=600):
        same, fp32 = res["errors"]["fp8_one_rank"], res["errors"]["fp32"]
        assert max(same.values()) < SAME_RECIPE, res
        lo, hi = FP8_VS_FP32
        assert lo < fp32["logits"] < hi and lo < fp32["grads"] < hi and fp32["loss"] < hi, res
        fwd, bwd = res["fwd"], res["bwd"]
        assert not any(fwd.get(op) or bwd.get(op) for op in PLAIN_OPS), res  # no bf16 GEMM of a linear ran
        if sp:
            # One gather for q/k/v and one for gate/up (shared: a list of FP8 weights), one for lm_head;
            # o_proj and down_proj reduce-scatter.
            assert fwd == {"all_gather_scaled_matmul": 3, "scaled_matmul_reduce_scatter": 2}, res
            # dgrads: the row layers' gradient gathered (FP8), lm_head's reduce-scattered; the shared ones
            # multiply locally (fp32 partials) and reduce-scatter once.
            assert bwd["all_gather_scaled_matmul"] == 2 and bwd["scaled_matmul_reduce_scatter"] == 1, res
        else:
            assert fwd == {"scaled_matmul": 6, "scaled_matmul_all_reduce": 2}, res
            assert bwd["scaled_matmul_all_reduce"] == 6, res
        # Quantized once per forward: the first, the one after each of the STEPS optimizer steps.
        assert res["quantizations"] == STEPS + 1, res
