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

from bench.dense import modes
from bench.harness.suites import (
    BACKENDS,
    DTYPES,
    FORMATS,
    OP_ALIASES,
    OPS,
    list_suites,
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


def _add_list(p: argparse.ArgumentParser, flags: tuple[str, ...], kind: Any, help_text: str) -> None:
    """A comma-list option of ``kind`` values (``LIST``; None when not given, so the suite or the mode decides)."""
    p.add_argument(*flags, type=_csv(kind), default=None, metavar="LIST", help=help_text)


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
        "command that writes a correctness and speed report of this GPU (bench/gpu_check/driver.py; "
        "--allow-cpu runs it on CPU under the interpreter); tune: time the GEMM config space "
        "against cuBLAS and write configs/tuned/<gpu-name>.yaml, or into --out-dir when given "
        "(bench/tune/tuner.py; --allow-cpu: tiny shapes under the interpreter, cpu.yaml always into --out-dir); "
        "hf-sweep: transformers families vs one process, --backends from sequential,chunked,fused (bench/sweep/hf.py); "
        "moe: the MoE suites of configs/moe-bench.yaml (bench/moe/mode.py; --gpu GEN without CUDA: the model alone)",
    )
    _add_list(
        p,
        ("--sections",),
        str,
        "gpu-check only: comma list of sections to run, from env,tune,tests,speed (default: all)",
    )
    p.add_argument(
        "--suite",
        action="append",
        default=None,
        metavar="NAME|PATH",
        help="shape suite name or YAML path; repeatable (default: tiny)",
    )
    _add_list(
        p,
        ("--ops",),
        parse_op,
        f"comma list of ops to run (default: the suite's); accepted: {', '.join(OPS)} or {', '.join(OP_ALIASES)}",
    )
    _add_list(
        p,
        ("--backends",),
        str,
        f"comma list from {', '.join(BACKENDS)} (default: the suite's; sequential is always run as the reference)",
    )
    _add_list(p, ("--dtypes",), str, f"comma list from {', '.join(DTYPES)} (default: the suite's)")
    _add_list(
        p,
        ("--operand-formats",),
        parse_format,
        f"comma list of operand formats from {', '.join(FORMATS)} (int8:per_group:<group size>; "
        "default: the suite's format key, else plain); fp8: dtype is the output's",
    )
    _add_list(
        p, ("--world-sizes", "--world-size"), int, "comma list of world sizes (TP degrees) (default: the suite's)"
    )
    _add_list(p, ("--tokens",), int, "comma list of M (rows across the TP group) replacing the suite's")
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


def _exit_on_sigterm() -> None:
    """SIGTERM ends the run through SystemExit, so temporary folders (``coc-bench-*``, the rank
    pools' ``coc-pool-*``) are removed and the ranks stopped by the usual ``finally`` and ``atexit``
    code; the default action would kill the process and leave them behind."""
    import signal

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)


def _check_output_args(args: argparse.Namespace) -> None:
    """``--cpu-threads`` and ``--format``, checked for every mode before it starts its work."""
    if args.cpu_threads < 1:
        raise SystemExit(f"error: --cpu-threads must be >= 1, got {args.cpu_threads}")
    for f in args.format:
        if f not in ("json", "csv", "png", "txt"):
            raise SystemExit(f"error: --format: {f!r} not in json,csv,png,txt")


def _main_tune(args: argparse.Namespace) -> int:
    """``--mode tune``: the tuned file's place depends on whether the kernels here would ever read it."""
    if args.allow_cpu and not _cuda_available():
        # Must precede any import of triton in this process.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from bench.tune import tuner

    # On a GPU the tuned file goes where the kernels read it (configs/tuned) unless --out-dir is named.
    # A CPU file is never read from there (only from COC_TUNED_DIR): it goes to --out-dir, default included.
    named = args.out_dir != build_parser().get_default("out_dir")
    out_dir = args.out_dir if named or not _cuda_available() else None
    return tuner.main(out_dir, args.allow_cpu)


def main(argv: list[str] | None = None) -> int:
    _exit_on_sigterm()
    args = build_parser().parse_args(argv)
    _check_output_args(args)
    if args.mode == "hf-sweep":
        from bench.sweep import hf

        return hf.main(args)
    if any(b not in BACKENDS for b in args.backends or []):
        raise SystemExit(f"error: --backends {','.join(args.backends)}: accepted {', '.join(BACKENDS)}")
    if args.mode == "model":
        return modes.main_model(args)
    if args.mode == "gpu-check":
        from bench.gpu_check import driver

        return driver.main(args.out_dir, args.allow_cpu, args.sections)
    if args.mode == "tune":
        return _main_tune(args)
    device_type = _device_type(args.device)
    if device_type == "cpu":
        # Must precede any import of triton in this process (world size 1 runs here).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.mode == "moe":
        from bench.moe import mode

        return mode.main(args, device_type)
    if args.mode == "single":
        return modes.main_single(args, device_type)
    return modes.main_run(args, device_type)


if __name__ == "__main__":
    sys.exit(main())
