"""Pipeline stages as sub-meshes with the non-computation clip.

Every rank runs the same program (forward and ``backward()``); the loss and every parameter
gradient must equal a single-process run, and on ranks outside a stage every activation of that
stage is an uninitialized DistTensor with zero elements, no storage, and the right global shape.
Tolerance: as tests/test_dt_autograd.py (sums of a few hundred fp32 terms).
"""

import pytest
import torch
import torch.nn.functional as F

from kernels.testing import run_ranks, seeded_randn

TOL = dict(rtol=1e-5, atol=1e-5)


def _check_clipped(t, shape):
    assert not t.is_initialized(), t
    assert t.shape == torch.Size(shape), (t.shape, shape)
    local = t.to_local()
    assert local.numel() == 0 and local.untyped_storage().nbytes() == 0


def _pipeline_1rank_stages(rank, world):
    """``world`` stages of one rank each: stage s computes gelu(h @ W_s + b_s)."""
    from autopar import ProcessMesh, Replicate, Shard, reshard, shard_tensor, stage_meshes

    stages = stage_meshes(ProcessMesh(list(range(world)), ["pp"]), "pp")
    X = seeded_randn(5, 3, 6, seed=0)
    Ws = [seeded_randn(6, 6, seed=1 + s) for s in range(world)]
    bs = [seeded_randn(6, seed=11 + s) for s in range(world)]
    ref_p = [t.clone().requires_grad_() for t in Ws + bs]
    h = X
    for s in range(world):
        h = F.gelu(h @ ref_p[s] + ref_p[world + s])
    ref_loss = (h * h).mean()
    ref_loss.backward()

    params = [shard_tensor(W, stages[s], [Replicate()]).requires_grad_() for s, W in enumerate(Ws)]
    params += [shard_tensor(b, stages[s], [Replicate()]).requires_grad_() for s, b in enumerate(bs)]
    h = shard_tensor(X, stages[0], [Shard(0)])
    acts = []
    for s in range(world):
        if s > 0:
            h = reshard(h, stages[s], [Shard(0)])
        h = F.gelu(h @ params[s] + params[world + s])
        acts.append((s, h))
    loss = (h * h).mean()
    loss.backward()
    for s, a in acts:
        if rank != s:
            _check_clipped(a, (5, 3, 6))
    if rank == world - 1:
        torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), **TOL)
    else:
        _check_clipped(loss, ())
    for i, (p, r) in enumerate(zip(params, ref_p, strict=False)):
        assert p.grad is not None and p.grad.shape == r.shape
        if rank == i % world:
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, **TOL, msg=f"param {i}")
        else:
            _check_clipped(p.grad, r.shape)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_one_rank_stages(world):
    assert all(run_ranks(_pipeline_1rank_stages, world))


def _pipeline_tp_stages(rank, world):
    """Two stages of two ranks; each stage is a Megatron MLP (column then row parallel)."""
    from autopar import ProcessMesh, Replicate, Shard, reshard, shard_tensor, stage_meshes, sync_gradients

    stages = stage_meshes(ProcessMesh([[0, 1], [2, 3]], ["pp", "tp"]), "pp")
    X = seeded_randn(4, 3, 8, seed=0)
    shapes = [(8, 12), (12,), (12, 8), (8,)]
    # Weights scaled by 1/sqrt(fan_in) keep activations O(1), so fp32 sums stay within TOL.
    raw = [[seeded_randn(*sh, seed=10 * s + j) / sh[0] ** 0.5 for j, sh in enumerate(shapes)] for s in range(2)]
    pls = [[Shard(1)], [Shard(0)], [Shard(0)], [Replicate()]]
    ref = [[t.clone().requires_grad_() for t in stage] for stage in raw]
    h = X
    for w1, b1, w2, b2 in ref:
        h = F.gelu(h @ w1 + b1) @ w2 + b2
    ref_loss = (h * h).mean()
    ref_loss.backward()

    params = [
        [shard_tensor(t, stages[s], p).requires_grad_() for t, p in zip(raw[s], pls, strict=False)] for s in range(2)
    ]
    h = shard_tensor(X, stages[0], [Replicate()])
    mid = None
    for s, (w1, b1, w2, b2) in enumerate(params):
        if s == 1:
            h = reshard(h, stages[1], [Replicate()])
        inner = F.gelu(h @ w1 + b1)  # column parallel: Shard(2) on tp
        h = inner @ w2 + b2  # row parallel: Partial on tp, reduced by the add
        if s == 0:
            mid = inner
    loss = (h * h).mean()
    loss.backward()
    reduced = sync_gradients([p for stage in params for p in stage])
    stage_of_rank = rank // 2
    if stage_of_rank == 0:
        _check_clipped(loss, ())
        assert mid.is_initialized() and mid.placements == (Shard(2),)
    else:
        _check_clipped(mid, (4, 3, 12))
        torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), **TOL)
    for s in range(2):
        for j, (p, r) in enumerate(zip(params[s], ref[s], strict=False)):
            if s == stage_of_rank:
                assert p.grad.placements == p.placements
                torch.testing.assert_close(
                    p.grad.full_tensor(), r.grad, **TOL, msg=lambda m, s=s, j=j: f"stage {s} param {j}: {m}"
                )
            else:
                _check_clipped(p.grad, r.shape)
    return reduced


def test_pipeline_two_stages_with_tp_inside():
    results = run_ranks(_pipeline_tp_stages, 4)
    # No batch/sequence dim is sharded, so only one gradient is Partial: stage 0's row bias b2,
    # whose output gradient comes back from stage 1's column-parallel layer as a partial sum over
    # tp (each rank's dgrad covers its columns). The matmul before it all-reduced that gradient in
    # its own backward; the bias defers its reduction to sync_gradients. Everything else is ().
    assert all(r == [(), (), (), ("tp",), (), (), (), ()] for r in results)


def _data_dependent(rank, world):
    from autopar import ProcessMesh, Replicate, shard_tensor

    x = shard_tensor(torch.ones(3), ProcessMesh([0]), [Replicate()])
    try:
        torch.nonzero(x)
    except NotImplementedError as e:
        return str(e)
    return None


def test_data_dependent_op_is_a_clear_error():
    msg = run_ranks(_data_dependent, 2)[1]
    assert msg is not None and "depends on the data" in msg
