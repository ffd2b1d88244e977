"""The Megatron-style linears built from existing weights (``from_linear`` / ``from_weight``,
strided slices), their ``state_dict()`` (no None), the tied-weight refusal, named operand errors
at W = 1 as at W = 2, and the sequence-parallel gradient sum (function and hooks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.testing import run_ranks

S, B, K, N = 4, 2, 8, 12
TOL = dict(rtol=1e-12, atol=1e-12)  # float64; nothing but sums over k/W pieces reordered


def _config(sp: bool = False):
    import autopar

    return autopar.ParallelConfig(sequence_parallel=sp, use_cpu_initialization=True, params_dtype=torch.float64)


def _full_linear(cls_name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if cls_name == "conv1d":
        from transformers.pytorch_utils import Conv1D

        m = Conv1D(N, K).double()  # weight [K, N]
        torch.nn.init.normal_(m.bias)
        return m
    m = torch.nn.Linear(K, N, dtype=torch.float64)
    return m


def _ref_weight(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    w = m.weight.t() if type(m).__name__ == "Conv1D" else m.weight
    return w.detach(), m.bias.detach()


def from_linear_matches(rank: int, world: int, kind: str, sp: bool) -> list[str]:
    """column(from_linear) -> gelu -> row(from_linear) equals the full two-linear model, forward and
    gradients; a stride-3 column layer holds this rank's slice of each of three blocks."""
    import autopar

    errors = []
    fc1 = _full_linear(kind)
    if kind == "conv1d":
        from transformers.pytorch_utils import Conv1D

        torch.manual_seed(1)
        fc2 = Conv1D(K, N).double()  # [N -> K]
    else:
        fc2 = torch.nn.Linear(N, K, dtype=torch.float64)
    config = _config(sp)
    col = autopar.ColumnParallelLinear.from_linear(fc1, config=config)
    row = autopar.RowParallelLinear.from_linear(fc2, config=config)
    w1, b1 = _ref_weight(fc1)
    w2, b2 = _ref_weight(fc2)
    x_full = torch.randn(S, B, K, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref_x = x_full.clone().requires_grad_()
    ref_params = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
    y_ref = F.linear(F.gelu(F.linear(ref_x, ref_params[0], ref_params[1])), ref_params[2], ref_params[3])
    y_ref.square().sum().backward()
    x = (x_full.chunk(world)[rank] if sp else x_full).clone().requires_grad_()
    y, _ = row(F.gelu(col(x)[0]))
    y.square().sum().backward()
    autopar.sum_sequence_parallel_grads(row)
    want_y = y_ref.detach().chunk(world)[rank] if sp else y_ref.detach()
    want = {
        "y": (y, want_y),
        "w1": (col.weight.grad, ref_params[0].grad.chunk(world)[rank]),
        "b1": (col.bias.grad, ref_params[1].grad.chunk(world)[rank]),
        "w2": (row.weight.grad, ref_params[2].grad.chunk(world, dim=1)[rank]),
        "b2": (row.bias.grad, ref_params[3].grad),
    }
    for name, (got, ref) in want.items():
        if not torch.allclose(got, ref, **TOL):
            errors.append(f"{kind} sp={sp} {name}: max diff {(got - ref).abs().max().item()}")
    packed = autopar.ColumnParallelLinear.from_weight(w1, b1, config=_config(), stride=3)
    blocks = [blk.chunk(world)[rank] for blk in w1.chunk(3)]
    if not torch.equal(packed.weight, torch.cat(blocks)):
        errors.append("stride=3: the slice is not this rank's piece of each block")
    if any(v is None for v in col.state_dict().values()) or any(v is None for v in row.state_dict().values()):
        errors.append(f"state_dict holds None: {col.state_dict()}")
    col.load_state_dict({**col.state_dict(), "_extra_state": None})  # a Megatron checkpoint's entry loads
    return errors


@pytest.mark.parametrize(("kind", "sp"), [("linear", False), ("linear", True), ("conv1d", True)])
def test_from_linear_matches_full_model(kind: str, sp: bool) -> None:
    if kind == "conv1d":
        pytest.importorskip("transformers")
    for errors in run_ranks(from_linear_matches, 2, kind, sp):
        assert not errors, errors


def test_tied_weight_is_refused() -> None:
    import autopar

    emb = torch.nn.Embedding(N, K, dtype=torch.float64)
    head = torch.nn.Linear(K, N, bias=False, dtype=torch.float64)
    head.weight = emb.weight
    with pytest.raises(ValueError, match="tied weight"):
        autopar.ColumnParallelLinear.from_linear(head, config=_config())
    with pytest.raises(ValueError, match="tied weight"):
        autopar.ColumnParallelLinear.from_weight(emb.weight, config=_config())
    untied = torch.nn.Linear(K, N, dtype=torch.float64)
    assert autopar.ColumnParallelLinear.from_linear(untied, config=_config()).weight.shape == (N, K)


def dtype_errors(rank: int, world: int) -> list[str]:
    """A half-precision input to float64 layers: the same named TypeError on every path."""
    import autopar

    msgs = []
    for sp in (False, True):
        config = _config(sp)
        col = autopar.ColumnParallelLinear(K, N, config=config, init_method=torch.nn.init.zeros_)
        row = autopar.RowParallelLinear(
            N,
            K,
            config=config,
            init_method=torch.nn.init.zeros_,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
        )
        for layer, width in ((col, K), (row, N // world)):
            try:
                layer(torch.ones(S, B, width, dtype=torch.float32))
                msgs.append(f"{type(layer).__name__} sp={sp}: no error")
            except TypeError as e:
                msgs.append(str(e))
    return msgs


@pytest.mark.parametrize("world", [1, 2])
def test_dtype_mismatch_is_named_at_every_world_size(world: int) -> None:
    for msgs in run_ranks(dtype_errors, world):
        for msg in msgs:
            assert "dtype torch.float64 does not match x dtype torch.float32" in msg, msgs


def test_dtype_mismatch_is_named_without_torch_distributed() -> None:
    import autopar

    col = autopar.ColumnParallelLinear(K, N, config=_config(), init_method=torch.nn.init.zeros_)
    with pytest.raises(TypeError, match="does not match x dtype"):
        col(torch.ones(S, B, K, dtype=torch.float32))
