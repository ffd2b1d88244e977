"""``python -m bench --mode moe``: the mixture-of-experts ops measured beside the model's predictions.

Suites come from ``configs/moe-bench.yaml`` (``--suite``, default ``tiny``). Each suite gives, per rank:

* ``grouped_matmul`` at W = 1, both projections: ``kernels.grouped_matmul`` (the persistent Triton
  kernel), ``torch._grouped_mm`` where this torch has it, and a per-expert ``torch.mm`` loop;
* ``all_gather_grouped_matmul`` (first projection, column shard ``[E, n / W, k]``) and
  ``grouped_matmul_reduce_scatter`` (second, row shard ``[E, k_out, n / W]``) at the TP world sizes;
* ``moe_dispatch`` and ``moe_combine`` (exact mode) at the EP world sizes,

for every backend chosen. Every row is first checked against plain torch math in fp64 written here (not
the package's references): the grouped GEMMs within ``kernels.testing.tolerance`` of ``|x| @ |w|.T``, the
dispatched rows bit for bit. On CPU the Triton kernel runs in the interpreter: checked, not timed, and the
chunked backends, which use that kernel wherever it runs, are checked with it and timed without it (their
grouped GEMM is then the ``torch.mm`` loop, as sequential's). Beside each timed row: the PREDICTION of
:mod:`bench.model.moe` from the bare parts timed in the same run (grouped GEMMs, collectives fitted on CPU,
the local copy), or with ``--gpu GEN`` on a machine without CUDA the predictions alone, from the roofline
and ``configs/links.yaml``. gpu-check's MoE rows: :mod:`bench.gpu_check.moe`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

import torch
import yaml

from bench.harness import report
from bench.harness.suites import DTYPES
from bench.model import dense as perf_model
from bench.model.moe import AG, COMBINE, DISPATCH, GROUPED, MODEL_NOTE, RS, Models, MoeCase, MoeShape, derive
from bench.moe.ranks import MoeOptions, backends_of, run_world
from kernels.paths import config_path

CONFIG_PATH = str(config_path("moe-bench.yaml"))
_KEYS = {"description", "experts", "topk", "tokens", "hidden", "intermediate", "gated", "dtype"}
_KEYS |= {"tp_world_sizes", "ep_world_sizes", "grouped", "backends", "warmup", "repeats"}


def suite_names(path: str = CONFIG_PATH) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return sorted(yaml.safe_load(f)["suites"])


def load(name: str, path: str = CONFIG_PATH) -> dict[str, Any]:
    """One suite of the config, its keys validated."""
    with open(path, encoding="utf-8") as f:
        suites = yaml.safe_load(f)["suites"]
    if name not in suites:
        raise ValueError(f"MoE suite {name!r} not in {os.path.basename(path)}; known: {', '.join(sorted(suites))}")
    raw = suites[name]
    if set(raw) - _KEYS:
        raise ValueError(f"MoE suite {name!r}: unknown key(s) {sorted(set(raw) - _KEYS)}; accepted: {sorted(_KEYS)}")
    if raw["dtype"] not in DTYPES or raw["experts"] < 1 or not 1 <= raw["topk"] <= raw["experts"]:
        raise ValueError(f"MoE suite {name!r}: dtype in {DTYPES}, experts >= 1 and 1 <= topk <= experts")
    return {"name": name, **raw}


def expand(
    suite: dict[str, Any], *, worlds: list[int] | None = None, tokens: int | None = None, dtype: str | None = None
) -> list[MoeCase]:
    """The suite's cases (grouped GEMMs at W = 1, TP ops, EP ops), restricted to ``worlds`` when given."""
    name, e, topk = suite["name"], suite["experts"], suite["topk"]
    t, h, d = tokens or suite["tokens"], suite["hidden"], dtype or suite["dtype"]
    inter = suite["intermediate"]
    up_n = inter * (2 if suite.get("gated", False) else 1)

    def shape(tok: int, k: int, n: int, w: int) -> MoeShape:
        return MoeShape(tokens=tok, k=k, n=n, experts=e, topk=topk, world=w, dtype=d)

    def wanted(w: int) -> bool:
        return worlds is None or w in worlds

    out = []
    if suite.get("grouped", True) and wanted(1):
        out += [
            MoeCase(name, "up", GROUPED, shape(t, h, up_n, 1)),
            MoeCase(name, "down", GROUPED, shape(t, inter, h, 1)),
        ]
    for w in suite.get("tp_world_sizes", []):
        if wanted(w) and t % w == 0 and up_n % w == 0 and inter % w == 0:
            out += [
                MoeCase(name, "up", AG, shape(t, h, up_n // w, w)),
                MoeCase(name, "down", RS, shape(t, inter // w, h, w)),
            ]
    for w in suite.get("ep_world_sizes", []):
        if wanted(w) and e % w == 0:
            out += [MoeCase(name, "rows", op, shape(t, h, h, w)) for op in (DISPATCH, COMBINE)]
    return out


def table(records: list[dict]) -> str:
    """The terminal table: one line per case and backend."""
    head = ["case", "backend", "status", "ms", "spread", "x base", "model ms", "model err"]
    lines = [head]
    for rec in records:
        for b in rec["backends"]:
            ms = b.get("ms")
            status = b["status"] + ("(i)" if b.get("interpreted") else "") + ("*" if b.get("fallback") else "")
            lines.append(
                [
                    rec["label"],
                    b["backend"],
                    status,
                    f"{ms[rec['stat']]:.3f}" if ms else "-",
                    f"{ms['spread']:.0%}" if ms else "-",
                    f"{b['speedup']:.2f}" if b.get("speedup") else "-",
                    f"{b['model_ms']:.3f}" if b.get("model_ms") is not None else "-",
                    f"{b['model_rel_err']:+.0%}" if b.get("model_rel_err") is not None else "-",
                ]
            )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = "\n".join(
        "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        for line in lines
    )
    return text + (
        f"\n\n{MODEL_NOTE}; model err = (model - measured) / measured. x base = the unfused baseline's time over "
        "the row's (sequential; grouped_matmul: the per-expert torch.mm loop). ok(i): checked in Triton's "
        "interpreter, not timed; *: fused ran the chunked path (the dispatcher's warning is in the JSON)."
    )


def model_rows(cases: list[MoeCase], backends: list[str], generation: str) -> list[dict]:
    """PREDICTIONS alone for ``generation`` (roofline GEMMs, configs/links.yaml): no measurement."""
    link, spec = perf_model.load_gpu(generation)
    records = []
    for case in cases:
        rows = [{"backend": b, "status": "model"} for b in backends_of(case, backends)]
        records.append(derive(case, rows, {}, models=Models(link, spec), stat="median"))
    return records


def main(args: argparse.Namespace, device_type: str) -> int:
    """``python -m bench --mode moe`` (the options of ``python -m bench``; ``--suite`` names MoE suites)."""
    from bench.harness import launch

    names = args.suite or ["tiny"]
    try:
        suites = [load(n) for n in names]
    except ValueError as e:
        raise SystemExit(f"error: --suite: {e}") from e
    if args.dtypes and args.dtypes[0] not in DTYPES:
        raise SystemExit(f"error: --dtypes: {args.dtypes[0]!r} not in {DTYPES}")
    dtype, tokens = (args.dtypes or [None])[0], (args.tokens or [None])[0]
    cases = [c for s in suites for c in expand(s, worlds=args.world_sizes, tokens=tokens, dtype=dtype)]
    backends = list(args.backends or suites[0].get("backends", ["sequential", "chunked2", "chunked4", "fused"]))
    backends = ["sequential"] + [b for b in backends if b != "sequential"]
    meta_extra = {"mode": "moe", "suites": names, "backends": backends, "config": os.path.relpath(CONFIG_PATH)}
    if args.gpu and device_type != "cuda":
        records = model_rows(cases, backends, args.gpu)
        text = table(records).replace("model ms", "MODEL ms") + f"\n\nMODEL ONLY for {args.gpu}: nothing was measured."
        meta = report.metadata("cpu", sys.argv, {**meta_extra, "gpu_generation": args.gpu})
        meta["device"] = {"type": "model", "name": f"model-{args.gpu}"}
        return _finish(args, {"meta": meta, "records": records}, text, bad=[])
    gen = None
    if device_type == "cuda" and not args.no_model:
        gen = args.gpu or perf_model.detect_generation(torch.cuda.get_device_name(0))
    suite_counts = [(s.get("warmup"), s.get("repeats")) for s in suites]
    opts = MoeOptions(
        backends=backends,
        warmup=args.warmup if args.warmup is not None else suite_counts[0][0] or (10 if device_type == "cuda" else 2),
        repeats=args.repeats
        if args.repeats is not None
        else suite_counts[0][1] or (50 if device_type == "cuda" else 7),
        seed=args.seed,
        stat=args.stat,
        model=not args.no_model,
        gpu_generation=gen,
    )
    gpus = torch.cuda.device_count() if device_type == "cuda" else None
    results = []
    for world in sorted({c.shape.world for c in cases}):
        if gpus is not None and world > gpus:
            report.say(f"skipping world size {world}: this node has {gpus} GPU(s), one per rank")
            continue
        todo = [c for c in cases if c.shape.world == world]
        started = time.monotonic()
        results.append(
            launch.spawn(run_world, world, device_type, args.timeout, todo, opts, cpu_threads=args.cpu_threads)
        )
        report.say(f"W={world}: {len(todo)} cases in {time.monotonic() - started:.1f} s")
    records = [r for res in results for r in res["records"]]
    meta = report.metadata(device_type, sys.argv, {**meta_extra, **dataclasses.asdict(opts)})
    doc = {
        "meta": meta,
        "records": records,
        "model": {
            "note": MODEL_NOTE,
            "link_models": {str(res["world"]): res["link_model"] for res in results},
            "calibration_samples": [s for res in results for s in res["calibration_samples"]],
        },
    }
    bad = [f"{r['label']} {b['backend']}" for r in records for b in r["backends"] if b["status"] == "incorrect"]
    return _finish(args, doc, table(records), bad=bad)


def _finish(args: argparse.Namespace, doc: dict[str, Any], text: str, *, bad: list[str]) -> int:
    print(text)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, args.name or "moe-" + report.default_stem(doc["meta"], None))
    report.write_json(stem + ".json", doc)
    report.say(f"wrote {stem}.json")
    if "txt" in args.format:
        with open(stem + ".txt", "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if bad:
        report.say("INCORRECT results (differ from plain torch math): " + "; ".join(bad))
        return 1
    return 0
