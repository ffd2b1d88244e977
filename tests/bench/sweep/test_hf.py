"""``python -m bench --mode hf-sweep`` (bench/sweep/hf.py) on a fixed subset of transformers families: every row
matches one process (1e-5, fp32) or is a named refusal, never ``wrong`` or ``error``, and the Markdown table is
written. The status rules themselves (what counts as wrong, refused, skipped) on made-up rows.

The sweep is the one implementation; tests/autopar/tp/test_hf_families.py checks more per family (every parameter
a DTensor, the backend each call ran on) for the families listed there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from bench.__main__ import build_parser  # noqa: E402
from bench.sweep import hf, hf_report  # noqa: E402

# Gemma / Gemma2: scaled embeddings; Qwen3: q / k norms (replicated_with_grad_allreduce); Phi-3 / GLM: split
# inputs under SP; OLMo2: q / k norms over all heads; GPT-2: autopar's own plan (packed c_attn); Llama: the plain
# plan; granite_swa: a named refusal ("local_params"). The other plain families (Qwen2, Mistral, Granite, Cohere)
# take the sweep's path Llama takes; tests/autopar/tp/test_hf_families.py checks each of them.
FAMILIES = [
    "gemma",
    "gemma2",
    "qwen3",
    "phi3",
    "glm",
    "olmo2",
    "gpt2",
    "llama",
    "granite_swa",
]


def _assert_no_failure(rows: list[dict]) -> None:
    bad = [(r["family"], r.get("backend"), r.get("sp"), r["status"], r.get("detail")) for r in hf.failed(rows)]
    assert not bad, bad


def test_sweep_subset_matches_one_process_or_refuses_by_name(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["--mode", "hf-sweep", "--families", ",".join(FAMILIES), "--backends", "sequential", "--world-size", "2"]
        + ["--out-dir", str(tmp_path), "--name", "out"]
    )
    assert hf.main(args) == 0
    doc = json.loads((tmp_path / "out.json").read_text())
    rows = doc["rows"]
    _assert_no_failure(rows)
    assert {(r["family"], r["sp"]) for r in rows} == {(f, sp) for f in FAMILIES for sp in (False, True)}
    assert all(r["status"] == "ok" for r in rows if r["family"] != "granite_swa"), rows
    refused = [r for r in rows if r["family"] == "granite_swa"]
    assert all(r["status"] == "refused" and "local_params" in r["detail"] for r in refused), refused
    assert all(r["ran"] == ["sequential"] for r in rows if r["status"] == "ok")
    table = (tmp_path / "out.md").read_text()
    assert "| family | sequential, SP off | sequential, SP on |" in table
    for family in FAMILIES:
        assert f"| {family} |" in table, family
    assert "refused [1]" in table and "local_params" in table
    assert doc["summary"]["families"]["ok"] == sorted(set(FAMILIES) - {"granite_swa"})


def test_sweep_on_the_chunked_backend() -> None:
    rows = hf.sweep(["qwen3"], backends=("chunked",), timeout=300)
    _assert_no_failure(rows)
    assert [(r["sp"], r["status"], r["ran"]) for r in rows] == [(False, "ok", ["chunked"]), (True, "ok", ["chunked"])]


def test_families_are_enumerated_with_the_reasons_to_skip() -> None:
    families = hf.causal_lm_families()
    assert set(FAMILIES) <= set(families)
    assert "bert" not in families  # no plan
    assert hf.skip_reason("mixtral") is None  # mixtures of experts are swept (moe_tp_experts)
    assert hf.skip_reason("llama4").startswith("multimodal")
    assert hf.skip_reason("llama") is None


def _row(family: str, status: str, **fields: object) -> dict:
    return {"family": family, "backend": "sequential", "sp": False, "status": status, **fields}


def test_status_rules() -> None:
    noise = {"logits": 0.0, "loss": 0.0, "grads": 0.0}
    one = (_t(0.0), _t(1.0), {"w": _t(0.0), "frozen": None})
    assert hf._compare(one, one, noise)["status"] == "ok"
    off = (_t(0.0), _t(1.0), {"w": _t(2e-5), "frozen": None})
    assert hf._compare(off, one, noise)["status"] == "wrong"
    noisy = hf._compare(off, one, {"logits": 0.0, "loss": 0.0, "grads": 1e-5})
    assert noisy["status"] == "ok" and noisy["within_noise_only"]
    missing = (_t(0.0), _t(1.0), {"w": None, "frozen": None})
    assert hf._compare(missing, one, noise)["missing_grads"] == ["w"]
    assert hf._compare(missing, one, noise)["status"] == "wrong"
    rows = [
        _row("a", "ok", logits=0.0, grads=0.0, ran=["sequential"]),
        _row("b", "refused", detail="ValueError: tp_plan style 'x' has no CoC equivalent. Supported: y"),
        _row("c", "wrong", logits=0.5, grads=0.0, ran=["sequential"]),
        _row("d", "error", detail="RuntimeError: boom"),
        {"family": "e", "status": "skipped", "detail": hf.ONE_PROCESS},
    ]
    assert [r["family"] for r in hf.failed(rows)] == ["c", "d"]
    want = {"a": "ok", "b": "refused", "c": "wrong", "d": "error", "e": "skipped"}
    assert hf_report.family_status(rows) == want
    meta = {"argv": ["bench", "--mode", "hf-sweep"], "date_utc": "2026-01-01T00:00:00Z", "versions": {"torch": "x"}}
    text = hf_report.markdown(rows, backends=("sequential",), meta=meta)
    assert "**WRONG** 5.0e-01" in text and "refused [1]" in text and "error [2]" in text
    assert "1. refused: ValueError: tp_plan style 'x' has no CoC equivalent (b)" in text
    assert f"- {hf.ONE_PROCESS} (1): e" in text


def _t(value: float):
    import torch

    return torch.full((2,), value)


def test_tiny_configs_cap_the_expert_counts() -> None:
    """The MoE families' tiny configs keep at most 4 experts, top-2 (their defaults: 60 experts, top-4, for
    Qwen2-MoE); fields a family's config does not have are not added, and a dense family is unchanged."""
    import transformers

    moe = hf.tiny_config("qwen2_moe")
    default = transformers.AutoConfig.for_model("qwen2_moe")
    assert default.num_experts > 4 and (moe.num_experts, moe.num_experts_per_tok) == (4, 2)
    assert moe.moe_intermediate_size == 32 and not hasattr(moe, "n_routed_experts")
    mixtral = hf.tiny_config("mixtral")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    llama = hf.tiny_config("llama")
    assert not any(hasattr(llama, k) for k in ("num_experts", "num_local_experts", "moe_intermediate_size"))
