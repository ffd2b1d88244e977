"""bench/cost/decode.py: the modelled table covers every (W, hidden, tokens) asked for, with the algorithm "auto"
picks under the default gates, and the host measurement reports each op above its hand-written torch twin."""

from __future__ import annotations

import json
from pathlib import Path

from bench.cost import decode


def test_model_table_and_host_rows(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    argv = ["--tokens", "1,512", "--hidden", "4096", "--worlds", "2,8", "--host", "--iters", "3", "--repeats", "1"]
    assert decode.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["model"]
    assert [(r["world"], r["tokens"]) for r in rows] == [(2, 1), (2, 512), (8, 1), (8, 512)]
    for r in rows:
        assert r["bytes"] == r["tokens"] * 4096 * 2
        assert r["auto"] == ("one_shot" if r["bytes"] <= 256 * 1024 else "two_shot"), r
        assert min(r["unfused"], r["one_shot"], r["two_shot"]) > 0, r
    # The one-shot model sends (W - 1) copies: it grows with W at a fixed size, the point of the two-shot gate.
    assert rows[3]["one_shot"] > rows[1]["one_shot"]
    assert "not measurements" in doc["kind"] and doc["anchors"]
    assert [h["op"] for h in doc["host"]] == [
        "all_reduce_rmsnorm",
        "matmul_all_reduce",
        "matmul_all_reduce + rmsnorm epilogue",
    ]
    for h in doc["host"]:
        assert h["op_us"] > 0 and h["torch_us"] > 0
