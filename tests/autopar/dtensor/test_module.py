"""DistTensor as a tensor to PyTorch: nn.Parameter weights in an nn.Module, torch.optim, state_dict,
torch.save / torch.load, deepcopy, module.to, and conversion to and from PyTorch DTensor.

Training is checked against one process running the same module on plain tensors: every loss
and every weight after 5 AdamW steps. The only difference is the order of the cross-rank sums
(data-parallel and sequence-parallel gradient reductions), hence a tolerance of a few ulps scaled
by Adam's normalization rather than bitwise equality.
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from kernels.testing import run_ranks

TRAIN_TOL = dict(rtol=1e-4, atol=1e-5)


class MLP(torch.nn.Module):
    """gelu(x @ w1 + b1) @ w2; weights are DistTensor parameters when ``mesh`` is given."""

    def __init__(self, seed, mesh=None, placements=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        values = {
            "w1": torch.randn(16, 32, generator=g) / 4,
            "b1": torch.randn(32, generator=g) / 4,
            "w2": torch.randn(32, 16, generator=g) / 6,
        }
        for name, v in values.items():
            if mesh is not None:
                from autopar import shard_tensor

                v = shard_tensor(v, mesh, placements[name])
            setattr(self, name, torch.nn.Parameter(v))

    def forward(self, x):
        return F.gelu(x @ self.w1 + self.b1) @ self.w2


def _layouts(kind):
    from autopar import Replicate, Shard

    R = Replicate()
    if kind == "tp":  # Megatron column then row parallel, data parallel over dp
        return {"w1": [R, Shard(1)], "b1": [R, Shard(0)], "w2": [R, Shard(0)]}, [Shard(0), R], (8, 16)
    # sequence parallel: [batch, sequence, hidden], 5 tokens split 3 + 2 over sp
    return {"w1": [R, R], "b1": [R, R], "w2": [R, R]}, [Shard(0), Shard(1)], (4, 5, 16)


def _train(rank, world, kind):
    from autopar import DistTensor, Partial, ProcessMesh, shard_tensor, sync_gradients

    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", kind])
    placements, x_placements, x_shape = _layouts(kind)
    model, ref = MLP(0, mesh, placements), MLP(0)
    assert [n for n, _ in model.named_parameters()] == ["w1", "b1", "w2"]
    assert all(isinstance(p, DistTensor) and isinstance(p, torch.nn.Parameter) for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    losses, reduced = [], None
    for _ in range(5):
        X = torch.randn(x_shape, generator=g)
        opt.zero_grad()
        y = model(shard_tensor(X, mesh, x_placements))
        loss = (y * y).mean()
        loss.backward()
        assert isinstance(model.w1.grad, DistTensor)
        assert model.w1.grad.placements[0] == Partial()  # not reduced over dp yet
        reduced = sync_gradients(model)
        assert all(p.grad.placements == p.placements for p in model.parameters())
        opt.step()
        ref_opt.zero_grad()
        ref_loss = (ref(X) ** 2).mean()
        ref_loss.backward()
        ref_opt.step()
        losses.append((loss.full_tensor().item(), ref_loss.item()))
    state = opt.state[model.w1]["exp_avg"]
    assert isinstance(state, DistTensor) and state.placements == model.w1.placements
    assert state.to_local().shape == model.w1.to_local().shape  # the state lives on the piece
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=False):
        assert isinstance(p, DistTensor) and p.placements == tuple(placements[name])
        torch.testing.assert_close(p.full_tensor(), q.detach(), **TRAIN_TOL, msg=name)
    return losses, reduced


@pytest.mark.parametrize("kind", ["tp", "sp"])
def test_mlp_trains_like_one_process_with_adamw(kind):
    results = run_ranks(_train, 4, kind, timeout=240)
    for losses, _reduced in results:
        for got, want in losses:
            assert got == pytest.approx(want, rel=1e-5), losses
    expect = [("dp",)] * 3 if kind == "tp" else [("dp", "sp")] * 3
    assert results[0][1] == expect


def _state_dict_and_copies(rank, world, path):
    from autopar import DistTensor, ProcessMesh, Replicate, Shard, shard_tensor

    mesh = ProcessMesh([0, 1], dim_names=["tp"])
    placements = {"w1": [Shard(1)], "b1": [Shard(0)], "w2": [Shard(0)]}
    model = MLP(0, mesh, placements)
    x = shard_tensor(torch.randn(6, 16, generator=torch.Generator().manual_seed(2)), mesh, [Replicate()])
    want = model(x).full_tensor()
    file = os.path.join(path, f"state-rank{rank}.pt")
    torch.save(model.state_dict(), file)

    fresh = MLP(1, mesh, placements)  # other values
    assert not torch.equal(fresh(x).full_tensor(), want)
    fresh.load_state_dict(torch.load(file))  # weights_only=True
    assert torch.equal(fresh(x).full_tensor(), want)
    assert isinstance(fresh.w1, DistTensor) and fresh.w1.placements == (Shard(1),)

    # Other placements on the same mesh: copy_ reshards.
    replicated = MLP(1, mesh, {k: [Replicate()] for k in placements})
    replicated.load_state_dict(torch.load(file))
    assert replicated.w1.placements == (Replicate(),)
    torch.testing.assert_close(replicated(x).full_tensor(), want)

    # Another mesh: a clear error, not a silent copy of the wrong piece.
    other = MLP(1, ProcessMesh([0], dim_names=["tp"]), {k: [Replicate()] for k in placements})
    with pytest.raises(RuntimeError, match="lives on mesh"):
        other.load_state_dict(torch.load(file))

    # A plain (single-process) state dict holds global tensors: each rank keeps its piece.
    plain = MLP(0).state_dict()
    fresh = MLP(1, mesh, placements)
    fresh.load_state_dict(plain)
    assert torch.equal(fresh(x).full_tensor(), want)

    # The whole module through a file, and deepcopy.
    whole = os.path.join(path, f"module-rank{rank}.pt")
    torch.save(model, whole)
    loaded = torch.load(whole, weights_only=False)
    assert isinstance(loaded.w1, torch.nn.Parameter) and isinstance(loaded.w1, DistTensor)
    assert torch.equal(loaded(x).full_tensor(), want)
    twin = copy.deepcopy(model)
    assert isinstance(twin.w1, torch.nn.Parameter) and twin.w1.placements == (Shard(1),)
    assert twin.w1.to_local().data_ptr() != model.w1.to_local().data_ptr()
    assert torch.equal(twin(x).full_tensor(), want)

    # module.to(dtype) keeps DistTensor parameters (swapped whole, pieces converted).
    twin.to(torch.float64)
    assert isinstance(twin.w1, DistTensor) and isinstance(twin.w1, torch.nn.Parameter)
    assert twin.w1.dtype == torch.float64 and twin.w1.to_local().dtype == torch.float64
    return True


def test_state_dict_save_load_deepcopy(tmp_path):
    assert run_ranks(_state_dict_and_copies, 2, str(tmp_path), timeout=180) == [True, True]


def _dtensor_interop(rank, world, mesh_shape):
    from torch.distributed.tensor import DTensor

    from autopar import DistTensor, Partial, ProcessMesh, Replicate, Shard, from_dtensor, to_dtensor

    ranks = list(range(world))
    nested = ranks if len(mesh_shape) == 1 else [ranks[:2], ranks[2:]]
    mesh = ProcessMesh(nested, dim_names=["a"] if len(mesh_shape) == 1 else ["a", "b"])
    G = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))  # uneven over 2, 3, 4
    one = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("avg"), Partial("max"), Partial("min")]
    cases = (
        [(p,) for p in one]
        if len(mesh_shape) == 1
        else [(p, q) for p in one for q in one if not (isinstance(p, Shard) and p == q)]
    )
    checked = 0
    for pl in cases:
        base = tuple(Replicate() if isinstance(p, Partial) else p for p in pl)
        from autopar import shard_tensor

        local = shard_tensor(G, mesh, base).to_local().clone()
        x = DistTensor.from_local(local, mesh, pl, global_shape=G.shape)
        if len({p.reduce_op for p in pl if isinstance(p, Partial)}) > 1:
            with pytest.raises(ValueError, match="mix Partial reduce types"):
                to_dtensor(x)
            continue
        d = to_dtensor(x)
        assert isinstance(d, DTensor) and d.shape == G.shape
        assert d.to_local().data_ptr() == x.to_local().data_ptr()
        assert d.device_mesh.mesh.tolist() == mesh.tolist()
        assert tuple(d.device_mesh.mesh_dim_names) == mesh.dim_names
        # The same placement objects on both sides: autopar's placements are torch's.
        assert d.placements == x.placements and all(q is p for p, q in zip(x.placements, d.placements, strict=True))
        torch.testing.assert_close(d.full_tensor(), x.full_tensor())
        back = from_dtensor(d)
        assert isinstance(back, DistTensor) and back.placements == tuple(pl)
        assert all(q is p for p, q in zip(d.placements, back.placements, strict=True))
        assert back.process_mesh == mesh and back.shape == G.shape
        assert back.to_local().data_ptr() == x.to_local().data_ptr()
        checked += 1
    # A DTensor made by DTensor itself.
    from torch.distributed.tensor import distribute_tensor

    dt = distribute_tensor(
        G, to_dtensor(x).device_mesh, [Shard(1)] * len(mesh_shape) if len(mesh_shape) == 1 else [Shard(1), Shard(0)]
    )
    y = from_dtensor(dt)
    assert y.to_local().data_ptr() == dt.to_local().data_ptr()
    torch.testing.assert_close(y.full_tensor(), G)
    with pytest.raises(ValueError, match="product"):
        from_dtensor(
            DTensor.from_local(
                torch.ones(5, 7), dt.device_mesh, [Partial("product")] * len(mesh_shape), run_check=False
            )
        )
    # A rank outside the mesh: uninitialized both ways, no storage.
    sub = ProcessMesh(ranks[1:], dim_names=["s"])
    z = to_dtensor(shard_tensor(G, sub, [Shard(0)]))
    z_back = from_dtensor(z)
    if rank == 0:
        assert not z_back.is_initialized() and z_back.to_local().numel() == 0
    assert z_back.shape == G.shape and z_back.placements == (Shard(0),)
    return checked


@pytest.mark.parametrize("world,mesh_shape", [(3, (3,)), (4, (2, 2))], ids=["1d-3", "2x2"])
def test_dtensor_interop_every_placement(world, mesh_shape):
    checked = run_ranks(_dtensor_interop, world, mesh_shape, timeout=180)
    # 2-D: 49 pairs less Shard(d) twice (2) less mixed Partial types (12), which DTensor rejects
    assert checked[0] == (7 if len(mesh_shape) == 1 else 35)


def _docs_example(rank, world, path):
    import contextlib
    import io
    import re

    from kernels.testing import REPO_ROOT

    text = open(os.path.join(REPO_ROOT, "docs", "dtensor.md")).read()
    section = text[text.index("## Examples: data + sequence parallel training") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    # The harness already holds the process group that torchrun's script would create.
    code = code.replace('dist.init_process_group("gloo")\n', "").replace("dist.destroy_process_group()\n", "")
    cwd, out = os.getcwd(), io.StringIO()
    os.chdir(path)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "docs/dtensor.md", "exec"), {"__name__": "readme"})
    finally:
        os.chdir(cwd)
    assert os.path.exists(os.path.join(path, f"mlp-rank{rank}.pt"))
    # One process, plain tensors, the same module and optimizer.
    torch.manual_seed(0)
    w1, w2 = torch.randn(32, 64) / 32**0.5, torch.randn(64, 32) / 64**0.5
    w1, w2 = w1.requires_grad_(), w2.requires_grad_()
    opt = torch.optim.AdamW([w1, w2], lr=1e-2)
    torch.manual_seed(1)
    X = torch.randn(8, 16, 32)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = (F.gelu(X @ w1) @ w2).pow(2).mean()
        loss.backward()
        opt.step()
        want.append(f"{loss.item():.4f} [('dp', 'sp'), ('dp', 'sp')]")
    return out.getvalue().splitlines(), want, text


def test_docs_distributed_tensor_example_runs(tmp_path):
    """docs/dtensor.md's nn.Module + AdamW example is a promise: run it on 4 ranks."""
    results = run_ranks(_docs_example, 4, str(tmp_path), timeout=180)
    lines, want, text = results[0]
    assert lines == want
    assert all(r[0] == [] for r in results[1:])
    for line in want:
        assert line.split()[0] in text  # the docs quote the losses it prints


def test_dispatch_overhead_bench_runs_at_world_2():
    """bench.cost.dispatch spawns its ranks and reports every row against DTensor."""
    from bench.cost.dispatch import run_world

    res = run_world(2, iters=3, repeats=1)
    assert res["world"] == 2
    assert [r["op"] for r in res["rows"]] == ["matmul", "gelu", "add"]
    for r in res["rows"] + [res["together"], res["train"]]:
        assert r["torch_us"] > 0 and r["dtensor_us"] > 0 and r["autopar_us"] > 0, r
    with pytest.raises(ValueError, match="--world"):
        run_world(0, iters=1, repeats=1)


def _pipeline_parameters_train(rank, world):
    from autopar import ProcessMesh, Replicate, reshard, shard_tensor, stage_meshes, sync_gradients

    stage0, stage1 = stage_meshes(ProcessMesh([0, 1], dim_names=["pp"]), "pp")
    g = torch.Generator().manual_seed(3)
    W0, W1 = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    X = torch.randn(5, 8, generator=g)
    w0 = torch.nn.Parameter(shard_tensor(W0, stage0, [Replicate()]))
    w1 = torch.nn.Parameter(shard_tensor(W1, stage1, [Replicate()]))
    opt = torch.optim.AdamW([w0, w1], lr=1e-2)
    ref = [W0.clone().requires_grad_(), W1.clone().requires_grad_()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        h = reshard(F.gelu(shard_tensor(X, stage0, [Replicate()]) @ w0), stage1, [Replicate()])
        y = h @ w1
        (y * y).mean().backward()  # every rank, clipped or not
        sync_gradients([w0, w1])
        opt.step()
        ref_opt.zero_grad()
        (F.gelu(X @ ref[0]) @ ref[1]).pow(2).mean().backward()
        ref_opt.step()
    mine, clipped = (w0, w1) if rank == 0 else (w1, w0)
    assert not clipped.is_initialized() and clipped.shape == (W1.shape if rank == 0 else W0.shape)
    for t in (clipped, clipped.grad, opt.state[clipped]["exp_avg"]):
        assert not t.is_initialized() and t.to_local().untyped_storage().nbytes() == 0
    torch.testing.assert_close(mine.full_tensor(), ref[rank].detach(), **TRAIN_TOL)
    return True


def test_pipeline_parameters_train_and_clipped_ranks_hold_nothing():
    """nn.Parameter weights on two pipeline stages, AdamW on every rank: the stage's rank trains
    like one process; the other rank's parameter, gradient and optimizer state stay empty."""
    assert run_ranks(_pipeline_parameters_train, 2, timeout=120) == [True, True]
