"""Families of the installed transformers that declare a tp_plan and build from a tiny dense config (the list
below), parallelized with ``autopar.parallelize_hf`` at world 2 against one process: logits, loss and every gradient
(fp32, 1e-5: the same products summed in another order, :mod:`tests.autopar.tp.hf_cases`), sequence parallelism
off and on, on the default (sequential) backend.

What this catches: a style that drops a module's own computation (Gemma's scaled embedding lost its
``sqrt(hidden)`` under the row style's forward: logits 0.5 off) or a plan string mapped to the wrong layout.
"""

from __future__ import annotations

import pytest

from kernels.testing import BACKEND_ENVS, run_ranks
from tests.autopar.tp.hf_cases import TOL, family_vs_one_process

pytest.importorskip("transformers")

# (model_type, sequence parallelism settings); the embeddings of Gemma and Gemma2 scale their lookups in their
# own forward.
FAMILIES = [
    ("llama", [False, True]),
    ("mistral", [False, True]),
    ("qwen2", [False, True]),
    ("gemma", [False, True]),
    ("gemma2", [False, True]),
    ("vaultgemma", [False, True]),
    ("gpt2", [False, True]),
    ("phi3", [False, True]),
    ("glm", [False, True]),
    ("phi", [False, True]),
    ("cohere", [False, True]),
    ("starcoder2", [False, True]),
    ("granite", [False, True]),
    ("gpt_neox", [False, True]),
    ("qwen3", [False, True]),  # q / k norms: replicated_with_grad_allreduce
    ("gemma3_text", [False, True]),
    ("exaone4", [False, True]),
    ("smollm3", [False, True]),
    ("olmo2", [False, True]),  # q / k norms over all heads, beside colwise_gather_output q / k / v
    ("olmo3", [False, True]),
]
# Families whose parameters are not all DTensors under sequence parallelism: OLMo's q / k norms read the gathered
# (replicated) projections, so they stay plain tensors (exact; torch's clip_grad_norm_ refuses the mix).
MIXED_UNDER_SP = {"olmo2", "olmo3"}


# The families the other backends run (the issue's list: Gemma's scaled embedding, Qwen3's and OLMo's q / k norms,
# Phi-3's and GLM's split inputs, GPT-2's packed c_attn), with the environment that picks each backend.
BACKEND_FAMILIES = ["llama", "gemma", "gemma2", "qwen3", "phi3", "glm", "olmo2", "gpt2"]


@pytest.mark.parametrize(("family", "sps"), FAMILIES, ids=[f for f, _ in FAMILIES])
def test_family_matches_one_process(family: str, sps: list[bool]) -> None:
    _check_family(family, sps, "sequential", {})


@pytest.mark.parametrize("backend", list(BACKEND_ENVS))
@pytest.mark.parametrize("family", BACKEND_FAMILIES)
def test_family_on_the_other_backends(family: str, backend: str) -> None:
    _check_family(family, [False, True], backend, BACKEND_ENVS[backend])


def _check_family(family: str, sps: list[bool], backend: str, env: dict[str, str]) -> None:
    for rank, rows in enumerate(run_ranks(family_vs_one_process, 2, family, sps, env=env, timeout=300)):
        for row in rows:
            tag = f"{family} {backend} sp={row['sp']} rank {rank}"
            assert row["backends"] == [backend], (tag, row["backends"])
            worst = max(row["grads"].items(), key=lambda kv: kv[1])
            assert row["logits"] < TOL and row["loss"] < TOL, (tag, row["logits"], row["loss"])
            assert worst[1] < TOL, (tag, worst)
            assert not row["missing_grads"], (tag, row["missing_grads"])
            if row["sp"]:
                assert row["dtensor_params"] == (family not in MIXED_UNDER_SP), tag


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_explicit_plan_with_sequence_parallelism_gets_the_norm_entries(family: str) -> None:
    """``parallelize_hf(model, sequence_parallel=True, plan=model.tp_plan)``: the norms' sequence-parallel entries
    (and GPT-2's position embedding) are added as without ``plan=``. Before: the explicit plan dropped them and
    the forward raised on a DTensor beside a plain tensor."""
    for rank, rows in enumerate(run_ranks(family_vs_one_process, 2, family, [True], True, timeout=300)):
        for row in rows:
            assert row["logits"] < TOL and row["loss"] < TOL, (family, rank, row["logits"], row["loss"])
            assert max(row["grads"].values()) < TOL and not row["missing_grads"], (family, rank)
            assert row["dtensor_params"], (family, rank)


@pytest.mark.parametrize(("family", "embedding"), [("llama", "embed_tokens"), ("gpt_neox", "embed_in")])
def test_plan_without_the_input_embedding_under_sequence_parallelism(family: str, embedding: str) -> None:
    """A plan that does not name the input embedding (transformers 5.17's own plans: it added ``embed_tokens``
    later; GPT-NeoX's ``embed_in``) gets it under sequence parallelism: the residual stream is sequence-sharded from
    the embedding on. Before: the first norm took each rank's full embedding output for its sequence shard, and
    the attention saw the sequence twice (a size error in these families, silently wrong where nothing checks)."""
    for rank, rows in enumerate(run_ranks(family_vs_one_process, 2, family, [True], True, drop=embedding, timeout=300)):
        for row in rows:
            assert row["logits"] < TOL and row["loss"] < TOL, (family, rank, row["logits"], row["loss"])
            assert max(row["grads"].values()) < TOL and not row["missing_grads"], (family, rank)
