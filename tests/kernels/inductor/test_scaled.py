"""The Inductor pass on FP8 graphs: ``torch._scaled_mm`` in torch's TP styles becomes the scaled coc ops.

The block is a column-parallel then a row-parallel FP8 linear, each quantizing its input and weight dynamically
(tensorwise, or rowwise as torch's float8 training does, with power-of-2 scales) and multiplying with
``torch._scaled_mm`` on the local shards. With sequence parallelism the column layer quantizes its rows before
the gather, as torchao's ``Float8ColwiseParallel`` does, so the graph all-gathers the FP8 payload (and, rowwise,
the scale rows). Compiled at world 2 (gloo) with the pass, the results are checked against the fp64 product of
the operands the graph quantized, within the bound of ``kernels.fp8.numerics``; gloo cannot all-gather FP8,
so the uncompiled SP block does not run there.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.fx as fx

from kernels.testing import BACKEND_ENVS, run_ranks

E4M3 = torch.float8_e4m3fn


def _quantize(t: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload, scale)``, ``t ~ payload * scale``: the amax over the tensor or each row (over the ranks too: a
    DTensor reduces a sharded amax), as a power of 2, so dividing by it rounds nowhere."""
    from torch.distributed.tensor import DTensor, Replicate

    amax = t.abs().amax() if mode == "tensor" else t.abs().amax(dim=-1, keepdim=True)
    if isinstance(amax, DTensor):
        amax = amax.redistribute(placements=[Replicate() if p.is_partial() else p for p in amax.placements])
    scale = torch.exp2(torch.ceil(torch.log2(amax.float().clamp(min=1e-12) / 448.0)))
    return (t.float() / scale).clamp(-448.0, 448.0).to(E4M3), scale


class Fp8Linear(torch.nn.Linear):
    """``y = x @ weight.T`` through ``torch._scaled_mm`` of the quantized local shards (torch's float8 training
    at its core). Under TP the input and weight are DTensors: the column layer receives rows sharded on a dim
    other than the last when sequence parallel and gathers the FP8 rows itself; the row layer's partial sums
    leave as ``Partial`` for the style's reduction."""

    def __init__(self, k: int, n: int, mode: str, bias_in_mm: str = "", upcast: bool = False):
        super().__init__(k, n, bias=bool(bias_in_mm))
        # "row_post": torchao's rowwise product without fast accumulation, the row scales applied after a
        # _scaled_mm of unit scales
        self.post_scale = mode == "row_post"
        self.mode, self.bias_in_mm, self.upcast = ("row" if self.post_scale else mode), bias_in_mm, upcast
        self.local_scale = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        if self.local_scale and isinstance(x, DTensor):
            # Each rank's own scale, not reduced over the ranks: the gathered rows of other ranks are then scaled
            # by this rank's scale in the graph, which the rewrite must keep.
            xq, xs = _quantize(x.to_local(), self.mode)
            xq = DTensor.from_local(xq, x.device_mesh, x.placements)
        else:
            xq, xs = _quantize(x, self.mode)
        wq, ws = _quantize(self.weight, self.mode)
        placement = None
        if isinstance(x, DTensor):
            if any(isinstance(p, Shard) and p.dim != x.dim() - 1 for p in x.placements):
                # The scales first: the pass meets their gather before the payload's and must wait for it.
                if isinstance(xs, DTensor):
                    xs = xs.redistribute(placements=[Replicate()])
                xq = xq.redistribute(placements=[Replicate()])
            row = isinstance(self.weight.placements[0], Shard) and self.weight.placements[0].dim == 1
            placement, mesh = (Partial() if row else Shard(-1)), x.device_mesh
            xq, xs, wq, ws = (t.to_local() if isinstance(t, DTensor) else t for t in (xq, xs, wq, ws))
        k = xq.shape[-1]
        row_scales = self.mode == "row"
        bias = None
        if self.bias_in_mm:
            bias = (self.bias.to_local() if isinstance(self.bias, DTensor) else self.bias).to(torch.bfloat16)
            if self.bias_in_mm == "split" and isinstance(self.bias, DTensor):
                bias = bias / self.bias.device_mesh.size()  # DTensor's Replicate -> Partial: b / W on each rank
        sa, sb = (xs.reshape(-1, 1), ws.reshape(1, -1)) if row_scales else (xs, ws)
        if self.post_scale:
            one = sa.new_ones(())
            y = torch._scaled_mm(xq.reshape(-1, k), wq.t(), one, one, out_dtype=torch.bfloat16)
            y = (y * (sa * sb)).to(torch.bfloat16)
        else:
            y = torch._scaled_mm(
                xq.reshape(-1, k), wq.t(), sa, sb, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True
            )
        if self.upcast:
            y = y.float()
        y = y.reshape(*xq.shape[:-1], y.shape[-1])
        return y if placement is None else DTensor.from_local(y, mesh, [placement])


class Block(torch.nn.Module):
    """FP8 column -> GELU -> FP8 row, and a bias after the row layer's reduction. Returns the output, the column
    output and the row layer's input (the references quantize what the graph quantized)."""

    def __init__(self, h: int, f: int, mode: str, bias_in_mm: str):
        super().__init__()
        self.col = Fp8Linear(h, f, "row" if mode == "row_post" else mode)
        self.row = Fp8Linear(f, h, mode, bias_in_mm=bias_in_mm, upcast=mode != "tensor")
        # tensor mode: an fp32 bias after a bf16 reduction promotes the sum, so it stays out of the op.
        self.post_bias = torch.nn.Parameter(torch.randn(h, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hid = self.col(x)
        a = torch.nn.functional.gelu(hid)
        return self.row(a) + self.post_bias, hid, a


def _quantize_first(layout: object) -> object:
    """A column style whose module receives the sharded rows (desired = input layouts), quantizes them and
    gathers the FP8 rows: torchao's Float8ColwiseParallel, without torchao."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    style = ColwiseParallel(input_layouts=layout)
    style.desired_input_layouts = (layout,)
    return style


def _fp8_block(rank: int, world: int, mode: str, gather: str, bias_in_mm: str) -> dict:
    """Compile the block with the pass (``gather``: "off" no SP, "fp8" / "fp8_dim1" SP quantizing before the gather
    on dim 0 / 1, "hp" SP with torch's plain column style, which gathers before the layer quantizes) and return
    the error ratios against the fp64 reference (at most 1 within the bound), the report and the backend runs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from kernels.inductor import rewrite as inductor_pass
    from kernels.testing import backend_calls
    from kernels.testing.compile import graph_passes_backend

    torch._dynamo.reset()
    torch.manual_seed(0)
    h, f = 32, 64
    block = Block(h, f, mode, bias_in_mm)
    single = copy.deepcopy(block)
    seq = 1 if gather == "fp8_dim1" else 0
    local = gather == "fp8_local"
    qmode = mode.removesuffix("_post")
    if gather == "off":
        plan = {"col": ColwiseParallel(input_layouts=Replicate()), "row": RowwiseParallel()}
    elif gather == "hp":
        plan = {"col": ColwiseParallel(input_layouts=Shard(0)), "row": RowwiseParallel(output_layouts=Shard(0))}
    else:
        plan = {"col": _quantize_first(Shard(seq)), "row": RowwiseParallel(output_layouts=Shard(seq))}
    block.col.local_scale = local
    parallelize_module(block, init_device_mesh("cpu", (world,)), plan)
    x = torch.randn(4 * world, 3, h) if seq == 0 else torch.randn(3, 4 * world, h)
    inp = x if gather == "off" else x.chunk(world, seq)[rank]
    inductor_pass.clear_report()
    with torch.no_grad(), inductor_pass.use_inductor_pass(), backend_calls() as calls:
        y, hid, a = torch.compile(block, backend=graph_passes_backend)(inp)
    eager = block(inp) if gather == "off" else None  # gloo all-gathers no FP8: only the no-SP block runs eagerly

    def full(t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t, dtype=torch.float32) for _ in range(world)]
        dist.all_gather(parts, t.float().contiguous())
        return torch.cat(parts, dim)

    def ratios(y: torch.Tensor, hid: torch.Tensor, a: torch.Tensor, rounded_partials: bool) -> dict:
        # a bias inside the row layer's _scaled_mm: added on every rank, or b / W on every rank
        times = {"": 0, "each": world, "split": 1}[bias_in_mm]
        want_hid, bound_hid, _ = _reference(x, single.col.weight, qmode, world=world)
        if local:
            # every gathered row times this rank's scale, as the graph computes it
            parts = [_quantize(c, mode) for c in x.chunk(world, seq)]
            xd = torch.cat([q.double() for q, _ in parts]) * parts[rank][1].double()
            wq, ws = _quantize(single.col.weight.detach(), mode)
            wd = (wq.double() * ws.double()).chunk(world, 0)[rank]  # this rank's columns: its scale
            want_hid, bound_hid, _ = _product(xd, wd, world)
        a_full = full(a, -1).to(a.dtype)
        want_y, bound_y, s = _reference(
            a_full, single.row.weight, qmode, world=world, bias=single.row.bias, times=times
        )
        if rounded_partials:
            # The uncompiled graph rounds each rank's partial to bf16 and sums them (in bf16 in tensor mode): W
            # more bf16 roundings of terms of at most S, which the coc op does not make.
            bound_y = bound_y + world * 2**-8 * (1 + 2**-8) * s
        want_y, bound_y = want_y + single.post_bias.double(), bound_y + 2**-24 * want_y.abs()
        y_full = y if gather == "off" else full(y, seq)
        out = {"y dtype": str(y.dtype), "hid dtype": str(hid.dtype)}
        got_hid = hid.double() if local else full(hid, -1).double()
        out["hid"] = float(((got_hid.reshape(want_hid.shape) - want_hid).abs() / bound_hid).max())
        out["y"] = float(((y_full.detach().double() - want_y).abs() / bound_y).max())
        return out

    return {
        # A graph left alone keeps its rounded partials; a rewritten one has the op's single rounding.
        "compiled": ratios(y, hid, a, bias_in_mm == "each"),
        "eager": ratios(*eager, True) if eager is not None else None,
        "report": [(r.graph, r.pattern, r.matched, r.detail) for r in inductor_pass.report()],
        "calls": dict(calls),
    }


def _reference(
    x: torch.Tensor, weight: torch.Tensor, mode: str, *, world: int, bias: torch.Tensor | None = None, times: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 ``dq(x) @ dq(w).T (+ times * bias)`` of the operands the block quantizes, the bound of
    ``kernels.fp8.numerics`` for a bf16 result summed over ``world`` ranks in fp32, and ``sum |dq(x)| |dq(w)|``."""
    xq, xs = _quantize(x, mode)
    wq, ws = _quantize(weight.detach(), mode)
    b = None if bias is None or not times else bias.detach().to(torch.bfloat16).double() * times
    return _product(xq.double() * xs.double(), wq.double() * ws.double(), world, b)


def _product(
    xd: torch.Tensor, wd: torch.Tensor, world: int, b: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from kernels.fp8.numerics import op_error_bound

    y, s = xd @ wd.T, xd.abs() @ wd.abs().T
    if b is not None:
        y, s = y + b, s + b.abs()
    bound = op_error_bound(y, s, xd.shape[-1], world, out_dtype=torch.bfloat16, accumulation="fp32")
    return y, bound, s


CASES = {
    # (mode, gather, bias in the row layer's _scaled_mm): what the pass rewrites, and the FP8 ops that ran
    ("tensor", "off", ""): ({"matmul_all_reduce"}, {"scaled_matmul_all_reduce"}),
    ("tensor", "off", "split"): ({"matmul_all_reduce"}, {"scaled_matmul_all_reduce"}),
    ("row", "off", ""): ({"matmul_all_reduce"}, {"scaled_matmul_all_reduce"}),
    ("tensor", "fp8", ""): (
        {"all_gather_matmul", "matmul_reduce_scatter"},
        {"all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"},
    ),
    ("row", "fp8", ""): (
        {"all_gather_matmul", "matmul_reduce_scatter"},
        {"all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"},
    ),
    ("tensor", "fp8_dim1", ""): (
        {"all_gather_matmul", "matmul_reduce_scatter"},
        {"all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"},
    ),
    ("row", "fp8_dim1", ""): (
        {"all_gather_matmul", "matmul_reduce_scatter"},
        {"all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"},
    ),
    # The row layer as torchao's rowwise backward computes: row scales applied after a unit-scaled _scaled_mm.
    ("row_post", "off", ""): ({"matmul_all_reduce"}, {"scaled_matmul_all_reduce"}),
    ("row_post", "fp8", ""): (
        {"all_gather_matmul", "matmul_reduce_scatter"},
        {"all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"},
    ),
    # Each rank's own tensorwise scale: the graph scales every gathered row by this rank's.
    ("tensor", "fp8_local", ""): (
        {"all_gather_matmul", "matmul_reduce_scatter"},
        {"all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"},
    ),
    # Left alone: a gather of the bf16 / fp32 rows the layer quantizes after it, and a bias added on every rank.
    ("row", "hp", ""): ({"matmul_reduce_scatter"}, {"scaled_matmul_reduce_scatter"}),
    ("tensor", "off", "each"): (set(), set()),
}


@pytest.mark.parametrize("case", list(CASES), ids=["-".join((*c[:2], c[2] or "nobias")) for c in CASES])
def test_scaled_mm_graphs_run_the_fp8_coc_ops(case):
    mode, gather, bias_in_mm = case
    want_matched, want_ops = CASES[case]
    for out in run_ranks(_fp8_block, 2, mode, gather, bias_in_mm, timeout=600):
        for run in ("compiled", "eager"):
            if out[run] is None:
                continue
            assert out[run]["hid"] <= 1 and out[run]["y"] <= 1, (run, out)
            assert out[run]["y dtype"] == "torch.float32" and out[run]["hid dtype"] == "torch.bfloat16", out
        matched = {p for _, p, ok, _ in out["report"] if ok}
        assert matched == want_matched, out["report"]
        assert all(f"FP8 {mode.removesuffix('_post')}-scaled" in d for _, _, ok, d in out["report"] if ok), out[
            "report"
        ]
        if mode == "row_post":
            assert any("after a unit-scaled" in d for _, p, ok, d in out["report"] if ok and p != "all_gather_matmul")
        assert {op for op, _ in out["calls"]} == want_ops, out["calls"]
        left = [d for _, p, ok, d in out["report"] if not ok and "'max'" not in d]
        if gather.startswith("fp8"):
            # the scale rows' gather is rewritten with the payload's, never reported on its own
            assert not [p for _, p, ok, _ in out["report"] if p == "all_gather_matmul" and not ok], out["report"]
        if gather == "hp":
            assert any("quantized after the gather" in d for d in left), left
        if bias_in_mm == "each":
            assert any("adds bias" in d and "on every rank" in d for d in left), left
        if bias_in_mm == "split":
            assert any("split as b / 2" in d for _, _, ok, d in out["report"] if ok), out["report"]


def _graph_with_scaled_mm(
    a: torch.dtype, scale_a: tuple, scale_b: tuple, scale_dtype: torch.dtype = torch.float32, **kwargs: object
) -> fx.Node:
    """A ``_scaled_mm`` node of ``a [4, 32]`` and an e4m3 ``b [32, 8]`` with fake metadata."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = fx.Graph()
    with FakeTensorMode() as mode:
        vals = {
            "a": torch.empty(4, 32, dtype=a),
            "b": torch.empty(32, 8, dtype=E4M3),
            "sa": torch.empty(scale_a, dtype=scale_dtype),
            "sb": torch.empty(scale_b, dtype=scale_dtype),
            "bias": torch.empty(8, dtype=torch.float16),
        }
    del mode
    nodes = {}
    for name, val in vals.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = val
    kw = {k: nodes["bias"] if v == "bias" else v for k, v in kwargs.items()}
    return graph.call_function(
        torch.ops.aten._scaled_mm.default, (nodes["a"], nodes["b"], nodes["sa"], nodes["sb"]), kw
    )


@pytest.mark.parametrize(
    ("a", "scale_a", "scale_b", "kwargs", "mode"),
    [
        (E4M3, (), (), {"out_dtype": torch.bfloat16}, "tensor"),
        (torch.float8_e5m2, (1,), (1,), {"out_dtype": torch.float32, "use_fast_accum": True}, "tensor"),
        (E4M3, (4, 1), (1, 8), {"out_dtype": torch.float16}, "row"),
    ],
)
def test_scaled_mm_read_as_an_fp8_matmul(a, scale_a, scale_b, kwargs, mode):
    from kernels.inductor.scaled import as_scaled_matmul

    mm = as_scaled_matmul(_graph_with_scaled_mm(a, scale_a, scale_b, **kwargs))
    assert (mm.mode, mm.out_dtype, mm.fast_accum, mm.n) == (
        mode,
        kwargs["out_dtype"],
        kwargs.get("use_fast_accum", False),
        8,
    )


@pytest.mark.parametrize(
    ("a", "scale_a", "scale_b", "extra", "reason"),
    [
        (E4M3, (), (), {"out_dtype": torch.bfloat16, "scale_result": None, "bias": "bias"}, "bias is (8,)"),
        (E4M3, (), (), {"out_dtype": E4M3}, "returns torch.float8_e4m3fn"),
        (E4M3, (), (), {}, "its FP8 input dtype"),
        (torch.bfloat16, (), (), {"out_dtype": torch.bfloat16}, "multiplies torch.bfloat16"),
        (E4M3, (4, 1), (1, 1), {"out_dtype": torch.bfloat16}, "neither tensorwise"),
        (E4M3, (4, 1), (1, 8), {"out_dtype": torch.bfloat16, "scale_dtype": torch.float16}, "not torch.float32"),
        (E4M3, (4, 1), (8, 1), {"out_dtype": torch.bfloat16}, "neither tensorwise"),
    ],
)
def test_scaled_mm_left_alone_with_the_reason(a, scale_a, scale_b, extra, reason):
    """Each refusal of a ``_scaled_mm`` names what the coc FP8 ops do not compute (an FP8 output, other dtypes,
    scales other than tensorwise / rowwise, a bias in neither out_dtype nor fp32)."""
    from kernels.inductor.patterns import LeftAlone
    from kernels.inductor.scaled import as_scaled_matmul

    scale_dtype = extra.pop("scale_dtype", torch.float32)
    node = _graph_with_scaled_mm(a, scale_a, scale_b, scale_dtype, **extra)
    with pytest.raises(LeftAlone, match=re.escape(reason)):
        as_scaled_matmul(node)


def test_scale_result_left_alone():
    from kernels.inductor.patterns import LeftAlone
    from kernels.inductor.scaled import as_scaled_matmul

    node = _graph_with_scaled_mm(E4M3, (), (), out_dtype=E4M3)
    node.update_kwarg("scale_result", node.args[2])
    with pytest.raises(LeftAlone, match="sets scale_result"):
        as_scaled_matmul(node)


def test_product_upcast_joins_and_a_downcast_does_not():
    """``_scaled_mm(..., bf16).float()`` before a reduction is read as one fp32 FP8 matmul; a narrowing convert
    is not (the op would round to a dtype the graph does not)."""
    from kernels.inductor.patterns import LeftAlone
    from kernels.inductor.scaled import scaled_product

    mm_node = _graph_with_scaled_mm(E4M3, (), (), out_dtype=torch.float32)
    graph = mm_node.graph
    with graph.inserting_after(mm_node):
        down = graph.call_function(torch.ops.prims.convert_element_type.default, (mm_node, torch.bfloat16))
    with pytest.raises(LeftAlone, match="not wider"):
        scaled_product(down)
    up_node = _graph_with_scaled_mm(E4M3, (), (), out_dtype=torch.bfloat16)
    with up_node.graph.inserting_after(up_node):
        up = up_node.graph.call_function(torch.ops.prims.convert_element_type.default, (up_node, torch.float32))
    mm = scaled_product(up)
    assert (mm.node, mm.out_dtype, mm.upcast, mm.nodes) == (up, torch.float32, torch.bfloat16, [up, up_node])


def _post_scaled_graph(scale_b_shape: tuple) -> fx.Node:
    """``convert(_scaled_mm(a [4, 32], b [32, 8], 1, 1, bf16) * (sa [4, 1] * sb), fp32)`` with fake metadata."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    graph = fx.Graph()
    with FakeTensorMode():
        vals = {
            "a": torch.empty(4, 32, dtype=E4M3),
            "b": torch.empty(32, 8, dtype=E4M3),
            "sa": torch.empty(4, 1),
            "sb": torch.empty(scale_b_shape),
        }
        nodes = {}
        for name, val in vals.items():
            nodes[name] = graph.placeholder(name)
            nodes[name].meta["val"] = val

        def call(target, *args, **kwargs):
            node = graph.call_function(target, args, kwargs)
            fake = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
            node.meta["val"] = target(*fake[0], **fake[1])
            return node

        one = call(aten.full.default, [], 1, dtype=torch.float32)
        mm = call(aten._scaled_mm.default, nodes["a"], nodes["b"], one, one, None, None, torch.bfloat16)
        outer = call(aten.mul.Tensor, nodes["sa"], nodes["sb"])
        scaled = call(aten.mul.Tensor, mm, outer)
        return call(torch.ops.prims.convert_element_type.default, scaled, torch.float32)


def test_row_scales_after_a_unit_scaled_mm_read_as_one_rowwise_matmul():
    """torchao's rowwise product without fast accumulation is one rowwise FP8 matmul: scale_a [m, 1], scale_b
    [1, n], the result's dtype its out_dtype; scales that are not such an outer product are named."""
    from kernels.inductor.patterns import LeftAlone
    from kernels.inductor.scaled import scaled_product

    top = _post_scaled_graph((1, 8))
    mm = scaled_product(top)
    assert (mm.mode, mm.out_dtype, mm.upcast, mm.node) == ("row", torch.float32, torch.bfloat16, top)
    assert [n.name for n in (mm.scale_a, mm.scale_b)] == ["sa", "sb"]
    with pytest.raises(LeftAlone, match="not the outer product"):
        scaled_product(_post_scaled_graph((8,)))


def test_erase_takes_a_node_listed_twice_once():
    """A node named twice (one constant scale passed as both scales) is erased once, without torch's warning."""
    import warnings

    from kernels.inductor.rewrite import _erase

    graph = fx.Graph()
    x = graph.placeholder("x")
    dead = graph.call_function(torch.ops.aten.neg.default, (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _erase(graph, [dead, dead])
    assert [n.name for n in graph.nodes] == ["x"]


def test_cache_key_covers_the_pattern_modules(monkeypatch):
    """Inductor reuses a cached graph while the pass's uuid is unchanged: the modules that find the patterns
    (plain and FP8) are part of it, so a change there recompiles."""
    import torch._inductor.custom_graph_pass as custom_graph_pass

    from kernels.inductor import patterns as inductor_patterns
    from kernels.inductor import rewrite as inductor_pass
    from kernels.inductor import scaled as inductor_scaled

    hashed = []
    real = custom_graph_pass.get_hash_for_files
    monkeypatch.setattr(
        custom_graph_pass, "get_hash_for_files", lambda files, *a: hashed.extend(files) or real(files, *a)
    )
    inductor_pass.CocInductorPass().uuid()
    assert {inductor_pass.__file__, inductor_patterns.__file__, inductor_scaled.__file__} <= set(hashed)


@pytest.mark.parametrize("backend", list(BACKEND_ENVS))
@pytest.mark.parametrize(("mode", "gather"), [("tensor", "fp8"), ("row", "fp8"), ("tensor", "off"), ("row", "off")])
def test_fp8_rewrites_run_on_the_other_backends(mode, gather, backend):
    """The rewritten FP8 ops (all-gather and reduce-scatter with sequence parallelism, all-reduce without) on the
    backend the environment picks, within the same bound as on the sequential one."""
    want_matched, want_ops = CASES[(mode, gather, "")]
    for out in run_ranks(_fp8_block, 2, mode, gather, "", timeout=600, env=BACKEND_ENVS[backend]):
        assert out["compiled"]["hid"] <= 1 and out["compiled"]["y"] <= 1, out
        assert {p for _, p, ok, _ in out["report"] if ok} == want_matched, out["report"]
        assert set(out["calls"]) == {(op, backend) for op in want_ops}, out["calls"]
