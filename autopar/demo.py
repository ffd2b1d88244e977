"""The main job: train a tensor-parallel transformer MLP block on every available path and check it.

``python -m autopar.demo`` spawns 4 ranks (gloo on CPU; NCCL with one GPU per rank when there are
at least 4 GPUs) or, under ``torchrun``, uses the ranks torchrun started::

    torchrun --nproc-per-node 4 -m autopar.demo

Each rank builds the block ``ColumnParallelLinear(h, 4h) -> gelu -> RowParallelLinear(4h, h)``
with sequence parallelism on and off, trains it a few SGD steps on every path (``sequential``,
``chunked`` with 2 / 4 / 8 pieces, ``fused`` where the fused kernels can run here), and after
every step compares the loss and every parameter gradient with the same model run in one process
on the full tensors. Rank 0 prints one table row per (path, sequence parallel) run: the step time
and the largest difference from the single-process reference, relative to the reference's
largest magnitude. The exit status is non-zero if any run differs by more than the tolerance or
any rank fails.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# fp32 differences between the TP and single-process runs come from summation order only: about
# eps32 * sqrt(terms) ~ 1e-6 relative for these sizes. 1e-4 leaves margin and still catches any
# misplaced shard, missing reduction or double-counted bias (all O(1) relative). This is a different
# quantity from kernels.testing.tolerance (one op's elementwise error against its fp64 reference): a
# relative difference of a whole training step's loss and gradients between two fp32 runs.
REL_TOL = 1e-4


@dataclass(frozen=True)
class Path:
    name: str
    parallel_num: int
    env: dict

    @property
    def label(self) -> str:
        return self.name if self.name != "chunked" else f"chunked/{self.parallel_num}"


PATHS = (
    Path("sequential", 1, {"COC_PARALLEL_NUM": "1", "USE_COC_FUSED_KERNEL": "0"}),
    Path("chunked", 2, {"COC_PARALLEL_NUM": "2", "USE_COC_FUSED_KERNEL": "0"}),
    Path("chunked", 4, {"COC_PARALLEL_NUM": "4", "USE_COC_FUSED_KERNEL": "0"}),
    Path("chunked", 8, {"COC_PARALLEL_NUM": "8", "USE_COC_FUSED_KERNEL": "0"}),
    Path("fused", 1, {"COC_PARALLEL_NUM": "1", "USE_COC_FUSED_KERNEL": "1"}),
)


@dataclass
class Row:
    path: str
    parallel_num: int
    sequence_parallel: bool
    step_ms: float = float("nan")
    loss_diff: float = float("nan")
    grad_diff: float = float("nan")
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.note.startswith("skipped") or (self.loss_diff <= REL_TOL and self.grad_diff <= REL_TOL)


def fused_unavailable_reason(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """Why the fused kernels cannot run on this group and device, or None when they can."""
    try:
        from kernels import fused
    except ImportError as e:
        return f"kernels.fused is not available ({e})"
    check = getattr(fused, "unavailable_reason", None)
    if check is None:
        return "kernels.fused has no unavailable_reason()"
    return check(group, device)


class _Env:
    """Set environment variables for a block (the COC_* values are read at call time)."""

    def __init__(self, values: dict) -> None:
        self.values, self.saved = values, {}

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc: Any) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_and_check(path: Path, sp: bool, args: argparse.Namespace, device: torch.device) -> Row:
    """Train the TP block and the single-process reference side by side on this rank."""
    from autopar import ColumnParallelLinear, ParallelConfig, RowParallelLinear

    rank, world = dist.get_rank(), dist.get_world_size()
    row = Row(path.label, path.parallel_num, sp)
    h, f, s, b = args.hidden, 4 * args.hidden, args.seq, args.batch
    cfg = ParallelConfig(sequence_parallel=sp, use_cpu_initialization=True)

    torch.manual_seed(1234)
    fc1 = ColumnParallelLinear(
        h, f, config=cfg, init_method=torch.nn.init.xavier_normal_, keep_master_weight_for_test=True
    )
    fc2 = RowParallelLinear(
        f,
        h,
        config=cfg,
        init_method=torch.nn.init.xavier_normal_,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        keep_master_weight_for_test=True,
    )
    gen = torch.Generator().manual_seed(99)
    b1_full = 0.1 * torch.randn(f, generator=gen)
    b2_full = 0.1 * torch.randn(h, generator=gen)
    f_sl = slice(rank * f // world, (rank + 1) * f // world)
    s_sl = slice(rank * s // world, (rank + 1) * s // world)
    with torch.no_grad():
        fc1.bias.copy_(b1_full[f_sl])
        fc2.bias.copy_(b2_full)
    ref = [t.clone().requires_grad_() for t in (fc1.master_weight, b1_full, fc2.master_weight, b2_full)]
    fc1.to(device)
    fc2.to(device)
    params = [fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    # The slice of the reference gradient each TP gradient must equal.
    ref_slices = [(f_sl,), (f_sl,), (slice(None), f_sl), (slice(None),)]

    times = []
    row.loss_diff = row.grad_diff = 0.0
    for _ in range(args.steps):
        x_full = torch.randn(s, b, h, generator=gen)
        t_full = torch.randn(s, b, h, generator=gen)
        n_total = t_full.numel()

        # Single-process reference.
        y_ref = torch.nn.functional.linear(
            torch.nn.functional.gelu(torch.nn.functional.linear(x_full, ref[0], ref[1])), ref[2], ref[3]
        )
        loss_ref = ((y_ref - t_full) ** 2).sum() / n_total
        loss_ref.backward()

        # Tensor-parallel block: with SP each rank holds s/W rows of input, output and target.
        x = (x_full[s_sl] if sp else x_full).to(device)
        target = (t_full[s_sl] if sp else t_full).to(device)
        for p in params:
            p.grad = None
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        hidden, _ = fc1(x)
        y, _ = fc2(torch.nn.functional.gelu(hidden))
        local_loss = ((y - target) ** 2).sum() / n_total
        local_loss.backward()
        if sp:
            # Megatron's finalize step: gradients of parameters marked sequence_parallel cover this
            # rank's rows only and are summed over the TP group. The loss is too.
            for p in params:
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad)
            loss = local_loss.detach().clone()
            dist.all_reduce(loss)
        else:
            loss = local_loss.detach()
        _sync(device)
        times.append(time.perf_counter() - start)

        row.loss_diff = max(row.loss_diff, abs(loss.item() - loss_ref.item()) / max(abs(loss_ref.item()), 1e-30))
        for p, r, sl in zip(params, ref, ref_slices, strict=False):
            row.grad_diff = max(row.grad_diff, _rel_diff(p.grad.cpu(), r.grad[sl]))
        with torch.no_grad():
            for p, r in zip(params, ref, strict=False):
                p -= args.lr * p.grad
                r -= args.lr * r.grad
                r.grad = None

    worst = torch.tensor([row.loss_diff, row.grad_diff], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    row.loss_diff, row.grad_diff = worst.tolist()
    # The first step pays one-off costs (allocations, the fused heap); report the rest.
    kept = times[1:] if len(times) > 1 else times
    step_ms = torch.tensor([1e3 * sum(kept) / len(kept)], dtype=torch.float64, device=device)
    dist.all_reduce(step_ms, op=dist.ReduceOp.MAX)
    row.step_ms = step_ms.item()
    return row


def run_rank(args: argparse.Namespace, device: torch.device) -> list[Row]:
    rows = []
    selected = [p for p in PATHS if p.label in args.paths]
    fused_reason = (
        fused_unavailable_reason(dist.group.WORLD, device) if any(p.name == "fused" for p in selected) else None
    )
    for path in selected:
        for sp in (False, True):
            if path.name == "fused" and fused_reason is not None:
                rows.append(Row(path.label, path.parallel_num, sp, note=f"skipped: {fused_reason}"))
                continue
            run_args = args
            if path.name == "fused" and device.type == "cpu":
                # On CPU the fused Triton kernels run in the interpreter, program by program:
                # correct but seconds per step, so fewer steps keep the demo short.
                run_args = argparse.Namespace(**{**vars(args), "steps": min(args.steps, args.interpreter_steps)})
            with _Env(path.env):
                rows.append(train_and_check(path, sp, run_args, device))
            if run_args is not args:
                rows[-1].note = f"Triton interpreter, {run_args.steps} step(s)"
    return rows


def format_table(rows: list[Row], world: int, backend: str, device: torch.device) -> str:
    head = (
        f"TP MLP block (column -> gelu -> row), {world} ranks, {backend} on {device.type}; "
        f"differences relative to the single-process reference (tolerance {REL_TOL:g})"
    )
    cols = (
        f"{'path':<12} {'parallel_num':>12} {'seq_parallel':>12} {'step_ms':>9} "
        f"{'loss_diff':>10} {'grad_diff':>10}  status"
    )
    lines = [head, cols, "-" * len(cols)]
    for r in rows:
        if r.note.startswith("skipped"):
            lines.append(
                f"{r.path:<12} {r.parallel_num:>12} {str(r.sequence_parallel):>12} "
                f"{'-':>9} {'-':>10} {'-':>10}  {r.note}"
            )
            continue
        lines.append(
            f"{r.path:<12} {r.parallel_num:>12} {str(r.sequence_parallel):>12} "
            f"{r.step_ms:>9.2f} {r.loss_diff:>10.2e} {r.grad_diff:>10.2e}  "
            f"{'ok' if r.ok else 'FAIL'}{'  (' + r.note + ')' if r.note else ''}"
        )
    failed = [r for r in rows if not r.ok]
    lines.append(
        f"{'FAILED' if failed else 'PASSED'}: {len(rows) - len(failed)}/{len(rows)} runs match the single-process model"
    )
    return "\n".join(lines)


def gpus_for_every_rank(world: int) -> bool:
    """One GPU per rank of this node: NCCL. Under torchrun the ranks of a node are
    ``LOCAL_WORLD_SIZE``, not the whole (possibly multi-node) world."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_world


def _rank_main(rank: int, world: int, args: argparse.Namespace, local_rank: int) -> bool:
    """One torchrun rank: join the group torchrun describes, run, rank 0 prints the table."""
    use_cuda = gpus_for_every_rank(world)
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rows = run_rank(args, device)
        if rank == 0:
            print(format_table(rows, world, backend, device), flush=True)
        return all(r.ok for r in rows)
    finally:
        # The TP modules hold the group; one still alive at destroy_process_group() can end the
        # process in "terminate called without an active exception" (upstream torch). They were
        # local to train_and_check: collect any reference cycle still keeping one.
        gc.collect()
        dist.destroy_process_group()


def spawned_rank(rank: int, world: int, args: argparse.Namespace) -> list[Row]:
    """One rank started by :func:`kernels.testing.run_ranks` (its group is up): this rank's rows."""
    device = torch.device("cuda", torch.cuda.current_device()) if gpus_for_every_rank(world) else torch.device("cpu")
    try:
        return run_rank(args, device)
    finally:
        gc.collect()  # as in _rank_main: no TP module may outlive this call holding the group


def _reexec_with_interpreter(argv: list[str] | None) -> None:
    """Restart this process with ``TRITON_INTERPRET=1`` if triton was imported without it.

    ``python -m autopar.demo`` imports the autopar package, hence kernels and triton, before this
    module runs, and triton fixes interpreted-or-compiled when a kernel is defined: setting the
    variable now is too late (the fused path then dies with "Cannot call @triton.jit'd outside of
    the scope of a kernel"). The same pid keeps torchrun's bookkeeping intact.
    """
    if "TRITON_INTERPRET" in os.environ:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" not in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    rest = sys.argv[1:] if argv is None else argv
    os.execv(sys.executable, [sys.executable, "-m", "autopar.demo", *rest])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m autopar.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=3, help="SGD steps per run")
    p.add_argument("--hidden", type=int, default=64, help="hidden size h (the MLP is h -> 4h -> h)")
    p.add_argument("--seq", type=int, default=32, help="sequence length (divisible by the world size)")
    p.add_argument("--batch", type=int, default=2, help="micro-batch size")
    p.add_argument(
        "--interpreter-steps",
        type=int,
        default=1,
        help="steps for the fused path when its kernels run in the CPU Triton interpreter",
    )
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument(
        "--paths",
        nargs="+",
        default=[p.label for p in PATHS],
        choices=[p.label for p in PATHS],
        help="paths to run (default: all available)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds the whole run may take before its ranks are declared hung (and a collective's timeout "
        "under torchrun)",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.interpreter_steps < 1:
        p.error(f"--steps and --interpreter-steps must be >= 1, got {args.steps} and {args.interpreter_steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        world = int(os.environ["WORLD_SIZE"])
        if args.seq % world or args.hidden * 4 % world:
            raise SystemExit(
                f"--seq ({args.seq}) and 4 * --hidden ({4 * args.hidden}) must be divisible by the world size {world}"
            )
        if not gpus_for_every_rank(world):
            # CPU ranks: the fused kernels can only run in the Triton interpreter.
            _reexec_with_interpreter(argv)
        ok = _rank_main(int(os.environ["RANK"]), world, args, local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        return 0 if ok else 1

    from kernels.testing import RankFailure, close_pools, run_ranks

    world = args.world_size
    if world < 1 or args.seq % world or args.hidden * 4 % world:
        raise SystemExit(
            f"--world-size ({world}) must be >= 1 and divide --seq ({args.seq}) and 4 * --hidden ({4 * args.hidden})"
        )
    cuda = gpus_for_every_rank(world)
    # gloo ranks on CPU run the fused kernels in the Triton interpreter (the pool sets it at their
    # birth); with a GPU per rank, NCCL.
    backend, device = ("nccl", "cuda") if cuda else ("gloo", "cpu")
    try:
        per_rank = run_ranks(spawned_rank, world, args, backend=backend, device=device, timeout=args.timeout)
    except RankFailure as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        close_pools()
    rows = per_rank[0]
    print(format_table(rows, world, backend, torch.device(device)), flush=True)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
