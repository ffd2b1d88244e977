"""Hugging Face mixture-of-experts models (tiny Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral; fp32) through
``autopar.parallelize_hf`` at world 2 against one process: transformers' ``"moe_tp_experts"`` plan entries run the
CoC MoE ops (``kernels.all_gather_grouped_matmul`` / ``grouped_matmul_reduce_scatter`` and their autograd).

Logits, loss, every gradient, the parameters after three SGD steps (``clip_grad_norm_`` under sequence parallelism,
where every parameter is a DTensor) and greedy ``generate()`` match (1e-5, :mod:`tests.autopar.tp.hf_cases`), with
sequence parallelism off and on, on the sequential and chunked backends; the expert weights are the DTensors
transformers' own styles make (same placements, same local shards). Router load imbalance: every token routed to
one expert (top-1) or to the same two (top-2), the other experts empty, forced through the weights.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kernels.testing import run_ranks
from tests.autopar.tp.hf_cases import TOL, B, S, _train, build, environment, train_errors

pytest.importorskip("transformers")

# Four experts of intermediate 32 (16 per rank), top-2; Qwen2-MoE's shared expert beside them.
MOE_CONFIGS = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
}
BACKENDS = {"sequential": {"COC_PARALLEL_NUM": "1"}, "chunked": {"COC_PARALLEL_NUM": "2"}}


@contextlib.contextmanager
def moe_calls() -> Iterator[collections.Counter]:
    """Counts the MoE operators' runs by ``(op, backend)`` (their implementation tables, restored after)."""
    from kernels.ops.moe import tp as moe

    calls: collections.Counter = collections.Counter()
    tables = (("gather", moe.GATHER_SPEC.impl), ("scatter", moe.SCATTER_SPEC.impl))
    saved = {name: dict(table) for name, table in tables}

    def spy(op: str, backend: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls[(op, backend)] += 1
            return fn(*args, **kwargs)

        return run

    for name, table in tables:
        for backend, fn in list(table.items()):
            table[backend] = spy(name, backend, fn)
    try:
        yield calls
    finally:
        for name, table in tables:
            table.update(saved[name])


def _imbalanced(model: torch.nn.Module) -> None:
    """Every token's router logits ``0.5 h_0, 0.25 h_0, 0, 0`` with ``h_0 > 0``: hidden dim 0 of the residual
    stream is held at 3 (the embeddings' column 0; nothing else writes it: the attention's and the experts' output
    row 0 zeroed), so the router's top-1 is expert 0 and its top-2 experts 0 and 1 for every token, the other
    experts get none."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 3.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.experts.down_proj[:, 0] = 0.0
            shared = getattr(layer.mlp, "shared_expert", None)
            if shared is not None:
                shared.down_proj.weight[0] = 0.0
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[0, 0], layer.mlp.gate.weight[1, 0] = 0.5, 0.25


def _expert_loads(model: torch.nn.Module, ids: torch.Tensor) -> list[list[int]]:
    """Tokens per expert in each layer, in one forward."""
    loads: list[list[int]] = []

    def record(module: torch.nn.Module, args: tuple) -> None:
        loads.append(torch.bincount(args[1].reshape(-1), minlength=module.num_experts).tolist())

    hooks = [layer.mlp.experts.register_forward_pre_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return loads


def _same_as_transformers_styles(tp: torch.nn.Module, ref: torch.nn.Module) -> bool:
    """The experts' DTensors against transformers' own ``packed_colwise`` / ``rowwise`` parameter styles applied
    to the one-process weights: the same placements and the same local shards."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    experts, theirs = tp.model.layers[0].mlp.experts, copy.deepcopy(ref.model.layers[0].mlp.experts)
    mesh = experts.gate_up_proj.device_mesh
    for name, style in (("gate_up_proj", "packed_colwise"), ("down_proj", "rowwise")):
        ALL_PARALLEL_STYLES[style].shard_param(theirs, name, mesh)
        ours, want = getattr(experts, name), getattr(theirs, name)
        if ours.placements != want.placements or not torch.equal(ours.to_local(), want.to_local()):
            return False
    return True


def moe_vs_one_process(
    rank: int, world: int, family: str, combos: list[tuple[bool, str]], overrides: dict[str, Any]
) -> list[dict[str, Any]]:
    """For each ``(sequence_parallel, backend)``: the max errors of the parallelized model against one process
    (first step's logits, loss, gradients; the parameters after the steps), the MoE ops' backends, and the
    experts' loads in the first forward. ``overrides``: config fields; ``"imbalanced"``: :func:`_imbalanced`."""
    import autopar

    fields = {**MOE_CONFIGS[family], **{k: v for k, v in overrides.items() if k != "imbalanced"}}
    ref = build(family, layers=1, **fields)
    if overrides.get("imbalanced"):
        _imbalanced(ref)
    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1))
    loads = _expert_loads(ref, ids)
    refs = {clip: _train(copy.deepcopy(ref), ids, clip=clip) for clip in {sp for sp, _ in combos}}
    rows = []
    for sp, backend in combos:
        with environment(BACKENDS[backend]):
            tp = autopar.parallelize_hf(copy.deepcopy(ref), sequence_parallel=sp)
            same_layout = _same_as_transformers_styles(tp, ref)
            with moe_calls() as calls:
                got = _train(tp, ids, clip=sp)
        want = refs[sp]
        rows.append(
            {
                "sp": sp,
                "backend": backend,
                **train_errors(got, want, tp),
                "calls": dict(calls),
                "same_layout": same_layout,
                "loads": loads,
            }
        )
    return rows


ALL_COMBOS = [(sp, backend) for backend in BACKENDS for sp in (False, True)]
# Each family runs both sequence-parallel settings and both backends, on one diagonal of ALL_COMBOS; the two
# diagonals together run every (sequence_parallel, backend) pair. The family changes the model code around the
# experts (Qwen2-MoE's shared expert, Mixtral's naming), not the MoE ops: the pair picks the op's implementation
# (backend) and its input layout (sequence-sharded or replicated), the same code for every family.
DIAGONALS = {
    "qwen3_moe": [(False, "sequential"), (True, "chunked")],
    "qwen2_moe": [(False, "chunked"), (True, "sequential")],
    "mixtral": [(False, "sequential"), (True, "chunked")],
}


def _check(rows: list[dict[str, Any]], tag: str) -> dict[str, float]:
    worst: dict[str, float] = {}
    for row in rows:
        where = f"{tag} sp={row['sp']} {row['backend']}"
        for key in ("logits", "loss", "grads", "params", "grad_norm"):
            assert row[key] < TOL, (where, key, row[key])
            worst[f"{row['backend']} sp={row['sp']} {key}"] = row[key]
        assert row["generate_equal"] and row["same_layout"], where
        ops = {op for op, _ in row["calls"]}
        assert ops == {"gather", "scatter"} and {b for _, b in row["calls"]} == {row["backend"]}, (where, row["calls"])
        if row["sp"]:
            assert row["dtensor_params"], where
    return worst


@pytest.mark.parametrize("family", list(MOE_CONFIGS))
def test_moe_family_matches_one_process(family: str) -> None:
    combos = DIAGONALS[family]
    assert {c for d in DIAGONALS.values() for c in d} == set(ALL_COMBOS)
    rows = run_ranks(moe_vs_one_process, 2, family, combos, {}, timeout=300)[0]
    print(family, _check(rows, family))


@pytest.mark.parametrize(("family", "topk", "loads"), [("mixtral", 1, [B * S, 0, 0, 0]), ("qwen2_moe", 2, None)])
def test_router_imbalance_one_expert_takes_every_token(family: str, topk: int, loads: list[int] | None) -> None:
    """Top-1: every token to expert 0, experts 1 to 3 empty; top-2: every token to experts 0 and 1, 2 and 3 empty."""
    want = loads or [B * S, B * S, 0, 0]
    combos = [(False, "chunked"), (True, "sequential")]
    rows = run_ranks(moe_vs_one_process, 2, family, combos, {"num_experts_per_tok": topk, "imbalanced": True})[0]
    assert all(layer == want for layer in rows[0]["loads"]), rows[0]["loads"]
    print(family, _check(rows, f"{family} imbalanced"))


def _refused(rank: int, world: int, plan_change: dict[str, str], overrides: dict[str, Any]) -> str:
    import autopar

    model = build("qwen3_moe", layers=1, **{**MOE_CONFIGS["qwen3_moe"], **overrides})
    plan = {**model.tp_plan, **plan_change}
    try:
        autopar.parallelize_hf(model, plan=plan)
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("plan_change", "overrides", "named"),
    [
        ({"model.layers.*.mlp.experts": "ep_dispatch_experts"}, {}, "on a parameter of the ep_dispatch_experts"),
        ({"model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm"}, {}, "'grouped_gemm' on a parameter"),
        ({}, {"moe_intermediate_size": 33}, "moe_intermediate_size=33"),
    ],
    ids=["ep_dispatch", "ep_params", "odd_intermediate"],
)
def test_what_is_not_supported_is_refused_by_name(plan_change: dict, overrides: dict, named: str) -> None:
    for message in run_ranks(_refused, 2, plan_change, overrides):
        assert named in message, message
