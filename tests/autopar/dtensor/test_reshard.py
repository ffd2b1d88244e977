"""Reshard transitions on 1-D meshes of 2, 3, 4 ranks and a 2x2 mesh, with uneven shapes.

Each case builds the source DistTensor from a known global value ``G`` (Partial sources get
per-rank noise that cancels in the reduction), reshards, and checks: the local shape equals
``torch.chunk``'s (and DTensor's); ``full_tensor()`` equals ``G``; and, where PyTorch DTensor's
``redistribute`` supports the transition (no Partial target), the local piece equals DTensor's,
reached through ``autopar.to_dtensor`` / ``autopar.from_dtensor``.
Shards, slices, gathers and all-to-all move values without arithmetic, so they are compared
exactly; reductions over W ranks of fp32 values add at most W roundings, hence ``1e-6``.
R->P follows Paddle (coordinate 0 keeps the value, the others hold zeros) and S->P goes S->R->P;
both are checked by plain math. Cross-mesh reshards are checked against ``G`` as well.
"""

import itertools

import pytest
import torch

from kernels.testing import run_ranks

TOL = dict(rtol=1e-6, atol=1e-6)
SHAPES = [(5, 7), (2, 3, 5)]


def _placements_1d(ndim):
    from autopar import Partial, Replicate, Shard

    return [Shard(d) for d in range(ndim)] + [Replicate(), Partial("sum"), Partial("avg"), Partial("max")]


def _placements_2d(ndim):
    from autopar import Partial, Replicate, Shard

    one = [Shard(0), Shard(ndim - 1), Replicate(), Partial("sum")]
    return [(a, b) for a, b in itertools.product(one, one) if not (isinstance(a, Shard) and a == b)]


def _make_source(G, mesh, placements, seed):
    """A DistTensor with value G: shard it, then add cancelling noise along Partial mesh dims."""
    from autopar import DistTensor, Partial, Replicate, shard_tensor

    base = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    local = shard_tensor(G, mesh, base).to_local().clone()
    coord = mesh.my_coordinate
    for m, p in enumerate(placements):
        if not isinstance(p, Partial):
            continue
        gen = torch.Generator().manual_seed(seed + 31 * m)
        W = mesh.shape[m]
        noise = [torch.randn(local.shape, generator=gen) for _ in range(W)]
        if p.reduce_op in ("sum", "avg"):
            mean = sum(noise) / W
            local = (local if p.reduce_op == "avg" else local / W) + noise[coord[m]] - mean
        else:  # max: coordinate 0 holds the value, the others hold something smaller
            local = local if coord[m] == 0 else local - noise[coord[m]].abs() - 0.5
    return DistTensor.from_local(local, mesh, placements, global_shape=G.shape)


def _dtensor_reshard(x, y):
    """The same transition done by PyTorch DTensor, through autopar.to_dtensor / from_dtensor:
    ``x`` converted (sharing its piece), redistributed to ``y``'s placements, converted back."""
    from autopar import from_dtensor, to_dtensor

    d = to_dtensor(x)
    assert d.to_local().data_ptr() == x.to_local().data_ptr()
    return from_dtensor(d.redistribute(d.device_mesh, y.placements))  # one vocabulary: torch's placements


def _check_transitions(rank, world, mesh_shape):
    from autopar import Partial, ProcessMesh, reshard
    from autopar.dtensor.redistribute import local_shape

    ranks = list(range(world))
    nested = ranks if len(mesh_shape) == 1 else [ranks[i : i + mesh_shape[1]] for i in range(0, world, mesh_shape[1])]
    mesh = ProcessMesh(nested)
    checked = compared = 0
    for si, shape in enumerate(SHAPES):
        G = torch.randn(shape, generator=torch.Generator().manual_seed(si))
        cands = _placements_1d(len(shape)) if len(mesh_shape) == 1 else _placements_2d(len(shape))
        cands = [c if isinstance(c, tuple) else (c,) for c in cands]
        for ci, (src, dst) in enumerate(itertools.product(cands, cands)):
            if any(
                isinstance(s, Partial) and s.reduce_op == "max" and s != d and isinstance(d, Partial)
                for s, d in zip(src, dst, strict=False)
            ):
                continue  # max -> sum is not a transition (see test_impossible_transition)
            x = _make_source(G, mesh, src, seed=100 * si + ci)
            y = reshard(x, mesh, dst)
            what = f"{list(src)} -> {list(dst)} shape {list(shape)} mesh {list(mesh_shape)}"
            assert list(y.to_local().shape) == local_shape(G.shape, mesh, y.placements), what
            assert y.placements == tuple(dst) and y.shape == G.shape, what
            torch.testing.assert_close(y.full_tensor(), G, **TOL, msg=what)
            if any(isinstance(d, Partial) for d in dst):
                # Paddle's R->P: only coordinate 0 along the Partial dim keeps the value.
                for m, d in enumerate(dst):
                    if (
                        isinstance(d, Partial)
                        and d.reduce_op == "sum"
                        and not isinstance(src[m], Partial)
                        and mesh.my_coordinate[m] != 0
                    ):
                        assert y.to_local().abs().sum() == 0, what
            elif not any(isinstance(p, Partial) and p.reduce_op == "max" for p in src):
                ref = _dtensor_reshard(x, y)
                assert ref.placements == y.placements and ref.process_mesh == mesh, what
                torch.testing.assert_close(y.to_local(), ref.to_local(), **TOL, msg=what)
                compared += 1
            checked += 1
    return checked, compared


@pytest.mark.parametrize(
    "world,mesh_shape", [(2, (2,)), (3, (3,)), (4, (4,)), (4, (2, 2))], ids=["1d-2", "1d-3", "1d-4", "2x2"]
)
def test_every_transition(world, mesh_shape):
    results = run_ranks(_check_transitions, world, mesh_shape, timeout=150)
    checked, compared = results[0]
    assert checked >= 75 and compared >= 30, (checked, compared)


def _impossible(rank, world):
    from autopar import Partial, ProcessMesh, reshard, shard_tensor

    mesh = ProcessMesh([0, 1])
    x = reshard(shard_tensor(torch.ones(3), mesh, [Partial("max")]), mesh, [Partial("max")])
    try:
        reshard(x, mesh, [Partial("sum")])
    except ValueError as e:
        return str(e)
    return None


def test_impossible_transition_names_both_placements():
    msg = run_ranks(_impossible, 2)[0]
    assert msg is not None and "Partial(max)" in msg and "Partial(sum)" in msg


def _cross_mesh(rank, world):
    from autopar import Partial, ProcessMesh, Replicate, Shard, reshard, shard_tensor

    G = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))
    a, b = ProcessMesh([0, 1]), ProcessMesh([2, 3])
    ab = ProcessMesh([[0, 1], [2, 3]])
    c = ProcessMesh([1, 2, 3])
    out = []
    cases = [
        (a, [Shard(0)], b, [Shard(1)]),
        (a, [Partial()], b, [Shard(0)]),
        (a, [Shard(1)], c, [Shard(0)]),
        (b, [Replicate()], a, [Partial()]),
        (ab, [Shard(0), Shard(1)], ProcessMesh([[0, 2], [1, 3]]), [Replicate(), Shard(0)]),
    ]
    for src_mesh, src_pl, dst_mesh, dst_pl in cases:
        x = shard_tensor(G, src_mesh, src_pl)
        y = reshard(x, dst_mesh, dst_pl)
        assert y.shape == G.shape and y.process_mesh == dst_mesh
        if rank in dst_mesh:
            torch.testing.assert_close(y.full_tensor(), G, **TOL)
            out.append(True)
        else:
            assert not y.is_initialized() and y.to_local().numel() == 0
    return len(out)


def test_cross_mesh():
    assert run_ranks(_cross_mesh, 4) == [2, 3, 4, 4]
