"""The FP8 ops with ``gather_dim`` / ``scatter_dim`` other than 0 (``[b, s, k]`` sharded on the sequence):
bitwise the dim-0 op on the same data moved to dim 0, on every backend and scaling mode, the gathered FP8
bytes and scales returned in the caller's layout; bad dims and scale shapes refused by name."""

from __future__ import annotations

import pytest
import torch

from kernels.testing import run_ranks

B, S_LOCAL, K, N = 2, 3, 136, 24  # odd rows; k not a multiple of 128


def _quant(t: torch.Tensor, mode: str, weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import kernels

    return kernels.quantize_fp8(t, "block2d" if weight and mode == "block" else mode)


def _dims_rank(rank: int, world: int, backend: str, modes: tuple[str, ...]) -> list[str]:
    """Failures as text: each mode's dim-1 calls against the dim-0 calls on the moved operands."""
    import torch.distributed as dist

    import kernels

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    failures = []
    opts = {"group": group, "backend": backend, "parallel_num": 2, "out_dtype": torch.bfloat16}
    for mode in modes:
        x_full = torch.randn(B, S_LOCAL * world, K, generator=g)
        xq_full, xs_full = _quant(x_full.reshape(-1, K), mode, False)
        xq_full = xq_full.view(B, S_LOCAL * world, K)
        if mode != "tensor":
            xs_full = xs_full.view(B, S_LOCAL * world, -1)
        wq, ws = _quant(torch.randn(N, K, generator=g), mode, True)
        rows = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
        xq = xq_full[:, rows]
        xs = xs_full if mode == "tensor" else xs_full[:, rows]
        # all-gather on dim 1, the scales given [b, s_local, G] and, flattened, [b * s_local, G]
        y, xg, xsg = kernels.all_gather_scaled_matmul(xq, xs, wq, ws, gather_dim=1, return_gathered=True, **opts)
        y0 = kernels.all_gather_scaled_matmul(
            xq.movedim(1, 0).contiguous(), xs if mode == "tensor" else xs.movedim(1, 0).contiguous(), wq, ws, **opts
        )
        if not torch.equal(y, y0.movedim(0, 1)):
            failures.append(f"{mode}: all-gather on dim 1 differs from dim 0 on the moved data")
        # Tensor mode: the gathered scales are per row (each row its rank's scale), here all the one scale.
        xs_rows = xs_full.reshape(1, 1, 1).expand(B, S_LOCAL * world, 1) if mode == "tensor" else xs_full
        if not torch.equal(xg.view(torch.uint8), xq_full.view(torch.uint8)) or not torch.equal(xsg, xs_rows):
            failures.append(f"{mode}: gathered FP8 bytes or scales are not x's in its layout")
        if mode != "tensor":
            y_flat = kernels.all_gather_scaled_matmul(xq, xs.reshape(-1, xs.shape[-1]), wq, ws, gather_dim=-2, **opts)
            if not torch.equal(y_flat, y):
                failures.append(f"{mode}: [m, G] scales in x's row order differ from [b, s, G]")
        # reduce-scatter on dim 1: each rank its own partial of the full sequence
        xr = torch.randn(B, S_LOCAL * world, K, generator=torch.Generator().manual_seed(10 + rank))
        xrq, xrs = _quant(xr.reshape(-1, K), mode, False)
        xrq = xrq.view(B, S_LOCAL * world, K)
        xrs = xrs if mode == "tensor" else xrs.view(B, S_LOCAL * world, -1)
        for det in (False, True) if backend != "fused" else (True,):
            z = kernels.scaled_matmul_reduce_scatter(xrq, xrs, wq, ws, scatter_dim=1, deterministic=det, **opts)
            moved = xrs if mode == "tensor" else xrs.movedim(1, 0).contiguous()
            z0 = kernels.scaled_matmul_reduce_scatter(
                xrq.movedim(1, 0).contiguous(), moved, wq, ws, deterministic=det, **opts
            )
            if tuple(z.shape) != (B, S_LOCAL, N) or not torch.equal(z, z0.movedim(0, 1)):
                failures.append(f"{mode} det={det}: reduce-scatter on dim 1 differs from dim 0 on the moved data")
    return failures


# The dims are handled above the backends (moved to dim 0 and back): every mode on the scripted
# backends, the block mode through the (interpreted) fused kernels.
@pytest.mark.parametrize(
    ("backend", "modes"),
    [("sequential", ("tensor", "row", "block")), ("chunked", ("tensor", "row", "block")), ("fused", ("block",))],
    ids=["sequential", "chunked", "fused"],
)
def test_fp8_sequence_dim_1_is_dim_0_on_moved_data(backend: str, modes: tuple[str, ...]) -> None:
    for failures in run_ranks(_dims_rank, 2, backend, modes, timeout=600):
        assert failures == [], failures


def test_fp8_bad_dims_and_scale_shapes_are_named() -> None:
    import kernels

    x = torch.randn(2, 4, 64)
    xq, xs = kernels.quantize_fp8(x.reshape(-1, 64), "row")
    wq, ws = kernels.quantize_fp8(torch.randn(8, 64), "row")
    xq = xq.view(2, 4, 64)
    with pytest.raises(ValueError, match="gather_dim=2 is the last dim of x"):
        kernels.all_gather_scaled_matmul(xq, xs, wq, ws, gather_dim=2)
    with pytest.raises(ValueError, match="scatter_dim=3 is out of range"):
        kernels.scaled_matmul_reduce_scatter(xq, xs, wq, ws, scatter_dim=3)
    with pytest.raises(ValueError, match=r"x_scale shape \[7, 1\] with w_scale shape \[8, 1\] fit no scaling mode"):
        kernels.all_gather_scaled_matmul(xq, xs[:7], wq, ws, gather_dim=1)
    with pytest.raises(TypeError, match="gather_dim must be an int"):
        kernels.all_gather_scaled_matmul(xq, xs, wq, ws, gather_dim=1.0)


def _layout_mismatch_rank(rank: int, world: int) -> list[str]:
    """The last rank passes another dim with the same shape ([4W, 4W, K], dim 0 against dim 1) or the
    same dim with another shape ([2, 8W, K] against [8W, 2, K], dim 1): the FP8 ops move the dim to
    dim 0 before the call, so only the caller's dim and the dims before it tell the calls apart.
    Refused by name on every backend: fused at a group's first call and later, sequential under
    COC_CHECK=1 (the test sets it). Returns the messages."""
    import torch.distributed as dist

    import kernels

    messages = []
    wq, ws = _quant(torch.randn(N, K), "row", True)
    last = rank == world - 1
    square = torch.randn(4 * world, 4 * world, K)
    flat = torch.randn(2, 8 * world, K)
    fq, fs = _quant(flat.reshape(-1, K), "row", False)
    fq, fs = fq.view(flat.shape), fs.view(tuple(flat.shape[:-1]) + (1,))
    cases = [
        ("gather_dim", square, 1 if last else 0, "gather_dim=0"),
        ("gather_dim", flat.reshape(8 * world, 2, K) if last else flat, 1, "prod(x.shape[:gather_dim])=2"),
        ("scatter_dim", square, 1 if last else 0, "scatter_dim=0"),
        ("scatter_dim", flat.reshape(8 * world, 2, K) if last else flat, 1, "prod(x.shape[:scatter_dim])=2"),
    ]
    for name, x, dim, expected in cases:
        xq, xs = _quant(x.reshape(-1, K), "row", False)
        xq, xs = xq.view(x.shape), xs.view(tuple(x.shape[:-1]) + (1,))
        op = kernels.all_gather_scaled_matmul if name == "gather_dim" else kernels.scaled_matmul_reduce_scatter
        for backend, warm in (("fused", False), ("fused", True), ("sequential", False)):
            group = dist.new_group(list(range(world)))
            opts = {"group": group, "backend": backend, "out_dtype": torch.float32}
            if warm:
                op(fq, fs, wq, ws, **opts, **{name: 1})  # the same call everywhere: the heap exists
            try:
                op(xq, xs, wq, ws, **opts, **{name: dim})
            except RuntimeError as e:
                message = str(e)
                if "ranks disagree" not in message or expected not in message:
                    messages.append(f"{name} {backend} warm={warm}: {message}")
            else:
                messages.append(f"{name} {backend} warm={warm}: ranks with other layouts got a result")
    return messages


def test_fp8_ranks_with_other_dims_or_layouts_are_refused_by_name() -> None:
    failures = run_ranks(_layout_mismatch_rank, 2, timeout=300, env={"COC_CHECK": "1"})
    assert failures == [[], []], failures
