"""FP8 training check: the same small tensor-parallel MLP trained with bf16 and with the FP8 recipe.

``python -m bench.fp8_curve [--steps 200] [--world 2] [--out docs/fp8_loss.png]`` trains both runs
on CPU gloo ranks (sequential backend), prints the final losses and their relative difference, and
writes the plot of both curves (tests/autopar/tp/test_fp8_linear.py runs the same training).

Model: two residual blocks ``x + Row(gelu(Column(LayerNorm(x))))`` at hidden 256, ffn 512 (32 tokens a step), sequence
parallel on when W > 1, and a 64-class bf16 head; bf16 parameters with fp32 master weights in the
optimizer (Adam). Task: cross-entropy against a fixed random teacher network's soft class
distribution (entropy about 1.05 nats), a language-model-like loss whose floor is the teacher's entropy. The
FP8 run differs only in ``fp8=autopar.Fp8Recipe()`` on the four tensor-parallel linears.
(``--task mse``, regression of the teacher's output, is the harder case for FP8: its loss keeps
falling towards zero, where FP8's rounding noise is a growing fraction of it; docs/fp8.md.)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

HIDDEN, FFN, SEQ, BATCH, CLASSES = 256, 512, 8, 4, 64
# Teacher logits have a standard deviation of about 0.7 / TEMPERATURE: an entropy of about 1.05 nats.
TEMPERATURE = 0.15
# Adam's learning rate: one for both runs, so the two curves differ by the FP8 linears alone.
LR = 1e-3


class _Block(torch.nn.Module):
    def __init__(self, config: object, fp8: object) -> None:
        import autopar

        super().__init__()
        init = torch.nn.init.xavier_normal_
        self.norm = torch.nn.LayerNorm(HIDDEN, dtype=torch.bfloat16)
        self.up = autopar.ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=init, fp8=fp8)
        self.down = autopar.RowParallelLinear(
            FFN,
            HIDDEN,
            config=config,
            init_method=init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            fp8=fp8,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.up(self.norm(x))
        y, _ = self.down(torch.nn.functional.gelu(h))
        return x + y


def _teacher_batch(step: int, rank: int, world: int, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sequence shard of step ``step``'s batch and target (same global batch on any W)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    t = torch.Generator().manual_seed(7)
    w1 = torch.randn(HIDDEN, HIDDEN, generator=t) / HIDDEN**0.5
    w2 = torch.randn(HIDDEN, HIDDEN, generator=t) / HIDDEN**0.5
    w3 = torch.randn(HIDDEN, CLASSES, generator=t) / HIDDEN**0.5
    target = torch.tanh(x @ w1) @ w2
    if task == "ce":
        target = torch.softmax((target @ w3) / TEMPERATURE, dim=-1)
    rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    return x[rows].to(torch.bfloat16), target[rows]


def train(rank: int, world: int, fp8: bool, steps: int, *, task: str = "ce") -> list[float]:
    """Loss per step (mean over the whole sequence, same on every rank)."""
    import autopar

    torch.manual_seed(0)
    config = autopar.ParallelConfig(
        params_dtype=torch.bfloat16, use_cpu_initialization=True, sequence_parallel=world > 1
    )
    recipe = autopar.Fp8Recipe() if fp8 else None
    model = torch.nn.Sequential(_Block(config, recipe), _Block(config, recipe))
    if task == "ce":
        model.append(torch.nn.Linear(HIDDEN, CLASSES, dtype=torch.bfloat16))
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.Adam(master, lr=LR)
    group = dist.group.WORLD if world > 1 else None
    losses = []
    for step in range(steps):
        x, target = _teacher_batch(step, rank, world, task)
        out = model(x).float()
        if task == "ce":
            loss = torch.nn.functional.cross_entropy(out.view(-1, CLASSES), target.view(-1, CLASSES))
        else:
            loss = torch.nn.functional.mse_loss(out, target)
        for p in params:
            p.grad = None
        loss.backward()
        for p, m in zip(params, master, strict=True):
            g = p.grad.float()
            # Sequence parallel: replicated parameters (LayerNorm, row bias, head) saw this rank's rows only.
            if world > 1 and not getattr(p, "tensor_model_parallel", False):
                dist.all_reduce(g, group=group)
            m.grad = g
        opt.step()
        with torch.no_grad():
            # An in-place copy bumps the parameters' version counters: the FP8 weights are requantized.
            for p, m in zip(params, master, strict=True):
                p.copy_(m)
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported, group=group)
            reported /= world
        losses.append(float(reported))
    return losses


def curves_rank(rank: int, world: int, steps: int, task: str = "ce") -> tuple[list[float], list[float]]:
    """``(bf16 losses, fp8 losses)`` on this rank (a ``kernels.testing.run_ranks`` body)."""
    os.environ["COC_PARALLEL_NUM"] = "1"
    return train(rank, world, False, steps, task=task), train(rank, world, True, steps, task=task)


def relative_gap(bf16: list[float], fp8: list[float], window: int = 20) -> float:
    """``|mean(fp8[-window:]) - mean(bf16[-window:])| / mean(bf16[-window:])``."""
    a = sum(bf16[-window:]) / len(bf16[-window:])
    b = sum(fp8[-window:]) / len(fp8[-window:])
    return abs(b - a) / a


def plot(bf16: list[float], fp8: list[float], path: str, task: str = "ce") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(bf16, label="bf16", linewidth=1.4)
    ax.plot(fp8, label="FP8 (1x128 / 128x128 block scales)", linewidth=1.2, linestyle="--")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (" + ("cross-entropy vs teacher" if task == "ce" else "MSE") + ")")
    gap = relative_gap(bf16, fp8)
    ax.set_title(f"TP MLP, hidden {HIDDEN}: final losses differ by {100 * gap:.2f} % (last 20 steps)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", default=os.path.join("docs", "fp8_loss.png"))
    parser.add_argument("--task", choices=("ce", "mse"), default="ce")
    args = parser.parse_args(argv)
    from kernels.testing import run_ranks

    bf16, fp8 = run_ranks(curves_rank, args.world, args.steps, args.task, timeout=1800)[0]
    gap = relative_gap(bf16, fp8)
    print(f"bf16 final {sum(bf16[-20:]) / 20:.5f}  fp8 final {sum(fp8[-20:]) / 20:.5f}  relative gap {100 * gap:.3f} %")
    plot(bf16, fp8, args.out, args.task)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
