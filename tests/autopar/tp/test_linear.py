"""autopar.ColumnParallelLinear / RowParallelLinear against a single-process reference.

Every rank builds the same full weight (``use_cpu_initialization`` + ``keep_master_weight_for_test``
gives the master weight the shards were cut from), runs the TP layer on its shard of the input and
compares output and the input / weight / bias gradients with plain ``torch`` math on the full
tensors. Values are float64: the TP result differs from the reference only in the order of a
W-term sum, so 1e-10 relative is far above rounding (about k * 2**-52) and far below any bug.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kernels.config import get_config
from kernels.testing import assert_no_errors, run_ranks

S, B, K, N = 12, 2, 12, 24  # s divisible by W in {2, 3, 4}; k, n divisible too; not tile multiples
TOL = dict(rtol=1e-10, atol=1e-10)
WORLDS = (2, 3, 4)
PARALLEL_NUMS = (1, 2, 4, 8)
BIAS_MODES = ("bias", "skip_bias_add", "no_bias")  # (bias, skip_bias_add): (T, F), (T, T), (F, -)


def _write_coc_yaml(directory: str, recompute: bool, coc_bwd: bool) -> str:
    path = os.path.join(directory, f"coc_r{int(recompute)}_c{int(coc_bwd)}.yaml")
    with open(path, "w") as f:
        f.write(
            f"recompute_all_gather: {str(recompute).lower()}\nenable_coc_in_column_backward: {str(coc_bwd).lower()}\n"
        )
    return path


@pytest.fixture(scope="module")
def coc_yamls(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[bool, bool], str]:
    d = str(tmp_path_factory.mktemp("coc"))
    return {(r, c): _write_coc_yaml(d, r, c) for r in (True, False) for c in (True, False)}


class _UseConfigFile:
    """``COC_CONFIG`` set for the duration of a block inside a rank (read at call time)."""

    def __init__(self, path: str) -> None:
        self.path, self.saved = path, None

    def __enter__(self) -> None:
        self.saved = os.environ.get("COC_CONFIG")
        os.environ["COC_CONFIG"] = self.path

    def __exit__(self, *exc: Any) -> None:
        if self.saved is None:
            os.environ.pop("COC_CONFIG", None)
        else:
            os.environ["COC_CONFIG"] = self.saved


def _config(sp: bool, **kw: Any) -> Any:
    from autopar import ParallelConfig

    return ParallelConfig(sequence_parallel=sp, params_dtype=torch.float64, use_cpu_initialization=True, **kw)


def _bias_flags(mode: str) -> tuple[bool, bool]:
    return mode != "no_bias", mode == "skip_bias_add"


def _close(name: str, got: torch.Tensor | None, want: torch.Tensor | None, errors: list[str]) -> None:
    if got is None or want is None:
        if got is not want:
            errors.append(
                f"{name}: got {'None' if got is None else 'a tensor'}, want {'None' if want is None else 'a tensor'}"
            )
        return
    if got.shape != want.shape:
        errors.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    elif not torch.allclose(got, want, **TOL):
        errors.append(f"{name}: max |diff| {(got - want).abs().max().item():.3e}")


def _reference(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    y = torch.nn.functional.linear(x, w, b)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad, (b.grad if b is not None else None)


class _CountCalls:
    """Count calls of the named ``kernels`` ops made through the autopar linears during a block."""

    def __init__(self, *names: str) -> None:
        self.names, self.counts, self.saved = names, {n: 0 for n in names}, {}

    def __enter__(self) -> _CountCalls:
        import autopar.tp.comm as lin

        for name in self.names:
            original = getattr(lin.kernels, name)
            self.saved[name] = original

            def counted(*args: Any, _name: str = name, _fn: Any = original, **kwargs: Any) -> Any:
                self.counts[_name] += 1
                return _fn(*args, **kwargs)

            setattr(lin.kernels, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        import autopar.tp.comm as lin

        for name, fn in self.saved.items():
            setattr(lin.kernels, name, fn)


def column_case(
    rank: int, world: int, *, sp: bool, bias_mode: str, gather_output: bool, errors: list[str], tag: str
) -> None:
    from autopar import ColumnParallelLinear

    has_bias, skip = _bias_flags(bias_mode)
    torch.manual_seed(1)
    layer = ColumnParallelLinear(
        K,
        N,
        config=_config(sp),
        init_method=torch.nn.init.normal_,
        bias=has_bias,
        gather_output=gather_output,
        skip_bias_add=skip,
        keep_master_weight_for_test=True,
    )
    if has_bias:
        with torch.no_grad():  # Megatron zeroes biases; a nonzero one shows where it is added
            layer.bias.copy_(torch.linspace(-1, 1, N, dtype=torch.float64).chunk(world)[rank])
    w_full = layer.master_weight
    b_full = torch.linspace(-1, 1, N, dtype=torch.float64) if has_bias else None
    gen = torch.Generator().manual_seed(2)
    x_full = torch.randn(S, B, K, generator=gen, dtype=torch.float64)
    g_full = torch.randn(S, B, N, generator=gen, dtype=torch.float64)
    y_ref, gx_ref, gw_ref, gb_ref = _reference(x_full, w_full, None if skip else b_full, g_full)
    if skip and has_bias:
        gb_ref = None

    n_sl = slice(rank * N // world, (rank + 1) * N // world)
    s_sl = slice(rank * S // world, (rank + 1) * S // world)
    x = (x_full[s_sl] if sp else x_full).clone().requires_grad_()
    ops = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
    with _CountCalls(*ops) as calls:
        y, out_bias = layer(x)
        if sp and not gather_output:
            # recompute_all_gather decides what the backward keeps: the shard or the gathered input.
            kept = y.grad_fn.saved_tensors[0]
            kept_rows = kept.numel() // kept.shape[-1]
            want_rows = (S // world if get_config().recompute_all_gather else S) * B
            if kept_rows != want_rows:
                errors.append(f"{tag}: backward keeps {kept_rows} input rows, want {want_rows}")
        g = g_full if gather_output else g_full[..., n_sl]
        (y * g).sum().backward()
    coc_bwd = get_config().enable_coc_in_column_backward
    want_calls = {
        "all_gather_matmul": int(sp),
        "matmul_reduce_scatter": int(sp and coc_bwd),
        "matmul_all_reduce": int(not sp and coc_bwd),
    }
    if calls.counts != want_calls:
        errors.append(f"{tag}: kernels ops called {calls.counts}, want {want_calls}")

    _close(f"{tag} weight", layer.weight.detach(), w_full[n_sl], errors)
    _close(f"{tag} output", y.detach(), y_ref if gather_output else y_ref[..., n_sl], errors)
    if skip:
        if out_bias is not layer.bias:
            errors.append(f"{tag}: output_bias is not layer.bias with skip_bias_add")
    elif out_bias is not None:
        errors.append(f"{tag}: output_bias should be None without skip_bias_add")
    _close(f"{tag} grad input", x.grad, gx_ref[s_sl] if sp else gx_ref, errors)
    _close(f"{tag} grad weight", layer.weight.grad, gw_ref[n_sl], errors)
    _close(
        f"{tag} grad bias",
        layer.bias.grad if (has_bias and not skip) else None,
        gb_ref[n_sl] if gb_ref is not None else None,
        errors,
    )


def row_case(
    rank: int, world: int, *, sp: bool, bias_mode: str, input_is_parallel: bool, errors: list[str], tag: str
) -> None:
    from autopar import RowParallelLinear

    has_bias, skip = _bias_flags(bias_mode)
    torch.manual_seed(3)
    layer = RowParallelLinear(
        N,
        K,
        config=_config(sp),
        init_method=torch.nn.init.normal_,
        bias=has_bias,
        input_is_parallel=input_is_parallel,
        skip_bias_add=skip,
        keep_master_weight_for_test=True,
    )
    b_full = torch.linspace(-1, 1, K, dtype=torch.float64) if has_bias else None
    if has_bias:
        with torch.no_grad():
            layer.bias.copy_(b_full)
    w_full = layer.master_weight
    gen = torch.Generator().manual_seed(4)
    x_full = torch.randn(S, B, N, generator=gen, dtype=torch.float64)
    g_full = torch.randn(S, B, K, generator=gen, dtype=torch.float64)
    y_ref, gx_ref, gw_ref, gb_ref = _reference(x_full, w_full, None if skip else b_full, g_full)

    k_sl = slice(rank * N // world, (rank + 1) * N // world)
    s_sl = slice(rank * S // world, (rank + 1) * S // world)
    x = (x_full[..., k_sl] if input_is_parallel else x_full).clone().requires_grad_()
    with _CountCalls("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce") as calls:
        y, out_bias = layer(x)
        g = g_full[s_sl] if sp else g_full
        (y * g).sum().backward()
    want_calls = {"all_gather_matmul": int(sp), "matmul_reduce_scatter": int(sp), "matmul_all_reduce": int(not sp)}
    if calls.counts != want_calls:
        errors.append(f"{tag}: kernels ops called {calls.counts}, want {want_calls}")

    _close(f"{tag} weight", layer.weight.detach(), w_full[:, k_sl], errors)
    _close(f"{tag} output", y.detach(), y_ref[s_sl] if sp else y_ref, errors)
    if skip and out_bias is not layer.bias:
        errors.append(f"{tag}: output_bias is not layer.bias with skip_bias_add")
    _close(f"{tag} grad input", x.grad, gx_ref[..., k_sl] if input_is_parallel else gx_ref, errors)
    _close(f"{tag} grad weight", layer.weight.grad, gw_ref[:, k_sl], errors)
    gb = layer.bias.grad if (has_bias and not skip) else None
    if gb is not None and sp:
        if not layer.bias.sequence_parallel:
            errors.append(f"{tag}: bias.sequence_parallel is not set with sequence parallelism")
        # Each rank's bias gradient covers its rows; the trainer sums them over the TP group.
        gb = gb.clone()
        dist.all_reduce(gb)
    _close(f"{tag} grad bias", gb, gb_ref if not skip else None, errors)


def column_cases(rank: int, world: int, yamls: dict) -> list[str]:
    errors: list[str] = []
    for (recompute, coc_bwd), path in sorted(yamls.items()):
        with _UseConfigFile(path):
            for bias_mode in BIAS_MODES:
                for sp in (True, False):
                    if not sp and not recompute:
                        continue  # recompute_all_gather only matters with sequence parallelism
                    tag = f"column sp={sp} {bias_mode} recompute={recompute} coc_bwd={coc_bwd}"
                    column_case(rank, world, sp=sp, bias_mode=bias_mode, gather_output=False, errors=errors, tag=tag)
            for sp in (True, False):
                column_case(
                    rank,
                    world,
                    sp=sp,
                    bias_mode="bias",
                    gather_output=True,
                    errors=errors,
                    tag=f"column sp={sp} gather_output recompute={recompute} coc_bwd={coc_bwd}",
                )
    return errors


def row_cases(rank: int, world: int) -> list[str]:
    errors: list[str] = []
    for bias_mode in BIAS_MODES:
        for sp, input_is_parallel in ((True, True), (False, True), (False, False)):
            row_case(
                rank,
                world,
                sp=sp,
                bias_mode=bias_mode,
                input_is_parallel=input_is_parallel,
                errors=errors,
                tag=f"row sp={sp} {bias_mode} input_is_parallel={input_is_parallel}",
            )
    return errors


@pytest.mark.parametrize("parallel_num", PARALLEL_NUMS)
@pytest.mark.parametrize("world", WORLDS)
def test_column_parallel_linear_matches_reference(world: int, parallel_num: int, coc_yamls: dict) -> None:
    assert_no_errors(run_ranks(column_cases, world, coc_yamls, env={"COC_PARALLEL_NUM": str(parallel_num)}))


@pytest.mark.parametrize("parallel_num", PARALLEL_NUMS)
@pytest.mark.parametrize("world", WORLDS)
def test_row_parallel_linear_matches_reference(world: int, parallel_num: int) -> None:
    assert_no_errors(run_ranks(row_cases, world, env={"COC_PARALLEL_NUM": str(parallel_num)}))


def _count_fused_calls(body: Any, *args: Any) -> tuple[list[str], int]:
    """Run ``body`` in this rank counting calls that reached the fused Triton ops (not a fallback)."""
    from kernels.fused import all_gather, all_reduce, scatter

    modules = (all_gather, scatter, all_reduce)
    originals = {module: module.run for module in modules}
    calls = [0]

    def counted(fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            return fn(*a, **kw)

        return wrapper

    for module, fn in originals.items():
        module.run = counted(fn)
    try:
        return body(*args), calls[0]
    finally:
        for module, fn in originals.items():
            module.run = fn


def fused_column_cases(rank: int, world: int, yamls: dict) -> tuple[list[str], int]:
    return _count_fused_calls(column_cases, rank, world, yamls)


def fused_row_cases(rank: int, world: int) -> tuple[list[str], int]:
    return _count_fused_calls(row_cases, rank, world)


@pytest.mark.parametrize("world", (2,))
def test_linears_on_the_fused_kernels(world: int, coc_yamls: dict) -> None:
    """USE_COC_FUSED_KERNEL=1: forward and every gradient through the Triton kernels (interpreter). World 2:
    the kernels' odd-world index arithmetic is checked at world 3 by tests/kernels/fused/test_ops.py, the
    linears' at world 3 on the other backends above."""
    env = {"USE_COC_FUSED_KERNEL": "1"}
    for results in (
        run_ranks(fused_column_cases, world, coc_yamls, env=env, timeout=300),
        run_ranks(fused_row_cases, world, env=env, timeout=300),
    ):
        assert_no_errors([errors for errors, _ in results])
        assert all(calls > 0 for _, calls in results), results
