"""Hugging Face Llama, Qwen2 and GPT-2 (tiny random configs, fp32) parallelized with
``autopar.parallelize_hf`` at world 2 against one process.

Logits, loss, every gradient, the parameters after three SGD steps (with ``clip_grad_norm_``
under sequence parallelism, where every parameter is a DTensor) and greedy ``generate()`` match,
with sequence parallelism off and on, on the sequential and chunked backends (fused: test_hf_fused
below). A spy on the registered ``torch.ops.coc`` operators shows which ran, on which backend.
"""

from __future__ import annotations

import pytest

from kernels.testing import run_ranks
from tests.autopar.tp.hf_cases import TOL, broadcast_load, build, compare_models, state_dict_roundtrip

pytest.importorskip("transformers")

COMBOS = [
    (False, {"COC_PARALLEL_NUM": "1"}),
    (True, {"COC_PARALLEL_NUM": "1"}),
    (False, {"COC_PARALLEL_NUM": "2"}),
    (True, {"COC_PARALLEL_NUM": "2"}),
]


def _check(rows: list[dict], fused: bool = False, model: str = "") -> None:
    for row in rows:
        tag = f"sp={row['sp']} env={row['env']}"
        for key in ("logits", "loss", "grads", "params"):
            assert row[key] < TOL, (tag, key, row[key])
        assert not row["missing_grads"], (tag, row["missing_grads"])
        assert row["generate_equal"], tag
        backend = "fused" if fused else ("chunked" if row["env"].get("COC_PARALLEL_NUM") == "2" else "sequential")
        calls = row["calls"]
        assert calls and all(b == backend for _, b in calls), (tag, calls)
        ops = {op for op, _ in calls}
        if row["sp"]:
            # sequence parallel: column inputs gathered, row outputs scattered by the CoC ops
            assert {"matmul_reduce_scatter"} <= ops and any(op.startswith("all_gather_matmul") for op in ops), (
                tag,
                calls,
            )
            if model in ("llama", "qwen2"):
                # q/k/v and gate/up share one gather per layer (autopar.tp.shared_gather)
                assert {"all_gather_matmul[3 weights]", "all_gather_matmul[2 weights]"} <= ops, (tag, calls)
            assert row["dtensor_params"] and row["grad_norm"] < TOL, (tag, row)
        else:
            assert "matmul_all_reduce" in ops, (tag, calls)


@pytest.mark.parametrize("model", ["llama", "qwen2", "gpt2"])
def test_hf_model_matches_one_process(model: str) -> None:
    (rows, _) = run_ranks(compare_models, 2, model, COMBOS, timeout=600)
    _check(rows, model=model)


@pytest.mark.triton
def test_hf_fused_smallest() -> None:
    """The fused kernels (interpreted) under the CoC styles with sequence parallelism on (one layer:
    every op of the model runs; the interpreter makes each call slow)."""
    combos = [(True, {"USE_COC_FUSED_KERNEL": "1"})]
    (rows, _) = run_ranks(compare_models, 2, "llama", combos, layers=1, timeout=1200)
    _check(rows, fused=True, model="llama")


@pytest.mark.parametrize(("model", "sp"), [("llama", True), ("gpt2", False)])
def test_full_state_dict_loads_gathers_and_saves(model: str, sp: bool) -> None:
    for rank, res in enumerate(run_ranks(state_dict_roundtrip, 2, model, sp, timeout=600)):
        assert res["loaded"] < TOL and res["gathered"] == 0.0 and not res["missing"], res
        if rank == 0:
            assert res["saved"] == 0.0, res


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_full_state_dict_broadcast_from_rank0_places_strided_shards(model: str) -> None:
    """GPT-2's packed ``c_attn`` is a strided shard, which torch's broadcast load slices at one contiguous offset
    (logits 0.37 off and the Adam moments of ``c_attn`` wrong before autopar.tp.strided_load); Llama (plain shards)
    is the control."""
    for res in run_ranks(broadcast_load, 2, model, timeout=600):
        assert res["logits"] < TOL, res
        assert res["moments"] and max(res["moments"].values()) == 0.0, res


def test_strided_load_warns_where_torch_internals_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import _state_dict_utils

    from autopar.tp import strided_load

    assert strided_load.install() and strided_load.install()  # idempotent: wrapped once
    assert _state_dict_utils._distribute_tensors._coc_strided
    monkeypatch.setattr(_state_dict_utils, "_distribute_tensors", lambda local_state_dict, keys: None)
    with pytest.warns(RuntimeWarning, match="broadcast_from_rank0=True"):
        assert not strided_load.install()
    monkeypatch.delattr(_state_dict_utils, "_distribute_tensors")
    with pytest.warns(RuntimeWarning, match="unchecked"):
        assert not strided_load.install()


def _tied_refused(rank: int, world: int) -> str:
    import autopar

    model = build("gpt2")  # lm_head.weight is transformer.wte.weight
    plan = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise", "lm_head": "colwise"}
    try:
        autopar.parallelize_hf(model, plan=plan)
    except ValueError as e:
        return str(e)
    return "no error"


def test_tied_head_without_its_embedding_is_refused() -> None:
    for msg in run_ranks(_tied_refused, 2):
        assert "tied weight" in msg and "transformer.wte.weight" in msg and "lm_head.weight" in msg, msg


def _tied_kept(rank: int, world: int) -> bool:
    import autopar

    model = autopar.parallelize_hf(build("gpt2"))
    return model.lm_head.weight is model.transformer.wte.weight


def test_tied_head_and_embedding_stay_tied() -> None:
    assert all(run_ranks(_tied_kept, 2))


def _sizes_checked(rank: int, world: int, model_name: str, overrides: dict, sp: bool) -> dict:
    from torch.distributed.tensor import DTensor

    import autopar

    model = build(model_name, **overrides)
    try:
        autopar.parallelize_hf(model, sequence_parallel=sp)  # no forward: the refusal comes before one
        message = "no error"
    except ValueError as e:
        message = str(e)
    split_sizes = [m.split_size for m in model.modules() if hasattr(m, "split_size")]  # GPT-2's attention
    return {
        "message": message,
        "sharded": [n for n, p in model.named_parameters() if isinstance(p, DTensor)],
        "split_sizes": split_sizes,
    }


@pytest.mark.parametrize(
    ("model", "overrides", "sp", "named"),
    [
        # multi-query attention: one KV head for two ranks (the first forward failed with shape '[2, 8, -1, 16]')
        (
            "llama",
            {"num_key_value_heads": 1},
            True,
            ["num_key_value_heads=1", "model.layers.*.self_attn.k_proj", "self_attn.v_proj", "replicated"],
        ),
        # three heads of 16 in GPT-2's packed q/k/v (c_attn): the shards divide by W but split a head
        ("gpt2", {"n_embd": 48, "n_head": 3}, False, ["n_head=3", "packed_colwise:3", "transformer.h.*.attn.c_attn"]),
        # an odd MLP width: the style refused it with out_features only, after sharding the attention
        (
            "llama",
            {"intermediate_size": 127},
            False,
            ["intermediate_size=127", "model.layers.*.mlp.gate_proj", "model.layers.*.mlp.down_proj"],
        ),
    ],
    ids=["llama_kv_heads", "gpt2_heads", "llama_intermediate"],
)
def test_sizes_the_mesh_does_not_divide_raise_at_parallelize_time(model, overrides, sp, named) -> None:
    """Every rank raises at parallelize time, naming the config fields, W and the mesh sizes that work, and the
    model is left unsharded."""
    for res in run_ranks(_sizes_checked, 2, model, overrides, sp):
        msg = res["message"]
        assert "mesh size W=2" in msg and all(n in msg for n in named), msg
        assert "Mesh sizes that divide everything this plan shards: 1." in msg, msg
        assert not res["sharded"] and set(res["split_sizes"]) <= {overrides.get("n_embd")}, res


def test_plan_strings() -> None:
    from torch.distributed.tensor import Replicate, Shard

    import autopar
    from autopar.tp.hf import coc_style, hf_plan_strings

    model = build("llama")
    sp = hf_plan_strings(model, sequence_parallel=True)
    assert sp["model.layers.0.input_layernorm"] == "sequence_parallel" and sp["model.norm"] == "sequence_parallel"
    assert "model.layers.0.input_layernorm" not in hf_plan_strings(model)
    row = coc_style("rowwise", sequence_parallel=True)
    assert isinstance(row, autopar.CocRowwiseParallel) and row.output_layouts == (Shard(1),)
    assert coc_style("colwise_gather_output").output_layouts == (Replicate(),)
    assert isinstance(coc_style("moe_tp_experts"), autopar.tp.moe.CocMoeExpertsParallel)
    with pytest.raises(ValueError, match="'grouped_gemm' has no CoC equivalent: it shards an experts module's"):
        coc_style("grouped_gemm")


def test_every_registered_plan_string_is_mapped_or_refused_by_name() -> None:
    """Every key of the installed transformers' style registry is a CoC style or refused by name with what to do
    instead: a string a new transformers adds fails here until it is mapped or refused, never a silent gap."""
    from torch.distributed.tensor.parallel import ParallelStyle

    parallel_utils = pytest.importorskip("transformers.distributed.parallel_utils")
    from autopar.tp.hf import REFUSED_PLAN_STRINGS, SUPPORTED_PLAN_STRINGS, coc_style

    supported = {s.split("[")[0] for s in SUPPORTED_PLAN_STRINGS}
    keys = set(parallel_utils.ALL_PARALLEL_STYLES.keys())
    assert keys, "the registry is empty: transformers moved it"
    unknown = keys - supported - set(REFUSED_PLAN_STRINGS)
    assert not unknown, f"transformers registers plan strings autopar neither maps nor refuses: {sorted(unknown)}"
    for key in sorted(keys):
        for sp in (False, True):
            if key in supported:
                assert isinstance(coc_style(key, sequence_parallel=sp), ParallelStyle), key
            else:
                with pytest.raises(ValueError, match=f"'{key}' has no CoC equivalent: .*instead|'{key}'.*leave it out"):
                    coc_style(key, sequence_parallel=sp)


def test_save_pretrained_on_one_rank_raises_instead_of_hanging() -> None:
    """The usual ``if rank == 0: model.save_pretrained(path)``: rank 0 raises within COC_TIMEOUT naming the rank
    that did not call it. Before: rank 0 waited in the parameters' gather forever."""
    from tests.autopar.tp.hf_cases import save_on_one_rank

    messages = run_ranks(save_on_one_rank, 2, env={"COC_TIMEOUT": "3"}, timeout=300)
    assert messages[1] is None
    assert "rank(s) [1]" in messages[0] and "call it on every rank" in messages[0], messages[0]
