"""The shape and neural-network op rules (view / reshape / flatten / unflatten / (un)squeeze,
permute / transpose / mT, expand, basic indexing, cat, contiguous, embedding, scaled dot-product
attention, cross_entropy, unary functions) against plain torch, values and gradients, on uneven
shapes at world 2 and 3, and the output placements where the rule must keep a shard (or must
gather: a view whose piece boundaries do not line up, an index into a sharded dim).

Shape ops move values without arithmetic: exact except where a Partial is reduced or a gradient
is summed (a few fp32 terms, hence ``1e-5``); attention and cross entropy are fp32 reductions over
at most 8 terms per output, compared with the same ``1e-5``.
"""

import pytest
import torch
import torch.nn.functional as F

from kernels.testing import run_ranks, seeded_randn

TOL = dict(rtol=1e-5, atol=1e-5)


def _cases(world):
    from autopar import Partial, Replicate, Shard

    S, R, P = Shard, Replicate(), Partial()
    A = seeded_randn(5, 6, 4, seed=1)
    B = seeded_randn(5, 8, seed=2)
    C = seeded_randn(5, 6, 3, seed=3)
    H = seeded_randn(2, 5, 64, seed=4)
    U = seeded_randn(5, 1, 4, seed=5)
    q, k, v = seeded_randn(2, 4, 5, 8, seed=6), seeded_randn(2, 2, 5, 8, seed=7), seeded_randn(2, 2, 5, 8, seed=8)
    mask = seeded_randn(2, 1, 5, 5, seed=9)
    logits = seeded_randn(6, 7, seed=10)
    labels = torch.tensor([0, 3, 6, -100, 2, 5])
    ids = torch.tensor([[0, 10, 3], [7, 5, 5], [1, 2, 9], [4, 8, 6], [10, 0, 2]])
    emb = seeded_randn(11, 6, seed=11)
    even2 = world == 2
    # name -> (fn, inputs, placements of the inputs, expected output placements or None)
    return {
        "view_merge_lead": (lambda a: a.view(5, 24), [A], [[S(0)]], [S(0)]),
        "view_merge_second": (lambda a: a.reshape(5, -1), [A], [[S(1)]], [S(1)]),
        "view_merge_inner_gathers": (lambda a: a.view(5, 24), [A], [[S(2)]], [R]),
        "view_split_heads": (lambda h: h.view(2, 5, -1, 16), [H], [[S(2)]], [S(2)] if even2 else [R]),
        "view_split": (lambda b: b.view(5, 2, 4), [B], [[S(1)]], [S(1)] if even2 else [R]),
        "view_partial": (lambda a: a.view(30, 4), [A], [[P]], [P]),
        "flatten_unflatten": (lambda a: a.flatten(1).unflatten(1, (2, 12)), [A], [[S(0)]], [S(0)]),
        "unsqueeze_squeeze": (lambda a: a.unsqueeze(1).squeeze(1).unsqueeze(-1), [A], [[S(1)]], [S(1)]),
        "transpose_permute": (lambda a: a.transpose(0, 2).permute(1, 2, 0), [A], [[S(0)]], [S(1)]),
        "mT_t": (lambda b: b.mT @ b.t().t(), [B], [[S(1)]], None),
        "expand": (lambda u: u.expand(5, 3, 4) + u.expand(2, -1, 3, -1)[1], [U], [[S(0)]], [S(0)]),
        "expand_sharded_broadcast_dim": (lambda u: u.expand(5, 3, 4), [U], [[S(1)]], [R]),
        "index_keeps_shard": (lambda a: a[..., :2] * a[:, None, :, 2:].sum(1), [A], [[S(0)]], [S(0)]),
        "index_sharded_dim_gathers": (lambda a: a[1:4, ::2], [A], [[S(0)]], [R]),
        "index_int": (lambda a: a[:, 2], [A], [[S(0)]], [S(0)]),
        "rotate_half": (lambda a: torch.cat((-a[..., 2:], a[..., :2]), dim=-1), [A], [[S(1)]], [S(1)]),
        "cat_other_dim": (lambda a, c: torch.cat([a, c], dim=2), [A, C], [[S(0)], [S(1)]], [S(0)]),
        "cat_sharded_dim": (lambda a, c: torch.cat([a, c], -1).transpose(1, 2), [A, C], [[S(2)], [S(2)]], [R]),
        "cat_partials": (lambda a, c: torch.cat([a, c], 1), [A, A], [[P], [P]], [P]),
        "cat_plain": (lambda a: torch.cat([a, C, torch.empty(0)], 2), [A], [[S(1)]], [S(1)]),
        "contiguous": (lambda a: a.transpose(0, 1).contiguous().view(6, 20), [A], [[S(1)]], [S(0)]),
        "unary_partial": (
            lambda a: F.silu(a) + torch.rsqrt(a * a + 1.0) + a.pow(2) + torch.sigmoid(a).exp() + a.tanh(),
            [A],
            [[P]],
            [R],
        ),
        "embedding_vocab_parallel": (lambda w: F.embedding(ids, w, padding_idx=5), [emb], [[S(0)]], [P]),
        "embedding_dim_sharded": (lambda w: F.embedding(ids, w), [emb], [[S(1)]], [S(2)]),
        "embedding_ids_sharded": (lambda i, w: F.embedding(i, w), [ids, emb], [[S(0)], [R]], [S(0)]),
        "sdpa_heads_gqa": (
            lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True),
            [q, k, v],
            [[S(1)], [S(1)], [S(1)]],
            [S(1)] if even2 else [R],
        ),
        "sdpa_batch_mask": (
            lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=0.3),
            [q, q * 0.5, q + 1.0],
            [[S(0)], [R], [S(1)]],
            [S(0)],
        ),
        "cross_entropy_sum": (lambda x: F.cross_entropy(x, labels, reduction="sum"), [logits], [[S(0)]], [P]),
        "cross_entropy_none": (lambda x: F.cross_entropy(x, labels, reduction="none"), [logits], [[S(0)]], [S(0)]),
        "cross_entropy_mean_classes": (
            lambda x: F.cross_entropy(x, labels, label_smoothing=0.1),
            [logits],
            [[S(1)]],
            [R],
        ),
        "dropout_off": (lambda a: F.dropout(a, p=0.3, training=False) * 2.0, [A], [[S(2)]], [S(2)]),
    }


def _run_cases(rank, world):
    from autopar import DistTensor, ProcessMesh, shard_tensor

    mesh = ProcessMesh(list(range(world)))
    done = []
    for name, (fn, tensors, pls, expect) in _cases(world).items():
        floats = [t.is_floating_point() for t in tensors]
        ref_in = [t.clone().requires_grad_() if f else t for t, f in zip(tensors, floats, strict=True)]
        ref = fn(*ref_in)
        weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(99))
        (ref * weight).sum().backward()
        dts = [shard_tensor(t, mesh, p) for t, p in zip(tensors, pls, strict=True)]
        dts = [d.requires_grad_() if f else d for d, f in zip(dts, floats, strict=True)]
        out = fn(*dts)
        assert isinstance(out, DistTensor), name
        if expect is not None:
            assert list(out.placements) == expect, (name, out.placements, expect)
        torch.testing.assert_close(out.full_tensor(), ref.detach(), **TOL, msg=name)
        (out * weight).sum().backward()
        for i, (d, r) in enumerate(zip(dts, ref_in, strict=True)):
            if floats[i]:
                assert d.grad is not None, (name, i)
                torch.testing.assert_close(d.grad.full_tensor(), r.grad, **TOL, msg=f"{name} grad {i}")
        done.append(name)
    return done


@pytest.mark.parametrize("world", [2, 3])
def test_shape_and_nn_ops_match_torch(world):
    done = run_ranks(_run_cases, world)
    assert done[0] == list(_cases(world)) and all(d == done[0] for d in done)


def _errors_case(rank, world):
    from autopar import ProcessMesh, Shard, shard_tensor

    mesh = ProcessMesh(list(range(world)))
    x = shard_tensor(seeded_randn(4, 6, seed=1), mesh, [Shard(0)])
    checks = [
        (NotImplementedError, "advanced indexing", lambda: x[torch.tensor([0, 1])]),
        (NotImplementedError, "dropout", lambda: F.dropout(x, p=0.5, training=True)),
        (NotImplementedError, "dropout_p", lambda: F.scaled_dot_product_attention(x, x, x, dropout_p=0.1)),
        (NotImplementedError, "view\\(dtype", lambda: x.view(torch.int32)),
        (ValueError, "invalid for a tensor of 24 elements", lambda: x.view(5, 5)),
        (NotImplementedError, "max_norm", lambda: F.embedding(torch.tensor([1]), x, max_norm=1.0)),
        (NotImplementedError, "no DistTensor SPMD rule", lambda: torch.argmax(x, 1)),
    ]
    for exc, match, fn in checks:
        with pytest.raises(exc, match=match):
            fn()
    return len(checks)


def test_unsupported_forms_raise_named_errors():
    assert run_ranks(_errors_case, 2) == [7, 7]


def test_clipped_rank_infers_shapes_of_shape_and_nn_ops():
    """In one process without a group this is rank 0, outside the mesh ``[1, 2]``: the new ops
    run only their rules and return uninitialized DistTensors of the right global shape and
    placements, and backward runs without communicating."""
    from autopar import Partial, ProcessMesh, Replicate, Shard, shard_tensor

    mesh = ProcessMesh([1, 2], dim_names=["tp"])
    h = shard_tensor(seeded_randn(2, 5, 64, seed=1), mesh, [Shard(2)]).requires_grad_()
    emb = shard_tensor(seeded_randn(11, 64, seed=2), mesh, [Shard(0)]).requires_grad_()
    ids = torch.tensor([[0, 10, 3, 1, 2], [7, 5, 5, 4, 9]])
    x = F.embedding(ids, emb) + h
    q = x.view(2, 5, 4, 16).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, q, torch.cat([q[..., :8], q[..., 8:]], -1), is_causal=True)
    out = a.transpose(1, 2).reshape(2, 5, -1)
    expect = {
        "embedding": (F.embedding(ids, emb), (2, 5, 64), (Partial(),)),
        "x": (x, (2, 5, 64), (Shard(2),)),
        "q": (q, (2, 4, 5, 16), (Shard(1),)),
        "attention": (a, (2, 4, 5, 16), (Shard(1),)),
        "out": (out, (2, 5, 64), (Shard(2),)),
        "loss": (F.cross_entropy(out.flatten(0, 1), ids.flatten() * 0), (), (Replicate(),)),
    }
    for name, (t, shape, pl) in expect.items():
        assert not t.is_initialized(), name
        assert t.shape == torch.Size(shape) and t.placements == pl, (name, t.shape, t.placements)
        assert t.to_local().numel() == 0, name
    out.sum().backward()
    assert emb.grad is not None and not emb.grad.is_initialized() and emb.grad.shape == (11, 64)
    assert h.grad is not None and h.grad.placements == (Shard(2),)
