"""The Inductor pass on weight-only int8 graphs: an int8 weight dequantized in the graph becomes the int8 coc ops.

The block is a column-parallel then a row-parallel linear whose weights are int8 with a scale
(``kernels.quantize_weight``: per_tensor, per_channel, per_group), dequantized in the forward as a user writes it
(``qweight.to(x.dtype) * scale[:, None]``, or ``(qweight.float() * scale).to(x.dtype)``, per group through
``[n, G, gs]``) and multiplied with ``F.linear``, in bf16. Compiled at world 2 (gloo) with the pass, without and
with sequence parallelism, the results are checked against the fp64 product of x and the dequantized weight
within the bound of ``kernels.testing.reference.tolerance``; the report must list the int8 rewrites and
``backend_calls`` must show that the int8 ops ran (and no other). Forms whose dequantization the int8 format does
not compute bit for bit stay with the plain op on the graph's dequantized weight, and the report says why.
"""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from kernels.testing import BACKEND_ENVS, run_ranks

BF16 = torch.bfloat16
GROUP = 8


class Int8Linear(torch.nn.Linear):
    """``F.linear(x, dequant(weight, scale))``: ``weight`` the int8 ``[n, k]`` values, ``scale`` their scale, both
    frozen parameters. ``form``: how the forward dequantizes (module docstring); "fp16" and "scalar32" are forms the
    int8 format does not compute bit for bit (a product in fp16 rounded again to bf16; an fp32 scale rounded to bf16
    by a bf16 multiply)."""

    def __init__(self, k: int, n: int, mode: str, form: str):
        super().__init__(k, n, bias=False)
        from kernels import quantize_weight

        dense = torch.randn(n, k)
        stored = BF16 if form == "xdtype" else torch.float32  # the scale's dtype: the weight's
        q, s = quantize_weight(dense.to(stored), mode, GROUP if mode == "per_group" else None)
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.scale = torch.nn.Parameter(s, requires_grad=False)
        self.mode, self.form = mode, form

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        q, s = self.weight, self.scale
        if self.mode == "per_group":
            n, k = q.shape
            s = s[..., None]
            q = q.reshape(n, -1, GROUP)
        elif self.mode == "per_channel":
            s = s[:, None]
        if self.form == "xdtype":
            w = q.to(dtype) * s
        elif self.form == "fp32":
            w = (q.float() * s).to(dtype)
        elif self.form == "fp16":
            w = (q.half() * s.half()).to(dtype)
        else:  # "scalar32": a 0-dim fp32 scale times a bf16 tensor multiplies in bf16
            w = q.to(dtype) * s
        return w.reshape(self.weight.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype))


class Block(torch.nn.Module):
    """int8 column -> GELU -> int8 row, and a bf16 bias after the row layer's reduction (it joins the op). Returns
    the output, the column output and the row layer's input (the reference multiplies what the graph did)."""

    def __init__(self, h: int, f: int, mode: str, form: str):
        super().__init__()
        self.col = Int8Linear(h, f, mode, form)
        self.row = Int8Linear(f, h, mode, form)
        self.post_bias = torch.nn.Parameter(torch.randn(h).to(BF16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hid = self.col(x)
        a = F.gelu(hid)
        return self.row(a) + self.post_bias, hid, a


def _styles(mode: str) -> tuple[type, type]:
    """torch's column / row styles for :class:`Int8Linear`: the int8 weight sharded as a linear's, its scale with
    it (per row: rows with the weight's rows; per group: groups with the weight's k; one value: replicated)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def partition(module: Int8Linear, mesh: object, weight_dim: int) -> None:
        scale_dim = {"per_tensor": None, "per_channel": 0 if weight_dim == 0 else None, "per_group": weight_dim}[mode]
        scale = Replicate() if scale_dim is None else Shard(scale_dim)
        for name, placement in (("weight", Shard(weight_dim)), ("scale", scale)):
            dist_t = distribute_tensor(getattr(module, name), mesh, [placement], src_data_rank=None)
            module.register_parameter(name, torch.nn.Parameter(dist_t, requires_grad=False))

    class Col(ColwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            partition(module, device_mesh, 0)

    class Row(RowwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            partition(module, device_mesh, 1)

    return Col, Row


def _int8_block(rank: int, world: int, mode: str, form: str, sp: bool) -> dict:
    """Compile the block with the pass (``sp``: the column layer gathers the sequence-sharded rows and the row
    layer reduce-scatters) and return the error ratios against the fp64 reference (at most 1 within the bound),
    the report, the backend runs and whether the module's dequantization equals the int8 format's bit for bit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from kernels.inductor import rewrite as inductor_pass
    from kernels.quant import dequantize
    from kernels.testing import backend_calls
    from kernels.testing.compile import graph_passes_backend
    from kernels.testing.reference import tolerance

    torch._dynamo.reset()
    torch.manual_seed(0)
    h, f = 32, 64
    block = Block(h, f, mode, form)
    single = copy.deepcopy(block)
    col, row = _styles(mode)
    if sp:
        plan = {"col": col(input_layouts=Shard(0)), "row": row(output_layouts=Shard(0))}
    else:
        plan = {"col": col(input_layouts=Replicate()), "row": row()}
    parallelize_module(block, init_device_mesh("cpu", (world,)), plan)
    x = torch.randn(4 * world, 3, h).to(BF16)
    inp = x.chunk(world, 0)[rank] if sp else x
    inductor_pass.clear_report()
    with torch.no_grad(), inductor_pass.use_inductor_pass(), backend_calls() as calls:
        y, hid, a = torch.compile(block, backend=graph_passes_backend)(inp)
    with torch.no_grad():
        eager = block(inp)

    def full(t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t, dtype=torch.float32) for _ in range(world)]
        dist.all_gather(parts, t.float().contiguous())
        return torch.cat(parts, dim)

    def product(xd: torch.Tensor, layer: Int8Linear, k: int, bias: torch.Tensor | None = None) -> tuple:
        wd = layer.dequantized(BF16).double()
        want, s = xd @ wd.T, xd.abs() @ wd.abs().T
        if bias is not None:
            want, s = want + bias.double(), s + bias.double().abs()
        return want, tolerance(BF16, k, world) * s

    def ratios(y: torch.Tensor, hid: torch.Tensor, a: torch.Tensor) -> dict:
        want_hid, bound_hid = product(x.double(), single.col, h)
        want_y, bound_y = product(full(a, -1).double(), single.row, f, single.post_bias.detach())
        y_full = full(y, 0) if sp else y.double()
        return {
            "dtypes": (str(y.dtype), str(hid.dtype)),
            "hid": float(((full(hid, -1).double() - want_hid).abs() / bound_hid).max()),
            "y": float(((y_full.double() - want_y).abs() / bound_y).max()),
        }

    same_bits = all(
        torch.equal(
            layer.dequantized(BF16),
            dequantize(layer.weight, layer.scale, GROUP if mode == "per_group" else None, None, BF16),
        )
        for layer in (single.col, single.row)
    )
    return {
        "compiled": ratios(y, hid, a),
        "eager": ratios(*eager),
        "report": [(r.graph, r.pattern, r.matched, r.detail) for r in inductor_pass.report()],
        "calls": dict(calls),
        "same_bits": same_bits,
    }


_SP = (
    {"all_gather_matmul", "matmul_reduce_scatter"},
    {"quantized_all_gather_matmul", "quantized_matmul_reduce_scatter"},
)
_NO_SP = ({"matmul_all_reduce"}, {"quantized_matmul_all_reduce"})
CASES = {
    # (mode, form, SP): the patterns rewritten, the ops that ran
    ("per_channel", "xdtype", False): _NO_SP,
    ("per_channel", "xdtype", True): _SP,
    ("per_channel", "fp32", False): _NO_SP,
    ("per_channel", "fp32", True): _SP,
    ("per_tensor", "xdtype", False): _NO_SP,
    ("per_tensor", "xdtype", True): _SP,
    ("per_tensor", "fp32", True): _SP,
    ("per_group", "xdtype", False): _NO_SP,
    ("per_group", "fp32", True): _SP,
}
# Forms the int8 format does not compute bit for bit: the plain ops on the graph's dequantized weight, and why.
# same_bits: the module's dequantization against the format's, on CPU. A bf16 tensor times a 0-dim fp32 scale equals
# the format's here (CPU kernels multiply by the fp32 value), but a kernel that casts its operands to the result
# dtype first (CUDA's TensorIterator) rounds the scale: what the graph computes depends on the kernel.
LEFT = {
    ("per_channel", "fp16", False): ({"matmul_all_reduce"}, "multiplies in float16", False),
    ("per_tensor", "scalar32", True): (
        {"all_gather_matmul", "matmul_reduce_scatter"},
        "by a float32 scale in bfloat16: whether the scale is rounded to bfloat16 first depends on the kernel",
        True,
    ),
}


def _ids(cases: dict) -> list[str]:
    return ["-".join((mode, form, "sp" if sp else "nosp")) for mode, form, sp in cases]


def _check_numbers(out: dict) -> None:
    for run in ("compiled", "eager"):
        assert out[run]["hid"] <= 1 and out[run]["y"] <= 1, (run, out)
        assert out[run]["dtypes"] == ("torch.bfloat16", "torch.bfloat16"), out


@pytest.mark.parametrize("case", list(CASES), ids=_ids(CASES))
def test_int8_weight_graphs_run_the_int8_coc_ops(case):
    mode, form, sp = case
    want_matched, want_ops = CASES[case]
    for out in run_ranks(_int8_block, 2, mode, form, sp, timeout=600):
        _check_numbers(out)
        assert out["same_bits"], "the matched form must dequantize as the int8 format does"
        matched = [(p, d) for _, p, ok, d in out["report"] if ok]
        assert {p for p, _ in matched} == want_matched, out["report"]
        assert all(f"int8-weight {mode}" in d for _, d in matched), out["report"]
        assert {op for op, _ in out["calls"]} == want_ops, out["calls"]
        if mode == "per_group":
            assert all(f"group_size {GROUP}" in d for _, d in matched), out["report"]
        assert any("added after the reduction" in d for p, d in matched if p != "all_gather_matmul"), out["report"]


@pytest.mark.parametrize("case", list(LEFT), ids=_ids(LEFT))
def test_int8_forms_the_format_does_not_compute_stay_plain(case):
    mode, form, sp = case
    want_matched, reason, same_bits = LEFT[case]
    for out in run_ranks(_int8_block, 2, mode, form, sp, timeout=600):
        _check_numbers(out)
        assert out["same_bits"] == same_bits
        matched = [(p, d) for _, p, ok, d in out["report"] if ok]
        assert {p for p, _ in matched} == want_matched, out["report"]
        assert all("int8 weight kept dequantized in the graph" in d and reason in d for _, d in matched), out["report"]
        assert {op for op, _ in out["calls"]} == want_matched, out["calls"]  # the plain ops, named as the patterns


# ---- the dequantization read on its own -----------------------------------------------------------------------


def _dequant_graph(build: object, q_shape: tuple, s_shape: tuple, s_dtype: torch.dtype, x_dtype: torch.dtype = BF16):
    """``b = permute(build(q, s))`` with fake metadata (``build(call, q, s)`` returns the dequantized [n, k] node),
    and the ``b`` node."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    graph = fx.Graph()
    with FakeTensorMode():
        nodes = {}
        for name, val in (("q", torch.empty(q_shape, dtype=torch.int8)), ("s", torch.empty(s_shape, dtype=s_dtype))):
            nodes[name] = graph.placeholder(name)
            nodes[name].meta["val"] = val

        def call(target, *args):
            node = graph.call_function(target, args)
            fake = fx.node.map_arg(args, lambda n: n.meta["val"])
            node.meta["val"] = target(*fake)
            return node

        w = build(call, nodes["q"], nodes["s"])
        assert w.meta["val"].dtype == x_dtype
        return call(aten.permute.default, w, [1, 0])


_A = torch.ops.aten
_CV = torch.ops.prims.convert_element_type.default


def _channel_xdtype(call, q, s):
    return call(_A.mul.Tensor, call(_CV, q, BF16), call(_A.unsqueeze.default, s, 1))


def _channel_fp32(call, q, s):
    return call(_CV, call(_A.mul.Tensor, call(_A.unsqueeze.default, s, 1), call(_CV, q, torch.float32)), BF16)


def _group_3d(call, q, s):
    grouped = call(
        _A.mul.Tensor, call(_CV, call(_A.reshape.default, q, [8, 4, 8]), BF16), call(_A.unsqueeze.default, s, 2)
    )
    return call(_A.reshape.default, grouped, [8, 32])


def _group_2d(call, q, s):
    grouped = call(
        _A.mul.Tensor,
        call(_CV, call(_A.reshape.default, q, [32, 8]), torch.float32),
        call(_A.reshape.default, s, [32, 1]),
    )
    return call(_CV, call(_A.reshape.default, grouped, [8, 32]), BF16)


def _tensor_int8_times_bf16(call, q, s):
    return call(_A.mul.Tensor, q, s)


@pytest.mark.parametrize(
    ("build", "s_shape", "s_dtype", "mode", "group_size", "how"),
    [
        (_channel_xdtype, (8,), BF16, "per_channel", 0, "in bfloat16, exact in float32 and rounded once"),
        (_channel_fp32, (8,), torch.float32, "per_channel", 0, "in float32, rounded to bfloat16"),
        (_group_3d, (8, 4), BF16, "per_group", 8, "in bfloat16"),
        (_group_2d, (8, 4), torch.float16, "per_group", 8, "in float32, rounded to bfloat16"),
        (_tensor_int8_times_bf16, (), BF16, "per_tensor", 0, "in bfloat16"),
    ],
)
def test_dequantizations_read_as_the_int8_format(build, s_shape, s_dtype, mode, group_size, how):
    from kernels.inductor.int8 import int8_weight

    b = _dequant_graph(build, (8, 32), s_shape, s_dtype)
    w = int8_weight(b, BF16)
    assert (w.mode, w.group_size, w.n, w.k, w.qweight.name, w.scale.name) == (mode, group_size, 8, 32, "q", "s")
    assert how in w.how
    # The same graph with a bf16 weight in place of the int8 one is not read (no int8 feeds it).
    plain = _dequant_graph(lambda call, q, s: call(_A.mul.Tensor, s, 2.0), (8, 32), (8, 32), BF16)
    assert int8_weight(plain, BF16) is None


def _fp64(call, q, s):
    return call(_CV, call(_A.mul.Tensor, call(_CV, q, torch.float64), call(_A.unsqueeze.default, s, 1)), BF16)


def _along_k(call, q, s):
    return call(_A.mul.Tensor, call(_CV, q, BF16), s)


def _offset(call, q, s):
    shifted = call(_A.sub.Tensor, call(_CV, q, BF16), call(_A.unsqueeze.default, s, 1))
    return call(_A.mul.Tensor, shifted, call(_A.unsqueeze.default, s, 1))


def _constant(call, q, s):
    return call(_A.mul.Tensor, call(_CV, q, BF16), 0.5)


def _bf16_then_fp16(call, q, s):
    narrow = call(_A.mul.Tensor, call(_CV, q, BF16), call(_A.unsqueeze.default, s, 1))
    return call(_CV, call(_CV, narrow, torch.float16), BF16)


@pytest.mark.parametrize(
    ("build", "s_shape", "s_dtype", "reason"),
    [
        (_fp64, (8,), torch.float64, "multiplies in float64"),
        (_along_k, (32,), BF16, "a scale along k is not one of them"),
        (_offset, (8,), BF16, "zero points"),
        (_constant, (8,), BF16, "by a constant, not a scale tensor"),
        (_bf16_then_fp16, (8,), BF16, "converted through float16, bfloat16"),
    ],
)
def test_dequantizations_left_to_the_plain_op_with_the_reason(build, s_shape, s_dtype, reason):
    from kernels.inductor.int8 import int8_weight
    from kernels.inductor.patterns import LeftAlone

    b = _dequant_graph(build, (8, 32), s_shape, s_dtype)
    with pytest.raises(LeftAlone, match=re.escape(reason)):
        int8_weight(b, BF16)


@pytest.mark.parametrize("backend", list(BACKEND_ENVS))
@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
@pytest.mark.parametrize("mode", ["per_tensor", "per_channel", "per_group"])
def test_int8_rewrites_run_on_the_other_backends(mode, sp, backend):
    """The rewritten int8 ops (all-reduce without SP, all-gather and reduce-scatter with it) on the backend the
    environment picks, within the same bound as on the sequential one."""
    want_matched, want_ops = _SP if sp else _NO_SP
    for out in run_ranks(_int8_block, 2, mode, "xdtype", sp, timeout=600, env=BACKEND_ENVS[backend]):
        _check_numbers(out)
        assert {p for _, p, ok, _ in out["report"] if ok} == want_matched, out["report"]
        assert set(out["calls"]) == {(op, backend) for op in want_ops}, out["calls"]


def _trained_block(rank: int, world: int, sp: bool) -> dict:
    """One forward and backward of the per-channel block compiled with the pass, and the same without it: outputs,
    input gradients, the report and the backend runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from kernels.inductor import rewrite as inductor_pass
    from kernels.testing import backend_calls
    from kernels.testing.compile import graph_passes_backend

    torch.manual_seed(0)
    block = Block(32, 64, "per_channel", "xdtype")
    col, row = _styles("per_channel")
    if sp:
        plan = {"col": col(input_layouts=Shard(0)), "row": row(output_layouts=Shard(0))}
    else:
        plan = {"col": col(input_layouts=Replicate()), "row": row()}
    parallelize_module(block, init_device_mesh("cpu", (world,)), plan)
    x = torch.randn(4 * world, 3, 32).to(BF16)
    inp = x.chunk(world, 0)[rank] if sp else x
    runs = {}
    for with_pass in (True, False):
        torch._dynamo.reset()
        xi = inp.clone().requires_grad_()
        inductor_pass.clear_report()
        with contextlib.ExitStack() as stack:
            if with_pass:
                stack.enter_context(inductor_pass.use_inductor_pass())
            calls = stack.enter_context(backend_calls())
            y = torch.compile(block, backend=graph_passes_backend)(xi)[0]
            y.float().sum().backward()
        runs[with_pass] = (y.detach(), xi.grad)
        if with_pass:
            report = [(r.graph, r.pattern, r.matched, r.detail) for r in inductor_pass.report()]
            ran = dict(calls)
    return {
        "report": report,
        "calls": ran,
        "same": [torch.equal(a, b) for a, b in zip(runs[True], runs[False], strict=True)],
    }


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_training_graphs_int8_forward_plain_backward(sp):
    """With a gradient the forward graph keeps the dequantized weight for the backward (its input gradient multiplies
    by it), so the forward's matmuls become the int8 ops and the backward's, reading the saved bf16 weight, the plain
    ones. The sequential int8 op multiplies the same bf16 weight bits by the same matmul as the graph, so output and
    input gradient equal the compile without the pass bit for bit."""
    want = {
        False: ({("forward", "matmul_all_reduce"), ("backward", "matmul_all_reduce")}, {"quantized_matmul_all_reduce"}),
        True: (
            {(g, p) for g in ("forward", "backward") for p in ("all_gather_matmul", "matmul_reduce_scatter")},
            {"quantized_all_gather_matmul", "quantized_matmul_reduce_scatter"},
        ),
    }[sp]
    for out in run_ranks(_trained_block, 2, sp, timeout=600):
        assert out["same"] == [True, True], out
        assert {(g, p) for g, p, ok, _ in out["report"] if ok} == want[0], out["report"]
        assert all(("int8-weight" in d) == (g == "forward") for g, _, ok, d in out["report"] if ok), out["report"]
        int8_ops = {op for op, _ in out["calls"] if op.startswith("quantized_")}
        assert int8_ops == want[1], out["calls"]


def test_cache_key_covers_the_int8_module(monkeypatch):
    """A change to the int8 pattern module compiles anew: it is part of the pass's Inductor cache key."""
    import torch._inductor.custom_graph_pass as custom_graph_pass

    from kernels.inductor import int8 as inductor_int8
    from kernels.inductor import rewrite as inductor_pass

    hashed = []
    real = custom_graph_pass.get_hash_for_files
    monkeypatch.setattr(
        custom_graph_pass, "get_hash_for_files", lambda files, *a: hashed.extend(files) or real(files, *a)
    )
    inductor_pass.CocInductorPass().uuid()
    assert inductor_int8.__file__ in hashed
