"""DistTensor ops and gradients against plain single-process torch, and Partial->Replicate sync.

Every rank builds the same global tensors from a seed and runs the reference in-process. Values
that only move between ranks are exact; sums over W ranks of fp32 partials are compared with
``rtol = atol = 1e-5`` (a few hundred fp32 terms, eps 1.2e-7 each, with margin).
"""

import pytest
import torch
import torch.nn.functional as F

from kernels.testing import run_ranks, seeded_randn

TOL = dict(rtol=1e-5, atol=1e-5)


def _ops_case(rank, world, mesh_shape):
    from autopar import Partial, ProcessMesh, Replicate, Shard, shard_tensor

    nested = list(range(world)) if len(mesh_shape) == 1 else [[0, 1], [2, 3]]
    mesh = ProcessMesh(nested)
    two = len(mesh_shape) == 2
    A, B = seeded_randn(5, 3, 4, seed=1), seeded_randn(4, 6, seed=2)
    C = seeded_randn(5, 3, 4, seed=3)
    bias = seeded_randn(4, seed=4)
    lw, lb = seeded_randn(4, seed=5), seeded_randn(4, seed=6)
    W = seeded_randn(6, 4, seed=7)

    def pl(*ps):
        return list(ps) + ([Replicate()] if two and len(ps) == 1 else [])

    cases = {
        "matmul_batch": (lambda a, b: torch.matmul(a, b), [A, B], [pl(Shard(0)), pl(Replicate())]),
        "matmul_k": (lambda a, b: a @ b, [A, B], [pl(Shard(2)), pl(Shard(0))]),
        "matmul_col": (lambda a, b: a @ b, [A, B], [pl(Shard(1)), [Replicate(), Shard(1)] if two else pl(Shard(1))]),
        "linear": (
            lambda a, w, b: F.linear(a, w, b),
            [A, W, seeded_randn(6, seed=8)],
            [pl(Shard(1)), pl(Shard(0)), pl(Replicate())],
        ),
        "add_sub": (
            lambda a, c, b: (a + b) - c * 0.5 + 1.0,
            [A, C, bias],
            [pl(Shard(0)), pl(Shard(1)), pl(Replicate())],
        ),
        "mul_div": (lambda a, c: a * c / (c * c + 1.0) - 2.0 / (a * a + 1.0), [A, C], [pl(Shard(2)), pl(Replicate())]),
        "partial_add": (lambda a, b: (a @ b) + (a @ b) * 3.0, [A, B], [pl(Shard(2)), pl(Shard(0))]),
        "gelu_relu": (lambda a: F.gelu(a) + F.relu(a) + a.relu() + torch.relu(a), [A], [pl(Shard(1))]),
        "softmax": (lambda a: F.softmax(a, dim=-1) * a.softmax(-1), [A], [pl(Shard(2))]),
        "layer_norm": (
            lambda a, w, b: F.layer_norm(a, (4,), w, b),
            [A, lw, lb],
            [pl(Shard(0), Shard(1)) if two else pl(Shard(1)), pl(Replicate()), pl(Replicate())],
        ),
        "sum_mean": (
            lambda a: a.sum(dim=1) * a.mean(-1, keepdim=True).sum(1) + torch.mean(a, 1) + a.sum(),
            [A],
            [pl(Shard(1))],
        ),
        "mixed_plain": (lambda a: B[0] + a @ B, [A], [pl(Shard(0))]),
        "partial_input": (lambda a, b: a @ b, [A, B], [pl(Partial()), pl(Replicate())]),
        # The output is Partial("avg") too: a Replicate operand's local vjps are averaged, not summed.
        "partial_avg_input": (
            lambda a, b, c: (a @ b) * 2.0 + F.linear(a, W) + (a * c) @ b,
            [A, B, C],
            [pl(Partial("avg")), pl(Replicate()), pl(Replicate())],
        ),
    }
    done = []
    for name, (fn, tensors, pls) in cases.items():
        ref_in = [t.clone().requires_grad_() for t in tensors]
        ref = fn(*ref_in)
        (ref * ref).sum().backward()
        dts = [shard_tensor(t, mesh, p).requires_grad_() for t, p in zip(tensors, pls, strict=False)]
        out = fn(*dts)
        loss = (out * out).sum()
        torch.testing.assert_close(out.full_tensor(), ref.detach(), **TOL, msg=name)
        torch.testing.assert_close(loss.full_tensor(), (ref * ref).sum().detach(), **TOL, msg=name)
        loss.backward()
        for i, (d, r) in enumerate(zip(dts, ref_in, strict=False)):
            assert d.grad is not None and d.grad.shape == r.shape, name
            # Partial grads hold pieces of the sum; full_tensor() reduces them.
            torch.testing.assert_close(d.grad.full_tensor(), r.grad, **TOL, msg=f"{name} grad {i}")
        done.append(name)
    return done


@pytest.mark.parametrize("world,mesh_shape", [(2, (2,)), (4, (2, 2))], ids=["1d-2", "2x2"])
def test_ops_forward_backward(world, mesh_shape):
    assert len(run_ranks(_ops_case, world, mesh_shape)[0]) == 14


# -- gradient synchronization: a two-layer MLP ---------------------------------------------------


def _mlp_reference(X, params):
    p = [t.clone().requires_grad_() for t in params]
    h = F.gelu(X @ p[0] + p[1])
    y = h @ p[2] + p[3]
    loss = (y * y).mean()
    loss.backward()
    return loss.detach(), [t.grad for t in p]


def _mlp_case(rank, world, mesh_nested, dim_names, x_pl, param_pls):
    from autopar import ProcessMesh, Replicate, Shard, shard_tensor, sync_gradients
    from autopar.dtensor.autograd import reshard_nograd as _reshard_nograd

    mesh = ProcessMesh(mesh_nested, dim_names)
    X = seeded_randn(4, 6, 8, seed=11)  # [batch, sequence, hidden]
    params = [
        seeded_randn(8, 10, seed=12),
        seeded_randn(10, seed=13),
        seeded_randn(10, 8, seed=14),
        seeded_randn(8, seed=15),
    ]
    ref_loss, ref_grads = _mlp_reference(X, params)
    x = shard_tensor(X, mesh, x_pl)
    ps = [shard_tensor(t, mesh, p).requires_grad_() for t, p in zip(params, param_pls, strict=False)]
    h = F.gelu(x @ ps[0] + ps[1])
    y = h @ ps[2] + ps[3]
    loss = (y * y).mean()
    loss.backward()
    torch.testing.assert_close(loss.full_tensor(), ref_loss, **TOL)
    # The old rule (Paddle before PR 59057): reduce only over the mesh dims sharding dim 0 of
    # the activations, then feed each rank's local piece to the optimizer.
    old_dims = {m for m, q in enumerate(x.placements) if q == Shard(0)}
    old_ok = []
    for p, g in zip(ps, ref_grads, strict=False):
        grad = p.grad
        old = _reshard_nograd(
            grad, tuple(Replicate() if m in old_dims and q.is_partial() else q for m, q in enumerate(grad.placements))
        )
        local_ref = shard_tensor(g, mesh, p.placements).to_local()
        old_ok.append(torch.allclose(old.to_local(), local_ref, **TOL))
    reduced = sync_gradients(ps)
    for i, (p, g) in enumerate(zip(ps, ref_grads, strict=False)):
        assert p.grad.placements == p.placements, (i, p.grad.placements, p.placements)
        torch.testing.assert_close(p.grad.full_tensor(), g, **TOL, msg=f"param {i}")
        local_ref = shard_tensor(g, mesh, p.placements).to_local()
        torch.testing.assert_close(p.grad.to_local(), local_ref, **TOL, msg=f"param {i} local")
    return reduced, old_ok


@pytest.mark.parametrize("case", ["dp", "sp", "cp", "dp_tp"])
def test_mlp_gradient_sync(case):
    from autopar import Replicate as R
    from autopar import Shard as S

    rep = [[R()]] * 4
    if case == "dp":
        args = (2, [0, 1], ["dp"], [S(0)], rep)
        expect = [("dp",)] * 4
    elif case == "sp":
        args = (2, [0, 1], ["sp"], [S(1)], rep)
        expect = [("sp",)] * 4
    elif case == "cp":
        # batch over dp, sequence (context) over a second mesh dim
        args = (4, [[0, 1], [2, 3]], ["dp", "cp"], [S(0), S(1)], [[R(), R()]] * 4)
        expect = [("dp", "cp")] * 4
    else:
        # data parallel x tensor parallel: W1 column-sharded, W2 row-sharded; the second bias is
        # Replicate on tp and its gradient must not be reduced over tp.
        args = (4, [[0, 1], [2, 3]], ["dp", "tp"], [S(0), R()], [[R(), S(1)], [R(), S(0)], [R(), S(0)], [R(), R()]])
        expect = [("dp",)] * 4
    results = run_ranks(_mlp_case, *args)
    for reduced, old_ok in results:
        assert reduced == expect
        if case == "sp":
            # The "dim 0 is the batch" rule syncs nothing here: every gradient would be wrong.
            assert not any(old_ok)
        if case == "dp":
            assert all(old_ok)
