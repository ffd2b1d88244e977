"""autopar linears: main_grad accumulation, frozen weights, deferred wgrad, supplied weights,
single-process use, ParallelConfig validation and the errors for impossible shapes."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kernels.testing import assert_no_errors, run_ranks

S, B, K, N = 8, 2, 8, 12


def _config(sp: bool, **kw: Any) -> Any:
    from autopar import ParallelConfig

    return ParallelConfig(sequence_parallel=sp, use_cpu_initialization=True, **kw)


def _layer(kind: str, sp: bool, **cfg: Any) -> torch.nn.Module:
    from autopar import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(3)
    if kind == "column":
        return ColumnParallelLinear(K, N, config=_config(sp, **cfg), init_method=torch.nn.init.normal_)
    return RowParallelLinear(
        N,
        K,
        config=_config(sp, **cfg),
        init_method=torch.nn.init.normal_,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    )


def _input(kind: str, sp: bool, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    if kind == "column":
        x = torch.randn(S, B, K, generator=gen)
        g = torch.randn(S, B, N // world, generator=gen)
        return (x.chunk(world)[rank] if sp else x).contiguous(), g
    x = torch.randn(S, B, N // world, generator=gen)
    g = torch.randn(S, B, K, generator=gen)
    return x, (g.chunk(world)[rank] if sp else g).contiguous()


def _backward(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    y, _ = layer(x)
    (y * g).sum().backward()
    return x.grad


def main_grad_cases(rank: int, world: int) -> list[str]:
    """gradient_accumulation_fusion adds grad_w into weight.main_grad (twice -> 2x), .grad stays None."""
    errors: list[str] = []
    for kind in ("column", "row"):
        for sp in (True, False):
            tag = f"{kind} sp={sp}"
            x, g = _input(kind, sp, rank, world)
            plain = _layer(kind, sp)
            gx_want = _backward(plain, x, g)
            gw_want = plain.weight.grad

            fused = _layer(kind, sp, gradient_accumulation_fusion=True)
            start = torch.linspace(-1, 1, fused.weight.numel()).view_as(fused.weight)
            fused.weight.main_grad = start.clone()
            for _ in range(2):
                gx = _backward(fused, x, g)
            if fused.weight.grad is not None:
                errors.append(f"{tag}: weight.grad set although the gradient went to main_grad")
            if not torch.allclose(fused.weight.main_grad, start + 2 * gw_want, rtol=1e-5, atol=1e-5):
                diff = (fused.weight.main_grad - start - 2 * gw_want).abs().max().item()
                errors.append(f"{tag}: main_grad != start + 2 * grad_w (max |diff| {diff:.3e})")
            if not torch.allclose(gx, gx_want, rtol=1e-6, atol=1e-6):
                errors.append(f"{tag}: input gradient changed with gradient_accumulation_fusion")

            # Megatron DDP's overlap_grad_reduce protocol: a dummy .grad and the flag raised.
            fused.weight.grad_added_to_main_grad = False
            fused.weight.zero_out_wgrad = True
            _backward(fused, x, g)
            if not fused.weight.grad_added_to_main_grad:
                errors.append(f"{tag}: grad_added_to_main_grad not raised")
            if fused.weight.grad is None or fused.weight.grad.abs().sum() != 0:
                errors.append(f"{tag}: expected a zero dummy weight.grad with zero_out_wgrad")

            missing = _layer(kind, sp, gradient_accumulation_fusion=True)
            try:
                _backward(missing, x, g)
                errors.append(f"{tag}: no error although weight.main_grad is missing")
            except RuntimeError as e:
                if "main_grad" not in str(e):
                    errors.append(f"{tag}: unclear error for a missing main_grad: {e}")
    return errors


def _frozen_weight_keeps_no_activation(layer: torch.nn.Module, kind: str, sp: bool, x: torch.Tensor) -> list[str]:
    """Only the weight gradient reads the input, so a frozen layer's autograd node must not keep
    it (with recompute_all_gather=False, not the gathered input either)."""
    import tempfile

    errors = []
    saved_env = os.environ.get("COC_CONFIG")
    with tempfile.TemporaryDirectory() as tmp:
        for recompute in (True, False):
            path = os.path.join(tmp, f"r{int(recompute)}.yaml")
            with open(path, "w") as f:
                f.write(f"recompute_all_gather: {str(recompute).lower()}\n")
            os.environ["COC_CONFIG"] = path
            try:
                y, _ = layer(x.clone().requires_grad_())
            finally:
                if saved_env is None:
                    os.environ.pop("COC_CONFIG", None)
                else:
                    os.environ["COC_CONFIG"] = saved_env
            kept = [tuple(t.shape) for t in y.grad_fn.saved_tensors if t is not None and t.shape != layer.weight.shape]
            if kept:
                errors.append(
                    f"{kind} sp={sp} recompute={recompute}: a frozen layer keeps activations {kept} for its backward"
                )
    return errors


def frozen_and_supplied_weight_cases(rank: int, world: int) -> list[str]:
    from autopar import ColumnParallelLinear

    errors: list[str] = []
    for kind in ("column", "row"):
        for sp in (True, False):
            x, g = _input(kind, sp, rank, world)
            ref = _layer(kind, sp)
            gx_want = _backward(ref, x, g)
            frozen = _layer(kind, sp)
            frozen.weight.requires_grad_(False)
            gx = _backward(frozen, x, g)
            if frozen.weight.grad is not None or not torch.allclose(gx, gx_want, rtol=1e-6, atol=1e-6):
                errors.append(f"{kind} sp={sp}: frozen weight gave a weight grad or a different input grad")
            if frozen.bias.grad is None or not torch.allclose(frozen.bias.grad, ref.bias.grad):
                errors.append(f"{kind} sp={sp}: frozen weight changed the bias gradient")
            errors += _frozen_weight_keeps_no_activation(frozen, kind, sp, x)

    # skip_weight_param_allocation: the weight comes with each forward (Megatron's shared embedding).
    torch.manual_seed(3)
    owner = ColumnParallelLinear(K, N, config=_config(True), init_method=torch.nn.init.normal_)
    shared = ColumnParallelLinear(
        K, N, config=_config(True), init_method=torch.nn.init.normal_, skip_weight_param_allocation=True
    )
    with torch.no_grad():
        shared.bias.copy_(owner.bias)
    x, g = _input("column", True, rank, world)
    y_owner, _ = owner(x)
    y_shared, _ = shared(x, weight=owner.weight)
    if shared.weight is not None or not torch.equal(y_owner, y_shared):
        errors.append("skip_weight_param_allocation: output differs with the supplied weight")
    for bad, what in ((None, "weight was not supplied"), (torch.zeros(N, K), "supplied weight's shape")):
        try:
            shared(x, weight=bad)
            errors.append(f"skip_weight_param_allocation: no error for weight={bad!r:.20}")
        except RuntimeError as e:
            if what not in str(e):
                errors.append(f"skip_weight_param_allocation: unexpected message {e}")
    return errors


def deferred_wgrad_cases(rank: int, world: int) -> list[str]:
    """defer_embedding_wgrad_compute: input and grad_output go to the caller's buffers, no wgrad."""
    from autopar import ColumnParallelLinear

    errors: list[str] = []
    for sp in (True, False):
        acts: list = []
        grads: list = []
        torch.manual_seed(3)
        layer = ColumnParallelLinear(
            K,
            N,
            config=_config(sp, gradient_accumulation_fusion=True, defer_embedding_wgrad_compute=True),
            init_method=torch.nn.init.normal_,
            embedding_activation_buffer=acts,
            grad_output_buffer=grads,
        )
        layer.weight.main_grad = torch.zeros_like(layer.weight)
        x, g = _input("column", sp, rank, world)
        gx = _backward(layer, x, g)
        if len(acts) != 1 or len(grads) != 1 or not torch.equal(grads[0], g):
            errors.append(f"sp={sp}: buffers hold {len(acts)} inputs / {len(grads)} grads, want 1 / 1 (= g)")
        if layer.weight.main_grad.abs().sum() != 0:
            errors.append(f"sp={sp}: the weight gradient was computed although deferred")
        if gx is None or gx.shape != x.shape:
            errors.append(f"sp={sp}: input gradient missing with deferred wgrad")
    return errors


def shape_error_cases(rank: int, world: int) -> list[str]:
    from autopar import ColumnParallelLinear, RowParallelLinear

    errors: list[str] = []
    try:
        ColumnParallelLinear(K, world * 3 + 1, config=_config(False), init_method=torch.nn.init.normal_)
        errors.append("output_size not divisible by W accepted")
    except ValueError as e:
        if "output_size" not in str(e):
            errors.append(f"unclear error: {e}")
    row = _layer("row", True)
    try:
        row(torch.randn(world + 1, B, N // world))
        errors.append("sequence-parallel row accepted a sequence dim not divisible by W")
    except ValueError as e:
        if "divisible" not in str(e):
            errors.append(f"unclear error: {e}")
    scatter = RowParallelLinear(
        N,
        K,
        config=_config(False),
        init_method=torch.nn.init.normal_,
        bias=False,
        input_is_parallel=False,
        skip_bias_add=False,
    )
    try:
        scatter(torch.randn(S, B, world * 2 + 1))
        errors.append("input_is_parallel=False accepted a last dim other than input_size")
    except ValueError as e:
        if "input_size=" not in str(e):
            errors.append(f"unclear error: {e}")
    return errors


def expert_cases(rank: int, world: int) -> list[str]:
    """is_expert with expert parallelism: Megatron's explicit expert communication, i.e. no TP
    collective inside either linear (the MoE dispatcher communicates)."""
    from autopar import ColumnParallelLinear, RowParallelLinear

    errors: list[str] = []
    cfg = _config(False, expert_model_parallel_size=2)
    torch.manual_seed(rank)  # experts differ per rank; nothing may mix them
    col = ColumnParallelLinear(K, N, config=cfg, init_method=torch.nn.init.normal_, is_expert=True)
    row = RowParallelLinear(
        N,
        K,
        config=cfg,
        init_method=torch.nn.init.normal_,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=True,
        is_expert=True,
    )
    if col.weight.allreduce or row.weight.allreduce:
        errors.append("expert weights must carry allreduce=False (not reduced over data parallel)")
    x = torch.randn(S, B, K, requires_grad=True)
    h, _ = col(x)
    y, y_bias = row(h)
    want = torch.nn.functional.linear(torch.nn.functional.linear(x, col.weight, col.bias), row.weight)
    if y_bias is not row.bias or not torch.allclose(y, want, rtol=1e-6, atol=1e-6):
        errors.append("expert linears communicated or added the bias")
    y.sum().backward()
    gx = torch.ones(S, B, K) @ row.weight @ col.weight
    if not torch.allclose(x.grad, gx, rtol=1e-5, atol=1e-5):
        errors.append("expert column reduced its input gradient")
    try:
        RowParallelLinear(
            N,
            K,
            config=cfg,
            init_method=torch.nn.init.normal_,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            is_expert=True,
        )(h.detach())
        errors.append("expert row without skip_bias_add accepted")
    except RuntimeError as e:
        if "skip_bias_add" not in str(e):
            errors.append(f"unclear error: {e}")
    return errors


def autocast_cases(rank: int, world: int) -> list[str]:
    """Under autocast the GEMMs run in the autocast dtype, as Megatron's torch.matmul would."""
    errors: list[str] = []
    for sp in (True, False):
        col, row = _layer("column", sp), _layer("row", sp)
        x, _ = _input("column", sp, rank, world)
        want, _ = row(torch.nn.functional.gelu(col(x)[0]))
        x = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = row(torch.nn.functional.gelu(col(x)[0]))
        if y.dtype != torch.bfloat16:
            errors.append(f"sp={sp}: output dtype {y.dtype} under bf16 autocast")
        # bf16 keeps 8 significant bits: a few 2**-8 relative through two GEMMs.
        err = ((y.float() - want).abs().max() / want.abs().max()).item()
        if err > 3e-2:
            errors.append(f"sp={sp}: bf16 autocast result off by {err:.3e} relative")
        y.float().sum().backward()
        for name, t in (("input", x), ("column weight", col.weight), ("row weight", row.weight)):
            if t.grad is None or t.grad.dtype != torch.float32:
                errors.append(f"sp={sp}: {name} gradient missing or not fp32 under autocast")
    return errors


@pytest.mark.parametrize("world", (2, 4))
def test_main_grad_accumulation(world: int) -> None:
    assert_no_errors(run_ranks(main_grad_cases, world, env={"COC_PARALLEL_NUM": "2"}))


def test_frozen_and_supplied_weights() -> None:
    assert_no_errors(run_ranks(frozen_and_supplied_weight_cases, 2))


def test_deferred_embedding_wgrad() -> None:
    assert_no_errors(run_ranks(deferred_wgrad_cases, 2))


def test_expert_layers_do_not_communicate() -> None:
    assert_no_errors(run_ranks(expert_cases, 2))


def test_autocast() -> None:
    assert_no_errors(run_ranks(autocast_cases, 2, env={"COC_PARALLEL_NUM": "2"}))


def test_shape_errors() -> None:
    assert_no_errors(run_ranks(shape_error_cases, 2))


def test_single_process_without_torch_distributed() -> None:
    """No process group: both linears are plain linears; column SP warns and turns itself off."""
    from autopar import ColumnParallelLinear, RowParallelLinear

    assert not (dist.is_available() and dist.is_initialized())
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="Disabling sequence parallel"):
        col = ColumnParallelLinear(K, N, config=_config(True), init_method=torch.nn.init.normal_)
    assert col.tp_group is None and not col.sequence_parallel and col.weight.shape == (N, K)
    row = RowParallelLinear(
        N,
        K,
        config=_config(True),
        init_method=torch.nn.init.normal_,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=True,
    )
    x = torch.randn(S, B, K, requires_grad=True)
    h, _ = col(x)
    y, y_bias = row(h)
    assert y_bias is row.bias
    want = torch.nn.functional.linear(torch.nn.functional.linear(x, col.weight, col.bias), row.weight)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    y.sum().backward()
    assert x.grad is not None and col.weight.grad is not None and row.weight.grad is not None


def test_linears_built_before_init_under_a_launcher_are_refused(monkeypatch) -> None:
    """WORLD_SIZE=2 (torchrun) but no process group: a linear would hold the full weight on every rank and
    never communicate; refused by name at construction."""
    from autopar import ColumnParallelLinear, RowParallelLinear

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="not initialized but WORLD_SIZE=2"):
        ColumnParallelLinear(K, N, config=_config(False), init_method=torch.nn.init.normal_)
    with pytest.raises(RuntimeError, match="not initialized but WORLD_SIZE=2"):
        RowParallelLinear(
            N,
            K,
            config=_config(False),
            init_method=torch.nn.init.normal_,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
        )


def test_parallel_config_validation() -> None:
    from autopar import ParallelConfig

    with pytest.raises(TypeError, match="sequence_parallel"):
        ParallelConfig(sequence_parallel=1)
    with pytest.raises(TypeError, match="params_dtype"):
        ParallelConfig(params_dtype=torch.int8)
    with pytest.raises(ValueError, match="expert_model_parallel_size"):
        ParallelConfig(expert_model_parallel_size=0)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion"):
        ParallelConfig(defer_embedding_wgrad_compute=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ParallelConfig(sequence_parallel=True, params_dtype=torch.bfloat16)


def test_row_sequence_parallel_needs_parallel_input() -> None:
    from autopar import RowParallelLinear

    with pytest.raises(RuntimeError, match="input_is_parallel"):
        RowParallelLinear(
            N,
            K,
            config=_config(True),
            init_method=torch.nn.init.normal_,
            bias=True,
            input_is_parallel=False,
            skip_bias_add=False,
        )
