"""Gradients through the conversions between DistTensor and plain tensors / PyTorch DTensor:
``to_local``, ``full_tensor``, ``DistTensor.from_local``, plain tensors mixed into DistTensor ops,
``to_dtensor`` and ``from_dtensor``, against plain single-process torch at world 2 on uneven
shapes. The gradients only move between ranks (no sum over ranks of different values) except
where a Partial is reduced: two fp32 terms, hence ``1e-6``.
"""

import pytest
import torch

from kernels.testing import run_ranks, seeded_randn

TOL = dict(rtol=1e-6, atol=1e-6)
SHAPE = (5, 3)


def _placements():
    from autopar import Partial, Replicate, Shard

    return [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("avg")]


def _grad_layout(p):
    from autopar import Partial, Replicate

    return Replicate() if isinstance(p, Partial) else p


def _to_local_full_tensor_case(rank, world):
    from autopar import DistTensor, Partial, ProcessMesh, Shard, shard_tensor

    mesh = ProcessMesh(list(range(world)))
    G, C = seeded_randn(*SHAPE, seed=1), seeded_randn(*SHAPE, seed=2)
    ref = G.clone().requires_grad_()
    (ref.sin() * C).sum().backward()
    checked = 0
    for p in _placements():
        # full_tensor: the gradient of the global value, back in x's layout.
        x = shard_tensor(G, mesh, [p]).requires_grad_()
        (x.full_tensor().sin() * C).sum().backward()
        assert x.grad.placements == (_grad_layout(p),), (p, x.grad.placements)
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad, **TOL, msg=f"full_tensor {p}")
        # to_local: each rank's gradient of its own piece, with x's placements (Partial -> Replicate).
        x = shard_tensor(G, mesh, [p]).requires_grad_()
        piece = x.to_local()
        assert piece.grad_fn is not None and piece.data_ptr() == x._local.data_ptr()
        c_piece = shard_tensor(C, mesh, [_grad_layout(p)]).to_local()
        (piece * c_piece).sum().backward()
        assert x.grad.placements == (_grad_layout(p),)
        torch.testing.assert_close(x.grad.full_tensor(), C, **TOL, msg=f"to_local {p}")
        checked += 2
    # grad_placements: each rank's piece of the loss is a different part of it (Partial).
    x = shard_tensor(G, mesh, [Shard(0)]).requires_grad_()
    full = x.full_tensor(grad_placements=[Partial()])
    (full * C * (rank + 1)).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), C * sum(r + 1 for r in range(world)), **TOL)
    # Without grad mode (or without requires_grad) the piece itself, untracked.
    with torch.no_grad():
        assert x.to_local() is x._local
    # from_local: the local piece gets its share of the gradient back.
    local = shard_tensor(G, mesh, [Shard(1)]).to_local().clone().requires_grad_()
    y = DistTensor.from_local(local, mesh, [Shard(1)], global_shape=G.shape)
    (y.full_tensor().sin() * C).sum().backward()
    torch.testing.assert_close(local.grad, shard_tensor(ref.grad, mesh, [Shard(1)]).to_local(), **TOL)
    return checked + 2


def _plain_operand_case(rank, world):
    """A plain tensor that requires grad (a norm weight, an embedding output) mixed into a
    DistTensor op is Replicate: its gradient is the whole reduced gradient on every rank."""
    import torch.nn.functional as F

    from autopar import ProcessMesh, Shard, shard_tensor

    mesh = ProcessMesh(list(range(world)))
    X, W, V = seeded_randn(5, 4, seed=3), seeded_randn(3, 4, seed=4), seeded_randn(3, seed=5)
    w_ref, v_ref, x_ref = W.clone().requires_grad_(), V.clone().requires_grad_(), X.clone().requires_grad_()
    (F.gelu(F.linear(x_ref, w_ref)) * v_ref).sum().backward()
    w, v = W.clone().requires_grad_(), V.clone().requires_grad_()
    x = shard_tensor(X, mesh, [Shard(0)]).requires_grad_()
    (F.gelu(F.linear(x, w)) * v).sum().full_tensor().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v.grad, v_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, rtol=1e-5, atol=1e-5)
    return True


def _dtensor_case(rank, world):
    from torch.distributed.tensor import DTensor

    from autopar import Partial, ProcessMesh, Replicate, from_dtensor, shard_tensor, to_dtensor

    mesh = ProcessMesh(list(range(world)))
    G, C = seeded_randn(*SHAPE, seed=6), seeded_randn(*SHAPE, seed=7)
    ref = G.clone().requires_grad_()
    (ref.sin() * C).sum().backward()
    for p in _placements():
        if p == Partial("avg"):
            continue  # DTensor's sum over Partial("avg") pieces is tested by test_reshard
        # DistTensor -> DTensor: DTensor ops, gradient back to the DistTensor.
        x = shard_tensor(G, mesh, [p]).requires_grad_()
        d = to_dtensor(x)
        assert isinstance(d, DTensor) and d.requires_grad
        (d.full_tensor().sin() * C).sum().backward()
        assert x.grad.placements == (_grad_layout(p),), (p, x.grad.placements)
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad, **TOL, msg=f"to_dtensor {p}")
        # DTensor -> DistTensor: DistTensor ops, gradient back to the DTensor leaf.
        with torch.no_grad():
            leaf = to_dtensor(shard_tensor(G, mesh, [p]))
        leaf.requires_grad_()
        t = from_dtensor(leaf)
        (t.full_tensor().sin() * C).sum().backward()
        want = Replicate() if p.is_partial() else p
        assert leaf.grad.placements[0].is_replicate() == want.is_replicate(), (p, leaf.grad.placements)
        torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad, **TOL, msg=f"from_dtensor {p}")
    return True


@pytest.mark.parametrize("world", [2])
def test_to_local_and_full_tensor_are_differentiable(world):
    assert run_ranks(_to_local_full_tensor_case, world) == [12] * world


def test_plain_tensor_operands_get_their_gradient():
    assert all(run_ranks(_plain_operand_case, 2))


def test_to_dtensor_and_from_dtensor_are_differentiable():
    assert all(run_ranks(_dtensor_case, 2))
