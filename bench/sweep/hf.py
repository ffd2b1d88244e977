"""``python -m bench --mode hf-sweep``: every causal-LM family of the installed transformers that declares a
tensor-parallel plan, parallelized with ``autopar.parallelize_hf`` against one process.

For each family (``transformers``' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config declares a non-empty
``base_model_tp_plan``, plus the families autopar plans itself, GPT-2) a tiny random model (:func:`build`: 2 layers,
hidden 64, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 128, fp32, no dropout) is parallelized at world ``W`` on
each backend with sequence parallelism off and on, and one forward and backward (``labels=input_ids``) is compared
with the same model in one process: the logits, the loss and every gradient (a DTensor's gathered). The fused
backend runs the Triton interpreter on CPU: it gets a one-layer model.

Each (family, backend, SP) ends as one of (:data:`STATUSES`):

* ``ok``: within :data:`TOL` (1e-5 absolute: the same fp32 products summed in another order);
* ``refused``: ``parallelize_hf`` raised ``ValueError`` / ``RuntimeError`` from autopar's own code (a named refusal:
  a plan string with no CoC style, a size W does not divide);
* ``wrong``: beyond the tolerance, or a parameter without a gradient that has one in one process;
* ``error``: any other exception (in ``parallelize_hf``, the forward or the backward), or a rank failure;
* ``skipped``: not run, with the reason (mixture-of-experts families: issue 30; multimodal or encoder-decoder).

``wrong`` and ``error`` make the exit status 1. Writes ``hf-sweep-<device>-<date>.json`` (every row and the run's
metadata) and ``.md`` (the table) under ``--out-dir``; :mod:`bench.sweep.hf_report` formats the table.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback
import warnings
from typing import Any

TOL = 1e-5
# A model whose own fp32 rounding error (one process against the same model in fp64) comes near TOL (Gemma4's
# scaled embeddings: 1.6e-5 in the gradients) gets NOISE_FACTOR times that error as its tolerance instead.
NOISE_FACTOR = 4.0
B, S = 2, 8
VOCAB = 128
DEFAULT_BACKENDS = ("sequential", "chunked")
HF_BACKENDS = ("sequential", "chunked", "fused")
# Without --families the fused backend (interpreted on CPU: minutes per family) runs on these only.
FUSED_FAMILIES = ("llama", "gemma", "gemma2", "qwen3", "phi3", "glm", "olmo2", "gpt2")
STATUSES = ("ok", "refused", "wrong", "error", "skipped")
ONE_PROCESS = "the tiny config fails in one process"
# The sizes every tiny config gets (the config's own names through its attribute_map).
TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
_MLA = dict(kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
# Per-family fields a tiny config needs beyond TINY (defaults sized for the full model that break at hidden 64).
OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_positions=64),
    "hrm_text": dict(H_cycles=1, L_cycles=1, L_bp_cycles=[1]),
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    "minicpm3": dict(_MLA, num_key_value_heads=4),
    "youtu": dict(_MLA, num_key_value_heads=4, head_dim=8),
    "gemma3n_text": dict(
        num_kv_shared_layers=0, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, laurel_rank=8
    ),
    "cohere_compass_text": dict(
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}}
    ),
}


# Mixture-of-experts sizes a tiny config caps (only fields the family's default config has): the defaults keep the
# full model's expert count (up to hundreds), which makes a CPU sweep of the MoE families take the better part
# of an hour for nothing the comparison needs. Group-limited routing (DeepSeek-style) gets one group.
MOE_CAPS: dict[str, int] = {
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_group": 1,
    "topk_group": 1,
}


def _transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def skip_reason(model_type: str) -> str | None:
    """Why ``model_type`` is not swept (None: it is): no plan, encoder-decoder, multimodal. Mixtures of experts are
    swept (their ``moe_tp_experts`` plans run on the CoC MoE ops; expert-parallel strings are refused by name)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from autopar.tp.hf import BUILTIN_PLANS

    _transformers()
    cls = CONFIG_MAPPING[model_type]
    plan = getattr(cls, "base_model_tp_plan", None) or {}
    if not plan and model_type not in BUILTIN_PLANS:
        return "no tp_plan"
    if getattr(cls, "is_encoder_decoder", False):
        return "encoder-decoder"
    subs = sorted(getattr(cls, "sub_configs", None) or {})
    if subs:
        return f"multimodal ({', '.join(subs)}); its text model is swept as its own family where it has one"
    return None


def causal_lm_families() -> list[str]:
    """Every model type of transformers' causal-LM auto mapping with a plan (its own or autopar's), sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _transformers()
    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if skip_reason(t) != "no tp_plan")


def tiny_config(model_type: str, *, layers: int = 2) -> Any:
    """A tiny config of ``model_type``: :data:`TINY`, the expert sizes capped (:data:`MOE_CAPS`), the family's
    :data:`OVERRIDES`, ``layers`` layers and no dropout. A config with ``layer_types`` gets one layer of each kind
    its default config uses (a hybrid model keeps its attention layers), so it may have more than ``layers``
    layers (never with ``layers=1``)."""
    t = _transformers()
    default = t.AutoConfig.for_model(model_type)
    caps = {k: min(v, getattr(default, k)) for k, v in MOE_CAPS.items() if isinstance(getattr(default, k, None), int)}
    fields = {**TINY, **caps, **OVERRIDES.get(model_type, {})}
    kinds = list(dict.fromkeys(getattr(default, "layer_types", None) or []))
    if len(kinds) > 1 and layers > 1:
        layers = max(layers, len(kinds))
        fields["layer_types"] = (kinds * layers)[:layers]
    cfg = t.AutoConfig.for_model(model_type, num_hidden_layers=layers, **fields)
    for key, value in vars(cfg).items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(cfg, key, 0.0)
    if isinstance(getattr(cfg, "activation_sparsity_pattern", None), list):  # Gemma3n: one entry per layer
        cfg.activation_sparsity_pattern = [0.0] * cfg.num_hidden_layers
    return cfg


def build(model_type: str, *, layers: int = 2, seed: int = 0) -> Any:
    """A tiny random fp32 model of ``model_type`` (:func:`tiny_config`), in training mode."""
    import torch

    t = _transformers()
    cfg = tiny_config(model_type, layers=layers)
    torch.manual_seed(seed)
    model = t.AutoModelForCausalLM.from_config(cfg).float()
    model.train()
    return model


def backend_env(backend: str) -> dict[str, str | None]:
    """The environment that selects ``backend`` for the CoC ops (the others' switches unset)."""
    from kernels.testing import BACKEND_ENVS

    env: dict[str, str | None] = {k: None for e in BACKEND_ENVS.values() for k in e}
    env.update(BACKEND_ENVS.get(backend, {}))
    return env


def _text(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:600]


def _named_refusal(e: BaseException) -> bool:
    """A ``ValueError`` / ``RuntimeError`` raised by autopar's own code (not by torch or transformers under it)."""
    import autopar

    if not isinstance(e, (ValueError, RuntimeError)):
        return False
    frames = traceback.extract_tb(e.__traceback__)
    root = os.path.dirname(os.path.abspath(autopar.__file__))
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(root + os.sep)


def _step(model: Any, ids: Any) -> tuple[Any, Any, dict[str, Any]]:
    """One forward and backward: logits, loss and every parameter's gradient (a DTensor's gathered)."""
    import torch
    from torch.distributed.tensor import DTensor

    # The same random draws in every step (and on every rank): a stochastic router (PhiMoE's sampling in
    # training mode) is then compared on the same samples, not on the draws the previous step left.
    torch.manual_seed(1234)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if isinstance(g, DTensor) else g
    logits = out.logits.full_tensor() if isinstance(out.logits, DTensor) else out.logits
    return logits.detach(), out.loss.detach(), grads


def _diff(a: Any, b: Any) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _errors(got: tuple[Any, Any, dict[str, Any]], want: tuple[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """The largest absolute differences of the logits, the loss and any gradient, and the gradients ``got``
    lacks where ``want`` has one."""
    logits, loss, grads = got
    want_logits, want_loss, want_grads = want
    errors = {n: _diff(grads[n], g) for n, g in want_grads.items() if g is not None and grads.get(n) is not None}
    worst = max(errors.items(), key=lambda kv: kv[1], default=(None, 0.0))
    return {
        "logits": _diff(logits, want_logits),
        "loss": _diff(loss, want_loss),
        "grads": worst[1],
        "worst_grad": worst[0],
        "missing_grads": sorted(n for n, g in want_grads.items() if g is not None and grads.get(n) is None),
    }


def _fp32_noise(model: Any, ids: Any, want: tuple[Any, Any, dict[str, Any]]) -> dict[str, float]:
    """The one-process fp32 run's own error against the same model in fp64 (zeros where fp64 does not run)."""
    try:
        exact = _step(copy.deepcopy(model).double(), ids)
    except Exception:  # noqa: BLE001 - a model with fp32-only code: the plain tolerance
        return {"logits": 0.0, "loss": 0.0, "grads": 0.0}
    found = _errors(want, exact)
    return {k: found[k] for k in ("logits", "loss", "grads")}


def _compare(
    got: tuple[Any, Any, dict[str, Any]], want: tuple[Any, Any, dict[str, Any]], noise: dict[str, float]
) -> dict[str, Any]:
    """:func:`_errors` and the status: ``ok`` within the tolerance (:data:`TOL`, or :data:`NOISE_FACTOR` times the
    model's own fp32 error where that is larger) with no gradient missing, else ``wrong``."""
    row = _errors(got, want)
    tol = {k: max(TOL, NOISE_FACTOR * noise[k]) for k in ("logits", "loss", "grads")}
    row["fp32_noise"] = noise
    if any(t > TOL for t in tol.values()):
        row["tolerance"] = tol
    bad = any(row[k] > tol[k] for k in tol) or row["missing_grads"]
    row["status"] = "wrong" if bad else "ok"
    row["within_noise_only"] = not bad and any(row[k] > TOL for k in tol)
    return row


def family_rows(rank: int, world: int, family: str, combos: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    """Rank body: ``family`` parallelized with ``parallelize_hf`` for each ``(backend, sequence_parallel)`` of
    ``combos`` against one process (fused: a one-layer model); one row per combo, its ``status`` and errors."""
    import torch

    import autopar
    from kernels.testing import backend_calls, environment

    warnings.simplefilter("ignore")
    ids = torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    refs: dict[int, tuple[Any, Any, dict[str, float]]] = {}
    rows = []
    for backend, sp in combos:
        layers = 1 if backend == "fused" else 2
        row: dict[str, Any] = {"family": family, "backend": backend, "sp": sp, "layers": layers}
        start = time.perf_counter()
        try:
            if layers not in refs:
                model = build(family, layers=layers)
                want = _step(copy.deepcopy(model), ids)
                refs[layers] = (model, want, _fp32_noise(model, ids, want))
        except Exception as e:  # noqa: BLE001 - the tiny model itself does not run: reported, not raised
            rows.append({**row, "status": "error", "detail": "one process: " + _text(e)})
            continue
        model, want, noise = refs[layers]
        row["layers"] = model.config.num_hidden_layers
        with environment(backend_env(backend)):
            try:
                tp = autopar.parallelize_hf(copy.deepcopy(model), sequence_parallel=sp)
            except Exception as e:  # noqa: BLE001
                refused = _named_refusal(e)
                detail = _text(e) if refused else "parallelize: " + _text(e)
                rows.append({**row, "status": "refused" if refused else "error", "detail": detail})
                continue
            try:
                with backend_calls() as calls:
                    got = _step(tp, ids)
            except Exception as e:  # noqa: BLE001
                # autopar's own error at the first forward (a layout its static checks cannot see) is a named
                # refusal too, reported as one that came at the forward.
                refused = _named_refusal(e)
                detail = ("refused at the first forward: " if refused else "forward / backward: ") + _text(e)
                rows.append({**row, "status": "refused" if refused else "error", "detail": detail})
                continue
        row.update(_compare(got, want, noise))
        row["ran"] = sorted({b for _, b in calls})
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
        del tp
    return rows


def _merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per combo from every rank's: the worst status and the largest errors over the ranks."""
    order = {s: i for i, s in enumerate(("ok", "refused", "wrong", "error"))}
    merged = []
    for rows in zip(*per_rank, strict=True):
        worst = max(rows, key=lambda r: order[r["status"]])
        row = dict(worst)
        for key in ("logits", "loss", "grads"):
            values = [r[key] for r in rows if key in r]
            if values:
                row[key] = max(values)
        merged.append(row)
    return merged


def sweep(
    families: list[str],
    *,
    world: int = 2,
    backends: tuple[str, ...] = DEFAULT_BACKENDS,
    sps: tuple[bool, ...] = (False, True),
    fused_families: tuple[str, ...] | None = None,
    timeout: float = 600.0,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Every ``(family, backend, sp)`` row (:func:`family_rows` on ``world`` gloo CPU ranks, one pooled call per
    family), the skipped families with their reason. ``fused_families``: the families the fused backend runs on
    (None: all)."""
    from kernels.testing import RankFailure, run_ranks

    rows: list[dict[str, Any]] = []
    for family in families:
        reason = skip_reason(family)
        if reason is not None:
            rows.append({"family": family, "status": "skipped", "detail": reason})
            continue
        runs = [b for b in backends if b != "fused" or fused_families is None or family in fused_families]
        combos = [(b, sp) for b in runs for sp in sps]
        if not combos:
            rows.append({"family": family, "status": "skipped", "detail": "fused only: not in FUSED_FAMILIES"})
            continue
        start = time.perf_counter()
        try:
            found = _merge(run_ranks(family_rows, world, family, combos, timeout=timeout))
            broken = [r for r in found if str(r.get("detail", "")).startswith("one process: ")]
            if broken and len(broken) == len(found):
                # The tiny config itself does not run: nothing of autopar's is tested, so the family is skipped
                # with the reason (it is not a failure of autopar's, nor a pass).
                first_line = broken[0]["detail"].removeprefix("one process: ").splitlines()[0][:160]
                found = [{"family": family, "status": "skipped", "detail": f"{ONE_PROCESS}: {first_line}"}]
        except RankFailure as e:
            found = [
                {"family": family, "backend": b, "sp": sp, "status": "error", "detail": "ranks: " + _text(e)}
                for b, sp in combos
            ]
        rows += found
        if progress:
            counts = {s: sum(r["status"] == s for r in found) for s in STATUSES if any(r["status"] == s for r in found)}
            print(f"{family}: {counts} ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    return rows


def failed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that make the sweep fail: ``wrong`` and ``error``."""
    return [r for r in rows if r["status"] in ("wrong", "error")]


def main(args: argparse.Namespace) -> int:
    """``--mode hf-sweep``: the sweep over ``--families`` (default: every family with a plan), ``--backends``
    (default: sequential, chunked), world ``--world-sizes[0]`` (default 2); JSON + Markdown into ``--out-dir``."""
    from bench.harness import report
    from bench.sweep import hf_report

    for b in args.backends or []:
        if b not in HF_BACKENDS:
            raise SystemExit(f"error: --mode hf-sweep --backends: {b!r} not in {', '.join(HF_BACKENDS)}")
    backends = tuple(args.backends or DEFAULT_BACKENDS)
    world = (args.world_sizes or [2])[0]
    families = args.families or causal_lm_families()
    fused_families = None if args.families else FUSED_FAMILIES
    start = time.perf_counter()
    rows = sweep(
        families, world=world, backends=backends, fused_families=fused_families, timeout=args.timeout, progress=True
    )
    extra = {
        "mode": "hf-sweep",
        "world": world,
        "backends": list(backends),
        "tolerance": TOL,
        "noise_factor": NOISE_FACTOR,
        "transformers": _transformers().__version__,
        "fused_families": list(fused_families) if fused_families and "fused" in backends else None,
        "seconds": round(time.perf_counter() - start, 1),
    }
    doc = {"meta": report.metadata("cpu", sys.argv, extra), "rows": rows, "summary": hf_report.summary(rows)}
    stem = args.name or f"hf-sweep-cpu-{doc['meta']['date_utc'][:10]}"
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, stem + ".json")
    md_path = os.path.join(args.out_dir, stem + ".md")
    report.write_json(json_path, doc)
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(hf_report.markdown(rows, backends=backends, meta=doc["meta"]))
    print(hf_report.summary_line(rows))
    report.say(f"wrote {json_path} and {md_path}")
    bad = failed(rows)
    for r in bad:
        report.say(f"FAILED {r['family']} {r.get('backend')} sp={r.get('sp')}: {r['status']} {r.get('detail', '')}")
    return 1 if bad else 0
