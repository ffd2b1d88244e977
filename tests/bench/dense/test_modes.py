"""bench.dense.modes: what a run on one node does with the cases it cannot spawn."""

import torch

from bench.dense.modes import drop_worlds_over_gpus
from bench.harness.suites import Case


def test_worlds_over_the_nodes_gpus_are_skipped_with_the_reason(monkeypatch):
    # A CUDA run without torchrun spawns one process per GPU: a world larger than the node's GPU count is skipped
    # and named, the others run (the count is torch's, read where no GPU exists too).
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cases = [Case("s", "l", "all_gather_matmul", 64, 32, 48, world, "bf16") for world in (1, 2, 4)]
    skipped: list[dict] = []
    kept = drop_worlds_over_gpus(cases, skipped)
    assert [c.world for c in kept] == [1, 2]
    assert skipped == [{"case": cases[2].label, "reason": "world size 4 > 2 GPUs"}]
