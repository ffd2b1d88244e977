"""What a tp_plan leaves out (autopar/tp/hf_regions.py), on the families the sweep (bench/sweep/hf.py) found:

- Apertus: its MLP's learnable xIELU activation scalars sit between the column- and row-parallel linears; each
  rank's gradient was its shard's part (0.009 off one process, silently). Now summed over the ranks.
- Doge: its attention holds a per-head parameter the plan does not shard: refused by name (it failed inside the
  forward on a shape mismatch before).
- Bamba with sequence parallelism: its Mamba mixers hold linears the plan leaves whole: refused by name before
  anything is sharded (torch's mixed Tensor / DTensor error in the forward before).
- GLM-4-MoE with sequence parallelism: its MoE block holds a shared expert the plan shards: refused by name (the
  MoE block's sequence-parallel style crashed on it in torch's DTensor.from_local).
- Qwen3.5 and HRM with sequence parallelism: parameters outside the plan on the residual stream's path (Qwen3.5's
  gated-delta-net A_log / dt_bias / conv, HRM's model-level initial state) are refused by name before anything
  is sharded (they failed at the first forward before, on torch's mixed Tensor / DTensor error).
- A path no static check can see (here a hook adding a plain tensor) fails at the first forward with an error
  naming the cause (torch's bare mixed-layout error before).
"""

from __future__ import annotations

import pytest

from kernels.testing import run_ranks
from tests.autopar.tp.hf_cases import TOL, family_vs_one_process


def test_activation_parameters_in_a_sharded_region_get_the_summed_gradient() -> None:
    for rank, rows in enumerate(run_ranks(family_vs_one_process, 2, "apertus", [False, True], timeout=300)):
        for row in rows:
            alphas = {n: e for n, e in row["grads"].items() if "act_fn" in n}
            assert alphas, row["grads"]
            assert max(alphas.values()) < TOL and max(row["grads"].values()) < TOL, (rank, row["sp"], alphas)
            assert row["logits"] < TOL and not row["missing_grads"], (rank, row)


def _refusal(rank: int, world: int, family: str, sp: bool) -> str:
    import autopar
    from bench.sweep.hf import build

    try:
        autopar.parallelize_hf(build(family), sequence_parallel=sp)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("family", "sp", "words"),
    [
        ("doge", False, ["self_attn.A", "tensor-parallel region", "partial gradient"]),
        ("bamba", True, ["sequence_parallel=True", "mamba (BambaMixer)", "sequence_parallel=False"]),
        ("glm4_moe", True, ["Glm4MoeMoE", "shared_experts.gate_proj.weight", "sequence_parallel=False"]),
        ("qwen3_5_text", True, ["every parameter on the residual stream's path", "linear_attn.A_log"]),
        ("hrm_text", True, ["every parameter on the residual stream's path", "model.z_L_init"]),
    ],
)
def test_plans_that_leave_out_what_the_sharding_reaches_are_refused_by_name(
    family: str, sp: bool, words: list[str]
) -> None:
    for message in run_ranks(_refusal, 2, family, sp, timeout=300):
        assert all(w in message for w in words), message


def _first_forward(rank: int, world: int) -> str:
    import torch

    import autopar
    from tests.autopar.tp.hf_cases import build

    model = autopar.parallelize_hf(build("llama"), sequence_parallel=True)
    # A plain tensor added to the sequence-sharded stream by code no plan describes.
    model.model.layers[0].register_forward_hook(lambda module, args, out: out + torch.ones(out.shape[-1]))
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    try:
        model(input_ids=ids, labels=ids, use_cache=False)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_mixed_layout_at_the_first_forward_names_the_cause() -> None:
    for message in run_ranks(_first_forward, 2, timeout=300):
        assert "does not support sequence parallelism" in message and "sequence_parallel=False" in message, message
