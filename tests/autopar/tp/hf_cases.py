"""Rank bodies shared by the Hugging Face tests: tiny random transformers models, one process vs
the CoC styles at world 2.

Every comparison is fp32. The tolerance: the sharded model sums the same products in another
order (over k/W pieces, then across ranks), so each value may differ by a few fp32 ulps of the
largest term; with values O(1) and k <= 128 that is ~1e-6, and 1e-5 leaves room for three
optimizer steps (SGD: a difference grows by at most lr * |grad difference| per step).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import tempfile
import warnings
from typing import Any

import torch

from kernels.testing import backend_calls, environment

TOL = 1e-5
B, S = 2, 8
STEPS, LR = 3, 0.1
NEW_TOKENS = 3


def build(model_name: str, seed: int = 0, layers: int = 2, **overrides: Any) -> torch.nn.Module:
    """A tiny random model; ``overrides``: config fields to set instead of the defaults below."""
    import transformers as T

    torch.manual_seed(seed)
    if model_name == "gpt2":
        fields = dict(n_embd=64, n_layer=layers, n_head=4, vocab_size=128, n_positions=64)
        fields.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cfg = T.GPT2Config(**{**fields, **overrides})
        return T.GPT2LMHeadModel(cfg)
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4)
    fields.update(num_key_value_heads=2, vocab_size=128, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    if model_name in ("llama", "qwen2"):
        cls_cfg, cls_model = {
            "llama": (T.LlamaConfig, T.LlamaForCausalLM),
            "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
        }[model_name]
        return cls_model(cls_cfg(**{**fields, **overrides}))
    # Any other family by its model_type: the same sizes, head_dim stated (some default it to 128 or 256).
    fields.update(head_dim=16)
    cfg = T.AutoConfig.for_model(model_name, **{**fields, **overrides})
    return T.AutoModelForCausalLM.from_config(cfg)


def coc_op_counter() -> contextlib.AbstractContextManager[collections.Counter]:
    """Counts the coc ops run by ``(op, backend)``: what the kernels entry points dispatched to, after the
    backend choice (a fallback shows up as another backend)."""
    return backend_calls()


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _train(model: torch.nn.Module, ids: torch.Tensor, clip: bool) -> dict[str, Any]:
    """Forward, backward and STEPS SGD steps; what the comparison needs from the first step and
    the parameters after the last."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=False)
    first: dict[str, Any] = {}
    for step in range(STEPS):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        if step == 0:
            first["logits"] = out.logits.detach()
            first["loss"] = out.loss.detach()
            first["grads"] = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        if clip:
            first.setdefault("norms", []).append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False))
        opt.step()
        opt.zero_grad(set_to_none=True)
    first["params"] = {n: _full(p) for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-token decode steps run replicated (warned once)
        first["generated"] = model.generate(ids[:, :S], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    model.train()
    return first


def train_errors(got: dict[str, Any], want: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """The max errors of a parallelized model's :func:`_train` results ``got`` against one process's ``want``
    (logits, loss, every gradient, the parameters after the steps, the clipped norms), whether greedy generate gave
    the same tokens and whether every parameter of ``model`` is a DTensor."""
    return {
        "logits": _max_diff(got["logits"], want["logits"]),
        "loss": _max_diff(got["loss"], want["loss"]),
        "grads": max(_max_diff(_full(got["grads"][n]), g) for n, g in want["grads"].items()),
        "params": max(_max_diff(got["params"][n], p) for n, p in want["params"].items()),
        "grad_norm": max(
            (_max_diff(a, b) for a, b in zip(got.get("norms", []), want.get("norms", []), strict=True)),
            default=0.0,
        ),
        "generate_equal": torch.equal(got["generated"], want["generated"]),
        "dtensor_params": all(type(p).__name__ == "DTensor" for p in model.parameters()),
    }


def compare_models(
    rank: int, world: int, model_name: str, combos: list[tuple[bool, dict[str, str]]], layers: int = 2
) -> list[dict[str, Any]]:
    """For each ``(sequence_parallel, backend env)`` combo: the max errors of the CoC-parallel model
    against one process, and the coc op calls of its training steps."""
    import autopar

    ref_model = build(model_name, layers=layers)
    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1))
    # clip_grad_norm_ needs every gradient a DTensor, as with torch's own styles: under SP the
    # plan makes every parameter one; without SP the norms and embeddings stay plain tensors.
    refs = {clip: _train(copy.deepcopy(ref_model), ids, clip=clip) for clip in (False, True)}
    rows = []
    for sp, env in combos:
        with environment(env):
            tp = autopar.parallelize_hf(copy.deepcopy(ref_model), sequence_parallel=sp)
            with coc_op_counter() as calls:
                got = _train(tp, ids, clip=sp)
            ref = refs[sp]
        row = {
            "sp": sp,
            "env": env,
            "logits": _max_diff(got["logits"], ref["logits"]),
            "loss": _max_diff(got["loss"], ref["loss"]),
            "grads": max(_max_diff(got["grads"][n], g) for n, g in ref["grads"].items()),
            "missing_grads": sorted(n for n, g in got["grads"].items() if g is None),
            "params": max(_max_diff(got["params"][n], p) for n, p in ref["params"].items()),
            "generate_equal": torch.equal(got["generated"], ref["generated"]),
            "calls": dict(calls),
            "dtensor_params": all(type(p).__name__ == "DTensor" for p in tp.parameters()),
        }
        if sp:
            row["grad_norm"] = max(_max_diff(a, b) for a, b in zip(got["norms"], ref["norms"], strict=True))
        rows.append(row)
        del tp
    return rows


def state_dict_roundtrip(rank: int, world: int, model_name: str, sp: bool) -> dict[str, Any]:
    """A full one-process state dict loads into the sharded model (torch's DCP helpers), gathers
    back, and a plain save_pretrained on every rank writes a checkpoint that transformers loads in
    one process."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    import autopar

    ref = build(model_name, seed=0)
    tp = autopar.parallelize_hf(build(model_name, seed=1), sequence_parallel=sp)  # other weights
    full = ref.state_dict()
    # torch replaces the entries of the dict it loads with their DTensor shards: give it a copy
    set_model_state_dict(tp, dict(full), options=StateDictOptions(full_state_dict=True))
    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loaded = _max_diff(tp(input_ids=ids).logits, ref(input_ids=ids).logits)
    gathered = get_model_state_dict(tp, options=StateDictOptions(full_state_dict=True))
    gather_err = max(_max_diff(gathered[k], v) for k, v in full.items() if k in gathered)
    missing = sorted(set(full) - set(gathered))
    shared = [None]
    if rank == 0:
        shared[0] = tempfile.mkdtemp(prefix="coc-hf-")
    dist.broadcast_object_list(shared, src=0)
    path = shared[0]
    tp.save_pretrained(path)  # plain, on every rank: rank 0 writes the gathered model
    copied = copy.deepcopy(tp)
    assert copied.save_pretrained.__self__ is copied, "a copy's save_pretrained must save the copy"
    with open(os.path.join(path, "config.json")) as f:
        config_text = f.read()
    assert "distributed_config" not in config_text and "device_mesh" not in config_text, config_text
    saved_err = None
    if rank == 0:
        reloaded = type(ref).from_pretrained(path)
        with torch.no_grad():
            saved_err = _max_diff(reloaded(input_ids=ids).logits, ref(input_ids=ids).logits)
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return {"loaded": loaded, "gathered": gather_err, "missing": missing, "saved": saved_err}


def broadcast_load(rank: int, world: int, model_name: str) -> dict[str, Any]:
    """A full model and Adam state dict passed on rank 0 only (``broadcast_from_rank0=True``) loads into the sharded
    model and its optimizer: the logits' error and, per optimizer moment, its gathered error (a copy, so exact)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import autopar

    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1))
    ref = build(model_name, seed=0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ref(input_ids=ids, labels=ids).loss.backward()
    ref_opt.step()
    full = StateDictOptions(full_state_dict=True)
    ref_osd = get_optimizer_state_dict(ref, ref_opt, options=full)
    tp = autopar.parallelize_hf(build(model_name, seed=1))
    opt = torch.optim.Adam(tp.parameters(), lr=0.01)
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(tp, dict(ref.state_dict()) if rank == 0 else {}, options=broadcast)
    set_optimizer_state_dict(tp, opt, ref_osd if rank == 0 else {}, options=broadcast)
    with torch.no_grad():
        logits = _max_diff(tp(input_ids=ids).logits, ref(input_ids=ids).logits)
    got = get_optimizer_state_dict(tp, opt, options=full)["state"]
    moments = {
        f"{key}.{name}": _max_diff(_full(got[key][name]), value)
        for key, state in ref_osd["state"].items()
        for name, value in state.items()
        if value.dim() > 0
    }
    return {"logits": logits, "moments": moments}


def family_vs_one_process(
    rank: int, world: int, family: str, sps: list[bool], explicit_plan: bool = False, *, drop: str = ""
) -> list[dict[str, Any]]:
    """One forward and backward of a tiny ``family`` model parallelized with ``parallelize_hf`` (sequence
    parallelism as in ``sps``) against the same model in one process: the max errors of the logits, the loss and
    every gradient (a DTensor's gathered), the parameters without a gradient, and whether every parameter is a
    DTensor, and the backends the CoC ops ran on. ``explicit_plan``: the model's plan strings (without sequence
    parallelism) passed as ``plan=``, less the entries whose key ends with ``drop`` (when given)."""
    import autopar
    from kernels.testing import backend_calls

    ref = build(family)
    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1))
    one = copy.deepcopy(ref)
    want = one(input_ids=ids, labels=ids)
    want.loss.backward()
    rows = []
    for sp in sps:
        # GPT-2 declares no plan: the strings parallelize_hf uses for it without sequence parallelism.
        plan = dict(ref.tp_plan or autopar.tp.hf.hf_plan_strings(ref)) if explicit_plan else None
        if plan is not None and drop:
            plan = {key: style for key, style in plan.items() if not key.endswith(drop)}
        tp = autopar.parallelize_hf(copy.deepcopy(ref), sequence_parallel=sp, plan=plan)
        with backend_calls() as calls:
            got = tp(input_ids=ids, labels=ids)
            got.loss.backward()
        grads = {n: _full(p.grad) for n, p in tp.named_parameters()}
        rows.append(
            {
                "sp": sp,
                "logits": _max_diff(got.logits, want.logits),
                "loss": _max_diff(got.loss, want.loss),
                "grads": {n: _max_diff(grads[n], p.grad) for n, p in one.named_parameters() if grads[n] is not None},
                "missing_grads": sorted(n for n, g in grads.items() if g is None),
                "dtensor_params": all(type(p).__name__ == "DTensor" for p in tp.parameters()),
                "backends": sorted({b for _, b in calls}),
            }
        )
    return rows


def save_on_one_rank(rank: int, world: int) -> str | None:
    """``save_pretrained`` under ``if rank == 0:``: rank 0's error message (None on the other ranks)."""
    import autopar

    tp = autopar.parallelize_hf(build("llama"))
    if rank != 0:
        return None
    path = tempfile.mkdtemp(prefix="coc-hf-")
    try:
        tp.save_pretrained(path)
    except RuntimeError as e:
        return str(e)
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    return "saved"
