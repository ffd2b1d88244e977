"""``bench.tune.gates``: the choice of all_reduce_rmsnorm's gates from timings, their place in the tuned file
(kept by a GEMM re-tune), and the tuner's CPU run measuring them at W = 2 for the dispatcher to read."""

from __future__ import annotations

import pytest
import torch

from bench.tune import gates as tune_gates
from bench.tune import tuner
from kernels.fused import tuned
from kernels.fused.gemm_configs import GemmConfig
from kernels.ops.all_reduce_rmsnorm import choose_algorithm
from tests.bench.tune.test_tuner import _fake_timer

pytestmark = pytest.mark.triton

KIB = 1024


def _timings(best: dict[int, str]) -> dict[int, dict[str, float]]:
    """The algorithm named per size at 1.0 s, the others at 2.0 s."""
    return {s: {a: 1.0 if a == name else 2.0 for a in tune_gates.ALGORITHMS} for s, name in best.items()}


@pytest.mark.parametrize(
    ("best", "gates"),
    [
        # One-shot up to 64 KiB, two-shot to 4 MiB, unfused above: the crossovers themselves.
        (
            {16 * KIB: "one_shot", 64 * KIB: "one_shot", 1024 * KIB: "two_shot", 4096 * KIB: "two_shot"}
            | {16384 * KIB: "unfused"},
            (64 * KIB, 4096 * KIB),
        ),
        # One noisy size inside the two-shot range does not cut it (a pair of gates makes three ranges at most).
        (
            {16 * KIB: "one_shot", 256 * KIB: "two_shot", 512 * KIB: "unfused", 1024 * KIB: "two_shot"}
            | {2048 * KIB: "two_shot", 8192 * KIB: "unfused"},
            (16 * KIB, 2048 * KIB),
        ),
        ({8 * KIB: "unfused", 64 * KIB: "unfused"}, (0, 0)),  # the collective library everywhere
        ({8 * KIB: "one_shot", 64 * KIB: "one_shot"}, (64 * KIB, 64 * KIB)),  # one-shot at every measured size
        ({8 * KIB: "two_shot", 64 * KIB: "two_shot"}, (0, 64 * KIB)),
    ],
    ids=["crossovers", "one_noisy_size", "unfused", "one_shot", "two_shot"],
)
def test_gates_follow_the_fastest_algorithm(best: dict[int, str], gates: tuple[int, int]) -> None:
    assert tune_gates.choose_gates(_timings(best)) == gates


def test_ties_go_to_the_smaller_gates_and_bad_timings_are_named() -> None:
    even = {s: dict.fromkeys(tune_gates.ALGORITHMS, 1.0) for s in (KIB, 2 * KIB)}
    assert tune_gates.choose_gates(even) == (0, 0)
    with pytest.raises(ValueError, match="no timings"):
        tune_gates.choose_gates({})
    with pytest.raises(ValueError, match=r"size 1024 has no positive time for \['unfused'\]"):
        tune_gates.choose_gates({KIB: {"one_shot": 1.0, "two_shot": 1.0, "unfused": 0.0}})


def test_gates_join_the_file_and_a_gemm_retune_keeps_them(tmp_path) -> None:
    path = tmp_path / "cpu.yaml"
    entry = tuned.Entry("matmul", "float32", 16, 32, 16, GemmConfig(16, 32, 16, 1, 1, 1, "persistent"))
    tuned.write(path, [entry], {"gpu": "test"})
    tuned.write_gates(path, [tuned.Gates(4, 1000, 5000)], {"gates_created": "now"})
    tuned.write_gates(path, [tuned.Gates(2, 10, 20), tuned.Gates(4, 100, 500)], {})
    tuned.write(path, [entry], {"gpu": "retuned"})  # the GEMM tuner's rewrite, no gates given
    text = path.read_text()
    assert "gates_created: now" not in text  # a re-tune writes its own header
    assert tuned.load(path) == [entry]
    assert tuned._load(str(path))[1] == {2: tuned.Gates(2, 10, 20), 4: tuned.Gates(4, 100, 500)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the --allow-cpu flow; a GPU measures its own sizes")
def test_cpu_tune_measures_gates_the_dispatcher_reads(tmp_path, monkeypatch) -> None:
    # The GEMM part of the run is the plain bf16 case alone: the gates are what this test measures.
    result = tuner.run(str(tmp_path), allow_cpu=True, timer=_fake_timer({}, []), gates=True, cases=[torch.bfloat16])
    (row,) = result["gates"]
    sizes = [m * tune_gates.CPU_HIDDEN * 2 for m in tune_gates.CPU_TOKENS]
    assert row["world"] == 2 and sorted(row["timings"]) == sizes, row
    assert all(t > 0 for per in row["timings"].values() for t in per.values()), row
    one_shot_max, fused_max = row["one_shot_max_bytes"], row["fused_max_bytes"]
    assert (one_shot_max, fused_max) == tune_gates.choose_gates(row["timings"])
    monkeypatch.setenv(tuned.ENV_TUNED_DIR, str(tmp_path))
    assert tuned.all_reduce_gates(torch.device("cpu"), 2) == tuned.Gates(2, one_shot_max, fused_max)
    assert tuned.load(result["path"]), "the GEMM entries stay beside the gates"
    for size in sizes:
        x = torch.empty(size // 2, dtype=torch.bfloat16)
        want = "one_shot" if size <= one_shot_max else "two_shot" if size <= fused_max else "unfused"
        assert choose_algorithm("auto", x, 2) == want
