"""QuantizedRowParallelLinear: inference with int8 weights built from a RowParallelLinear.

Reference per rank: ``all_reduce(x_shard @ dequant(qweight_shard).T) + bias``, the toolkit's fp64
reference of that all-reduce from every rank's shards (the dequantized weight shards are gathered),
within its one tolerance rule; the full input (``input_is_parallel=False``) and the full float
weight are built from one seed on every rank.
"""

import pytest
import torch
import torch.distributed as dist

import autopar
import kernels
from kernels.quant import dequantize
from kernels.testing import assert_close, reference, run_ranks

pytestmark = pytest.mark.triton  # runs Triton kernels (interpreted on CPU)

IN, OUT = 24, 10


def _row(input_is_parallel, skip_bias_add, sequence_parallel=False):
    torch.manual_seed(0)  # the master weight is drawn on the CPU: same on every rank
    config = autopar.ParallelConfig(sequence_parallel=sequence_parallel, use_cpu_initialization=True)
    layer = autopar.RowParallelLinear(
        IN,
        OUT,
        config=config,
        init_method=torch.nn.init.normal_,
        bias=True,
        input_is_parallel=input_is_parallel,
        skip_bias_add=skip_bias_add,
        # explicit: resolving the default would import megatron (seconds)
        tp_group=dist.group.WORLD if dist.is_initialized() else None,
    )
    with torch.no_grad():
        layer.bias.copy_(torch.arange(OUT, dtype=torch.float32))
    return layer


def _check_linear(rank, world):
    k_local = IN // world
    cases = 0
    for mode, group_size in (("per_channel", None), ("per_group", 5), ("per_tensor", None)):
        for input_is_parallel in (True, False):
            for skip_bias_add in (False, True):
                layer = _row(input_is_parallel, skip_bias_add)
                qlayer = autopar.quantize_row_parallel_linear(layer, mode, group_size)
                torch.manual_seed(1)
                x_full = torch.randn(3, 2, IN)
                x_shard = x_full[..., rank * k_local : (rank + 1) * k_local]
                with torch.no_grad():
                    out, out_bias = qlayer(x_shard if input_is_parallel else x_full)
                    float_out, _ = layer(x_shard if input_is_parallel else x_full)
                w = dequantize(qlayer.qweight, qlayer.scale, group_size, dtype=torch.float32)
                ws = [torch.empty_like(w) for _ in range(world)]
                dist.all_gather(ws, w)
                xs = list(x_full.split(k_local, dim=-1))
                if skip_bias_add:
                    assert out_bias is qlayer.bias
                    assert torch.equal(out_bias, layer.bias.detach())
                else:
                    assert out_bias is None
                bias = None if skip_bias_add else layer.bias.detach()
                what = f"{mode} input_is_parallel={input_is_parallel} skip_bias_add={skip_bias_add}"
                assert_close(what, out, reference("ar", xs, ws, bias, rank), torch.float32)
                # Close to the float layer within the int8 rounding: |dW| <= scale / 2 per weight,
                # summed over IN inputs of |x| <= 4.
                torch.testing.assert_close(out, float_out, rtol=0, atol=IN * 4 * qlayer.scale.max().item())
                cases += 1
    return cases


def test_quantized_row_parallel_linear_forward():
    assert run_ranks(_check_linear, 2) == [12, 12]


def _check_backward(rank, world):
    qlayer = autopar.quantize_row_parallel_linear(_row(True, False))
    x = torch.randn(3, 2, IN // world, requires_grad=True)
    out, _ = qlayer(x)  # forward works even when the input requires grad
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()
    return True


def test_backward_refused():
    assert run_ranks(_check_backward, 2) == [True, True]


def _check_sequence_parallel(rank, world):
    """Sequence parallelism: this rank's [s / W, b, n] rows of the reduced output, bias added once."""
    k_local = IN // world
    out_shapes = []
    for mode, group_size in (("per_channel", None), ("per_group", 5)):
        layer = _row(True, False, sequence_parallel=True)
        qlayer = autopar.quantize_row_parallel_linear(layer, mode, group_size)
        assert qlayer.sequence_parallel
        torch.manual_seed(1)
        x_full = torch.randn(4, 2, IN)
        x_shard = x_full[..., rank * k_local : (rank + 1) * k_local]
        with torch.no_grad():
            out, out_bias = qlayer(x_shard)
        assert out_bias is None
        w = dequantize(qlayer.qweight, qlayer.scale, group_size, dtype=torch.float32)
        ws = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(ws, w)
        ref = reference("rs", list(x_full.split(k_local, dim=-1)), ws, layer.bias.detach(), rank)
        assert_close(f"{mode} sequence_parallel", out, ref, torch.float32)
        out_shapes.append(tuple(out.shape))
        with pytest.raises(ValueError, match="scatter_dim"):
            qlayer(torch.randn(3, 2, k_local))  # s = 3 does not split over W = 2
    return out_shapes


def test_sequence_parallel_reduce_scatters_the_output():
    for shapes in run_ranks(_check_sequence_parallel, 2):
        assert shapes == [(2, 2, OUT), (2, 2, OUT)]


def test_wrong_full_input_width():
    layer = _row(False, False)
    qlayer = autopar.quantize_row_parallel_linear(layer)
    with pytest.raises(ValueError, match="input_is_parallel=False"):
        qlayer(torch.randn(2, IN + 1))
    with torch.no_grad():
        out, _ = qlayer(torch.ones(2, IN))
    w = dequantize(qlayer.qweight, qlayer.scale, dtype=torch.float32)
    ref = reference("ar", [torch.ones(2, IN)], [w], layer.bias.detach(), 0)
    assert_close("full input at W = 1", out, ref, torch.float32)
    assert kernels.quant.quant_spec(qlayer.qweight, qlayer.scale, None, None).mode == "per_channel"
