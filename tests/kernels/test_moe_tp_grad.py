"""Autograd of the tensor-parallel MoE ops (kernels/ops/moe_autograd.py): the chain ``all_gather_grouped_matmul ->
silu -> grouped_matmul_reduce_scatter`` differentiated at W = 1, 2, 3 on the sequential and chunked backends,
against torch autograd of the one-process dense MoE in fp64 (the same inputs, regenerated from seeds).

Tolerance: every gradient entry is a sum, in fp32, of at most ``T = max(k, n, k_out) * topk * M <= 16 * 2 * 15``
products plus the sums over slots and ranks, each product rounded once, of magnitudes below ``S``: the error is
below ``(T + topk + W) * 2^-24 * S``. The inputs are O(1) with weights scaled by ``1 / sqrt(fan_in)``, so the
partial sums stay O(1) (the largest gradient entry here is < 8, ``S`` < 64 covers every sum's magnitude): the bound
is ``~500 * 6e-8 * 64 ~ 2e-3`` in the worst case and far below it in practice, since rounding errors do not all
align; the test asserts 1e-5 absolute (the one-process comparison of the model tests) and prints the worst error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.testing import run_ranks
from tests.kernels.test_moe_tp import CASES, K_OUT, K, N, _inputs, _shard

TOL = 1e-5
RUNS = [(b, c, num) for c in ("skewed", "top1", "even") for b, num in (("sequential", 1), ("chunked", 2))]


def _upstream(world: int, case: str) -> torch.Tensor:
    """The gradient of the loss with respect to the output, every rank's tokens."""
    m_local = CASES[case][0]
    return torch.randn(m_local * world, K_OUT, generator=torch.Generator().manual_seed(7 + world))


def _rank_grads(rank: int, world: int, runs: list[tuple[str, str, int]]) -> list[dict[str, torch.Tensor]]:
    out = []
    for backend, case, parallel_num in runs:
        inp = _inputs(world, case, torch.float32)
        m_local = CASES[case][0]
        own, cols = slice(rank * m_local, (rank + 1) * m_local), _shard(world, rank)
        x = inp["x"][own].clone().requires_grad_()
        w1 = inp["w1"][:, cols].contiguous().requires_grad_()
        w2 = inp["w2"][:, :, cols].contiguous().requires_grad_()
        tw = inp["tw"].clone().requires_grad_()
        opts = {"backend": backend, "parallel_num": parallel_num}
        y, routing = kernels.all_gather_grouped_matmul(x, inp["ids"][own], w1, **opts)
        result = kernels.grouped_matmul_reduce_scatter(F.silu(y), w2, routing, tw, **opts)
        (result * _upstream(world, case)[own]).sum().backward()
        out.append({"out": result.detach(), "x": x.grad, "w1": w1.grad, "w2": w2.grad, "tw": tw.grad})
    return out


def _dense(world: int, case: str) -> dict[str, torch.Tensor]:
    """The one-process dense MoE in fp64 and torch autograd: ``out[t] = sum_s tw[t, s] w2[e] silu(w1[e] x[t])``."""
    inp = _inputs(world, case, torch.float32)
    x, w1, w2, tw = (inp[k].double().requires_grad_() for k in ("x", "w1", "w2", "tw"))
    ids = inp["ids"].long()
    hidden = F.silu(torch.einsum("tsnk,tk->tsn", w1[ids], x))
    out = torch.einsum("ts,tson,tsn->to", tw, w2[ids], hidden)
    (out * _upstream(world, case).double()).sum().backward()
    return {"out": out.detach(), "x": x.grad, "w1": w1.grad, "w2": w2.grad, "tw": tw.grad}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gradients_match_one_process_dense_moe(world: int) -> None:
    """dx, dW1, dW2 and d topk_weights (the router's) of every rank against the dense MoE's, with skewed routing
    (experts without tokens), top-1 and even routing, on both backends."""
    worst: dict[str, float] = {}
    for rank, per_run in enumerate(run_ranks(_rank_grads, world, RUNS, timeout=300)):
        for (backend, case, _), got in zip(RUNS, per_run, strict=True):
            ref = _dense(world, case)
            m_local = CASES[case][0]
            own, cols = slice(rank * m_local, (rank + 1) * m_local), _shard(world, rank)
            want = {
                "out": ref["out"][own],
                "x": ref["x"][own],
                "w1": ref["w1"][:, cols],
                "w2": ref["w2"][:, :, cols],
                "tw": ref["tw"],  # replicated: the whole gradient on every rank
            }
            for key, value in want.items():
                assert got[key] is not None and got[key].shape == value.shape, (backend, case, key)
                err = (got[key].double() - value).abs().max().item()
                worst[key] = max(worst.get(key, 0.0), err)
                assert err < TOL, (f"W={world} rank={rank} {backend} {case} {key}", err)
    print(f"W={world} worst |grad error| (fp32 vs fp64 dense): {worst}")


def _tw_bits(rank: int, world: int) -> torch.Tensor:
    grads = _rank_grads(rank, world, [("chunked", "skewed", 2)])
    return grads[0]["tw"]


def test_topk_weight_gradient_is_the_same_bits_on_every_rank() -> None:
    """A router run replicated must see the same gradient on every rank, or its copies drift apart."""
    first, *rest = run_ranks(_tw_bits, 3, timeout=300)
    assert all(torch.equal(first, other) for other in rest)


def test_shapes_of_a_no_grad_call_are_unchanged() -> None:
    inp = _inputs(1, "even", torch.float32)
    w1 = inp["w1"].requires_grad_()
    with torch.no_grad():
        y, _ = kernels.all_gather_grouped_matmul(inp["x"], inp["ids"], w1)
    assert not y.requires_grad and y.shape == (4 * 2, N) and inp["x"].shape[1] == K
