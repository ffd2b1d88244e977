"""Per-op host overhead of autopar.DistTensor versus PyTorch DTensor on tiny CPU ops.

``python -m bench.cost.dispatch [--world W] [--iters N] [--repeats R] [--json PATH]``

Runs on a ``W``-rank gloo group (default 2; rank 0 measures while the other ranks wait in a
barrier, so they do not compete for the CPU), with the same placements on both sides (activation
``Shard(0)``, weight ``Replicate()``), so no op communicates and the measured time is dispatch:
rule lookup or sharding propagation, wrapping, plus the local op. The local op's own time is
measured on plain tensors of the local shapes and reported beside it; before timing, each op's
local result and output placements are checked to be the same in all three variants. Each figure
is the minimum over ``repeats`` interleaved rounds of the mean over ``iters`` calls, forward only,
no autograd recording; a last row times one training step (forward and backward) of the three ops together.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _time(fns: list[Callable[[], object]], iters: int, repeats: int) -> list[float]:
    """Mean time per call of each fn; the minimum over ``repeats`` rounds, interleaved.

    Interleaving puts the three variants under the same machine load, and the minimum discards
    rounds slowed by other processes (CI machines are shared), as timeit recommends.
    """
    for fn in fns:
        for _ in range(max(10, iters // 10)):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[i].append((time.perf_counter() - t0) / iters)
    return [min(s) for s in samples]


def run(iters: int = 1000, repeats: int = 15) -> dict:
    """Time the ops on this rank; the caller has initialized the default process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate as DR
    from torch.distributed.tensor import Shard as DS
    from torch.distributed.tensor import distribute_tensor

    import autopar

    world = dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    w = torch.randn(16, 16)
    dmesh = init_device_mesh("cpu", (world,))
    mesh = autopar.ProcessMesh(list(range(world)), ["dp"])
    dx, dw = distribute_tensor(x, dmesh, [DS(0)]), distribute_tensor(w, dmesh, [DR()])
    ax, aw = autopar.shard_tensor(x, mesh, [autopar.Shard(0)]), autopar.shard_tensor(w, mesh, [autopar.Replicate()])
    # The baseline is the local op on this rank's piece: what both wrappers end up computing.
    x = ax.to_local().clone()
    if dist.get_rank() != 0:
        return {}
    ops = {
        "matmul": (lambda a, b: a @ b),
        "gelu": (lambda a, b: F.gelu(a)),
        "add": (lambda a, b: a + a),
    }
    rows = []
    with torch.no_grad():
        _check_same_work(ops, (x, w), (dx, dw), (ax, aw))
        for name, op in ops.items():
            t_torch, t_dtensor, t_autopar = _time(
                [partial(op, x, w), partial(op, dx, dw), partial(op, ax, aw)], iters, repeats
            )
            rows.append(_row(name, t_torch, t_dtensor, t_autopar))
    # One training step of the same three ops: forward with a weight that requires grad, then
    # backward through the autograd engine (not part of "together", which is forward only).
    tw, dwg, awg = (w.clone().requires_grad_(), dw.detach().requires_grad_(), aw.detach().requires_grad_())

    def step(a, b):
        b.grad = None
        (F.gelu(a @ b) + a).sum().backward()

    t_torch, t_dtensor, t_autopar = _time(
        [lambda: step(x, tw), lambda: step(dx, dwg), lambda: step(ax, awg)], max(1, iters // 10), repeats
    )
    train = _row("fwd+bwd", t_torch, t_dtensor, t_autopar)
    together = _row("together", *(sum(r[k] for r in rows) / 1e6 for k in ("torch_us", "dtensor_us", "autopar_us")))
    return {
        "torch": torch.__version__,
        "world": world,
        "iters": iters,
        "repeats": repeats,
        "shape_x": [8, 16],
        "shape_w": [16, 16],
        "rows": rows,
        "together": together,
        "train": train,
        "loadavg": list(os.getloadavg()),
    }


def _check_same_work(ops: dict, plain: tuple, dtensors: tuple, autopars: tuple) -> None:
    """Every variant computes the same local result in the same layout, so the figures compare
    dispatch and nothing else (a wrapper that skipped or changed the op would fail here). Each op
    runs three times and the last result is checked: the first calls fill the caches, and the
    cached paths are the ones the timing loop runs."""
    for name, op in ops.items():
        want = op(*plain)
        for kind, args in (("DTensor", dtensors), ("autopar", autopars)):
            for _ in range(3):
                out = op(*args)
            local = out.to_local()
            pl = [(type(p).__name__, getattr(p, "dim", None)) for p in out.placements]
            if not torch.equal(local, want) or pl != [("Shard", 0)]:
                raise RuntimeError(
                    f"{name}: {kind} computes {list(local.shape)} as {pl}, not the "
                    f"plain op's {list(want.shape)} as [Shard(0)]"
                )


def _row(op: str, t_torch: float, t_dtensor: float, t_autopar: float) -> dict:
    """Times in seconds -> a table row; overhead_ratio compares the time added to torch's."""
    return {
        "op": op,
        "torch_us": t_torch * 1e6,
        "dtensor_us": t_dtensor * 1e6,
        "autopar_us": t_autopar * 1e6,
        "autopar_over_dtensor": t_autopar / t_dtensor,
        "overhead_ratio": (t_autopar - t_torch) / (t_dtensor - t_torch),
    }


def _rank_body(rank: int, world: int, iters: int, repeats: int) -> dict:
    return run(iters, repeats)


def run_world(world: int, iters: int, repeats: int) -> dict:
    """``run`` on ``world`` gloo ranks of :func:`kernels.testing.run_ranks` (the one spawner); rank 0's figures."""
    from kernels.testing import run_ranks

    if world < 1:
        raise ValueError(f"--world must be >= 1, got {world}")
    return run_ranks(_rank_body, world, iters, repeats, timeout=600)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (rank 0 measures)")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    args = ap.parse_args()
    from kernels.testing import close_pools

    try:
        res = run_world(args.world, args.iters, args.repeats)
    finally:
        close_pools()
    print(f"per-op time on CPU, torch {res['torch']}, world {res['world']}, x [8, 16] Shard(0), w [16, 16] Replicate()")
    print(
        f"{'op':8s} {'torch us':>10s} {'DTensor us':>11s} {'autopar us':>11s} "
        f"{'autopar/DTensor':>16s} {'overhead ratio':>15s}"
    )
    for r in res["rows"] + [res["together"], res["train"]]:
        print(
            f"{r['op']:8s} {r['torch_us']:10.1f} {r['dtensor_us']:11.1f} {r['autopar_us']:11.1f} "
            f"{r['autopar_over_dtensor']:16.2f} {r['overhead_ratio']:15.2f}"
        )
    print("together: the three forward ops summed; fwd+bwd: gelu(x @ w) + x, sum, backward")
    print("overhead ratio = (autopar - torch) / (DTensor - torch): the added host time per op")
    print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
        from bench.harness.report import write_json

        write_json(args.json, res)


if __name__ == "__main__":
    main()
