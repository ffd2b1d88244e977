"""The sequence-parallel training recipe of docs/linears.md trains as one process does.

Under sequence parallelism each rank holds S/W rows of the output, and the backward of the
linears adds up every rank's loss gradient, so the rank losses must sum to the model's loss:
divide by the GLOBAL element count (``y.square().sum() / (S * B * H)``), not by the local one
(``y.square().mean()`` gives gradients W times too large). The row bias sees only this rank's
rows, so its gradient (like every parameter marked ``sequence_parallel``) is summed over the TP
group before the step (``autopar.sum_sequence_parallel_grads``, or ``sequence_parallel_grad_hooks``
once, in the backward). Both mistakes are run too, to show this test catches them.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.testing import run_ranks

S, B, H, FFN = 8, 2, 16, 32
STEPS, LR = 5, 0.5


def _reference(X, W1, W2):
    """The same model in one process: plain torch, full weights, zero biases."""
    params = [
        W1.clone().requires_grad_(),
        torch.zeros(FFN, requires_grad=True),
        W2.clone().requires_grad_(),
        torch.zeros(H, requires_grad=True),
    ]
    losses = []
    for _ in range(STEPS):
        y = F.linear(F.gelu(F.linear(X, params[0], params[1])), params[2], params[3])
        loss = y.square().mean()
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
                p.grad = None
        losses.append(loss.item())
    return losses, [p.detach() for p in params]


def _train_sp(rank, world, recipe):
    import autopar

    config = autopar.ParallelConfig(sequence_parallel=True, use_cpu_initialization=True)
    torch.manual_seed(0)  # every rank cuts its slice of the same full weights
    fc1 = autopar.ColumnParallelLinear(
        H, FFN, config=config, init_method=torch.nn.init.xavier_normal_, keep_master_weight_for_test=True
    )
    fc2 = autopar.RowParallelLinear(
        FFN,
        H,
        config=config,
        init_method=torch.nn.init.xavier_normal_,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        keep_master_weight_for_test=True,
    )
    X = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)) + 0.5  # offset: biases matter
    ref_losses, ref_params = _reference(X, fc1.master_weight, fc2.master_weight)

    params = [fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    if recipe == "hooks":
        autopar.sequence_parallel_grad_hooks(params)  # the sum in the backward instead
    x = X.chunk(world)[rank]  # [S/W, B, H]: this rank's rows of the sequence
    losses = []
    for _ in range(STEPS):
        h, _ = fc1(x)
        y, _ = fc2(F.gelu(h))  # [S/W, B, H]
        if recipe == "local_mean":
            loss = y.square().mean()  # the mistake: normalized by the local count
        else:
            loss = y.square().sum() / (S * B * H)  # the recipe: the GLOBAL element count
        loss.backward()
        if recipe in ("documented", "local_mean"):
            autopar.sum_sequence_parallel_grads(params)  # Megatron's finalize step for SP parameters
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
                p.grad = None
        total = loss.detach().clone()
        dist.all_reduce(total)  # each rank holds a piece of the loss
        losses.append(total.item())

    n_local, k_local = FFN // world, FFN // world
    mine = [
        ref_params[0][rank * n_local : (rank + 1) * n_local],
        ref_params[1][rank * n_local : (rank + 1) * n_local],
        ref_params[2][:, rank * k_local : (rank + 1) * k_local],
        ref_params[3],
    ]
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=False))
    param_diff = max(
        ((p.detach() - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
        for p, r in zip(params, mine, strict=False)
    )
    del fc1, fc2, params  # release the modules before the pool's group is reused
    return loss_diff, param_diff


@pytest.mark.parametrize("recipe", ["documented", "hooks"])
def test_documented_sp_recipe_trains_as_one_process(recipe):
    for loss_diff, param_diff in run_ranks(_train_sp, 2, recipe):
        assert loss_diff < 1e-5 and param_diff < 1e-5, (loss_diff, param_diff)


@pytest.mark.parametrize("recipe", ["local_mean", "no_bias_sum"])
def test_each_mistake_is_caught(recipe):
    """Without the global normalization or the bias-gradient sum, training departs from one
    process within 5 steps (so the test above would fail on either mistake)."""
    for loss_diff, param_diff in run_ranks(_train_sp, 2, recipe):
        assert max(loss_diff, param_diff) > 1e-3, (recipe, loss_diff, param_diff)
