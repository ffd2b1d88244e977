"""All-reduce + residual + RMSNorm (+ FP8 quantization) (kernels/ops/all_reduce_rmsnorm.py) on every backend and
fused algorithm, worlds 1-4 (fused: 1-3), against an fp64 reference, with the bit-level promises of its docstring.

Bounds (u: the unit roundoff of x's dtype, 2^-8 bf16, 2^-11 fp16, 2^-24 fp32; fp32 accumulation):

- ``residual_out`` is ``h`` rounded once: ``|r - h64| <= u |h64| + W 2^-24 S`` (S: the sum of the magnitudes of
  the W terms and the residual, the fp32 sum's error);
- ``out``: ``rstd`` carries the fp32 mean of n squares (``n 2^-24`` relative) and ``h``'s error, then two
  roundings (the normalized value, its product with the weight): ``|y - y64| <= (2u + (n + 4W) 2^-24) |y64|``
  plus ``h``'s absolute error scaled as ``h`` is, ``2 rstd |weight| W 2^-24 S`` (it dominates where h cancels);
- FP8 ``out`` dequantized: e4m3 keeps 3 mantissa bits (relative error 2^-4) and its smallest subnormal step is
  2^-9 of a scale: ``|q * s - y64| <= 2^-4 |y64| + 2^-9 s`` (plus the ``out`` bound of the fp32 value).
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

import kernels
from kernels.fp8.quantize import expand_scale
from kernels.testing import run_ranks

# (dtype, u): u the unit roundoff of the dtype.
DTYPES = {"float32": (torch.float32, 2.0**-24), "bfloat16": (torch.bfloat16, 2.0**-8)}
SHAPES = ((5, 40), (9, 136), (0, 24))  # odd row counts, a second 128-column quant block, no rows


def _inputs(rank: int, world: int, dtype: torch.dtype, shape: tuple[int, int]) -> tuple[Any, ...]:
    """Every rank's x (seeded by rank) and the replicated residual and weight."""
    g = torch.Generator().manual_seed(1000 + 17 * shape[0] + shape[1])
    xs = [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]
    residual = torch.randn(shape, generator=g).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[1], generator=g)).to(dtype)
    return xs, residual, weight


def _ranks_body(rank: int, world: int, runs: list[tuple[str, str, str, str | None, tuple[int, int]]]) -> list:
    out = []
    for backend, algorithm, dtype_name, quant, shape in runs:
        xs, residual, weight = _inputs(rank, world, DTYPES[dtype_name][0], shape)
        x = xs[rank].view(1, *shape)  # leading dims are kept
        res = kernels.all_reduce_rmsnorm(
            x, residual.view(1, *shape), weight, 1e-5, quant=quant, algorithm=algorithm, backend=backend
        )
        assert res.out.shape == x.shape and res.residual.shape == x.shape, (res.out.shape, x.shape)
        assert res.residual.dtype == x.dtype
        out.append((res.out.view(shape), res.residual.view(shape), res.scale))
    return out


def _check(world: int, run: tuple, got: tuple) -> None:
    backend, algorithm, dtype_name, quant, shape = run
    dtype, u = DTYPES[dtype_name]
    xs, residual, weight = _inputs(0, world, dtype, shape)
    terms = [t.double() for t in xs] + [residual.double()]
    h64 = sum(terms)
    magnitude = sum(t.abs() for t in terms)
    rstd64 = torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5)
    y64 = h64 * rstd64 * weight.double()
    out, residual_out, scale = got
    n = shape[1]
    tag = f"{run} W={world}"
    bound_h = u * h64.abs() + world * 2.0**-24 * magnitude
    assert ((residual_out.double() - h64).abs() <= bound_h).all(), tag
    rel = 2 * u + (n + 4 * world) * 2.0**-24
    # h's own error (the fp32 sum's) passes through the scaling by rstd * weight, also where h cancels to ~0.
    bound_y = rel * y64.abs() + 2 * rstd64 * weight.double().abs() * world * 2.0**-24 * magnitude
    if quant is None:
        assert out.dtype == dtype, tag
        assert ((out.double() - y64).abs() <= bound_y).all(), (tag, (out.double() - y64).abs().max())
        return
    assert out.dtype == torch.float8_e4m3fn and scale is not None, tag
    s = expand_scale(scale.reshape(shape[0], scale.shape[-1]) if scale.dim() else scale, quant, *shape).double()
    deq = out.double() * s
    bound_q = 2.0**-4 * y64.abs() + 2.0**-9 * s + bound_y
    assert ((deq.double() - y64).abs() <= bound_q).all(), (tag, (deq.double() - y64).abs().max())


def _grid(backends: tuple[str, ...], algorithms: tuple[str, ...], quants: tuple) -> list:
    return [
        (b, a, d, q, s)
        for b in backends
        for a in algorithms
        for d in DTYPES
        for q in quants
        for s in SHAPES
        if not (q is not None and s[0] == 0 and q == "tensor")
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_scripted_backends_match_fp64_and_each_other(world: int) -> None:
    runs = _grid(("sequential", "chunked"), ("auto",), (None, "row", "block", "tensor"))
    per_rank = run_ranks(_ranks_body, world, runs, timeout=600)
    for rank_out in per_rank:
        for run, got in zip(runs, rank_out, strict=True):
            _check(world, run, got)
    _same_bits(per_rank, runs, key=lambda run: run[2:])


@pytest.mark.triton
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fused_algorithms_match_fp64_and_each_other_bitwise(world: int) -> None:
    """one-shot, two-shot, unfused and auto: the same bits on every rank and run; ``residual_out`` also the
    reference's bits (the sum and the residual add are the same fp32 operations in the same order).

    At these sizes ``auto`` is one-shot under the default gates (asserted below; the gates' other choices are
    test_size_switch_follows_the_planted_tuned_gates'), so the auto run is a second one-shot call, after the
    two-shot and unfused ones on the same heap: the run-to-run bits. The norm (and its quantization) is one kernel
    on ``h`` whatever the exchange (kernels/fused/all_reduce_norm.py), so the row and tensor quantizations run
    on the two fused exchanges only, and worlds 3 and 4, whose only new path is the exchange among more ranks
    (W = 3: rows that do not split evenly), run the two fused exchanges against the sequential reference."""
    from kernels.ops.all_reduce_rmsnorm import choose_algorithm

    if world > 1:
        largest = torch.empty(max(SHAPES, key=lambda s: s[0] * s[1]), dtype=torch.float32)
        assert choose_algorithm("auto", largest, world) == "one_shot", world
    algorithms = ("one_shot", "two_shot", "unfused", "auto")
    runs = _grid(("fused",), algorithms if world <= 2 else ("one_shot", "two_shot"), (None, "block"))
    runs += _grid(("sequential",), ("auto",), (None, "block"))
    if world == 2:
        # The other two quantizations: row inside the norm kernel, tensor after it.
        runs += [("fused", a, "float32", q, (9, 136)) for a in ("one_shot", "two_shot") for q in ("row", "tensor")]
    if world >= 3:
        # Three or four interpreted ranks cost most: W = 3 (rows that do not split evenly) runs bf16 unquantized,
        # W = 4 bf16 with the in-kernel block quantization.
        quant = None if world == 3 else "block"
        runs = [run for run in runs if run[2] == "bfloat16" and run[3] == quant]
    per_rank = run_ranks(_ranks_body, world, runs, timeout=900)
    for rank_out in per_rank:
        for run, got in zip(runs, rank_out, strict=True):
            _check(world, run, got)
    fused_only = [(i, run) for i, run in enumerate(runs) if run[0] == "fused"]
    _same_bits([[outs[i] for i, _ in fused_only] for outs in per_rank], [run for _, run in fused_only], lambda r: r[2:])
    # residual_out: fused and reference alike.
    for outs in per_rank:
        first: dict[tuple, torch.Tensor] = {}
        for run, got in zip(runs, outs, strict=True):
            key = run[2:]
            assert torch.equal(first.setdefault(key, got[1]), got[1]), run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_a_resolved_signature_runs_its_bound_runner_with_the_operators_bits(dtype: torch.dtype) -> None:
    """The sequential backend's signature binds its runner once (``SPEC.bind``) and the next eager calls run it:
    the outputs of each quantization and shape (1-D, 2-D, 3-D, no rows) have the bits, shapes and dtypes of the
    same call through the registered operator."""
    from kernels.ops import all_reduce_rmsnorm as op
    from kernels.protocol.spec import forget_signatures
    from kernels.testing import operator_calls

    runs: list[int] = []

    def counting(call: Any, ops: Any) -> Any:
        runner = bind(call, ops)
        assert runner is not None

        def run(ops: Any) -> Any:
            runs.append(1)
            return runner(ops)

        return run

    bind = op.SPEC.bind
    assert bind is not None
    g = torch.Generator().manual_seed(7)
    forget_signatures()
    object.__setattr__(op.SPEC, "bind", counting)
    try:
        for quant in (None, "tensor", "row", "block"):
            for shape in ((5, 40), (2, 3, 136), (40,), (0, 24)):
                if quant == "tensor" and 0 in shape:
                    continue
                x, r = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
                w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)

                def call(x: torch.Tensor = x, r: torch.Tensor = r, w: torch.Tensor = w, quant: Any = quant) -> Any:
                    return kernels.all_reduce_rmsnorm(x, r, w, 1e-5, quant=quant, backend="sequential")

                before = len(runs)
                call()  # resolves the signature
                eager = call()
                assert len(runs) == before + 1, (quant, shape)
                with operator_calls() as recorded:
                    traced = call()
                assert [o for o, _ in recorded] == [op.SPEC.operator], (quant, shape)
                for a, b in zip(eager, traced, strict=True):
                    assert (a is None) == (b is None), (quant, shape)
                    if a is not None:
                        assert (a.shape, a.dtype) == (b.shape, b.dtype), (quant, shape)
                        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    finally:
        object.__setattr__(op.SPEC, "bind", bind)
        forget_signatures()


def _same_bits(per_rank: list, runs: list, key: Any) -> None:
    """Every output of runs with the same ``key`` has the same bits, on every rank."""
    first: dict[tuple, tuple] = {}
    for outs in per_rank:
        for run, got in zip(runs, outs, strict=True):
            seen = first.setdefault(key(run), got)
            for a, b in zip(seen, got, strict=True):
                assert (a is None) == (b is None), run
                if a is not None:
                    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), run


def _bad_calls() -> list[tuple[str, dict[str, Any], str]]:
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    return [
        (
            "residual shape",
            dict(x=x, residual=r[:2], weight=w),
            r"residual must be \[3, 8\] torch.float32 .*got \[2, 8\]",
        ),
        ("residual dtype", dict(x=x, residual=r.double(), weight=w), r"residual must be .*got \[3, 8\] torch.float64"),
        ("weight shape", dict(x=x, residual=r, weight=w[:4]), r"weight must be a floating \[n\] = \[8\]"),
        ("eps nan", dict(x=x, residual=r, weight=w, eps=math.nan), "eps must be a finite number"),
        ("eps inf", dict(x=x, residual=r, weight=w, eps=math.inf), "eps must be a finite number"),
        ("quant", dict(x=x, residual=r, weight=w, quant="block2d"), "quant='block2d' is not one of"),
        ("algorithm", dict(x=x, residual=r, weight=w, algorithm="ring"), "algorithm='ring' is not one of"),
        ("x dtype", dict(x=x.int(), residual=r.int(), weight=w), "x must be"),
    ]


@pytest.mark.parametrize(("name", "kwargs", "match"), _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_arguments_are_named(name: str, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kernels.all_reduce_rmsnorm(**kwargs)


def _one_rank_bad(rank: int, world: int) -> str:
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    try:
        kernels.all_reduce_rmsnorm(x, r, w, math.nan if rank == 1 else 1e-6)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "no error"


def _algorithms_differ(rank: int, world: int) -> str:
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    try:
        kernels.all_reduce_rmsnorm(x, r, w, algorithm="one_shot" if rank == 0 else "two_shot")
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "no error"


def test_one_ranks_bad_eps_and_differing_algorithms_raise_on_every_rank() -> None:
    for message in run_ranks(_one_rank_bad, 2, timeout=300):
        assert "eps must be a finite number" in message, message
    for message in run_ranks(_algorithms_differ, 2, timeout=300):
        assert "algorithm" in message and "one_shot" in message and "two_shot" in message, message


def _gates_file(directory: str, one_shot: int, fused: int) -> None:
    gates = f"all_reduce_gates:\n  - {{world: 2, one_shot_max_bytes: {one_shot}, fused_max_bytes: {fused}}}\n"
    with open(os.path.join(directory, "cpu.yaml"), "w") as f:
        f.write("version: 1\nentries: []\n" + gates)


def _switch_body(rank: int, world: int, directory: str) -> list[str]:
    """The path each size takes under the planted gates (100 and 1000 bytes of x)."""
    from kernels.fused import all_reduce_norm
    from kernels.ops import all_reduce_rmsnorm as op

    os.environ["COC_TUNED_DIR"] = directory
    ran: list[str] = []
    real_rows, real_reference = all_reduce_norm.reduced_rows, op.reference
    all_reduce_norm.reduced_rows = lambda *a, **k: ran.append(k["algorithm"]) or real_rows(*a, **k)
    op.reference = lambda *a, **k: ran.append("unfused") or real_reference(*a, **k)
    try:
        for rows in (2, 5, 40):  # x of 2 x 8, 5 x 8, 40 x 8 fp32: 64, 160 and 1280 bytes
            x, r, w = torch.randn(rows, 8), torch.randn(rows, 8), torch.randn(8)
            kernels.all_reduce_rmsnorm(x, r, w, backend="fused")
    finally:
        all_reduce_norm.reduced_rows, op.reference = real_rows, real_reference
        del os.environ["COC_TUNED_DIR"]
    return ran


@pytest.mark.triton
def test_size_switch_follows_the_planted_tuned_gates(tmp_path: Any) -> None:
    _gates_file(str(tmp_path), 100, 1000)
    for ran in run_ranks(_switch_body, 2, str(tmp_path), timeout=600):
        assert ran == ["one_shot", "two_shot", "unfused"], ran


def _differing_gates_body(rank: int, world: int, directories: list[str]) -> str:
    import torch.distributed as dist

    os.environ["COC_TUNED_DIR"] = directories[rank]
    # A group of its own: a failed fused call retires its group (kernels.fused.runtime), not the pool's.
    group = dist.new_group(list(range(world)))
    try:
        x, r, w = torch.randn(5, 8), torch.randn(5, 8), torch.randn(8)
        kernels.all_reduce_rmsnorm(x, r, w, group=group, backend="fused")
    except RuntimeError as e:
        return str(e)
    finally:
        del os.environ["COC_TUNED_DIR"]
    return "no error"


def test_ranks_whose_tuned_gates_differ_are_refused_naming_the_algorithm(tmp_path: Any) -> None:
    """Each rank reads its own tuned file: a one-shot rank beside an unfused one would wait forever."""
    directories = [str(tmp_path / "a"), str(tmp_path / "b")]
    for d, gates in zip(directories, ((1000, 2000), (0, 0)), strict=True):
        os.makedirs(d)
        _gates_file(d, *gates)
    for message in run_ranks(_differing_gates_body, 2, directories, timeout=300):
        assert "algorithm" in message and "one_shot" in message and "unfused" in message, message


def test_bad_gates_are_named(tmp_path: Any) -> None:
    from kernels.fused import tuned

    _gates_file(str(tmp_path), 2000, 1000)
    with pytest.raises(ValueError, match="one_shot_max_bytes 2000 exceeds fused_max_bytes 1000"):
        tuned.load(tmp_path / "cpu.yaml")


def _replay_body(rank: int, world: int, algorithm: str, device: str, quant: str | None = None) -> int:
    """Warm up, capture one fused call, then replays on new x / residual copied into the captured ones (the heap
    scrambled before each), each equal bit for bit to an eager fused call on the same inputs (which the tests
    above hold to the fp64 reference). Returns the replays checked."""
    import torch.distributed as dist

    from kernels.testing import scramble
    from tests.kernels.fused import cases as fused_cases
    from tests.kernels.fused.graph_replay import new_graph

    dev = fused_cases.gpu_device() if device == "cuda" else torch.device(device)
    group = dist.new_group(list(range(world)))

    def call(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> kernels.NormOutputs:
        return kernels.all_reduce_rmsnorm(x, r, w, 1e-5, quant=quant, algorithm=algorithm, group=group, backend="fused")

    xs, residual, weight = _inputs(rank, world, torch.float32, (5, 40))
    static_x, static_r, weight = xs[rank].to(dev), residual.to(dev), weight.to(dev)
    call(static_x, static_r, weight)  # the group's heap and the call check, outside capture
    graph = new_graph(dev)
    with graph.capture():
        captured = call(static_x, static_r, weight)
    checks = 0
    for rows in (7, 9):  # _inputs seeds by the shape: other values, cut to the captured 5 rows
        new_xs, new_residual, _ = _inputs(rank, world, torch.float32, (rows, 40))
        static_x.copy_(new_xs[rank][:5].to(dev))
        static_r.copy_(new_residual[:5].to(dev))
        assert scramble(group, dev) > 0, "no heap to scramble"
        graph.replay()
        replayed = [t.clone() for t in captured if t is not None]  # scale: None without quant
        assert scramble(group, dev) > 0, "no heap to scramble"
        eager = call(static_x.clone(), static_r.clone(), weight)
        names = ("out", "residual", "scale")[: len(replayed)]
        for name, a, b in zip(names, replayed, [t for t in eager if t is not None], strict=True):
            same = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            assert same, f"{algorithm} quant={quant} replay (rows seed {rows}) rank {rank}: {name} differs"
        checks += 1
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    kernels.check_errors(group)
    return checks


@pytest.mark.triton
@pytest.mark.parametrize(("algorithm", "quant"), [("one_shot", None), ("two_shot", "block"), ("one_shot", "row")])
def test_captured_fused_call_replays_like_eager(algorithm: str, quant: str | None) -> None:
    """CUDA-graph semantics on CPU (tests/kernels/fused/graph_replay.py): the launches recorded at capture and
    rerun; a launch carrying a per-call host value would wait for stale flags or read stale rows. The row and
    block quantizations run inside the norm kernel, so a replay rewrites the payload and its scales too."""
    assert run_ranks(_replay_body, 2, algorithm, "cpu", quant, timeout=600) == [2, 2]


@pytest.mark.gpu
def test_captured_fused_call_replays_on_gpu() -> None:
    """The same body in a real CUDA graph: world 2 over NCCL with two GPUs, else world 1 (norm kernel only)."""
    world = min(torch.cuda.device_count(), 2)
    if world < 1:
        pytest.skip("needs a CUDA GPU")
    backend = "nccl" if world > 1 else "gloo"
    assert (
        run_ranks(_replay_body, world, "one_shot", "cuda", device="cuda", backend=backend, timeout=600) == [2] * world
    )
