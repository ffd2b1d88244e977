"""CUDA-graph semantics for the fused ops where there is no GPU: capture records, replay reruns.

A CUDA graph captures a stream's kernel launches with their arguments as they were at capture and
replays exactly those launches, on the same memory, any number of times; nothing the host computed
at capture is computed again. :class:`InterpretedGraph` gives interpreted Triton launches the same
semantics: inside :meth:`InterpretedGraph.capture` a launch is recorded and not run, and
:meth:`InterpretedGraph.replay` runs the recorded launches in order with the recorded arguments
(tensors by reference, so inputs copied into them in place are seen, as in a graph).
``kernels.fused.runtime.capturing`` reports True meanwhile, so the fused path's refusals inside
capture apply as on a GPU.

What this cannot model: torch ops issued between the launches (they run once, at capture, here,
and are replayed on a GPU). The fused ops issue none on their steady-state path for contiguous
operands; the tests keep biases and scales contiguous and fixed across replays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class InterpretedGraph:
    """Record interpreted Triton launches at capture and rerun them at replay (CPU stand-in for
    ``torch.cuda.CUDAGraph``)."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, tuple, Any, dict]] = []

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        from triton.runtime.interpreter import InterpretedFunction

        from kernels.fused import runtime

        real_run, real_capturing = InterpretedFunction.run, runtime.capturing

        def record(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if warmup:
                return real_run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            self.launches.append((fn, args, grid, kwargs))
            return None

        InterpretedFunction.run = record
        runtime.capturing = lambda device: True
        try:
            yield
        finally:
            InterpretedFunction.run = real_run
            runtime.capturing = real_capturing

    def replay(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        from kernels.heap import heaps_of

        if not self.launches:
            raise RuntimeError("replay of a graph that captured no launch")
        # Interpreter spins time out by the heap's pad clock, which the host keeps running during a
        # fused call (on a GPU they read %globaltimer, which always runs).
        heaps = list(heaps_of(None))
        for heap in heaps:
            heap.arm_clock(True)
        try:
            for fn, args, grid, kwargs in self.launches:
                InterpretedFunction.run(fn, *args, grid=grid, warmup=False, **kwargs)
        finally:
            for heap in heaps:
                heap.arm_clock(False)


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the same two methods."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self) -> Any:
        return torch.cuda.graph(self.graph)

    def replay(self) -> None:
        self.graph.replay()


def new_graph(device: torch.device) -> Any:
    return CudaGraph() if device.type == "cuda" else InterpretedGraph()
