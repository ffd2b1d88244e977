"""Hugging Face mixture-of-experts models under expert parallelism (tiny Qwen3-MoE, Qwen2-MoE with its shared
expert, Mixtral; fp32; E = 4 experts, 2 per rank at world 2): ``autopar.parallelize_hf(model, expert_parallel=True)``
runs transformers' ``ep_plan`` (``"ep_dispatch_experts"``, ``"grouped_gemm"``) on
``kernels.moe_dispatch_grouped_matmul`` (the dispatch with the first expert GEMM) -> ``kernels.grouped_matmul`` ->
``kernels.moe_combine``, the attention on the TP plan's styles over the same mesh.

Logits, loss, every gradient, the parameters after three SGD steps (``clip_grad_norm_`` under sequence parallelism)
and greedy ``generate()`` match one process (1e-5, :mod:`tests.autopar.tp.hf_cases`), sequence parallelism off and
on, on the sequential and chunked backends; the expert weights are the DTensors transformers' own ``grouped_gemm``
makes (``Shard(0)``, same local experts); a spy on the public ops shows the dispatch with the first GEMM, the second
GEMM and combine ran on the backend asked. Router load imbalance (every token to one expert, top-1, so one rank
receives no row; every token to experts 0 and 1, both on rank 0). transformers' own loading with
``ep_implementation="coc"`` (after ``autopar.register_hf()``) against the same checkpoint in one process, and what
is refused by name.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kernels.testing import run_ranks
from tests.autopar.tp.hf_cases import NEW_TOKENS, TOL, B, S, _full, _max_diff, _train, build, environment, train_errors
from tests.autopar.tp.test_hf_moe import BACKENDS, MOE_CONFIGS, _expert_loads, _imbalanced

pytest.importorskip("transformers")


@contextlib.contextmanager
def ep_calls() -> Iterator[collections.Counter]:
    """Counts the public expert-parallel ops' calls by ``(op, backend)`` (the backend the dispatch's handle
    records; ``"-"`` for the grouped GEMM, which has no communication backend); restored after."""
    import kernels
    from kernels.ops.moe.layout import EpCall

    calls: collections.Counter = collections.Counter()
    names = ("moe_dispatch", "moe_dispatch_grouped_matmul", "moe_combine", "grouped_matmul")
    saved = {name: getattr(kernels, name) for name in names}

    def dispatch(*args: Any, **kw: Any) -> Any:
        rows, handle = saved["moe_dispatch"](*args, **kw)
        calls[("moe_dispatch", EpCall.decode(handle.call).backend)] += 1
        return rows, handle

    def dispatch_gemm(*args: Any, **kw: Any) -> Any:
        y, handle = saved["moe_dispatch_grouped_matmul"](*args, **kw)
        calls[("moe_dispatch_grouped_matmul", EpCall.decode(handle.call).backend)] += 1
        return y, handle

    def combine(y: torch.Tensor, handle: Any, **kw: Any) -> Any:
        calls[("moe_combine", EpCall.decode(handle.call).backend)] += 1
        return saved["moe_combine"](y, handle, **kw)

    def grouped(*args: Any, **kw: Any) -> Any:
        calls[("grouped_matmul", "-")] += 1
        return saved["grouped_matmul"](*args, **kw)

    kernels.moe_dispatch, kernels.moe_combine, kernels.grouped_matmul = dispatch, combine, grouped
    kernels.moe_dispatch_grouped_matmul = dispatch_gemm
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)


def _same_as_transformers_grouped_gemm(tp: torch.nn.Module, ref: torch.nn.Module) -> bool:
    """The experts' DTensors against transformers' own ``grouped_gemm`` parameter style applied to the one-process
    weights: the same placements and the same local experts."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    experts, theirs = tp.model.layers[0].mlp.experts, copy.deepcopy(ref.model.layers[0].mlp.experts)
    mesh = experts.gate_up_proj.device_mesh
    for name in ("gate_up_proj", "down_proj"):
        ALL_PARALLEL_STYLES["grouped_gemm"].shard_param(theirs, name, mesh)
        ours, want = getattr(experts, name), getattr(theirs, name)
        if ours.placements != want.placements or not torch.equal(ours.to_local(), want.to_local()):
            return False
    return True


def ep_vs_one_process(
    rank: int, world: int, family: str, combos: list[tuple[bool, str]], overrides: dict[str, Any]
) -> list[dict[str, Any]]:
    """For each ``(sequence_parallel, backend)``: the max errors of the expert-parallel model against one process
    (first step's logits, loss, gradients; the parameters after the steps), the ops it ran, and the experts'
    loads in the first forward. ``overrides``: config fields; ``"imbalanced"``: the router forced to experts 0
    (and 1) for every token (``tests.autopar.tp.test_hf_moe._imbalanced``)."""
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
            tp = autopar.parallelize_hf(copy.deepcopy(ref), sequence_parallel=sp, expert_parallel=True)
            same_layout = _same_as_transformers_grouped_gemm(tp, ref)
            with ep_calls() as calls:
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


def _check(rows: list[dict[str, Any]], tag: str) -> dict[str, float]:
    worst: dict[str, float] = {}
    for row in rows:
        where = f"{tag} sp={row['sp']} {row['backend']}"
        for key in ("logits", "loss", "grads", "params", "grad_norm"):
            assert row[key] < TOL, (where, key, row[key])
            worst[f"{row['backend']} sp={row['sp']} {key}"] = row[key]
        assert row["generate_equal"] and row["same_layout"], where
        ops = {op for op, _ in row["calls"]}
        # The first expert GEMM rides on the dispatch (moe_dispatch_grouped_matmul), the second is grouped_matmul.
        assert ops == {"moe_dispatch_grouped_matmul", "moe_combine", "grouped_matmul"}, (where, row["calls"])
        backends = {b for op, b in row["calls"] if op != "grouped_matmul"}
        assert backends == {row["backend"]}, (where, row["calls"])
        if row["sp"]:
            assert row["dtensor_params"], where
    return worst


@pytest.mark.parametrize(
    ("family", "combos"),
    [
        # One diagonal of the (sequence_parallel, backend) pairs each: together every pair runs. The pair picks
        # the ops' implementation and input layout; the family only the model code around the experts.
        ("qwen3_moe", [(False, "sequential"), (True, "chunked")]),
        ("mixtral", [(False, "chunked"), (True, "sequential")]),
    ],
)
def test_expert_parallel_family_matches_one_process(family: str, combos: list[tuple[bool, str]]) -> None:
    rows = run_ranks(ep_vs_one_process, 2, family, combos, {}, timeout=300)[0]
    print(family, _check(rows, family))


@pytest.mark.parametrize(("family", "topk", "loads"), [("mixtral", 1, [B * S, 0, 0, 0]), ("qwen2_moe", 2, None)])
def test_router_imbalance_under_expert_parallelism(family: str, topk: int, loads: list[int] | None) -> None:
    """Top-1: every token to expert 0, so rank 1's experts and rank 1 itself receive no row; top-2: every token to
    experts 0 and 1 (both rank 0's), 2 and 3 empty, with Qwen2-MoE's shared expert beside them."""
    want = loads or [B * S, B * S, 0, 0]
    combos = [(False, "chunked"), (True, "sequential")]
    rows = run_ranks(ep_vs_one_process, 2, family, combos, {"num_experts_per_tok": topk, "imbalanced": True})[0]
    assert all(layer == want for layer in rows[0]["loads"]), rows[0]["loads"]
    print(family, _check(rows, f"{family} imbalanced"))


def _step(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), "grads": grads, "generated": generated}


def registry_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """transformers' loading with ``DistributedConfig(tp_size=2, ep_size=2, ep_implementation="coc")`` against the
    checkpoint in one process; the error of the same load under ``register_hf(sequence_parallel=True)``; whether
    ``unregister_hf`` took the entry out."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import EPImplementationInterface

    import autopar

    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1))
    want = _step(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), ids)
    autopar.register_hf()
    try:
        config = DistributedConfig(tp_size=world, ep_size=world, ep_implementation="coc")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config)
        with ep_calls() as calls:
            got = _step(model, ids)
        autopar.register_hf(sequence_parallel=True)
        try:
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config)
            refused = "no error"
        except NotImplementedError as e:
            refused = str(e)
    finally:
        autopar.unregister_hf()
    experts = model.model.layers[0].mlp.experts
    return {
        "logits": _max_diff(got["logits"], want["logits"]),
        "loss": _max_diff(got["loss"], want["loss"]),
        "grads": max(_max_diff(got["grads"][n], g) for n, g in want["grads"].items()),
        "missing_grads": sorted(set(want["grads"]) - set(got["grads"])),
        "generate_equal": torch.equal(got["generated"], want["generated"]),
        "ops": sorted({op for op, _ in calls}),
        "local_experts": experts.gate_up_proj.to_local().shape[0],
        "registered_after": "coc" in EPImplementationInterface(),
        "sequence_parallel": refused,
    }


def test_transformers_loading_with_ep_implementation_coc(tmp_path: Any) -> None:
    pytest.importorskip("transformers.distributed.expert_parallel")
    build("qwen3_moe", layers=1, **MOE_CONFIGS["qwen3_moe"]).save_pretrained(tmp_path)
    for row in run_ranks(registry_load, 2, str(tmp_path), timeout=300):
        for key in ("logits", "loss", "grads"):
            assert row[key] < TOL, (key, row)
        assert not row["missing_grads"] and row["generate_equal"], row
        assert row["ops"] == ["grouped_matmul", "moe_combine", "moe_dispatch_grouped_matmul"], row
        assert row["local_experts"] == 2 and not row["registered_after"], row
        assert "under sequence parallelism is not supported" in row["sequence_parallel"], row


REFUSALS = {
    "experts_3": ("qwen3_moe", {}, {"num_experts": 3}, "num_local_experts=3 does not divide"),
    "experts_5": ("mixtral", {}, {"num_local_experts": 5}, "num_local_experts=5 does not divide"),
    "no_ep_plan": ("llama", {}, {}, "declares no expert-parallel plan"),
    "tp_params_under_ep": (
        "qwen3_moe",
        {"model.layers.*.mlp.experts": "ep_dispatch_experts"},
        {},
        "'packed_colwise' on a parameter of the ep_dispatch_experts module",
    ),
}


def _refused(rank: int, world: int) -> dict[str, str]:
    """Each case of :data:`REFUSALS`: the error parallelize_hf raises (expert_parallel=True, or the plan changed)."""
    import autopar

    messages = {}
    for case, (family, plan_change, overrides, _) in REFUSALS.items():
        model = build(family, layers=1, **{**MOE_CONFIGS.get(family, {}), **overrides})
        plan = {**model.tp_plan, **plan_change} if plan_change else None
        try:
            autopar.parallelize_hf(model, plan=plan, expert_parallel=not plan_change)
            messages[case] = "no error"
        except (ValueError, NotImplementedError) as e:
            messages[case] = str(e)
    return messages


def test_what_is_not_supported_is_refused_by_name() -> None:
    """An expert count the mesh size does not divide (naming the config field), a model without an ep_plan, and
    the TP plan's parameter styles left on an ep_dispatch_experts module."""
    for messages in run_ranks(_refused, 2):
        for case, (*_, named) in REFUSALS.items():
            assert named in messages[case], (case, messages[case])
