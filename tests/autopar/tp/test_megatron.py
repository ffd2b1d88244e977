"""autopar's linears against UNPATCHED megatron-core, and patch_megatron / unpatch_megatron.

Megatron's sequence-parallel and gather/scatter-along-the-last-dim paths allocate on
``torch.cuda.current_device()``, so on CPU the unpatched comparison covers sequence parallelism off
with ``gather_output=False`` / ``input_is_parallel=True``; the other paths are compared, once
patched, with plain torch math on the full tensors. Values are float64 (see test_linear.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from kernels.testing import assert_no_errors, run_ranks

pytest.importorskip("megatron.core")

S, B, K, N = 8, 3, 8, 12
TOL = dict(rtol=1e-10, atol=1e-10)
# Output grad_fn names that show autopar's Functions ran (Megatron's own are other names).
OURS = {
    "ColumnParallelLinearFunctionBackward",
    "ColumnParallelLinearSPFunctionBackward",
    "RowParallelLinearFunctionBackward",
    "RowParallelLinearSPFunctionBackward",
    "_GatherFromTensorParallelRegionBackward",
}


def _mcore_config(world: int, sp: bool = False, **kw: Any) -> Any:
    from megatron.core import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=world,
        sequence_parallel=sp,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
        **kw,
    )


def _run(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, Any]:
    """Forward and backward of one layer; everything the comparison needs, detached."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y, out_bias = layer(x)
    (y * g).sum().backward()
    return {
        "y": y.detach(),
        "grad_fn": type(y.grad_fn).__name__,
        "out_bias": out_bias is not None,
        "gx": x.grad,
        "gw": layer.weight.grad,
        "gb": layer.bias.grad if layer.bias is not None else None,
    }


def _same(a: dict, b: dict, tag: str, errors: list[str]) -> None:
    for key in ("y", "gx", "gw", "gb"):
        if (a[key] is None) != (b[key] is None):
            errors.append(f"{tag} {key}: one side is None")
        elif a[key] is not None and not torch.allclose(a[key], b[key], **TOL):
            errors.append(f"{tag} {key}: max |diff| {(a[key] - b[key]).abs().max().item():.3e}")
    if a["out_bias"] != b["out_bias"]:
        errors.append(f"{tag}: output_bias presence differs")


def _param_attrs(p: torch.Tensor | None) -> dict[str, Any]:
    names = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce", "sequence_parallel")
    return {} if p is None else {n: getattr(p, n, "<unset>") for n in names}


def _build_pair(kind: str, world: int, group: Any, bias: bool, skip: bool, **kw: Any) -> tuple:
    """The same layer from Megatron and from autopar, built from the same seed."""
    from megatron.core import tensor_parallel as mtp

    import autopar

    mine_cls = {"column": autopar.ColumnParallelLinear, "row": autopar.RowParallelLinear}[kind]
    theirs_cls = {"column": mtp.ColumnParallelLinear, "row": mtp.RowParallelLinear}[kind]
    shapes = (K, N) if kind == "column" else (N, K)
    extra = {} if kind == "column" else {"input_is_parallel": True}
    extra.update(kw)
    layers = []
    for cls in (theirs_cls, mine_cls):
        torch.manual_seed(7)
        layers.append(
            cls(
                *shapes,
                config=_mcore_config(world),
                init_method=torch.nn.init.normal_,
                bias=bias,
                skip_bias_add=skip,
                tp_group=group,
                **extra,
            )
        )
        if bias:
            with torch.no_grad():
                layers[-1].bias.copy_(torch.linspace(-1, 1, layers[-1].bias.numel(), dtype=torch.float64))
    return layers[0], layers[1]


def _inputs(kind: str, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    if kind == "column":
        return (
            torch.randn(S, B, K, generator=gen, dtype=torch.float64),
            torch.randn(S, B, N // world, generator=gen, dtype=torch.float64),
        )
    x_full = torch.randn(S, B, N, generator=gen, dtype=torch.float64)
    return (x_full.chunk(world, dim=-1)[rank].contiguous(), torch.randn(S, B, K, generator=gen, dtype=torch.float64))


def _sharded_layout(layer: torch.nn.Module) -> dict[str, Any]:
    sd = layer.sharded_state_dict(prefix="layer.", metadata={"dp_cp_group": None})
    return {
        key: (
            type(v).__name__,
            getattr(v, "global_shape", None),
            getattr(v, "global_offset", None),
            getattr(v, "axis_fragmentations", None),
            getattr(v, "replica_id", None),
        )
        for key, v in sd.items()
    }


def _same_sharded_state_dict(theirs: torch.nn.Module, mine: torch.nn.Module, tag: str, errors: list[str]) -> None:
    """Megatron's dist checkpointing must see the TP shards (without ``sharded_state_dict`` it
    would save each parameter as replicated, i.e. one rank's shard as the whole tensor)."""
    if not hasattr(mine, "sharded_state_dict"):
        errors.append(f"{tag}: no sharded_state_dict")
        return
    a, b = _sharded_layout(theirs), _sharded_layout(mine)
    if a != b:
        errors.append(f"{tag}: sharded_state_dict {b} != Megatron's {a}")


def against_megatron(rank: int, world: int) -> list[str]:
    """Unpatched Megatron vs autopar, explicit tp_group, sequence parallelism off."""
    from autopar import unpatch_megatron

    unpatch_megatron()
    errors: list[str] = []
    for kind in ("column", "row"):
        for bias, skip in ((True, False), (True, True), (False, False)):
            tag = f"{kind} bias={bias} skip_bias_add={skip}"
            theirs, mine = _build_pair(kind, world, dist.group.WORLD, bias, skip)
            if not torch.equal(theirs.weight, mine.weight):
                errors.append(f"{tag}: initial weights differ from Megatron's for the same seed")
            for name in ("weight", "bias"):
                if _param_attrs(getattr(theirs, name)) != _param_attrs(getattr(mine, name)):
                    errors.append(
                        f"{tag}: {name} attributes {_param_attrs(getattr(mine, name))} != "
                        f"Megatron's {_param_attrs(getattr(theirs, name))}"
                    )
            # Megatron's modules also save "_extra_state": None; ours leave it out (no None in a state
            # dict: safetensors refuses one) and accept it on load.
            if set(theirs.state_dict()) - {"_extra_state"} != set(mine.state_dict()):
                errors.append(
                    f"{tag}: state_dict keys {sorted(mine.state_dict())} != Megatron's {sorted(theirs.state_dict())}"
                )
            if any(v is None for v in mine.state_dict().values()):
                errors.append(f"{tag}: state_dict holds None values")
            mine.load_state_dict(theirs.state_dict())  # strict: Megatron checkpoints load as they are
            _same_sharded_state_dict(theirs, mine, tag, errors)
            x, g = _inputs(kind, rank, world)
            a, b = _run(theirs, x, g), _run(mine, x, g)
            if a["grad_fn"] in OURS or b["grad_fn"] not in OURS:
                errors.append(f"{tag}: grad_fn Megatron {a['grad_fn']}, autopar {b['grad_fn']}")
            _same(a, b, tag, errors)
    return errors


def patch_switches_prebuilt_modules(rank: int, world: int) -> list[str]:
    """Modules built before patch_megatron() switch paths; patch and unpatch are idempotent."""
    from megatron.core import tensor_parallel as mtp
    from megatron.core.tensor_parallel import layers as mlayers

    import autopar
    from autopar.tp.megatron import is_megatron_patched

    errors: list[str] = []
    original = {c: c.__dict__["forward"] for c in (mlayers.ColumnParallelLinear, mlayers.RowParallelLinear)}
    try:
        for kind in ("column", "row"):
            theirs, _ = _build_pair(kind, world, dist.group.WORLD, True, False)
            x, g = _inputs(kind, rank, world)
            before = _run(theirs, x, g)
            autopar.patch_megatron()
            autopar.patch_megatron()
            if not is_megatron_patched():
                errors.append("is_megatron_patched() is False after patch_megatron()")
            patched = _run(theirs, x, g)
            want_fn = (
                "ColumnParallelLinearFunctionBackward" if kind == "column" else "RowParallelLinearFunctionBackward"
            )
            if patched["grad_fn"] != want_fn:
                errors.append(
                    f"{kind}: pre-built Megatron module ran {patched['grad_fn']} after patching, expected {want_fn}"
                )
            _same(before, patched, f"{kind} patched vs unpatched", errors)
            autopar.unpatch_megatron()
            autopar.unpatch_megatron()
            for cls, fwd in original.items():
                if cls.__dict__["forward"] is not fwd:
                    errors.append(f"{cls.__name__}.forward not restored by unpatch_megatron()")
            if before["grad_fn"] in OURS or _run(theirs, x, g)["grad_fn"] != before["grad_fn"]:
                errors.append(f"{kind}: module did not return to Megatron's path after unpatching")
    finally:
        autopar.unpatch_megatron()
    if mtp.ColumnParallelLinear is not mlayers.ColumnParallelLinear:
        errors.append("megatron.core.tensor_parallel.ColumnParallelLinear is not layers.ColumnParallelLinear")
    return errors


def _full_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, g: torch.Tensor) -> tuple:
    # Megatron returns the column master weight in fp32 whatever params_dtype is (exact in fp64).
    x, w = x.clone().requires_grad_(), w.to(x.dtype).clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    y = torch.nn.functional.linear(x, w, b)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad, (b.grad if b is not None else None)


def _check(tag: str, got: torch.Tensor | None, want: torch.Tensor, errors: list[str]) -> None:
    if got is None or got.shape != want.shape or not torch.allclose(got, want, **TOL):
        detail = (
            "None"
            if got is None
            else (
                f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
                if got.shape != want.shape
                else f"max |diff| {(got - want).abs().max().item():.3e}"
            )
        )
        errors.append(f"{tag}: {detail}")


def patched_megatron_paths_cpu_cannot_run(rank: int, world: int) -> list[str]:
    """Patched Megatron modules with sequence parallelism, gather_output and
    input_is_parallel=False (all CUDA-only in Megatron itself) against full-tensor math."""
    from megatron.core import tensor_parallel as mtp

    import autopar

    errors: list[str] = []
    s_sl = slice(rank * S // world, (rank + 1) * S // world)
    n_sl = slice(rank * N // world, (rank + 1) * N // world)
    gen = torch.Generator().manual_seed(5)
    bias_n = torch.linspace(-1, 1, N, dtype=torch.float64)
    bias_k = torch.linspace(-1, 1, K, dtype=torch.float64)
    autopar.patch_megatron()
    try:
        for sp, gather in ((True, False), (True, True), (False, True)):
            tag = f"patched column sp={sp} gather_output={gather}"
            torch.manual_seed(8)
            col = mtp.ColumnParallelLinear(
                K,
                N,
                config=_mcore_config(world, sp=sp),
                init_method=torch.nn.init.normal_,
                gather_output=gather,
                keep_master_weight_for_test=True,
                tp_group=dist.group.WORLD,
            )
            with torch.no_grad():
                col.bias.copy_(bias_n[n_sl])
            x_full = torch.randn(S, B, K, generator=gen, dtype=torch.float64)
            g_full = torch.randn(S, B, N, generator=gen, dtype=torch.float64)
            y_ref, gx_ref, gw_ref, gb_ref = _full_reference(x_full, col.master_weight, bias_n, g_full)
            x = (x_full[s_sl] if sp else x_full).clone().requires_grad_()
            y, _ = col(x)
            (y * (g_full if gather else g_full[..., n_sl])).sum().backward()
            _check(f"{tag} output", y.detach(), y_ref if gather else y_ref[..., n_sl], errors)
            _check(f"{tag} grad input", x.grad, gx_ref[s_sl] if sp else gx_ref, errors)
            _check(f"{tag} grad weight", col.weight.grad, gw_ref[n_sl], errors)
            _check(f"{tag} grad bias", col.bias.grad, gb_ref[n_sl], errors)

        for sp, input_is_parallel in ((True, True), (False, False)):
            tag = f"patched row sp={sp} input_is_parallel={input_is_parallel}"
            torch.manual_seed(9)
            row = mtp.RowParallelLinear(
                N,
                K,
                config=_mcore_config(world, sp=sp),
                init_method=torch.nn.init.normal_,
                bias=True,
                input_is_parallel=input_is_parallel,
                skip_bias_add=False,
                keep_master_weight_for_test=True,
                tp_group=dist.group.WORLD,
            )
            with torch.no_grad():
                row.bias.copy_(bias_k)
            x_full = torch.randn(S, B, N, generator=gen, dtype=torch.float64)
            g_full = torch.randn(S, B, K, generator=gen, dtype=torch.float64)
            y_ref, gx_ref, gw_ref, gb_ref = _full_reference(x_full, row.master_weight, bias_k, g_full)
            x = (x_full[..., n_sl] if input_is_parallel else x_full).clone().requires_grad_()
            y, _ = row(x)
            (y * (g_full[s_sl] if sp else g_full)).sum().backward()
            gb = row.bias.grad.clone()
            if sp:
                dist.all_reduce(gb)
            _check(f"{tag} output", y.detach(), y_ref[s_sl] if sp else y_ref, errors)
            _check(f"{tag} grad input", x.grad, gx_ref[..., n_sl] if input_is_parallel else gx_ref, errors)
            _check(f"{tag} grad weight", row.weight.grad, gw_ref[:, n_sl], errors)
            _check(f"{tag} grad bias", gb, gb_ref, errors)
    finally:
        autopar.unpatch_megatron()
    return errors


def tp_group_from_parallel_state(rank: int, world: int) -> list[str]:
    """tp_group=None: Megatron's TP group when parallel_state is initialized, else the default group."""
    from megatron.core import parallel_state as ps

    import autopar

    errors: list[str] = []
    cfg = autopar.ParallelConfig(use_cpu_initialization=True)
    if (
        autopar.ColumnParallelLinear(4, 2 * world, config=cfg, init_method=torch.nn.init.zeros_).tp_group
        is not dist.group.WORLD
    ):
        errors.append("tp_group=None without parallel_state did not resolve to the default group")
    # TP of size 2 inside the world: two TP groups when world is 4.
    tp = 2
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        layer = autopar.RowParallelLinear(
            2 * tp,
            3,
            config=cfg,
            init_method=torch.nn.init.ones_,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
        )
        if layer.tp_group is not ps.get_tensor_model_parallel_group():
            errors.append("tp_group=None did not resolve to Megatron's tensor-parallel group")
        if layer.weight.shape != (3, 2):
            errors.append(f"weight shape {tuple(layer.weight.shape)} != (3, 2) for TP size {tp}")
        x = torch.full((2, 1, 2), float(rank + 1))
        y, _ = layer(x)
        # Sum over the TP group only: ranks {0,1} -> 2 * (1 + 2), ranks {2,3} -> 2 * (3 + 4).
        first = (rank // tp) * tp
        want = 2.0 * sum(r + 1 for r in range(first, first + tp))
        if not torch.all(y == want):
            errors.append(f"row output {y.flatten().tolist()} != {want} (reduction not over the TP group)")
    finally:
        ps.destroy_model_parallel()
    return errors


@pytest.mark.parametrize("world", (2, 4))
def test_matches_unpatched_megatron(world: int) -> None:
    assert_no_errors(run_ranks(against_megatron, world, env={"COC_PARALLEL_NUM": "2"}))


def test_patch_switches_prebuilt_modules_and_is_idempotent() -> None:
    assert_no_errors(run_ranks(patch_switches_prebuilt_modules, 2, env={"COC_PARALLEL_NUM": "4"}))


@pytest.mark.parametrize("world", (2, 4))
def test_patched_megatron_sequence_parallel_and_scatter_gather(world: int) -> None:
    assert_no_errors(run_ranks(patched_megatron_paths_cpu_cannot_run, world, env={"COC_PARALLEL_NUM": "2"}))


def test_tp_group_defaults_to_megatron_parallel_state() -> None:
    assert_no_errors(run_ranks(tp_group_from_parallel_state, 4))


def test_unpatch_without_patch_is_noop_and_patch_needs_no_distributed() -> None:
    from megatron.core.tensor_parallel import layers as mlayers

    import autopar
    from autopar.tp.megatron import is_megatron_patched

    original = mlayers.ColumnParallelLinear.__dict__["forward"]
    autopar.unpatch_megatron()
    assert mlayers.ColumnParallelLinear.__dict__["forward"] is original
    autopar.patch_megatron()
    try:
        assert is_megatron_patched()
        assert mlayers.ColumnParallelLinear.__dict__["forward"] is not original
    finally:
        autopar.unpatch_megatron()
    assert not is_megatron_patched()
    assert mlayers.ColumnParallelLinear.__dict__["forward"] is original
