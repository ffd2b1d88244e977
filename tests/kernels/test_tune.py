"""customized_coc overrides through the ops, and COC_PARALLEL_NUM=auto (agreement, caches, reuse).

Spies wrap the op implementations of the table (``kernels.ops.table.OPS``) inside the ranks (each call looks its
implementation up there), so a test sees which path and split count an op really ran with.
"""

import json
import logging
import os

import pytest
import torch
import torch.distributed as dist

import kernels
from kernels import tune
from kernels.config import build_config
from kernels.ops.all_reduce import SPEC as ALL_REDUCE
from kernels.ops.gemm import PUBLIC_NAMES, GemmCall
from kernels.ops.table import OPS
from kernels.protocol import decide, requested
from kernels.testing import assert_close, reference, run_ranks


class _Spy:
    """Records ``(op, backend, parallel_num)`` of every dense op run the backend choice made (implementations are
    looked up per call in ``kernels.ops.table.OPS``); the op named by its plain form."""

    def __init__(self):
        self.calls = []
        self._saved = {}

    def __enter__(self):
        for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
            table = OPS[name].impl
            self._saved[name] = dict(table)
            for backend, fn in list(table.items()):

                def spy(call, ops, _fn=fn):
                    self.calls.append((PUBLIC_NAMES[(call.pattern, "plain")], call.backend, call.parallel_num))
                    return _fn(call, ops)

                table[backend] = spy
        return self

    def __exit__(self, *exc):
        for name, table in self._saved.items():
            OPS[name].impl.update(table)


def _call(group):
    world = dist.get_world_size(group)
    return GemmCall(op="matmul_all_reduce", pattern="all_reduce", group_name=group.group_name, world=world)


def _resolve(x, w, world):
    call = GemmCall(op="matmul_all_reduce", pattern="all_reduce", group_name=dist.group.WORLD.group_name, world=world)
    shape = (x.shape[0], x.shape[1], w.shape[0])
    resolved = decide(ALL_REDUCE, requested(call, shape), x.device, (shape, (x.dtype, w.dtype)))
    return resolved.backend, resolved.parallel_num


def _write_yaml(path, text):
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def _customized(rank, world):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(7, 12, generator=g) for _ in range(world)]
    ws = [torch.randn(10, 12, generator=g) for _ in range(world)]
    ref = reference("ar", xs, ws, None, rank)
    out = {}
    # [7, 12, 10] is customized to 4 (key written with odd spacing in the YAML).
    out["resolve_hit"] = _resolve(xs[rank], ws[rank], world)
    # [6, 12, 10] is customized to 1: no chunking although COC_PARALLEL_NUM=2.
    out["resolve_one"] = _resolve(xs[rank][:6], ws[rank], world)
    out["resolve_miss"] = _resolve(xs[rank][:5], ws[rank], world)
    with _Spy() as spy:
        y = kernels.matmul_all_reduce(xs[rank], ws[rank])
        kernels.matmul_all_reduce(xs[rank][:6], ws[rank])
        # An explicit parallel_num wins over customized_coc.
        kernels.matmul_all_reduce(xs[rank], ws[rank], parallel_num=8)
        q, s = kernels.quantize_weight(ws[rank])
        kernels.quantized_matmul_all_reduce(xs[rank], q, s)
        # The linears pass parallel_num=None, so the table reaches them too: a row-parallel
        # forward of [s=7, b=1, 12 per rank] -> 10 is the matmul_all_reduce of shape [7, 12, 10].
        import autopar

        row = autopar.RowParallelLinear(
            12 * world,
            10,
            config=autopar.ParallelConfig(use_cpu_initialization=True),
            init_method=torch.nn.init.normal_,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=torch.distributed.group.WORLD,
        )
        with torch.no_grad():
            row(xs[rank][:, None, :])
    assert_close("customized matmul_all_reduce", y, ref, torch.float32)
    out["calls"] = spy.calls
    return out


def test_customized_coc_applies_through_ops(tmp_path):
    cfg = _write_yaml(tmp_path / "coc.yaml", 'customized_coc: {"[ 7,12,10 ]": 4, "[6, 12, 10]": 1}\n')
    res = run_ranks(_customized, 2, env={"COC_CONFIG": cfg, "COC_PARALLEL_NUM": "2"})
    for r in res:
        assert r["resolve_hit"] == ("chunked", 4)
        assert r["resolve_one"] == ("sequential", 1)
        assert r["resolve_miss"] == ("chunked", 2)
        assert r["calls"] == [
            ("matmul_all_reduce", "chunked", 4),
            ("matmul_all_reduce", "sequential", 1),
            ("matmul_all_reduce", "chunked", 8),
            ("matmul_all_reduce", "chunked", 4),
            ("matmul_all_reduce", "chunked", 4),
        ]


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _auto(rank, world, cache_path):
    tune.clear_memory_cache()
    handler = _ListHandler()
    tune.log.addHandler(handler)
    tune.log.setLevel(logging.INFO)
    measured = []
    real_measure = tune._measure

    def counting_measure(call, *args):
        measured.append(call.op)
        return real_measure(call, *args)

    tune._measure = counting_measure
    try:
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(16, 12, generator=g) for _ in range(world)]
        ws = [torch.randn(10, 12, generator=g) for _ in range(world)]
        ref = reference("ar", xs, ws, None, rank)
        results = []
        with _Spy() as spy:
            for _ in range(3):
                results.append(kernels.matmul_all_reduce(xs[rank], ws[rank]))
        for i, y in enumerate(results):
            assert_close(f"auto call {i}", y, ref, torch.float32)
        key = tune.tuning_key(
            "matmul_all_reduce", (16, 12, 10), torch.float32, world, device_type="cpu", allow_fused=True
        )
        first = tune._memory[tune.memory_key(key, None, world)]
        in_file = tune.read_cache_file(cache_path).get(key)
        # A fresh process (memory cleared) reads the file back instead of tuning again.
        tune.clear_memory_cache()
        with _Spy() as spy_reload:
            kernels.matmul_all_reduce(xs[rank], ws[rank])
        reloaded = tune._memory[tune.memory_key(key, None, world)]
        return dict(
            first=first,
            in_file=in_file,
            reloaded=reloaded,
            measured=measured,
            calls=spy.calls,
            reload_calls=spy_reload.calls,
            logs=handler.messages,
        )
    finally:
        tune._measure = real_measure
        tune.log.removeHandler(handler)
        tune.clear_memory_cache()


@pytest.mark.parametrize("world", [2, 3])
def test_auto_agrees_caches_and_is_reused(tmp_path, world):
    cache = str(tmp_path / "tune.json")
    res = run_ranks(_auto, world, cache, env={"COC_PARALLEL_NUM": "auto", "COC_TUNE_CACHE": cache})
    choice = res[0]["first"]
    assert choice in (1, 2, 4, 8, "fused")
    for r in res:
        assert r["first"] == choice  # every rank agreed
        assert r["in_file"] == choice and r["reloaded"] == choice
        assert r["measured"] == ["matmul_all_reduce"]  # tuned once, never again
        # Tuning's own timing runs bypass the spies' counting only if they ran before; the three
        # user calls after tuning all ran the chosen path.
        expected = "fused" if choice == "fused" else "chunked" if choice > 1 else "sequential"
        user_calls = r["calls"][-3:] if expected != "fused" else []
        for op, path, num in user_calls:
            assert (op, path) == ("matmul_all_reduce", expected) and (expected != "chunked" or num == choice)
    assert len(res[0]["logs"]) == 2 and "tuned" in res[0]["logs"][0] and "from" in res[0]["logs"][1]
    assert all(r["logs"] == [] for r in res[1:])  # logged once, by group rank 0
    with open(cache) as f:
        data = json.load(f)
    assert data["version"] == 1 and list(data["entries"].values()) == [choice]


def _honour_cache(rank, world, cache_dir):
    """Rank 0's cache file wins: ranks whose files disagree still run rank 0's choice."""
    tune.clear_memory_cache()
    key = tune.tuning_key("matmul_all_reduce", (9, 12, 10), torch.float32, world, device_type="cpu", allow_fused=False)
    path = os.path.join(cache_dir, f"rank{rank}.json")
    tune.write_cache_entry(path, key, 2 if rank == 0 else 8)
    os.environ["COC_TUNE_CACHE"] = path
    try:
        x = torch.randn(9, 12)
        w = torch.randn(10, 12)
        with _Spy() as spy:
            kernels.matmul_all_reduce(x, w, backend="chunked")
            kernels.matmul_all_reduce(x, w, backend="chunked")
        return spy.calls
    finally:
        del os.environ["COC_TUNE_CACHE"]
        tune.clear_memory_cache()


def test_auto_honours_rank0_cache_file(tmp_path):
    res = run_ranks(_honour_cache, 2, str(tmp_path), env={"COC_PARALLEL_NUM": "auto"})
    for calls in res:
        assert calls == [("matmul_all_reduce", "chunked", 2)] * 2


def _auto_quantized(rank, world):
    tune.clear_memory_cache()
    try:
        x = torch.randn(5, 12)
        q, s = kernels.quantize_weight(torch.randn(10, 12), "per_group", 4)
        y = kernels.quantized_matmul_all_reduce(x, q, s, backend="chunked")
        key = tune.tuning_key(
            "quantized_matmul_all_reduce", (5, 12, 10), torch.float32, world, device_type="cpu", allow_fused=False
        )
        return tune._memory[tune.memory_key(key, None, world)], y.shape
    finally:
        tune.clear_memory_cache()


def test_auto_tunes_the_quantized_op():
    res = run_ranks(_auto_quantized, 2, env={"COC_PARALLEL_NUM": "auto"})
    assert res[0][0] in (1, 2, 4, 8) and res[0][0] == res[1][0]
    assert res[0][1] == (5, 10)


def _choices_per_group(rank, world):
    """Ranks of a 2 x 2 mesh tune along rows, then along columns (groups of the same size)."""
    tune.clear_memory_cache()
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    # Each group "measures" a different winner, as timing noise can make it.
    winners = {(0, 1): 2, (2, 3): 4, (0, 2): 8, (1, 3): 1}
    real_measure = tune._measure
    tune._measure = lambda call, x, w, impl, candidates: (winners[tuple(dist.get_process_group_ranks(call.group))], [])
    try:
        x, w = torch.randn(6, 12), torch.randn(10, 12)
        row = tune.choose_parallel_num(_call(rows[rank // 2]), x, w, ALL_REDUCE.impl, allow_fused=False)
        col = tune.choose_parallel_num(_call(cols[rank % 2]), x, w, ALL_REDUCE.impl, allow_fused=False)
        return row, col
    finally:
        tune._measure = real_measure
        tune.clear_memory_cache()


def test_auto_choice_is_kept_per_group_not_per_size():
    res = run_ranks(_choices_per_group, 4)
    assert [r[0] for r in res] == [2, 2, 4, 4]
    # Ranks 0 and 2 (1 and 3) share a column group: they must run the same split count.
    assert [r[1] for r in res] == [8, 1, 8, 1]


def test_auto_single_process(monkeypatch, tmp_path):
    """World 1 (no process group): tunes locally, with no collectives."""
    monkeypatch.setenv("COC_PARALLEL_NUM", "auto")
    monkeypatch.setenv("COC_TUNE_CACHE", str(tmp_path / "c.json"))
    tune.clear_memory_cache()
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    y = kernels.matmul_all_reduce(x, w, backend="chunked")
    assert_close("auto at W = 1", y, reference("ar", [x], [w], None, 0), torch.float32)
    assert len(tune.read_cache_file(str(tmp_path / "c.json"))) == 1
    tune.clear_memory_cache()


def test_tune_cache_bad_values(tmp_path):
    with pytest.raises(ValueError, match="COC_TUNE_CACHE"):
        build_config({"COC_TUNE_CACHE": str(tmp_path / "missing-dir" / "c.json")})
    with pytest.raises(ValueError, match="COC_TUNE_CACHE"):
        build_config({"COC_TUNE_CACHE": str(tmp_path)})
    assert build_config({"COC_TUNE_CACHE": str(tmp_path / "c.json")}).tune_cache == str(tmp_path / "c.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        tune.read_cache_file(str(bad))
    bad.write_text(json.dumps({"version": 1, "entries": {"k": 3}}))
    with pytest.raises(ValueError, match="choice 3"):
        tune.read_cache_file(str(bad))
    bad.write_text(json.dumps({"entries": {}}))
    with pytest.raises(ValueError, match="version-1"):
        tune.read_cache_file(str(bad))
