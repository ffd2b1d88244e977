"""``python -m bench``: benchmark the fused / overlapped TP ops, and model them.

Examples::

    python -m bench --suite tiny                          # CPU smoke run, writes JSON + CSV (docs/bench.md: time)
    python -m bench --suite llama2-70b --world-sizes 8 --ops ag,rs --backends sequential,chunked4,fused
    python -m bench --suite cpu --operand-formats plain,fp8:row,int8:per_group   # every op in other formats
    torchrun --nproc-per-node 8 -m bench --suite llama3-70b   # under torchrun: W = its world size
    python -m bench --mode single --suite llama2-70b --world-sizes 8   # single GPU: GEMM core, fixed costs
    PYTHONPATH=. python3 -m bench --mode gpu-check --out-dir bench/results   # a GPU machine's whole report
    python -m bench --mode model --gpu H800 --suite flux-ref  # predictions only (no measurement)
    python -m bench --mode hf-sweep --out-dir bench/results   # HF model families under parallelize_hf (CPU)
    python -m bench --mode moe --suite tiny   # MoE ops (configs/moe-bench.yaml); --gpu H800 without CUDA: model only
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from bench.harness import report
from bench.harness.suites import (
    BACKENDS,
    DTYPES,
    FORMATS,
    OP_ALIASES,
    OPS,
    Case,
    list_suites,
    load_suite,
    parse_format,
    parse_op,
)


def _csv(kind: Any) -> Any:
    def parse(text: str) -> list:
        try:
            return [kind(t) for t in text.split(",") if t.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark all_gather_matmul / matmul_reduce_scatter / matmul_all_reduce over shape "
        "suites, backends, dtypes, world sizes and operand formats (plain, FP8, int8 weights: the scaled "
        "and quantized op of each pattern). Each case is checked against the sequential backend before "
        "it is timed. Reports median and spread over repeats (max over ranks), TFLOP/s per "
        "rank, the bare collective's bus bandwidth, speedup over the unfused baseline (sequential; "
        "FP8: torch._scaled_mm + the collective), and overlap "
        "efficiency (t_gemm + t_comm - t_op) / min(t_gemm, t_comm). Beside each measurement "
        "it prints the performance model's PREDICTION (bench/model/dense.py), labelled as a model.",
        epilog=(
            "Suites (configs/bench/): "
            + ", ".join(list_suites())
            + ". Ops: "
            + ", ".join(f"{a}={o}" for a, o in OP_ALIASES.items())
            + ". Without torchrun the tool spawns one process "
            "per rank for each world size (gloo on CPU, NCCL with one GPU per rank); under torchrun it runs "
            "the cases of torchrun's world size. Exit status 1 if any backend disagrees with sequential."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--mode",
        choices=("run", "single", "model", "gpu-check", "tune", "hf-sweep", "moe"),
        default="run",
        help="run: distributed benchmark (default); single: one-GPU fixed costs (Triton GEMM core "
        "vs torch, fused op at world 1 vs bare GEMM, 4-way chunking at world 1); model: print "
        "the model's predictions for --gpu without measuring anything; gpu-check: one "
        "command that writes a correctness and speed report of this GPU (bench/gpu_check.py; "
        "--allow-cpu runs it on CPU under the interpreter); tune: time the GEMM config space "
        "against cuBLAS and write configs/tuned/<gpu-name>.yaml, or into --out-dir when given "
        "(bench/tune.py; --allow-cpu: tiny shapes under the interpreter, cpu.yaml always into --out-dir); "
        "hf-sweep: transformers families vs one process, --backends from sequential,chunked,fused (bench/hf_sweep.py); "
        "moe: the MoE suites of configs/moe-bench.yaml (bench/moe.py; --gpu GEN without CUDA: the model alone)",
    )
    p.add_argument(
        "--sections",
        type=_csv(str),
        default=None,
        metavar="LIST",
        help="gpu-check only: comma list of sections to run, from env,tune,tests,speed (default: all)",
    )
    p.add_argument(
        "--suite",
        action="append",
        default=None,
        metavar="NAME|PATH",
        help="shape suite name or YAML path; repeatable (default: tiny)",
    )
    p.add_argument(
        "--ops",
        type=_csv(parse_op),
        default=None,
        metavar="LIST",
        help=f"comma list of ops to run (default: the suite's); accepted: {', '.join(OPS)} or {', '.join(OP_ALIASES)}",
    )
    p.add_argument(
        "--backends",
        type=_csv(str),
        default=None,
        metavar="LIST",
        help=f"comma list from {', '.join(BACKENDS)} (default: the suite's; sequential is always run as the reference)",
    )
    p.add_argument(
        "--dtypes",
        type=_csv(str),
        default=None,
        metavar="LIST",
        help=f"comma list from {', '.join(DTYPES)} (default: the suite's)",
    )
    p.add_argument(
        "--operand-formats",
        type=_csv(parse_format),
        default=None,
        metavar="LIST",
        help=f"comma list of operand formats from {', '.join(FORMATS)} (int8:per_group:<group size>; "
        "default: the suite's format key, else plain); fp8: dtype is the output's",
    )
    p.add_argument(
        "--world-sizes",
        "--world-size",
        type=_csv(int),
        default=None,
        metavar="LIST",
        help="comma list of world sizes (TP degrees) (default: the suite's)",
    )
    p.add_argument(
        "--tokens",
        type=_csv(int),
        default=None,
        metavar="LIST",
        help="comma list of M (rows across the TP group) replacing the suite's",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="warm-up calls per timing (default: suite, else 2 CPU / 10 GPU)"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed calls per timing (default: suite, else 7 CPU / 50 GPU)"
    )
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when available, else CPU"
    )
    p.add_argument(
        "--gpu",
        default=None,
        metavar="GEN",
        help="GPU generation of configs/links.yaml for the model (default: detected from the device "
        "name); required for --mode model",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="fit the link model to collective-only timings of this run (always on for CPU runs)",
    )
    p.add_argument("--no-model", action="store_true", help="do not compute model predictions")
    p.add_argument("--families", type=_csv(str), metavar="LIST", help="hf-sweep only: model types (default: all)")
    p.add_argument(
        "--out-dir", default="bench_results", help="directory for the report files (default: ./bench_results)"
    )
    p.add_argument("--name", default=None, help="file stem of the reports (default: <device>-<backend>-<UTC time>)")
    p.add_argument(
        "--format",
        type=_csv(str),
        default=["json", "csv", "png"],
        metavar="LIST",
        help="comma list from json,csv,png (png needs matplotlib; skipped with a message otherwise)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a world size's run is killed")
    p.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="statistic of the repeats behind speedup, overlap, TFLOP/s and the model comparison "
        "(default median; min = least disturbed repeat, for machines shared with other work); "
        "the reports keep median, p20, p80, min and max either way",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch threads per rank on CPU (default 1: figures per core, and no OpenMP spinning "
        "when ranks share the cores)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run the GPU modes (--mode single, gpu-check, tune) on CPU anyway: tests their code path; "
        "the Triton kernels then run in the interpreter and the times are meaningless",
    )
    return p


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _device_type(choice: str) -> str:
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch.cuda.is_available() is False")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


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
    from bench.formats import public_op
    from bench.runner import has_op

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
    from bench.model import dense as perf_model
    from bench.runner import predict, roofline_gemm

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
    from bench.harness import launch
    from bench.moe import count as _count
    from bench.runner import RunOptions
    from bench.single import run_single, single_table

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
        warmup=_count(args.warmup, defaults["warmup"], device_type, 2, 10),
        repeats=_count(args.repeats, defaults["repeats"], device_type, 7, 50),
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


def main_run(args: argparse.Namespace, device_type: str) -> int:
    from bench.harness import launch
    from bench.moe import count as _count
    from bench.runner import RunOptions, run_world

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
        warmup=_count(args.warmup, defaults["warmup"], device_type, 2, 10),
        repeats=_count(args.repeats, defaults["repeats"], device_type, 7, 50),
        seed=args.seed,
        progress=not args.no_progress,
        calibrate=args.calibrate,
        gpu_generation=gen,
        model=not args.no_model,
        stat=args.stat,
    )
    if device_type == "cuda" and not torchrun:
        import torch

        gpus = torch.cuda.device_count()
        too_big = sorted({c.world for c in cases if c.world > gpus})
        if too_big:
            report.say(f"skipping world sizes {too_big}: this node has {gpus} GPU(s), one per rank")
            skipped += [
                {"case": c.label, "reason": f"world size {c.world} > {gpus} GPUs"} for c in cases if c.world > gpus
            ]
            cases = [c for c in cases if c.world <= gpus]
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
    model_label = None
    if not args.no_model:
        names = sorted({lm["name"] for lm in link_models.values() if lm})
        model_label = "link model: " + ", ".join(names) if names else None
    text = report.table(records, model_label)
    print(text)
    summary = report.model_summary(records)
    if summary:
        print(
            "\nmodel vs measured, median |relative error| per backend: "
            + ", ".join(
                f"{b} {s['median_abs_rel_err']:.0%} (max {s['max_abs_rel_err']:.0%}, {s['cases']} cases)"
                for b, s in sorted(summary.items())
            )
        )
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


def _exit_on_sigterm() -> None:
    """SIGTERM ends the run through SystemExit, so temporary folders (``coc-bench-*``, the rank
    pools' ``coc-pool-*``) are removed and the ranks stopped by the usual ``finally`` and ``atexit``
    code; the default action would kill the process and leave them behind."""
    import signal

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)


def main(argv: list[str] | None = None) -> int:
    _exit_on_sigterm()
    args = build_parser().parse_args(argv)
    if args.cpu_threads < 1:
        raise SystemExit(f"error: --cpu-threads must be >= 1, got {args.cpu_threads}")
    for f in args.format:
        if f not in ("json", "csv", "png", "txt"):
            raise SystemExit(f"error: --format: {f!r} not in json,csv,png,txt")
    if args.mode == "hf-sweep":
        from bench import hf_sweep

        return hf_sweep.main(args)
    if any(b not in BACKENDS for b in args.backends or []):
        raise SystemExit(f"error: --backends {','.join(args.backends)}: accepted {', '.join(BACKENDS)}")
    if args.mode == "model":
        return main_model(args)
    if args.mode == "gpu-check":
        from bench import gpu_check

        return gpu_check.main(args.out_dir, args.allow_cpu, args.sections)
    if args.mode == "tune":
        if args.allow_cpu and not _cuda_available():
            # Must precede any import of triton in this process.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from bench import tune

        # On a GPU the tuned file goes where the kernels read it (configs/tuned) unless --out-dir is named.
        # A CPU file is never read from there (only from COC_TUNED_DIR): it goes to --out-dir, default included.
        named = args.out_dir != build_parser().get_default("out_dir")
        out_dir = args.out_dir if named or not _cuda_available() else None
        return tune.main(out_dir, args.allow_cpu)
    device_type = _device_type(args.device)
    if device_type == "cpu":
        # Must precede any import of triton in this process (world size 1 runs here).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.mode == "moe":
        from bench import moe

        return moe.main(args, device_type)
    if args.mode == "single":
        return main_single(args, device_type)
    return main_run(args, device_type)


if __name__ == "__main__":
    sys.exit(main())
