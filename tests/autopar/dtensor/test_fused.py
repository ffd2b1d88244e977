"""The overlapped ops from ``kernels`` inside DistTensor matmuls, against plain math.

A matmul whose output is Partial on one mesh dim, resharded to Replicate or Shard(0), must run
``kernels.matmul_all_reduce`` / ``kernels.matmul_reduce_scatter`` (the backward's dgrad too); a Shard(0) input
gathered into
a column-sharded matmul must run ``kernels.all_gather_matmul``. The ranks wrap those three ops to
count calls, run forward and backward, and compare with single-process torch. With
``COC_PARALLEL_NUM=2`` the chunked backend runs; with the default the sequential one. Tolerance:
``1e-5`` between two fp32 runs of a whole step (GELU, loss and every gradient, with summation
orders that differ), not one op against its fp64 reference, so not the toolkit's op bound; any
misplaced shard or missing reduction is O(1) off.
"""

import pytest
import torch
import torch.nn.functional as F

from kernels.testing import run_ranks

pytestmark = pytest.mark.triton  # runs Triton kernels (interpreted on CPU)

TOL = dict(rtol=1e-5, atol=1e-5)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / shape[-1] ** 0.5


def _fused_case(rank, world):
    import kernels
    from autopar import Partial, ProcessMesh, Replicate, Shard, reshard, shard_tensor

    calls = {"matmul_all_reduce": 0, "matmul_reduce_scatter": 0, "all_gather_matmul": 0}
    originals = {name: getattr(kernels, name) for name in calls}

    def counting(name):
        def fn(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return fn

    for name in calls:
        setattr(kernels, name, counting(name))
    try:
        mesh = ProcessMesh(list(range(world)), ["tp"])
        X = _rand(6, 3, 8, seed=1)  # [s, b, h]; s divisible by W
        W1 = _rand(8, 12, seed=2)  # matmul layout [k, n]
        W2 = _rand(8, 12, seed=3)  # linear layout [n, k]
        bias = _rand(12, seed=4)
        ref = [t.clone().requires_grad_() for t in (X, W1, W2, bias)]
        # Sequence-parallel column layer then row layer (Megatron SP MLP), and a bias add.
        h_ref = F.gelu(ref[0] @ ref[1] + ref[3])
        y_ref = F.linear(h_ref, ref[2])
        loss_ref = (y_ref * y_ref).mean()
        loss_ref.backward()

        x = shard_tensor(X, mesh, [Shard(0)]).requires_grad_()
        w1 = shard_tensor(W1, mesh, [Shard(1)]).requires_grad_()
        w2 = shard_tensor(W2, mesh, [Shard(1)]).requires_grad_()
        b = shard_tensor(bias, mesh, [Shard(0)]).requires_grad_()
        h = F.gelu(x @ w1 + b)  # all_gather_matmul: x Shard(0) gathered
        assert h.placements == (Shard(2),)
        y_partial = F.linear(h, w2)  # Partial on tp, not computed yet
        assert y_partial.placements == (Partial(),)
        y = reshard(y_partial, mesh, [Shard(0)])  # matmul_reduce_scatter
        loss = (y * y).mean()
        loss.backward()
        torch.testing.assert_close(loss.full_tensor(), loss_ref.detach(), **TOL)
        torch.testing.assert_close(y.full_tensor(), y_ref.detach(), **TOL)
        for name, d, r in zip(["x", "w1", "w2", "bias"], [x, w1, w2, b], ref, strict=False):
            torch.testing.assert_close(d.grad.full_tensor(), r.grad, **TOL, msg=name)
        # Row parallel without SP: Partial -> Replicate through matmul_all_reduce, also when the
        # reshard comes from the add rule (Partial + Replicate bias).
        hr = shard_tensor(h_ref.detach(), mesh, [Shard(2)])
        out = F.linear(hr, w2) + _rand(8, seed=5)
        torch.testing.assert_close(out.full_tensor(), F.linear(h_ref, ref[2]).detach() + _rand(8, seed=5), **TOL)
        assert out.placements == (Replicate(),)
        # Any other use of a pending product computes it plainly (a scaling keeps it Partial).
        other = F.linear(hr, w2) * 2.0
        torch.testing.assert_close(other.full_tensor(), 2.0 * F.linear(h_ref, ref[2]).detach(), **TOL)
        return calls
    finally:
        for name, fn in originals.items():
            setattr(kernels, name, fn)


@pytest.mark.parametrize("parallel_num", [None, "2"], ids=["sequential", "chunked-2"])
@pytest.mark.parametrize("world", [2, 3])
def test_overlapped_ops_are_used_and_exact(world, parallel_num):
    results = run_ranks(_fused_case, world, env={"COC_PARALLEL_NUM": parallel_num})
    for calls in results:
        # matmul_reduce_scatter twice: the row layer's forward and the sequence-parallel column
        # layer's dgrad (Partial over tp, reduce-scattered back to x's Shard(0)).
        assert calls == {"matmul_all_reduce": 1, "matmul_reduce_scatter": 2, "all_gather_matmul": 1}, calls


def _empty_piece_case(rank, world):
    """The hidden dim (6) over 4 ranks splits 2, 2, 2, 0: the last rank holds empty pieces of the
    contracted dim. Its weight gradient must still come out (zero-sized), and every rank must pick
    the same path (the overlapped ops need k > 0, so here the plain product and reshard)."""
    from autopar import ProcessMesh, Shard, reshard, shard_tensor

    mesh = ProcessMesh(list(range(world)), ["tp"])
    X, W1, W2, bias = _rand(8, 3, 8, seed=1), _rand(8, 6, seed=2), _rand(5, 6, seed=3), _rand(6, seed=4)
    ref = [t.clone().requires_grad_() for t in (X, W1, W2, bias)]
    y_ref = F.linear(F.gelu(ref[0] @ ref[1] + ref[3]), ref[2])
    (y_ref * y_ref).mean().backward()

    x = shard_tensor(X, mesh, [Shard(0)]).requires_grad_()
    w1 = shard_tensor(W1, mesh, [Shard(1)]).requires_grad_()
    w2 = shard_tensor(W2, mesh, [Shard(1)]).requires_grad_()
    b = shard_tensor(bias, mesh, [Shard(0)]).requires_grad_()
    y = reshard(F.linear(F.gelu(x @ w1 + b), w2), mesh, [Shard(0)])
    (y * y).mean().backward()
    torch.testing.assert_close(y.full_tensor(), y_ref.detach(), **TOL)
    for name, d, r in zip(["x", "w1", "w2", "bias"], [x, w1, w2, b], ref, strict=False):
        torch.testing.assert_close(d.grad.full_tensor(), r.grad, **TOL, msg=name)
    return w2.grad.to_local().shape[1]


@pytest.mark.parametrize("parallel_num", [None, "2"], ids=["sequential", "chunked-2"])
def test_empty_pieces_of_the_contracted_dim(parallel_num):
    assert run_ranks(_empty_piece_case, 4, env={"COC_PARALLEL_NUM": parallel_num}) == [2, 2, 2, 0]
