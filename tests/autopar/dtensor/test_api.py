"""DistTensor API in one process: views, validation errors, and clipped-rank shape inference.

Without an initialized process group this process is rank 0, so a mesh without rank 0 makes it
a clipped rank: ops must return uninitialized DistTensors with the right global shape, dtype and
placements, allocate nothing, and backward must run without communicating.
"""

import pytest
import torch
import torch.nn.functional as F

from autopar import DistTensor, Partial, ProcessMesh, Replicate, Shard, shard_tensor


def test_views_and_local_pieces():
    mesh = ProcessMesh([[0]], dim_names=["dp", "tp"])
    x = shard_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(1), Partial("avg")])
    assert x.dims_mapping == [-1, 0] and x.partial_status == {1: "avg"}
    assert x.shape == torch.Size([3, 4]) and x.process_mesh == mesh and x.is_initialized()
    assert torch.equal(x.full_tensor(), torch.arange(12.0).reshape(3, 4))
    y = DistTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)])
    assert y.placements == (Shard(0), Replicate()) and y.shape == torch.Size([3, 4])


def test_validation_errors():
    with pytest.raises(ValueError, match="ragged"):
        ProcessMesh([[0, 1], [2]])
    with pytest.raises(ValueError, match="duplicate"):
        ProcessMesh([0, 0])
    with pytest.raises(ValueError, match="dim_names"):
        ProcessMesh([0, 1], dim_names=["a", "b"])
    mesh = ProcessMesh([0])
    with pytest.raises(ValueError, match="local shape"):
        DistTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)], global_shape=(5, 4))
    with pytest.raises(ValueError, match="out of range"):
        shard_tensor(torch.ones(3), mesh, [Shard(1)])
    with pytest.raises(ValueError, match="different meshes"):
        shard_tensor(torch.ones(3), mesh, [Replicate()]) + shard_tensor(torch.ones(3), ProcessMesh([1]), [Replicate()])
    with pytest.raises(NotImplementedError, match="no DistTensor SPMD rule"):
        torch.cumsum(shard_tensor(torch.ones(3), mesh, [Replicate()]), 0)


def test_elementwise_ops_without_rule_need_one_non_partial_layout():
    """Elementwise ATen ops (what optimizers use) run on the pieces when all operands share one
    layout and none is Partial; otherwise they raise instead of returning a wrong value."""
    mesh = ProcessMesh([0], dim_names=["dp"])
    X = torch.randn(4, 3)
    x = shard_tensor(X, mesh, [Shard(0)])
    y = torch.atan(x)
    assert isinstance(y, DistTensor) and y.placements == (Shard(0),)
    torch.testing.assert_close(y.full_tensor(), torch.atan(X))
    with pytest.raises(NotImplementedError, match="Partial"):
        torch.atan(shard_tensor(X, mesh, [Partial()]))
    with pytest.raises(NotImplementedError, match="share mesh, global shape and placements"):
        torch.maximum(x, shard_tensor(X, mesh, [Replicate()]))
    with pytest.raises(NotImplementedError, match="full_tensor"):
        x.sum().item()


def test_submesh():
    mesh = ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["pp", "tp"])
    s1 = mesh.get_submesh("pp", 1)
    assert s1.process_ids == (3, 4, 5) and s1.dim_names == ("tp",)
    assert mesh.get_submesh("tp", 2).process_ids == (2, 5)
    assert mesh.dim_groups("pp") == [(0, 3), (1, 4), (2, 5)]
    assert mesh.coordinate(4) == (1, 1) and 4 in mesh and 7 not in mesh


def test_clipped_rank_infers_shapes_and_allocates_nothing():
    mesh = ProcessMesh([1, 2], dim_names=["tp"])  # this process (rank 0) is outside
    x = shard_tensor(torch.randn(6, 5, 8), mesh, [Shard(0)])
    w = shard_tensor(torch.randn(8, 12), mesh, [Shard(1)]).requires_grad_()
    b = shard_tensor(torch.randn(12), mesh, [Shard(0)]).requires_grad_()
    ln_w = shard_tensor(torch.randn(12), mesh, [Replicate()]).requires_grad_()
    h = F.layer_norm(F.gelu(x @ w + b), (12,), ln_w)
    s = h.softmax(-1).sum(dim=1)
    loss = s.mean()
    # x @ w gathers x (the weight's column shard wins), layer_norm needs the last dim whole.
    expect = {
        "h": (h, (6, 5, 12), (Replicate(),)),
        "s": (s, (6, 12), (Replicate(),)),
        "loss": (loss, (), (Replicate(),)),
        "xsum": (x.sum(), (), (Partial(),)),
        "mm": (x @ w, (6, 5, 12), (Shard(2),)),
    }
    for name, (t, shape, pl) in expect.items():
        assert not t.is_initialized(), name
        assert t.shape == torch.Size(shape) and t.placements == pl and t.dtype == torch.float32, name
        assert t.to_local().numel() == 0 and t.to_local().untyped_storage().nbytes() == 0, name
    loss.backward()
    for p, shape in ((w, (8, 12)), (b, (12,)), (ln_w, (12,))):
        assert p.grad is not None and not p.grad.is_initialized() and p.grad.shape == shape
    with pytest.raises(ValueError, match="outside"):
        loss.full_tensor()
    with pytest.raises(NotImplementedError, match="depends on the data"):
        torch.nonzero(x)


def test_clipped_placeholders_keep_the_data_device():
    """A clipped rank's placeholders, forward and backward, sit on the data's device (allocating
    nothing): a cross-mesh receive allocates there, and NCCL cannot receive into CPU tensors."""
    mesh = ProcessMesh([1, 2], dim_names=["tp"])  # this process (rank 0) is outside
    dev = torch.device("meta")
    x = shard_tensor(torch.empty(6, 5, 8, device=dev), mesh, [Shard(0)])
    w = shard_tensor(torch.empty(8, 12, device=dev), mesh, [Shard(1)]).requires_grad_()
    y = F.gelu(x @ w + torch.zeros(12, device=dev))
    loss = y.sum()
    loss.backward()
    for name, t in (("x", x), ("y", y), ("loss", loss), ("w.grad", w.grad)):
        assert not t.is_initialized() and t.to_local().device == dev, name
    local = DistTensor.from_local(torch.empty(3, 8, device=dev), mesh, [Shard(0)], global_shape=(6, 8))
    assert local.to_local().device == dev


def test_dtype_argument_of_reductions_and_softmax():
    """``dtype=`` of sum / mean / softmax is honoured as torch does, on computing and clipped ranks."""
    X = torch.randn(4, 6)
    f64 = torch.float64
    cases = {
        "sum": (lambda t: t.sum(dtype=f64), lambda t: t.sum(dtype=f64)),
        "torch.sum": (lambda t: torch.sum(t, 1, dtype=f64), lambda t: torch.sum(t, 1, dtype=f64)),
        "mean": (lambda t: t.mean(0, keepdim=True, dtype=f64), lambda t: t.mean(0, keepdim=True, dtype=f64)),
        "torch.softmax": (lambda t: torch.softmax(t, -1, f64), lambda t: torch.softmax(t, -1, f64)),
        "softmax": (lambda t: t.softmax(-1, dtype=f64), lambda t: t.softmax(-1, dtype=f64)),
        "F.softmax": (lambda t: F.softmax(t, -1, dtype=f64), lambda t: F.softmax(t, -1, dtype=f64)),
    }
    for name, (fn, ref_fn) in cases.items():
        ref_x = X.clone().requires_grad_()
        ref = ref_fn(ref_x)
        ref.sum().backward()
        x = shard_tensor(X, ProcessMesh([0]), [Shard(0)]).requires_grad_()
        out = fn(x)
        assert out.dtype == f64 and out.to_local().dtype == f64, name
        torch.testing.assert_close(out.full_tensor(), ref.detach(), msg=name)
        out.sum().backward()
        assert x.grad.dtype == torch.float32, name
        torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad, msg=name)
        clipped = fn(shard_tensor(X, ProcessMesh([1]), [Shard(0)]))  # rank 0 is outside
        assert not clipped.is_initialized() and clipped.dtype == f64, name


def test_sync_gradients_on_a_module_and_second_backward():
    from autopar import sync_gradients

    mesh = ProcessMesh([0], dim_names=["dp"])
    model = torch.nn.Module()
    model.inner = torch.nn.Module()
    model.w = shard_tensor(torch.randn(4, 3), mesh, [Replicate()]).requires_grad_()
    model.inner.v = shard_tensor(torch.randn(3), mesh, [Replicate()]).requires_grad_()
    x = shard_tensor(torch.randn(5, 4), mesh, [Shard(0)])
    loss = ((x @ model.w) * model.inner.v).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert model.w.grad.placements == (Partial(),)
    assert sync_gradients(model) == [("dp",), ("dp",)]
    assert model.w.grad.placements == (Replicate(),)
    w, v = model.w.full_tensor().detach().requires_grad_(), model.inner.v.full_tensor().detach().requires_grad_()
    (2 * ((x.full_tensor() @ w) * v).sum()).backward()  # two backward passes accumulate
    torch.testing.assert_close(model.w.grad.full_tensor(), w.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.inner.v.grad.full_tensor(), v.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_optimizer_steps_on_local_pieces():
    from autopar import attach_local_grads, sync_gradients

    mesh = ProcessMesh([0], dim_names=["dp"])
    W = torch.randn(4, 3)
    w = shard_tensor(W, mesh, [Replicate()]).requires_grad_()
    with torch.no_grad():  # the piece itself (with grad mode on, to_local() is a tracked view)
        opt = torch.optim.SGD([w.to_local()], lr=0.1)
    x = shard_tensor(torch.randn(5, 4), mesh, [Shard(0)])
    (x @ w).sum().backward()
    sync_gradients([w])
    attach_local_grads([w])
    opt.step()
    expected = W - 0.1 * x.full_tensor().sum(0, keepdim=True).T.expand(4, 3)
    torch.testing.assert_close(w.full_tensor(), expected)


def test_sgd_steps_parameters_and_rejects_unsynced_gradients():
    """torch.optim.SGD on nn.Parameter(DistTensor): the step updates the local piece; zero_grad
    without set_to_none zeroes Partial gradients in place; a step on a Partial gradient raises."""
    from autopar import sync_gradients

    mesh = ProcessMesh([0], dim_names=["dp"])
    W = torch.randn(4, 3)
    w = torch.nn.Parameter(shard_tensor(W, mesh, [Replicate()]))
    assert isinstance(w, DistTensor) and isinstance(w, torch.nn.Parameter) and w.requires_grad
    with torch.no_grad():
        local = w.to_local()
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    x = shard_tensor(torch.randn(5, 4), mesh, [Shard(0)])
    (x @ w).sum().backward()
    assert w.grad.placements == (Partial(),)
    with pytest.raises(NotImplementedError, match="sync_gradients"):
        opt.step()
    opt.zero_grad(set_to_none=False)
    assert w.grad.placements == (Partial(),) and w.grad.to_local().abs().sum() == 0
    (x @ w).sum().backward()
    sync_gradients([w])
    opt.step()
    expected = W - 0.1 * x.full_tensor().sum(0, keepdim=True).T.expand(4, 3)
    torch.testing.assert_close(w.full_tensor(), expected)
    with torch.no_grad():
        assert w.to_local() is local  # updated in place, the same piece
    assert opt.state[w]["momentum_buffer"].placements == (Replicate(),)


def test_adamw_foreach_matches_single_tensor_path():
    """AdamW(foreach=True) runs torch._foreach_* ops on the pieces: same result as foreach=False."""
    from autopar import sync_gradients

    mesh = ProcessMesh([0], dim_names=["dp"])
    x = shard_tensor(torch.randn(5, 4), mesh, [Shard(0)])
    results = []
    for foreach in (False, True):
        torch.manual_seed(0)
        ps = [
            torch.nn.Parameter(shard_tensor(torch.randn(4, 3), mesh, [Replicate()])),
            torch.nn.Parameter(shard_tensor(torch.randn(3), mesh, [Replicate()])),
        ]
        opt = torch.optim.AdamW(ps, lr=0.1, foreach=foreach)
        for _ in range(2):
            opt.zero_grad()
            ((x @ ps[0]) * ps[1]).sum().backward()
            sync_gradients(ps)
            opt.step()
        assert all(isinstance(opt.state[p]["exp_avg_sq"], DistTensor) for p in ps)
        results.append([p.full_tensor() for p in ps])
        opt.zero_grad(set_to_none=False)  # _foreach_zero_ with foreach=True
        assert all(p.grad.to_local().abs().sum() == 0 for p in ps)
    # Reductions of the pieces are not reductions of the tensors: no silent answer.
    with pytest.raises(NotImplementedError, match="_foreach_norm"):
        torch._foreach_norm(ps)
    with pytest.raises(NotImplementedError, match="no DistTensor SPMD rule"):
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
    for a, b in zip(*results, strict=False):
        torch.testing.assert_close(a, b)


def _wrapper_meta(t: torch.Tensor) -> tuple:
    # The C++ tensor's own metadata (what the autograd engine and optimizers see), not the
    # Python-level views DistTensor defines.
    with torch._C.DisableTorchFunctionSubclass():
        return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, t.is_leaf)


@pytest.mark.parametrize("fast", [True, False], ids=["dtensor_new", "make_wrapper_subclass"])
def test_both_wrapper_constructors_give_the_same_tensors(monkeypatch, fast):
    """Wrappers are built with DTensor's ``_dtensor__new__`` where torch has it, else with
    ``_make_wrapper_subclass`` (and always when the declared dtype is not the piece's): both give
    the same metadata, values and gradients, clipped and empty pieces included."""
    import autopar.dtensor.tensor as T

    if not fast:
        monkeypatch.setattr(T, "_DTENSOR_NEW", None)
    elif T._DTENSOR_NEW is None:
        pytest.skip("this torch has no torch.Tensor._dtensor__new__")
    mesh = ProcessMesh([0], dim_names=["dp"])
    X, W = torch.randn(4, 3), torch.randn(3, 5)
    x = shard_tensor(X, mesh, [Shard(0)])
    w = torch.nn.Parameter(shard_tensor(W, mesh, [Replicate()]))
    with torch.no_grad():
        for _ in range(3):  # the cached (hot) paths too
            y = F.gelu(x @ w) + x @ w
            r = torch.relu(x) + x.relu()
        # The cached one-input path served the last calls, and kept the input's placement.
        xw = x @ w
        assert x._lid in T.UNARY_PLAIN.get(torch.relu, {}) and xw._lid in T.UNARY_PLAIN.get(F.gelu, {})
        assert F.gelu(xw).placements == torch.relu(x).placements == (Shard(0),)
    torch.testing.assert_close(r.full_tensor(), 2 * torch.relu(X))
    assert y.placements == r.placements == (Shard(0),)
    assert _wrapper_meta(y) == ((4, 5), (5, 1), torch.float32, torch.device("cpu"), False, True)
    torch.testing.assert_close(y.full_tensor(), F.gelu(X @ W) + X @ W)
    loss = (F.gelu(x @ w) + x @ w).sum()
    assert _wrapper_meta(loss)[4:] == (True, False)
    loss.backward()
    Wr = W.clone().requires_grad_()
    (F.gelu(X @ Wr) + X @ Wr).sum().backward()
    torch.testing.assert_close(w.grad.full_tensor(), Wr.grad)
    assert _wrapper_meta(w.grad) == ((3, 5), (5, 1), torch.float32, torch.device("cpu"), False, True)
    empty = shard_tensor(torch.ones(0, 3), mesh, [Shard(0)])
    assert _wrapper_meta(empty + empty)[:2] == ((0, 3), (3, 1))
    clipped = shard_tensor(torch.ones(2, 3, dtype=torch.float64), ProcessMesh([1]), [Replicate()])
    assert _wrapper_meta(clipped)[:3] == ((2, 3), (3, 1), torch.float64)
    declared = T.make(torch.ones(2), mesh, (Replicate(),), torch.Size([2]), torch.bfloat16)
    assert _wrapper_meta(declared)[2] == torch.bfloat16 and declared.to_local().dtype == torch.float32


def test_private_constructor_probe_rejects_a_changed_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_dtensor__new__`` is private: a torch where it builds another tensor, or takes other
    arguments, must send DistTensor to ``_make_wrapper_subclass`` (decided once at import)."""
    from autopar.dtensor import tensor

    real = getattr(torch.Tensor, "_dtensor__new__", None)
    assert tensor._private_constructor_works() == (real is not None)

    def local_shape(cls, piece, spec, requires_grad):  # the piece's shape, not the global one
        return torch.Tensor._make_wrapper_subclass(cls, piece.shape, dtype=piece.dtype)

    def other_signature(cls, piece, spec, *, requires_grad, extra):
        raise AssertionError("unreachable")

    for fake in (local_shape, other_signature):
        monkeypatch.setattr(tensor, "_DTENSOR_NEW", fake)
        assert not tensor._private_constructor_works(), fake.__name__


def test_lazy_bits_are_resolved_and_sparse_pieces_refused() -> None:
    """A conjugated or negated view becomes a plain piece (the wrapper constructors differ on those
    bits); a sparse tensor is refused by name instead of failing inside an op."""
    mesh = ProcessMesh([0], dim_names=["dp"])
    z = torch.tensor([1 + 2j, 3 - 1j])
    for lazy in (z.conj(), torch._neg_view(torch.tensor([1.0, -2.0]))):
        for d in (DistTensor.from_local(lazy, mesh, [Replicate()]), shard_tensor(lazy, mesh, [Shard(0)])):
            assert not d.to_local().is_conj() and not d.to_local().is_neg()
            torch.testing.assert_close(d.full_tensor(), lazy.resolve_conj().resolve_neg())
    with pytest.raises(TypeError, match="only dense.*sparse_coo"):
        DistTensor.from_local(torch.eye(2).to_sparse(), mesh, [Replicate()])
    with pytest.raises(TypeError, match="only dense.*sparse_coo"):
        shard_tensor(torch.eye(2).to_sparse(), mesh, [Replicate()])
