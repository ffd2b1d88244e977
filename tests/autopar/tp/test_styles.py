"""The CoC ParallelStyles against torch's own styles on a plain two-linear block + norm, with
torch's ``parallelize_module``: the same DTensor parameters (placements, local shards), the same
outputs and gradients, with sequence parallelism on dim 0 ([s, b, h], Megatron) and dim 1
([b, s, h], Hugging Face), and the CoC ops doing the communication."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.testing import run_ranks
from tests.autopar.tp.hf_cases import coc_op_counter
from tests.autopar.tp.spies import public_op_counter

H, FFN = 16, 32
TOL = 1e-12  # float64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H, dtype=torch.float64)
        self.w1 = nn.Linear(H, FFN, dtype=torch.float64)
        self.w2 = nn.Linear(FFN, H, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


def _plans(coc: bool, sp: bool, seq_dim: int) -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    import autopar

    col, row, seq = (
        (autopar.CocColwiseParallel, autopar.CocRowwiseParallel, autopar.CocSequenceParallel)
        if coc
        else (ColwiseParallel, RowwiseParallel, SequenceParallel)
    )
    if not sp:
        return {"w1": col(), "w2": row()}
    return {
        "norm": seq(sequence_dim=seq_dim, use_local_output=True),
        "w1": col(input_layouts=Shard(seq_dim)),
        "w2": row(output_layouts=Shard(seq_dim)),
    }


def styles_match_torch(rank: int, world: int, sp: bool, seq_dim: int) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    errors: list[str] = []
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = Block()
    with torch.no_grad():
        base.norm.weight.normal_()  # not ones: the norm-gradient sum must be right, not trivially so
    shape = [2, 2]
    shape.insert(seq_dim, 4 * world)
    x_full = torch.randn(*shape, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = x_full.chunk(world, dim=seq_dim)[rank].contiguous() if sp else x_full
    results = {}
    for coc in (False, True):
        model = parallelize_module(copy.deepcopy(base), mesh, _plans(coc, sp, seq_dim))
        with coc_op_counter() as calls:
            y = model(x.clone())
            y = y.to_local() if isinstance(y, DTensor) else y
            (y * y).sum().backward()
        if not coc and sp:
            # torch's SequenceParallel leaves the norm gradients Partial: make them the parameter's
            # placement (the sum the CoC style does in the backward)
            for p in model.norm.parameters():
                p.grad = p.grad.redistribute(placements=p.placements)
        results[coc] = (model, y.detach(), dict(calls))
    (theirs, y_t, calls_t), (mine, y_m, calls_m) = results[False], results[True]
    if calls_t:
        errors.append(f"torch's styles ran coc ops: {calls_t}")
    want_ops = {"all_gather_matmul", "matmul_reduce_scatter"} if sp else {"matmul_all_reduce"}
    if not want_ops <= {op for op, _ in calls_m}:
        errors.append(f"CoC styles ran {calls_m}, want {want_ops}")
    if (y_t - y_m).abs().max() > TOL:
        errors.append(f"output differs by {(y_t - y_m).abs().max().item()}")
    for (name, p_t), (_, p_m) in zip(theirs.named_parameters(), mine.named_parameters(), strict=True):
        if not isinstance(p_t, DTensor):  # not in the plan (the norm without SP): plain in both
            if isinstance(p_m, DTensor) or (p_t.grad - p_m.grad).abs().max() > TOL:
                errors.append(f"{name}: unplanned parameter differs ({type(p_m).__name__})")
            continue
        if not isinstance(p_m, DTensor) or p_m.placements != p_t.placements:
            errors.append(f"{name}: {type(p_m).__name__} {getattr(p_m, 'placements', None)} vs {p_t.placements}")
            continue
        if not torch.equal(p_m.to_local(), p_t.to_local()):
            errors.append(f"{name}: local shard differs from torch's")
        g_t, g_m = p_t.grad.full_tensor(), p_m.grad.full_tensor()
        if (g_t - g_m).abs().max() > TOL:
            errors.append(f"{name}.grad differs by {(g_t - g_m).abs().max().item()}")
        if p_m.grad.placements != p_m.placements:
            errors.append(f"{name}.grad placements {p_m.grad.placements}, want {p_m.placements}")
    dist.barrier()
    return errors


@pytest.mark.parametrize(("sp", "seq_dim"), [(False, 0), (True, 0), (True, 1)])
def test_coc_styles_match_torch_styles(sp: bool, seq_dim: int) -> None:
    for errors in run_ranks(styles_match_torch, 2, sp, seq_dim):
        assert not errors, errors


def test_style_arguments_are_checked() -> None:
    import autopar

    with pytest.raises(TypeError, match="input_layouts"):
        autopar.CocColwiseParallel(input_layouts="shard")
    with pytest.raises(ValueError, match="packed"):
        autopar.CocColwiseParallel(packed=0)


def _shared_gather_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    import autopar
    from autopar.tp import share_input_gather

    torch.manual_seed(0)
    block = nn.ModuleDict({"a": nn.Linear(H, FFN, dtype=torch.float64), "b": nn.Linear(H, 8, dtype=torch.float64)})
    ref = copy.deepcopy(block)
    mesh = init_device_mesh("cpu", (world,))
    style = autopar.CocColwiseParallel(input_layouts=Shard(1))
    parallelize_module(block, mesh, {"a": style, "b": style})
    link = share_input_gather([block["a"], block["b"]])
    x, x2 = (
        torch.randn(2, 3 * world, H, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    )
    shard = slice(rank * 3, (rank + 1) * 3)
    x_local = x[:, shard].requires_grad_()
    with coc_op_counter() as calls:
        ya = block["a"](x_local)  # one gather for both; b's output waits
        yb2 = block["b"](x2[:, shard])  # another input while b's waits: computed on its own
        yb = block["b"](x_local)  # takes the waiting output
    (ya.sum() + 2 * yb.sum()).backward()
    xr = x.clone().requires_grad_()
    (ref["a"](xr).sum() + 2 * ref["b"](xr).sum()).backward()
    n_a, n_b = FFN // world, 8 // world
    errors = {
        "a": (ya - ref["a"](x)[..., rank * n_a : (rank + 1) * n_a]).abs().max().item(),
        "b": (yb - ref["b"](x)[..., rank * n_b : (rank + 1) * n_b]).abs().max().item(),
        "b2": (yb2 - ref["b"](x2)[..., rank * n_b : (rank + 1) * n_b]).abs().max().item(),
        "grad_x": (x_local.grad - xr.grad[:, shard]).abs().max().item(),
        "grad_w": max((block[m].weight.grad.full_tensor() - ref[m].weight.grad).abs().max().item() for m in "ab"),
        "grad_b": max((block[m].bias.grad.full_tensor() - ref[m].bias.grad).abs().max().item() for m in "ab"),
    }
    return {"errors": errors, "calls": dict(calls), "waiting": len(link._waiting)}


def test_siblings_share_one_gather_and_other_inputs_compute_their_own() -> None:
    for res in run_ranks(_shared_gather_rank, 2):
        assert max(res["errors"].values()) < TOL, res
        assert res["calls"] == {
            ("all_gather_matmul[2 weights]", "sequential"): 1,
            ("all_gather_matmul", "sequential"): 1,
        }
        assert res["waiting"] == 0, res


def _fp8_shared_gather_rank(rank: int, world: int) -> dict:
    """Linked siblings with the FP8 recipe (one FP8 gather for both weights) against the same modules unlinked
    (one FP8 gather each): the same quantized operands, fp32 sums in another order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    import autopar
    from autopar.tp import share_input_gather

    torch.manual_seed(0)
    base = nn.ModuleDict({"a": nn.Linear(H, FFN), "b": nn.Linear(H, 8)})
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3 * world, H, generator=gen)[:, rank * 3 : (rank + 1) * 3]
    ga, gb = (
        torch.randn(2, 3 * world, FFN // world, generator=gen),
        torch.randn(2, 3 * world, 8 // world, generator=gen),
    )
    runs = {}
    for shared in (False, True):
        block = copy.deepcopy(base)
        style = autopar.CocColwiseParallel(input_layouts=Shard(1), fp8=autopar.Fp8Recipe())
        parallelize_module(block, mesh, {"a": style, "b": style})
        if shared:
            share_input_gather([block["a"], block["b"]])
        x_local = x.clone().requires_grad_()
        with public_op_counter() as calls:
            ya, yb = block["a"](x_local), block["b"](x_local)
        ((ya * ga).sum() + (yb * gb).sum()).backward()
        grads = [block[m].weight.grad.to_local() for m in "ab"] + [block[m].bias.grad.to_local() for m in "ab"]
        runs[shared] = ([ya.detach(), yb.detach(), x_local.grad, *grads], dict(calls))
    (alone, alone_calls), (linked, linked_calls) = runs[False], runs[True]
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(linked, alone, strict=True)]
    return {"errors": errors, "alone": alone_calls, "linked": linked_calls}


def test_fp8_siblings_share_one_gather() -> None:
    for res in run_ranks(_fp8_shared_gather_rank, 2):
        assert max(res["errors"]) < 1e-6, res  # fp32 sums of k <= 32 products in another order
        assert res["alone"] == {"all_gather_scaled_matmul": 2}, res
        assert res["linked"] == {"all_gather_scaled_matmul": 1}, res


def _autocast_siblings_rank(rank: int, world: int) -> dict:
    """Under autocast, linked siblings cast their operands as an unlinked module does (the Functions'
    operand check): the same outputs, in the autocast dtype."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    import autopar
    from autopar.tp import share_input_gather

    torch.manual_seed(0)
    base = nn.ModuleDict({"a": nn.Linear(H, FFN), "b": nn.Linear(H, 8)})
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(2, 3 * world, H, generator=torch.Generator().manual_seed(1))[:, rank * 3 : (rank + 1) * 3]
    outs = {}
    for shared in (False, True):
        block = copy.deepcopy(base)
        style = autopar.CocColwiseParallel(input_layouts=Shard(1))
        parallelize_module(block, mesh, {"a": style, "b": style})
        if shared:
            share_input_gather([block["a"], block["b"]])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[shared] = [block[m](x) for m in "ab"]
    return {
        "dtypes": {shared: [str(y.dtype) for y in ys] for shared, ys in outs.items()},
        "diff": max((a.float() - b.float()).abs().max().item() for a, b in zip(outs[True], outs[False], strict=True)),
    }


def test_linked_siblings_cast_under_autocast_as_one_module() -> None:
    for res in run_ranks(_autocast_siblings_rank, 2):
        assert res["dtypes"] == {False: ["torch.bfloat16"] * 2, True: ["torch.bfloat16"] * 2}, res
        assert res["diff"] == 0.0, res  # the same bf16 products, one gather for both or one each


def test_share_input_gather_refuses_unparallelized_or_mismatched_modules() -> None:
    from autopar.tp import share_input_gather

    with pytest.raises(ValueError, match="two or more"):
        share_input_gather([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="CocColwiseParallel first"):
        share_input_gather([nn.Linear(2, 2), nn.Linear(2, 2)])


class _TanhEmbedding(nn.Embedding):
    """An embedding whose forward does more than the lookup (as Gemma's scales it)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(ids) * 3.0)


class _ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


def _own_forward_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    import autopar

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = _TanhEmbedding(16, H, padding_idx=5, dtype=torch.float64)
    ids = torch.randint(0, 16, (2, 4 * world), generator=torch.Generator().manual_seed(1))
    ids[0, :2] = 5  # the padding row gets no gradient
    ref = copy.deepcopy(base)
    y_ref = ref(ids)
    (y_ref * y_ref).sum().backward()
    errors = {}
    for sp in (False, True):
        emb = copy.deepcopy(base)
        out = Shard(1) if sp else Replicate()
        style = autopar.CocRowwiseParallel(input_layouts=Replicate(), output_layouts=out, use_local_output=False)
        parallelize_module(emb, mesh, style)
        y = emb(ids)
        y = y.full_tensor() if isinstance(y, DTensor) else y
        (y * y).sum().backward()
        errors[sp] = {
            "out": (y - y_ref).abs().max().item(),
            "grad": (emb.weight.grad.full_tensor() - ref.weight.grad).abs().max().item(),
        }
    refusals = []
    for style in (autopar.CocColwiseParallel(), autopar.CocRowwiseParallel()):
        try:
            parallelize_module(_ScaledLinear(H, FFN), mesh, style)
            refusals.append("no error")
        except NotImplementedError as e:
            refusals.append(str(e))
    return {"errors": errors, "refusals": refusals}


def test_styles_keep_the_module_forward_or_refuse_it() -> None:
    """The row style on an embedding runs the module's own forward (here a scale and a tanh after the lookup) on
    the local rows; the linear styles, which compute the product themselves, refuse a subclass with its own
    forward instead of dropping it. Before: the embedding's forward was replaced by a bare lookup."""
    for res in run_ranks(_own_forward_rank, 2):
        for sp, err in res["errors"].items():
            assert max(err.values()) < TOL, (sp, err)
        for msg in res["refusals"]:
            assert "_ScaledLinear has its own forward" in msg and "silently wrong" in msg, msg
