"""CUDA-graph capture: whether the current call is being captured.

Parts of a call that communicate sized by shapes, read device memory on the host, time or
synchronize (heap creation, ``COC_CHECK=1``, ``COC_PARALLEL_NUM=auto`` tuning) cannot be captured;
each refuses by name inside capture instead of failing with a raw CUDA error.
"""

from __future__ import annotations

import torch


def capturing(device: torch.device) -> bool:
    """Whether work queued now on ``device``'s current stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
