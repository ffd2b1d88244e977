"""The compiled route on Hugging Face models: a tiny random Llama (one decoder layer; Qwen2 once)
parallelized with torch's plain styles at world 2 (gloo), compiled with the coc Inductor pass, trains as
one process does.

One rank spawn per sequence-parallel setting compiles the model once per backend (``torch._dynamo.reset()``
between: the backend is a constant of the rewritten graph): sequential (and, with sequence parallelism, fused); Qwen2
compiles once, on the chunked backend. Inductor itself compiles one of them, the sequence-parallel
Llama on the sequential backend; the others compile through :func:`kernels.testing.compile.graph_passes_backend`,
which runs the same graph passes (the coc pass included) and executes the rewritten graphs eagerly instead of
generating and compiling C++ for each, the bulk of a CPU compile's cost. Inductor's lowering of the coc ops is the
same whatever the backend argument or model, and the real compile checks it.

What is checked, per backend: logits, loss and every gradient of the first step and the parameters after three
SGD steps against one process; logits against the same parallelized model run eagerly; the post-grad graphs (a spy
pass chained after the coc pass) hold one coc op per rewrite the pass reported and only the collectives it reported
as left alone; the compiled code called the coc backends (a spy on ``kernels.call.IMPLEMENTATIONS``) and nothing else.

Greedy ``generate()`` is not run compiled: the pass needs static shapes (``dynamic=False``; it leaves symbolic
shapes alone) and every decode step has a new length, so each step would be a fresh CPU compile of the model.

The tolerance is that of tests/autopar/tp/hf_cases.py (``TOL``): the sharded model sums the same fp32 products in
another order.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from typing import Any

import pytest
import torch

from kernels.testing import backend_calls, run_ranks

SEQ = {"COC_PARALLEL_NUM": "1"}
CHUNKED = {"COC_PARALLEL_NUM": "2"}
FUSED = {"USE_COC_FUSED_KERNEL": "1"}
B, S = 2, 8
STEPS, LR = 3, 0.1


def llama_plan(sequence_parallel: bool) -> dict[str, Any]:
    """torch's plain styles for ``LlamaForCausalLM``: transformers' own ``base_model_tp_plan`` (colwise q/k/v and
    gate/up, rowwise o/down); with SP, torchtitan's layout inside each decoder layer, the sequence dim of HF's
    ``[b, s, h]`` (dim 1) sharded between the layer's collectives and the layer's output gathered again for the
    replicated final norm and head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    layer = "model.layers.*."
    if not sequence_parallel:
        plan = {f"{layer}self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
        plan.update({f"{layer}mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")})
        plan[f"{layer}self_attn.o_proj"] = RowwiseParallel()
        plan[f"{layer}mlp.down_proj"] = RowwiseParallel()
        return plan
    seq = Shard(1)
    plan = {
        "model.layers.*": PrepareModuleInputOutput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(seq,),
            use_local_input=False,
            output_layouts=(seq,),
            desired_output_layouts=(Replicate(),),
            use_local_output=True,
        ),
        f"{layer}input_layernorm": SequenceParallel(sequence_dim=1),
        f"{layer}self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        f"{layer}self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        f"{layer}post_attention_layernorm": SequenceParallel(sequence_dim=1),
        f"{layer}mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        f"{layer}mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
    }
    plan.update({f"{layer}self_attn.{p}_proj": ColwiseParallel() for p in "qkv"})
    plan.update({f"{layer}mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")})
    return plan


class _GraphSpy:
    """A post-grad pass chained after the coc pass: what each graph holds once the coc pass has run."""

    def __init__(self) -> None:
        from torch._inductor.custom_graph_pass import CustomGraphPass

        spy = self

        class Pass(CustomGraphPass):
            def __call__(self, graph: torch.fx.Graph) -> None:
                held: collections.Counter = collections.Counter()
                for node in graph.nodes:
                    ns = getattr(node.target, "namespace", None)
                    if node.op == "call_function" and ns in ("coc", "_c10d_functional"):
                        held[f"{ns}.{node.target._opname}"] += 1
                spy.graphs.append(held)

            def uuid(self) -> None:
                return None  # no cache key: Inductor compiles afresh, so both passes run every time

        self.graphs: list[collections.Counter] = []
        self.pass_ = Pass()


def _backend_calls() -> contextlib.AbstractContextManager[collections.Counter]:
    """Counts the coc backend runs by ``(op, backend)``: what the compiled code's coc ops executed."""
    return backend_calls()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (_full(a).detach() - _full(b).detach()).abs().max().item()


def _name(parameter_name: str) -> str:
    return parameter_name.removeprefix("_orig_mod.")  # torch.compile's wrapper module


def _train(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=False)
    got: dict[str, Any] = {}
    for step in range(steps):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        if step == 0:
            got["logits"], got["loss"] = out.logits.detach(), out.loss.detach()
            got["grads"] = {_name(n): _full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    got["params"] = {_name(n): _full(p).detach().clone() for n, p in model.named_parameters()}
    return got


def compiled_llama(
    rank: int, world: int, sequence_parallel: bool, variants: list[tuple[dict, int, bool]], model: str = "llama"
) -> list[dict]:
    """For each ``(environment, steps, inductor)``: the parallel Llama compiled by Inductor (``inductor``) or through
    its graph passes only, against one process (module docstring)."""
    from torch._inductor import config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from kernels.inductor import rewrite as inductor_pass
    from kernels.testing.compile import graph_passes_backend
    from tests.autopar.tp.hf_cases import build, environment

    base = build(model, layers=1)
    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1))
    ref = {steps: _train(copy.deepcopy(base), ids, steps) for steps in {s for _, s, _ in variants}}
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for env, steps, inductor in variants:
        with environment(env):
            torch._dynamo.reset()
            model = parallelize_module(copy.deepcopy(base), mesh, llama_plan(sequence_parallel))
            with torch.no_grad():
                eager_logits = model(input_ids=ids).logits
            spy = _GraphSpy()
            inductor_pass.clear_report()
            saved = inductor_config.post_grad_custom_post_pass
            with inductor_pass.use_inductor_pass(), _backend_calls() as calls:
                inductor_config.post_grad_custom_post_pass = [inductor_config.post_grad_custom_post_pass, spy.pass_]
                try:
                    compiler = "inductor" if inductor else graph_passes_backend
                    got = _train(torch.compile(model, dynamic=False, backend=compiler), ids, steps)
                finally:
                    inductor_config.post_grad_custom_post_pass = saved
            want = ref[steps]
            rows.append(
                {
                    "env": env,
                    "logits": _diff(got["logits"], want["logits"]),
                    "eager": _diff(got["logits"], eager_logits),
                    "loss": _diff(got["loss"], want["loss"]),
                    "grads": max(_diff(got["grads"][n], g) for n, g in want["grads"].items()),
                    "params": max(_diff(got["params"][n], p) for n, p in want["params"].items()),
                    "report": [(r.graph, r.pattern, r.matched, r.detail) for r in inductor_pass.report()],
                    "graphs": [dict(g) for g in spy.graphs],
                    "calls": dict(calls),
                }
            )
    torch._dynamo.reset()
    return rows


TOL = 1e-5
# What the pass rewrites in the one-layer Llama, per graph (docs/inductor.md explains each).
WANT = {
    False: {
        "forward": {"matmul_all_reduce": 2},  # o_proj, down_proj
        "backward": {"matmul_all_reduce": 5},  # the input gradients of q, k, v, gate, up
    },
    True: {
        # q/k/v and gate/up: one gather each on dim 1 for several matmuls; o_proj, down_proj scatter dim 1
        "forward": {"all_gather_matmul": 2, "matmul_reduce_scatter": 2},
        # the output gradients of o_proj and down_proj, gathered; the input gradients of q/k/v and of
        # gate/up, each a sum of matmuls, reduce-scattered as one matmul of the concatenated operands
        "backward": {"all_gather_matmul": 2, "matmul_reduce_scatter": 2},
    },
}


def _check(row: dict, sequence_parallel: bool, backend: str) -> None:
    for key in ("logits", "eager", "loss", "grads", "params"):
        assert row[key] < TOL, (key, row)
    matched: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    left: dict[str, int] = collections.Counter()
    for graph, pattern, ok, _ in row["report"]:
        if ok:
            matched[graph][pattern] += 1
        else:
            left[graph] += 1
    assert {g: dict(c) for g, c in matched.items()} == WANT[sequence_parallel], row["report"]
    # The graphs after the pass: one coc op per rewrite, and no functional collective but those left alone.
    assert len(row["graphs"]) == 2, row["graphs"]
    for graph, held in zip(("forward", "backward"), row["graphs"], strict=True):
        coc = sum(n for op, n in held.items() if op.startswith("coc."))
        collectives = sum(n for op, n in held.items() if op.startswith("_c10d") and not op.endswith("wait_tensor"))
        assert coc == sum(matched[graph].values()), (graph, held, row["report"])
        assert collectives == left[graph], (graph, held, row["report"])
    # The compiled code ran the coc ops on the backend the environment asks for, and only there.
    assert row["calls"], row
    assert {b for _, b in row["calls"]} == {backend}, row["calls"]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sp"])
def test_plain_styles_llama_compiled_with_the_pass(sequence_parallel):
    # The fused kernels (interpreted) for one step with sequence parallelism, where every matched op is
    # a gather or a scatter. Inductor itself compiles the sequence-parallel Llama on the sequential backend.
    # The chunked backend runs compiled in the Qwen2 test (the backend is a constant of the same graph).
    variants = [(SEQ, STEPS, sequence_parallel)] + ([(FUSED, 1, False)] if sequence_parallel else [])
    backends = ("sequential", "fused")[: len(variants)]
    rows = run_ranks(compiled_llama, 2, sequence_parallel, variants, timeout=900)
    for rank_rows in rows:
        for row, backend in zip(rank_rows, backends, strict=True):
            _check(row, sequence_parallel, backend)


def test_plain_styles_qwen2_compiled_with_the_pass():
    """Qwen2 is Llama's layout with biases on q/k/v: the pass folds them into the gather's matmuls
    (sequence parallelism, chunked backend). GPT-2 has no such route: torch's plain styles take
    nn.Linear and nn.Embedding, not its Conv1D."""
    for rank_rows in run_ranks(compiled_llama, 2, True, [(CHUNKED, STEPS, False)], "qwen2", timeout=900):
        _check(rank_rows[0], True, "chunked")
