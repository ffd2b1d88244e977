"""Loading straight into shards (autopar/tp/hf_load.py): a model built on the meta device, parallelized with
``parallelize_hf(..., checkpoint=path)``, reads only its shards from a ``save_pretrained`` checkpoint.

The memory bound: each rank allocates its shards (half of every sharded parameter at W = 2, the vocabulary
included) and the replicated norms; 0.6x of the model's bytes leaves 0.1x for the allocator and the temporary
index vectors, and a load that read the full tensors first (as ``from_pretrained`` then ``parallelize_hf``
does) peaks at 1x or more.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from autopar.tp.hf_load import load_shards
from kernels.testing import run_ranks
from tests.autopar.tp.hf_cases import TOL, B, S, _max_diff, build


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _load_and_compare(rank: int, world: int, path: str, sp: bool, ids: torch.Tensor, ref: torch.Tensor) -> dict:
    import transformers as T

    import autopar

    config = T.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config)
    baseline = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS: the peak below is the sharding's and the load's
    model = autopar.parallelize_hf(model, sequence_parallel=sp, checkpoint=path)
    peak = _status_kb("VmHWM") - baseline
    left_on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    local_bytes = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters()
    )
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return {"error": _max_diff(logits, ref), "meta": left_on_meta, "peak_kb": peak, "local_bytes": local_bytes}


def _saved(model: nn.Module) -> tuple[str, torch.Tensor, torch.Tensor]:
    path = tempfile.mkdtemp(prefix="coc-load-")
    model.save_pretrained(path)
    ids = torch.randint(1, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return path, ids, model(input_ids=ids).logits


@pytest.mark.parametrize(("name", "sp"), [("llama", True), ("gpt2", False), ("qwen3", False)])
def test_meta_model_reads_its_shards_and_matches_one_process(name: str, sp: bool) -> None:
    """Llama (rotary buffers rebuilt, SP), GPT-2 (packed q/k/v: strided shards, tied head), Qwen3 (q/k norms)."""
    path, ids, ref = _saved(build(name))
    try:
        for res in run_ranks(_load_and_compare, 2, path, sp, ids, ref, timeout=600):
            assert res["error"] < TOL and res["meta"] == [], res
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_sharded_load_peaks_below_0_6x_of_the_model_per_rank() -> None:
    model = build("llama", hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=8)
    model.resize_token_embeddings(16384)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes >= 200e6, model_bytes
    path, ids, ref = _saved(model)
    del model
    try:
        for res in run_ranks(_load_and_compare, 2, path, False, ids, ref, timeout=600):
            assert res["error"] < TOL and res["meta"] == [], res
            assert res["local_bytes"] <= 0.55 * model_bytes, (res, model_bytes)
            assert res["peak_kb"] * 1024 <= 0.6 * model_bytes, (res["peak_kb"] * 1024 / model_bytes, res)
    finally:
        shutil.rmtree(path, ignore_errors=True)


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2, bias=False)


def _checkpoint(tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    path = tempfile.mkdtemp(prefix="coc-load-")
    save_file(tensors, f"{path}/model.safetensors")
    return path


@pytest.mark.parametrize(
    ("tensors", "error", "match"),
    [
        ({"a.weight": torch.ones(3, 4), "a.bias": torch.ones(3)}, KeyError, "has no tensor for b.weight"),
        (
            {"a.weight": torch.ones(4, 3), "a.bias": torch.ones(3), "b.weight": torch.ones(2, 3)},
            ValueError,
            r"a.weight is \[4, 3\] in the checkpoint, \[3, 4\] in the model",
        ),
    ],
)
def test_missing_and_misshapen_tensors_are_named(tensors: dict[str, Any], error: type, match: str) -> None:
    path = _checkpoint(tensors)
    try:
        with pytest.raises(error, match=match):
            load_shards(_Two(), path, device=torch.device("cpu"))
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_plain_parameters_load_exactly_in_the_models_dtype() -> None:
    tensors = {"a.weight": torch.randn(3, 4), "a.bias": torch.randn(3), "b.weight": torch.randn(2, 3)}
    path = _checkpoint(tensors)
    try:
        model = _Two().to(torch.float64)
        load_shards(model, path, device=torch.device("cpu"))
        for key, value in tensors.items():
            got = model.get_parameter(key)
            assert got.dtype == torch.float64 and torch.equal(got, value.double()), key
    finally:
        shutil.rmtree(path, ignore_errors=True)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_shards(_Two(), tempfile.gettempdir() + "/coc-no-such-checkpoint", device=torch.device("cpu"))
