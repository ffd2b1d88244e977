"""Timing of one callable across the ranks of a group, ``triton.testing.do_bench`` style.

Each repeat starts aligned across ranks (a barrier on CPU; on GPU a tiny all-reduce on the stream,
which orders the GPU work without stalling the host) and is timed per rank: ``time.perf_counter``
on CPU, CUDA events on GPU with the L2 cache flushed before each repeat (as do_bench does) so a
repeat does not find the previous one's operands in cache. The time of a repeat is the maximum
over ranks: an op is done when its slowest rank is.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

_L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than the L2 of any current GPU (H100: 50 MB)


@dataclass(frozen=True)
class Stats:
    """Seconds over repeats (after warm-up); quantiles as do_bench's default (0.2, 0.8)."""

    median: float
    p20: float
    p80: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        if not samples:
            raise ValueError("Stats.of needs at least one sample")
        s = sorted(samples)
        return cls(statistics.median(s), _quantile(s, 0.2), _quantile(s, 0.8), s[0], s[-1], len(s))

    def pick(self, stat: str) -> float:
        """The median, or the minimum (the least disturbed repeat, for machines shared with other work)."""
        if stat not in ("median", "min"):
            raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
        return self.median if stat == "median" else self.min

    @property
    def spread(self) -> float:
        """(p80 - p20) / median: the relative width of the middle 60 %."""
        return (self.p80 - self.p20) / self.median if self.median > 0 else 0.0

    def to_ms(self) -> dict[str, float]:
        d = {k: v * 1e3 for k, v in asdict(self).items() if k != "n"}
        d["n"] = self.n
        d["spread"] = self.spread
        return d


def _quantile(sorted_samples: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(sorted_samples) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_samples) - 1)
    return sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * (pos - lo)


class Timer:
    """Times callables on one device for the ranks of ``group`` (None: default group or no group)."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None):
        self.device = device
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.cuda = device.type == "cuda"
        self._flush = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device) if self.cuda else None
        self._token = torch.zeros(1, device=device)

    def _align(self) -> None:
        if not self.distributed:
            return
        if self.cuda:
            dist.all_reduce(self._token, group=self.group)
        else:
            dist.barrier(group=self.group)

    def run(self, fn: Callable[[], object], warmup: int, repeats: int) -> Stats:
        """Warm up, then time ``repeats`` calls; every rank must call with the same counts."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        for _ in range(warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            for i in range(repeats):
                self._flush.zero_()
                self._align()
                starts[i].record()
                fn()
                ends[i].record()
            torch.cuda.synchronize(self.device)
            local = [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends, strict=False)]
        else:
            local = []
            for _ in range(repeats):
                self._align()
                t0 = time.perf_counter()
                fn()
                local.append(time.perf_counter() - t0)
        return Stats.of(self.max_over_ranks(local))

    def max_over_ranks(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def all_ranks_true(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is true on every rank (keeps ranks on one code path)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item() > 0.5)
