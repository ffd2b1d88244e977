"""The fused runtime's per-call-object memos (kernels/fused/runtime.py): a descriptor kept with its call object is
the one computed afresh, for every operand signature and tile the object meets."""

from __future__ import annotations

import dataclasses

import torch

from kernels.format import PLAIN
from kernels.fused import runtime
from kernels.ops.gemm import GemmCall, Operands
from kernels.protocol import check_words


def _fresh(call: GemmCall, ops: Operands, tiles: tuple[int, int] | None) -> tuple[int, ...]:
    return check_words(runtime.op_word(call.op), call.items(ops), tiles)


def test_descriptors_kept_with_a_call_equal_fresh_ones_for_each_signature_and_tile() -> None:
    call = GemmCall(op="all_gather_matmul", pattern="all_gather", fmt=PLAIN, backend="fused", parallel_num=1)
    fused = runtime.as_fused(call)
    assert fused.parallel_num is None and fused.backend == "fused"
    assert runtime.as_fused(call) is fused  # made once per call object
    assert runtime.as_fused(fused) is fused
    w = torch.randn(8, 16)
    operands = [Operands(torch.randn(m, 16), (w,), (b,)) for m in (4, 5) for b in (None, torch.randn(8))]
    cases = [(ops, tiles) for ops in operands for tiles in (None, (64, 32), (32, 64))]
    seen = set()
    for _ in range(2):  # the second round reads the memo
        for ops, tiles in cases:
            words = runtime.describe(fused, ops, tiles)
            assert words == _fresh(fused, ops, tiles)
            # An equal call that is another object computes the same words.
            assert runtime.describe(dataclasses.replace(fused), ops, tiles) == words
            seen.add(words)
    assert len(seen) == len(cases)  # shapes, bias and tiles each change the descriptor
    # Bounded: 12 signatures met by one object keep at most 8.
    assert len(vars(fused)["_descriptors"]) <= 8
