"""The decode path in models (:mod:`autopar.tp.decode`): ``parallelize_hf`` at world 2 fuses each row-parallel
linear's all-reduce with the residual add and the next RMSNorm under ``torch.no_grad()``.

Checked against one process (fp32): greedy ``generate()`` gives the same tokens with the fused GEMM epilogue
really running (``coc::matmul_all_reduce_rmsnorm``, counted per backend by ``kernels.testing.backend_calls``)
at every layer end (spies on :class:`~autopar.tp.decode.PendingReduce`); logits and ``output_hidden_states``
within ``hf_cases.TOL`` with no pending value escaping the forward; ``fuse_norm=False`` runs the unfused op
only; training (autograd recording) never defers; a norm that is not Llama's form (Gemma's ``1 + weight``) runs
unfused.

Tolerance: at W = 2 in fp32 the fused sum ``(p0 + p1) + residual`` is the unfused model's operation for
operation (two addends commute exactly), so differences come only from the sharded GEMMs' k order (see
``hf_cases``); TOL = 1e-5.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from typing import Any

import pytest
import torch

from kernels.testing import run_ranks
from tests.autopar.tp.hf_cases import TOL, B, S, build, coc_op_counter, environment

pytest.importorskip("transformers")

NEW = 4


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _spied(counts: Counter) -> Any:
    """Count fused norms and unfused materializations of pending layer ends."""
    from autopar.tp.decode import PendingReduce

    normalize, materialize = PendingReduce.normalize, PendingReduce.materialize

    def counted_normalize(self: PendingReduce, *args: Any) -> torch.Tensor:
        counts["fused"] += 1
        return normalize(self, *args)

    def counted_materialize(self: PendingReduce) -> torch.Tensor:
        counts["unfused" if self._value is None else "reused"] += 1
        return materialize(self)

    PendingReduce.normalize, PendingReduce.materialize = counted_normalize, counted_materialize
    return lambda: setattr(PendingReduce, "normalize", normalize) or setattr(PendingReduce, "materialize", materialize)


def generate_fused(rank: int, world: int, model_name: str, env: dict[str, str], fuse_norm: bool) -> dict[str, Any]:
    import autopar

    layers = 2
    ref = build(model_name, layers=layers).eval()
    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1))
    counts: Counter = Counter()
    with environment(env):
        tp = autopar.parallelize_hf(copy.deepcopy(ref), fuse_norm=fuse_norm).eval()
        restore = _spied(counts)
        try:
            with torch.no_grad(), warnings.catch_warnings(), coc_op_counter() as calls:
                warnings.simplefilter("ignore")
                got = tp.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
                out = tp(input_ids=ids, output_hidden_states=True)
            with coc_op_counter() as train_calls:
                tp.train()(input_ids=ids, labels=ids).loss.backward()
        finally:
            restore()
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        ref_out = ref(input_ids=ids, output_hidden_states=True)
    return {
        "generate_equal": torch.equal(got, want),
        "logits": _diff(out.logits, ref_out.logits),
        "hidden": max(_diff(a, b) for a, b in zip(out.hidden_states, ref_out.hidden_states, strict=True)),
        "hidden_types": sorted({type(h).__name__ for h in out.hidden_states}),
        "counts": dict(counts),
        "calls": dict(calls),
        "train_calls": dict(train_calls),
        "layers": layers,
        # generate: the prompt plus NEW - 1 one-token steps; then the one forward above
        "forwards": NEW + 1,
    }


@pytest.mark.parametrize(
    ("model", "env"),
    [("llama", {"COC_PARALLEL_NUM": "1"}), ("qwen2", {"COC_PARALLEL_NUM": "2"})],
)
def test_generate_runs_the_fused_layer_ends(model: str, env: dict[str, str]) -> None:
    backend = "chunked" if env["COC_PARALLEL_NUM"] == "2" else "sequential"
    for rank, row in enumerate(run_ranks(generate_fused, 2, model, env, True, timeout=300)):
        tag = f"{model} rank {rank}"
        assert row["generate_equal"], tag
        assert row["logits"] < TOL and row["hidden"] < TOL, (tag, row)
        assert row["hidden_types"] == ["Tensor"], (tag, row["hidden_types"])
        # Every layer end (o_proj + post_attention_layernorm, down_proj + the next input_layernorm or the
        # final norm) of every forward is one fused call; none materialized unfused.
        ends = 2 * row["layers"] * row["forwards"]
        assert row["counts"].get("fused") == ends and not row["counts"].get("unfused"), (tag, row["counts"])
        assert row["calls"].get(("matmul_all_reduce+rmsnorm", backend)) == ends, (tag, row["calls"])
        assert ("matmul_all_reduce", backend) not in row["calls"], (tag, row["calls"])
        # training records autograd: the row linears run the plain op, never the epilogue
        assert ("matmul_all_reduce", backend) in row["train_calls"], (tag, row["train_calls"])
        assert not any(op == "matmul_all_reduce+rmsnorm" for op, _ in row["train_calls"]), (tag, row["train_calls"])


def test_fuse_norm_false_runs_unfused() -> None:
    for rank, row in enumerate(run_ranks(generate_fused, 2, "llama", {"COC_PARALLEL_NUM": "1"}, False, timeout=300)):
        tag = f"rank {rank}"
        assert row["generate_equal"] and row["logits"] < TOL, (tag, row)
        assert not row["counts"], (tag, row["counts"])
        assert ("matmul_all_reduce+rmsnorm", "sequential") not in row["calls"], (tag, row["calls"])


def test_other_norm_forms_run_unfused() -> None:
    """Gemma's RMSNorm multiplies by ``1 + weight``: not Llama's form, so its layer ends materialize unfused
    (and match one process)."""
    for rank, row in enumerate(run_ranks(generate_fused, 2, "gemma", {"COC_PARALLEL_NUM": "1"}, True, timeout=300)):
        tag = f"gemma rank {rank}"
        assert row["generate_equal"] and row["logits"] < TOL and row["hidden"] < TOL, (tag, row)
        assert not row["counts"].get("fused") and row["counts"].get("unfused"), (tag, row["counts"])
        assert ("matmul_all_reduce+rmsnorm", "sequential") not in row["calls"], (tag, row["calls"])


def _operands() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=gen) for shape in ((3, 8), (4, 8), (3, 4), (4,)))


def test_pending_value_answers_metadata_and_materializes_on_any_other_use() -> None:
    """Single process (W = 1): shape / dtype reads leave it pending; an add with the residual keeps it pending;
    any other op (here relu, then a kernel reached through the dispatcher) sees the reduced value."""
    from autopar.tp.decode import PendingReduce, defer

    x, w, r, _ = _operands()
    with torch.no_grad():
        pending = defer(x, w, None, None)
        assert isinstance(pending, PendingReduce)
        assert (pending.shape, pending.dtype, pending.dim()) == ((3, 4), torch.float32, 2)
        assert pending._value is None
        summed = r + pending
        assert isinstance(summed, PendingReduce) and summed._residual is r and pending._value is None
        # x @ w.T + r through the same GEMM: exact
        assert torch.equal(torch.relu(summed), torch.relu(r + torch.nn.functional.linear(x, w)))
        assert type(torch.relu(pending)) is torch.Tensor
    with torch.enable_grad():
        assert defer(x, w, None, None) is None  # autograd recording: never deferred


def test_norm_of_a_pending_layer_end_is_the_models_norm() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from autopar.tp.decode import defer, fuse_rmsnorm, is_llama_rmsnorm

    x, w, r, g = _operands()
    norm = LlamaRMSNorm(4, eps=1e-5)
    norm.weight.data.copy_(g)
    want = norm(r + torch.nn.functional.linear(x, w))
    assert is_llama_rmsnorm(norm)
    fuse_rmsnorm(norm)
    assert not is_llama_rmsnorm(norm)  # a forward set on the instance: not fused twice
    with torch.no_grad():
        summed = r + defer(x, w, None, None)
        got = norm(summed)
        # fp32, W = 1: h = x @ w.T + r, then the same norm arithmetic; rsqrt and mean may differ by an ulp
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(summed + 0, r + torch.nn.functional.linear(x, w), atol=0, rtol=0)


def test_in_place_write_before_use_raises() -> None:
    from autopar.tp.decode import defer

    x, w, r, _ = _operands()
    with torch.no_grad():
        pending = r + defer(x, w, None, None)
        r.add_(1)  # the residual changed after the add was written: the unfused model saw the old one
        with pytest.raises(RuntimeError, match="modified in place"):
            torch.relu(pending)
