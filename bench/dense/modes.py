"""The dense benchmark's modes of ``python -m bench``: ``run`` (the distributed benchmark of the suites' cases,
:mod:`bench.dense.runner` on each rank), ``single`` (one GPU's fixed costs, :mod:`bench.dense.single`) and ``model``
(the performance model's predictions alone, :mod:`bench.model.dense`). ``bench/__main__.py`` parses the command
line and calls one of them.
"""

from __future__ import annotations

import argparse
import os
import sys

from bench.harness import report
from bench.harness.suites import DTYPES, Case, load_suite


def count(cli: int | None, suite: int | None, device_type: str, cpu: int, gpu: int) -> int:
    """Warm-up or repeat count: the command line's, else the suite's, else the device's default (the run and
    single modes)."""
    if cli is not None:
        return cli
    if suite is not None:
        return suite
    return gpu if device_type == "cuda" else cpu


def _select_cases(args: argparse.Namespace, world_override: int | None = None) -> tuple[list[Case], list, dict]:
    suites = [load_suite(s) for s in (args.suite or ["tiny"])]
    for d in args.dtypes or []:
        if d not in DTYPES:
            raise SystemExit(f"error: --dtypes: {d!r} not in {DTYPES}")
    cases: list[Case] = []
    skipped: list[dict] = []
    first = suites[0]
    for s in suites:
        cases += s.cases(
            ops=args.ops,
            tokens=args.tokens,
            world_sizes=[world_override] if world_override else args.world_sizes,
            dtypes=args.dtypes,
            formats=args.operand_formats,
        )
    valid = []
    for c in cases:
        reason = c.invalid_reason()
        if reason:
            skipped.append({"case": c.label, "reason": reason})
        else:
            valid.append(c)
    defaults = {"backends": first.backends, "warmup": first.warmup, "repeats": first.repeats}
    return valid, skipped, defaults


def _filter_available_ops(cases: list[Case], skipped: list[dict]) -> list[Case]:
    from bench.dense.formats import public_op
    from bench.dense.runner import has_op

    keep = []
    missing: set[str] = set()
    for c in cases:
        if has_op(c):
            keep.append(c)
        else:
            missing.add(public_op(c))
            skipped.append({"case": c.label, "reason": f"kernels.{public_op(c)} is not available in this build"})
    for op in sorted(missing):
        if os.environ.get("RANK", "0") == "0":  # under torchrun, say it once
            report.say(f"skipping {op}: kernels.{op} is not available in this build")
    return keep


def _gpu_generation(args: argparse.Namespace, device_type: str) -> str | None:
    from bench.model import dense as perf_model

    if args.gpu:
        if args.gpu not in perf_model.known_generations():
            raise SystemExit(
                f"error: --gpu {args.gpu!r} not in configs/links.yaml ({', '.join(perf_model.known_generations())})"
            )
        return args.gpu
    if device_type == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
        gen = perf_model.detect_generation(name)
        if gen is None:
            report.say(f"no link model for {name!r} in configs/links.yaml: pass --gpu or --calibrate for predictions")
        return gen
    return None


def _write(args: argparse.Namespace, doc: dict, records: list[dict], text: str, plot_title: str) -> list[str]:
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, report.default_stem(doc["meta"], args.name))
    written = []
    if "json" in args.format:
        report.write_json(stem + ".json", doc)
        written.append(stem + ".json")
    if "csv" in args.format and records and "backends" in records[0]:
        report.write_csv(stem + ".csv", records, doc["meta"])
        written.append(stem + ".csv")
    if "txt" in args.format:
        with open(stem + ".txt", "w", encoding="utf-8") as f:
            f.write(text + "\n")
        written.append(stem + ".txt")
    if "png" in args.format and records and "backends" in records[0]:
        why = report.write_plot(stem + ".png", records, plot_title)
        if why:
            report.say(f"plot skipped: {why}")
        else:
            written.append(stem + ".png")
    return written


def main_model(args: argparse.Namespace) -> int:
    from bench.dense.runner import predict, roofline_gemm
    from bench.model import dense as perf_model

    if not args.gpu:
        raise SystemExit(f"error: --mode model needs --gpu (one of {', '.join(perf_model.known_generations())})")
    gen = _gpu_generation(args, "cpu")
    link, spec = perf_model.load_gpu(gen)
    cases, skipped, defaults = _select_cases(args)
    backends = args.backends or defaults["backends"]
    if "sequential" not in backends:
        backends = ["sequential"] + backends
    if any(c.kind == "fp8" for c in cases):
        # FP8's unfused path is not its sequential backend (an fp32 reference); for the others the model's
        # baseline is the sequential schedule.
        backends = ["sequential", "baseline"] + [b for b in backends if b != "sequential"]
    records = []
    for c in cases:
        preds = {b: predict(c, b, roofline_gemm(spec, c, b), link) for b in backends}
        base = preds["baseline" if c.kind == "fp8" else "sequential"]
        comm_bytes = perf_model.comm_bytes(
            c.op,
            "baseline",
            c.gemm_shape,
            c.comm_elems,
            "fp8" if c.kind == "fp8" else c.dtype,
            fp8_mode=c.mode if c.kind == "fp8" else "block",
            out_dtype=c.dtype,
        )
        records.append(
            {
                **c.to_dict(),
                "label": c.label,
                "model_gemm_ms": roofline_gemm(spec, c, "baseline")(*c.gemm_shape) * 1e3,
                "model_comm_ms": link.collective_time(c.collective, comm_bytes, c.world) * 1e3,
                "backends": [
                    {
                        "backend": b,
                        "model_ms": None if t is None else t * 1e3,
                        "model_speedup": None if t is None or base is None else base / t,
                    }
                    for b, t in preds.items()
                ],
            }
        )
    head = (
        ["case (MODEL, not measured)", "gemm ms", "comm ms"]
        + [f"{b} ms" for b in backends]
        + [f"{b} x" for b in backends if b not in ("sequential", "baseline")]
    )
    lines = [head]
    for r in records:
        ms = [f"{b['model_ms']:.3f}" if b["model_ms"] is not None else "-" for b in r["backends"]]
        sp = [
            f"{b['model_speedup']:.2f}" if b["model_speedup"] is not None else "-"
            for b in r["backends"]
            if b["backend"] not in ("sequential", "baseline")
        ]
        lines.append([r["label"], f"{r['model_gemm_ms']:.3f}", f"{r['model_comm_ms']:.3f}"] + ms + sp)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=False))
        )
        for line in lines
    )
    text += (
        f"\n\nMODEL PREDICTIONS for {gen} (configs/links.yaml: datasheet bandwidths, assumed efficiencies "
        "and latencies; GEMM time from a roofline, not measured). x = predicted speedup over the unfused "
        "baseline (sequential; FP8: the baseline, torch._scaled_mm + NCCL)."
    )
    print(text)
    doc = {
        "meta": report.metadata("cpu", sys.argv, {"mode": "model", "gpu_generation": gen}),
        "link_model": link.describe(),
        "gpu_spec": vars(spec),
        "records": records,
        "skipped": skipped,
    }
    doc["meta"]["device"] = {"type": "model", "name": f"model-{gen}"}
    args.format = [f for f in args.format if f == "json"]
    for path in _write(args, doc, records, text, ""):
        report.say(f"wrote {path}")
    return 0


def main_single(args: argparse.Namespace, device_type: str) -> int:
    from bench.dense.runner import RunOptions
    from bench.dense.single import run_single, single_table
    from bench.harness import launch

    if device_type != "cuda" and not args.allow_cpu:
        print(
            "single-GPU mode needs a CUDA GPU (none found): skipped. On CPU the Triton kernels run in the "
            "interpreter, so their times would mean nothing (--allow-cpu runs it anyway to test the code path)."
        )
        return 0
    cases, skipped, defaults = _select_cases(args)
    cases = _filter_available_ops(cases, skipped)
    opts = RunOptions(
        backends=[],
        warmup=count(args.warmup, defaults["warmup"], device_type, 2, 10),
        repeats=count(args.repeats, defaults["repeats"], device_type, 7, 50),
        seed=args.seed,
        progress=not args.no_progress,
    )
    out = launch.run_in_process(run_single, device_type, args.timeout, cases, opts, cpu_threads=args.cpu_threads)
    text = single_table(out["records"])
    print(text)
    meta = report.metadata(device_type, sys.argv, {"mode": "single", "warmup": opts.warmup, "repeats": opts.repeats})
    doc = {"meta": meta, "records": out["records"], "skipped": skipped}
    args.format = [f for f in args.format if f in ("json", "txt")]
    for path in _write(args, doc, out["records"], text, ""):
        report.say(f"wrote {path}")
    return 0


def drop_worlds_over_gpus(cases: list[Case], skipped: list[dict]) -> list[Case]:
    """The cases this node can spawn (one GPU per rank); the others are added to ``skipped`` with the reason."""
    import torch

    gpus = torch.cuda.device_count()
    too_big = sorted({c.world for c in cases if c.world > gpus})
    if too_big:
        report.say(f"skipping world sizes {too_big}: this node has {gpus} GPU(s), one per rank")
        skipped += [{"case": c.label, "reason": f"world size {c.world} > {gpus} GPUs"} for c in cases if c.world > gpus]
        cases = [c for c in cases if c.world <= gpus]
    return cases


def _model_label(link_models: dict[str, dict | None]) -> str | None:
    """The table's model note names the link models the worlds used (None when no world had one)."""
    names = sorted({lm["name"] for lm in link_models.values() if lm})
    return "link model: " + ", ".join(names) if names else None


def _print_model_summary(records: list[dict]) -> dict:
    """Print how far the model's predictions were from the measurements, per backend; returns the summary."""
    summary = report.model_summary(records)
    if summary:
        print(
            "\nmodel vs measured, median |relative error| per backend: "
            + ", ".join(
                f"{b} {s['median_abs_rel_err']:.0%} (max {s['max_abs_rel_err']:.0%}, {s['cases']} cases)"
                for b, s in sorted(summary.items())
            )
        )
    return summary


def main_run(args: argparse.Namespace, device_type: str) -> int:
    from bench.dense.runner import RunOptions, run_world
    from bench.harness import launch

    torchrun = launch.under_torchrun()
    world_override = int(os.environ["WORLD_SIZE"]) if torchrun else None
    if torchrun and args.world_sizes and world_override not in args.world_sizes:
        report.say(f"under torchrun the world size is {world_override}; --world-sizes {args.world_sizes} ignored")
    cases, skipped, defaults = _select_cases(args, world_override)
    cases = _filter_available_ops(cases, skipped)
    backends = list(args.backends or defaults["backends"])
    if "sequential" not in backends:
        backends.insert(0, "sequential")
    gen = None if args.no_model else _gpu_generation(args, device_type)
    opts = RunOptions(
        backends=backends,
        warmup=count(args.warmup, defaults["warmup"], device_type, 2, 10),
        repeats=count(args.repeats, defaults["repeats"], device_type, 7, 50),
        seed=args.seed,
        progress=not args.no_progress,
        calibrate=args.calibrate,
        gpu_generation=gen,
        model=not args.no_model,
        stat=args.stat,
    )
    if device_type == "cuda" and not torchrun:
        cases = drop_worlds_over_gpus(cases, skipped)
    if device_type == "cpu" and any(c.flops > 5e10 for c in cases):
        report.say("note: these are GPU-sized shapes; on CPU each case takes minutes (try --suite tiny or cpu)")
    worlds = sorted({c.world for c in cases})
    results = []
    if torchrun:
        import torch.distributed as dist

        rank, world, device = launch.init_torchrun(device_type, args.timeout, args.cpu_threads)
        try:
            results.append(run_world(rank, world, device, cases, opts))
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        for world in worlds:
            results.append(
                launch.spawn(
                    run_world,
                    world,
                    device_type,
                    args.timeout,
                    [c for c in cases if c.world == world],
                    opts,
                    cpu_threads=args.cpu_threads,
                )
            )
    records = [r for res in results for r in res["records"]]
    link_models = {str(res["world"]): res["link_model"] for res in results}
    model_label = None if args.no_model else _model_label(link_models)
    text = report.table(records, model_label)
    print(text)
    summary = _print_model_summary(records)
    meta = report.metadata(
        device_type,
        sys.argv,
        {
            "mode": "run",
            "suites": args.suite or ["tiny"],
            "backends": backends,
            "stat": opts.stat,
            "warmup": opts.warmup,
            "repeats": opts.repeats,
            "world_sizes": worlds,
            "torchrun": torchrun,
            "cpu_threads": args.cpu_threads,
        },
    )
    doc = {
        "meta": meta,
        "records": records,
        "skipped": skipped,
        "model": {
            "note": report.MODEL_NOTE,
            "link_models": link_models,
            "summary": summary,
            "calibration_samples": [s for res in results for s in res["calibration_samples"]],
        },
    }
    for path in _write(args, doc, records, text, f"{meta['device']['name']} {', '.join(meta['suites'])}"):
        report.say(f"wrote {path}")
    bad = [f"{r['label']} {b['backend']}" for r in records for b in r["backends"] if b["status"] == "incorrect"]
    if bad:
        report.say("INCORRECT results (differ from sequential): " + "; ".join(bad))
        return 1
    return 0
