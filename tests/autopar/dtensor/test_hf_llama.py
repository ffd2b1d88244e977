"""A Hugging Face Llama (transformers 5, tiny random config) with DistTensor tensor-parallel
weights at world 2 against the same model in one process: logits, loss, every gradient, and two
SGD steps.

The weights get in as docs/dtensor.md shows: each q/k/v/gate/up ``nn.Linear`` weight becomes
``nn.Parameter(shard_tensor(w, mesh, [Shard(0)]))`` (column parallel), each o/down weight
``[Shard(1)]`` (row parallel); the model code is unchanged. The plain activations entering a
column layer count as Replicate; the row layers' Partial outputs are all-reduced where the
residual add needs them. Both attention implementations (``eager``: matmul / softmax /
repeat_kv; ``sdpa``: scaled_dot_product_attention with grouped-query heads) and a vocab-parallel
embedding (``[Shard(0)]``, Partial output) are covered.

fp32 tolerance: the parallel model sums the same products in another grouping (two halves of each
row-parallel contraction of 64 or 128 terms, then an all-reduce), so values differ by a few ulps of
O(1) activations; ``1e-5`` leaves a wide margin (observed maxima: logits 8e-7 after two SGD steps,
gradients 2e-7).
"""

import copy

import pytest
import torch

from kernels.testing import run_ranks

pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-5)
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def _tiny_llama(attn_implementation):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    config._attn_implementation = attn_implementation
    return LlamaForCausalLM(config)


def _parallelize(model, mesh, vocab_parallel):
    """The user code: TP weights as DistTensor parameters, nothing else changes."""
    from autopar import Shard, shard_tensor

    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLUMN + ROW:
            placement = Shard(0) if leaf in COLUMN else Shard(1)
            module.weight = torch.nn.Parameter(shard_tensor(module.weight.detach(), mesh, [placement]))
    if vocab_parallel:
        w = model.model.embed_tokens.weight
        model.model.embed_tokens.weight = torch.nn.Parameter(shard_tensor(w.detach(), mesh, [Shard(0)]))
    return model


def _full(t):
    from autopar import DistTensor

    return t.full_tensor() if isinstance(t, DistTensor) else t


def _counting_all_reduce(calls):
    import kernels

    original = kernels.matmul_all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    return original, counted


def _llama_case(rank, world, attn_implementation, vocab_parallel):
    import kernels
    from autopar import DistTensor, ProcessMesh, Shard, sync_gradients

    ref = _tiny_llama(attn_implementation)
    mesh = ProcessMesh(list(range(world)), ["tp"])
    model = _parallelize(copy.deepcopy(ref), mesh, vocab_parallel)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    gen = torch.Generator().manual_seed(1)
    errors = {"logits": 0.0, "loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(2):
        ids = torch.randint(0, 128, (2, 7), generator=gen)
        for opt in opts:
            opt.zero_grad()
        r = ref(input_ids=ids, labels=ids, use_cache=False)
        r.loss.backward()
        calls = []
        original, kernels.matmul_all_reduce = _counting_all_reduce(calls)
        try:
            out = model(input_ids=ids, labels=ids, use_cache=False)
        finally:
            kernels.matmul_all_reduce = original
        # Each row layer's (o_proj, down_proj) Partial output meets the Replicate residual: one
        # overlapped matmul + all-reduce from kernels each. With a vocab-parallel embedding the
        # residual stream itself is Partial, Partial + Partial stays Partial, and the next norm
        # reduces it with a plain all-reduce instead (correct, not overlapped).
        assert len(calls) == (0 if vocab_parallel else 2 * 2), len(calls)
        assert isinstance(out.logits, DistTensor) and isinstance(out.loss, DistTensor)
        out.loss.backward()
        sync_gradients(model)
        torch.testing.assert_close(out.logits.full_tensor(), r.logits, **TOL)
        torch.testing.assert_close(out.loss.full_tensor(), r.loss, **TOL)
        errors["logits"] = max(errors["logits"], (out.logits.full_tensor() - r.logits).abs().max().item())
        errors["loss"] = max(errors["loss"], (out.loss.full_tensor() - r.loss).abs().item())
        sharded = 0
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            assert p.grad is not None, f"{name} got no gradient"
            if isinstance(p, DistTensor):
                assert p.grad.placements == p.placements, (name, p.grad.placements)
                sharded += 1
            torch.testing.assert_close(_full(p.grad), q.grad, **TOL, msg=f"step {step} grad {name}")
            errors["grad"] = max(errors["grad"], (_full(p.grad) - q.grad).abs().max().item())
        assert sharded == 7 * 2 + vocab_parallel
        for opt in opts:
            opt.step()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(_full(p.detach()), q.detach(), **TOL, msg=f"param {name}")
        errors["param"] = max(errors["param"], (_full(p.detach()) - q.detach()).abs().max().item())
    # The KV cache path (use_cache=True, the default) in inference: its cat starts from an empty tensor.
    with torch.no_grad():
        ids = torch.randint(0, 128, (2, 5), generator=gen)
        torch.testing.assert_close(model(input_ids=ids).logits.full_tensor(), ref(input_ids=ids).logits, **TOL)
    q_grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert q_grad.placements == (Shard(0),) and q_grad.to_local().shape == (32, 64)
    return errors


@pytest.mark.parametrize("attn_implementation, vocab_parallel", [("eager", False), ("sdpa", False), ("sdpa", True)])
def test_hf_llama_with_dist_tensor_weights_matches_one_process(attn_implementation, vocab_parallel):
    errors = run_ranks(_llama_case, 2, attn_implementation, vocab_parallel, timeout=300)
    assert errors[0] == errors[1]
