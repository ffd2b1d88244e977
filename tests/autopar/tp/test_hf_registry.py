"""``autopar.register_hf``: transformers' own tensor-parallel loading (``from_pretrained(path,
distributed_config=DistributedConfig(tp_size=2, enable_sequence_parallel=...))``) of a saved tiny Llama / Qwen2
at world 2, its linears, embeddings and norms on the CoC ops, against the same checkpoint in one process.

Checked per rank: logits, loss and every gradient (fp32, ``hf_cases.TOL``), the CoC ops ran (with sequence
parallelism the sequence-sharded ones), the parameters are the shards transformers loaded (local shapes), and
``unregister_hf`` puts transformers' layers back (a load after it runs no CoC op and still matches); greedy
``generate()`` gives the same tokens, and Qwen2's tied input embedding / output head stay one parameter.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from kernels.testing import run_ranks
from tests.autopar.tp.hf_cases import NEW_TOKENS, TOL, B, S, build, coc_op_counter

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed.tensor_parallel")


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local_shape(t: torch.Tensor) -> tuple[int, ...]:
    from torch.distributed.tensor import DTensor

    return tuple(t.to_local().shape if isinstance(t, DTensor) else t.shape)


def _step(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), "grads": grads}


def _generate(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # under sequence parallelism the one-token steps run replicated (warned)
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def _load(path: str, world: int, sp: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_size=world, enable_sequence_parallel=sp)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config)


def load_and_compare(rank: int, world: int, path: str, sp: bool) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    import autopar

    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1))
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = _step(ref_model, ids)
    originals = {k: ALL_PARALLEL_STYLES[k] for k in ("colwise", "rowwise", "embedding_rowwise", "sequence_parallel")}
    autopar.register_hf()
    autopar.register_hf()  # idempotent
    try:
        registered = {k: type(ALL_PARALLEL_STYLES[k]).__name__ for k in originals}
        model = _load(path, world, sp)
        with coc_op_counter() as calls:
            got = _step(model, ids)
        with coc_op_counter() as generate_calls:
            generated = _generate(model, ids)
    finally:
        autopar.unregister_hf()
    layer = model.model.layers[0]
    row = {
        "registered": registered,
        "subclass": all(isinstance(ALL_PARALLEL_STYLES[k], type(v)) for k, v in originals.items()),
        "restored": all(ALL_PARALLEL_STYLES[k] is v for k, v in originals.items()),
        "logits": _diff(got["logits"], ref["logits"]),
        "loss": _diff(got["loss"], ref["loss"]),
        "grads": max(_diff(got["grads"][n], g) for n, g in ref["grads"].items()),
        "missing_grads": sorted(set(ref["grads"]) - set(got["grads"])),
        "calls": dict(calls),
        "generate_calls": dict(generate_calls),
        "shapes": {
            "q_proj": _local_shape(layer.self_attn.q_proj.weight),
            "o_proj": _local_shape(layer.self_attn.o_proj.weight),
            "embed": _local_shape(model.model.embed_tokens.weight),
            "lm_head": _local_shape(model.lm_head.weight),
        },
        "norm_dtensor": type(layer.input_layernorm.weight).__name__ == "DTensor",
        # transformers names the input embedding in its plans from 5.2x on (5.17 leaves it whole)
        "embed_planned": any(key.endswith("embed_tokens") for key in model.tp_plan),
        "generate_equal": torch.equal(generated, _generate(ref_model, ids)),
        "tied": (model.lm_head.weight is model.model.embed_tokens.weight)
        == (ref_model.lm_head.weight is ref_model.model.embed_tokens.weight),
    }
    # After unregister_hf: transformers' own layers again.
    plain = _load(path, world, False)
    with coc_op_counter() as plain_calls:
        with torch.no_grad():
            row["plain_logits"] = _diff(plain(input_ids=ids).logits, ref["logits"])
    row["plain_calls"] = dict(plain_calls)
    return row


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    paths = {}
    for name in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp(f"hf-registry-{name}")
        # Qwen2 with its input embedding and output head tied, as its small checkpoints are
        build(name, tie_word_embeddings=name == "qwen2").save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.mark.parametrize(("model", "sp"), [("llama", False), ("llama", True), ("qwen2", False)])
def test_transformers_tp_loading_runs_coc_ops(saved: dict[str, str], model: str, sp: bool) -> None:
    # transformers' tensor-parallel loading requires accelerate (not in setup.py's test extra)
    pytest.importorskip("accelerate")
    for rank, row in enumerate(run_ranks(load_and_compare, 2, saved[model], sp, timeout=300)):
        tag = f"{model} sp={sp} rank {rank}"
        assert all(n.startswith("Coc") for n in row["registered"].values()), (tag, row["registered"])
        assert row["subclass"] and row["restored"], tag
        for key in ("logits", "loss", "grads"):
            assert row[key] < TOL, (tag, key, row[key])
        assert not row["missing_grads"], (tag, row["missing_grads"])
        assert row["generate_equal"] and row["tied"], tag
        ops = {op for op, _ in row["calls"]}
        if sp:
            assert "matmul_reduce_scatter" in ops and any(op.startswith("all_gather_matmul") for op in ops), (tag, ops)
            assert {"all_gather_matmul[3 weights]", "all_gather_matmul[2 weights]"} <= ops, (tag, ops)
            assert row["norm_dtensor"], tag
        else:
            assert "matmul_all_reduce" in ops, (tag, ops)
            # generate() runs the decode path: the layer ends fused (autopar.tp.decode)
            assert any(op == "matmul_all_reduce+rmsnorm" for op, _ in row["generate_calls"]), (tag, row)
        # hidden 64, 4 heads of 16, vocab 128: each rank holds half of every sharded dim
        embed = (64, 64) if row["embed_planned"] else (128, 64)
        assert row["shapes"] == {"q_proj": (32, 64), "o_proj": (64, 32), "embed": embed, "lm_head": (64, 64)}, (
            tag,
            row["shapes"],
        )
        assert row["plain_logits"] < TOL and not row["plain_calls"], (tag, row["plain_calls"])


def test_unregister_without_register_is_a_no_op() -> None:
    import autopar
    from autopar.tp import hf_registry

    autopar.unregister_hf()
    assert not hf_registry.is_hf_registered()


def test_a_layer_without_the_dtensor_api_is_refused_by_version() -> None:
    """transformers before the DTensor loader (partition_tensor / prepare_module_tp) has no shard_param."""
    from autopar.tp import hf_registry

    class OldLayer:
        def partition_tensor(self, *args: object) -> None: ...

        def prepare_module_tp(self, module: object, device_mesh: object) -> None: ...

    with pytest.raises(RuntimeError, match=rf"transformers {transformers.__version__}.*shard_param"):
        hf_registry._check_layer("colwise", OldLayer())


def apertus_gradients(rank: int, world: int, path: str) -> dict:
    from transformers import AutoModelForCausalLM

    import autopar

    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1))
    ref = _step(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), ids)
    autopar.register_hf()
    try:
        got = _step(_load(path, world, False), ids)
    finally:
        autopar.unregister_hf()
    return {n: _diff(got["grads"][n], g) for n, g in ref["grads"].items() if "act_fn" in n}


def test_transformers_tp_loading_sums_the_activation_parameters_gradients(tmp_path: Any) -> None:
    """Apertus' xIELU scalars sit between the column and row linears (autopar/tp/hf_regions.py): loaded through
    transformers' own TP with autopar registered, their gradients are summed over the ranks as with parallelize_hf."""
    pytest.importorskip("accelerate")
    build("apertus").save_pretrained(tmp_path)
    for rank, errors in enumerate(run_ranks(apertus_gradients, 2, str(tmp_path), timeout=300)):
        assert errors and max(errors.values()) < TOL, (rank, errors)
