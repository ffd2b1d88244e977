"""Every bad-input rule of docs/api.md section 1: ValueError/TypeError naming the argument and value."""

import pytest
import torch

import kernels
from kernels.testing import run_ranks

OPS = [kernels.all_gather_matmul, kernels.matmul_reduce_scatter, kernels.matmul_all_reduce]
X = torch.randn(4, 6)
W = torch.randn(5, 6)
B = torch.randn(5)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "args,kwargs,exc,needle",
    [
        ((X[0], W), {}, ValueError, "x must have at least 2 dims"),
        ((X, W[0]), {}, ValueError, "weight must be 2-D"),
        ((X, torch.randn(2, 5, 6)), {}, ValueError, "shape (2, 5, 6)"),
        ((X, torch.randn(5, 7)), {}, ValueError, "k mismatch: x has k=6"),
        ((X, W.double()), {}, TypeError, "weight dtype torch.float64 does not match x dtype torch.float32"),
        ((X.long(), W.long()), {}, TypeError, "x must be a floating-point tensor"),
        ((X, W, torch.randn(4)), {}, ValueError, "bias must have shape (5,)"),
        ((X, W, B.double()), {}, TypeError, "bias dtype torch.float64"),
        ((X.tolist(), W), {}, TypeError, "x must be a torch.Tensor, got list"),
        ((X, "w"), {}, TypeError, "weight must be a torch.Tensor, got str"),
        ((X, W, 3.0), {}, TypeError, "bias must be a torch.Tensor or None, got float"),
        ((X, W), {"backend": "nccl"}, ValueError, "backend='nccl' is not accepted"),
        ((X, W), {"parallel_num": 3}, ValueError, "parallel_num=3 is not accepted"),
        ((X, W), {"parallel_num": True}, ValueError, "parallel_num=True is not accepted"),
        ((X, W), {"parallel_num": 2.0}, ValueError, "parallel_num=2.0 is not accepted"),
        ((X, W), {"group": "tp"}, TypeError, "group must be a torch.distributed ProcessGroup"),
    ],
)
def test_bad_input(op, args, kwargs, exc, needle):
    with pytest.raises(exc) as e:
        op(*args, **kwargs)
    assert needle in str(e.value)


def test_bad_flags():
    with pytest.raises(TypeError, match="return_gathered must be a bool, got 1"):
        kernels.all_gather_matmul(X, W, return_gathered=1)
    with pytest.raises(TypeError, match="deterministic must be a bool, got 'yes'"):
        kernels.matmul_all_reduce(X, W, deterministic="yes")


def test_device_mismatch():
    meta = torch.empty(5, 6, device="meta")
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        kernels.matmul_all_reduce(X, meta)
    with pytest.raises(ValueError, match="bias is on meta but x is on cpu"):
        kernels.matmul_all_reduce(X, W, torch.empty(5, device="meta"))


def test_requires_grad_is_refused_not_silently_detached():
    w = W.clone().requires_grad_()
    with pytest.raises(TypeError, match="forward-only and weight requires grad"):
        kernels.matmul_all_reduce(X, w)
    with torch.no_grad():
        torch.testing.assert_close(kernels.matmul_all_reduce(X, w), X @ W.T)


def test_world_one_without_process_group():
    # torch.distributed not initialized in the test process: W == 1, no communication.
    torch.testing.assert_close(kernels.matmul_reduce_scatter(X, W, B), X @ W.T + B)
    y, xg = kernels.all_gather_matmul(X, W, B, parallel_num=2, return_gathered=True)
    torch.testing.assert_close(xg, X, rtol=0, atol=0)
    torch.testing.assert_close(y, X @ W.T + B)


@pytest.mark.parametrize("world_size", ["2", "1", None], ids=["WORLD_SIZE=2", "WORLD_SIZE=1", "unset"])
def test_launched_with_several_processes_but_no_process_group(monkeypatch, world_size):
    """torchrun sets WORLD_SIZE; without init_process_group every rank would return its own unreduced partial
    (with the right shape). Refused by name; one process (WORLD_SIZE unset or 1) runs as a group of one."""
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    xq, xs = kernels.quantize_fp8(X, "row")
    wq, ws = kernels.quantize_fp8(W, "row")
    calls = [
        lambda: kernels.matmul_all_reduce(X, W),
        lambda: kernels.all_gather_matmul(X, W),
        lambda: kernels.matmul_reduce_scatter(X, W),
        lambda: kernels.quantized_matmul_all_reduce(X, *kernels.quantize_weight(W)),
        lambda: kernels.scaled_matmul_all_reduce(xq, xs, wq, ws),
    ]
    for call in calls:
        if world_size == "2":
            with pytest.raises(RuntimeError, match=r"not initialized but WORLD_SIZE=2 .*init_process_group"):
                call()
        else:
            call()


def test_resolved_signature_still_reads_the_group(monkeypatch):
    """A signature resolved as a group of one (no process group) is not reused once WORLD_SIZE says there are
    several processes: the call is refused as it would have been at its first call."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.testing.assert_close(kernels.matmul_all_reduce(X, W), X @ W.T)
    torch.testing.assert_close(kernels.matmul_all_reduce(X, W), X @ W.T)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"not initialized but WORLD_SIZE=2 .*init_process_group"):
        kernels.matmul_all_reduce(X, W)


def _reduce_scatter_bad_rows(rank, world):
    with pytest.raises(ValueError) as e:
        kernels.matmul_reduce_scatter(torch.randn(7, 6), W)
    assert "m=7" in str(e.value) and "W=3" in str(e.value)
    with pytest.raises(ValueError, match="m=5"):
        kernels.matmul_reduce_scatter(torch.randn(5, 2, 6), W)  # dim 0 is scattered, not s * b
    return True


def test_reduce_scatter_rows_not_divisible():
    assert run_ranks(_reduce_scatter_bad_rows, 3) == [True] * 3


def _empty_dims(rank, world):
    """k == 0 (a rank whose shard of the contracted dim is empty) and m == 0 are valid shapes."""
    out = {}
    for backend in ("sequential", "chunked"):
        w0 = torch.zeros(5, 0)
        y = kernels.matmul_all_reduce(torch.zeros(4, 2, 0), w0, B, backend=backend, parallel_num=2)
        torch.testing.assert_close(y, B.expand(4, 2, 5))  # the empty sum is 0, plus bias
        y = kernels.matmul_reduce_scatter(torch.zeros(2 * world, 0), w0, backend=backend)
        assert y.shape == (2, 5) and not y.any()
        y, xg = kernels.all_gather_matmul(torch.zeros(3, 0), w0, backend=backend, return_gathered=True)
        assert y.shape == (3 * world, 5) and xg.shape == (3 * world, 0) and not y.any()
        y = kernels.all_gather_matmul(torch.zeros(0, 6), W, backend=backend, parallel_num=4)
        out[backend] = tuple(y.shape)
    return out


def test_empty_k_and_m():
    assert run_ranks(_empty_dims, 2) == [{"sequential": (0, 5), "chunked": (0, 5)}] * 2


def _layer_k_mismatch(rank, world):
    """The TP linears flatten [s, b, k] to rows: a wrong k must be reported with the shape passed."""
    import autopar

    messages = []
    for sp in (False, True):
        cfg = autopar.ParallelConfig(sequence_parallel=sp)
        layers = [
            autopar.ColumnParallelLinear(6, 8, config=cfg, init_method=torch.nn.init.normal_),
            autopar.RowParallelLinear(
                6,
                8,
                config=cfg,
                init_method=torch.nn.init.normal_,
                bias=True,
                input_is_parallel=True,
                skip_bias_add=False,
            ),
        ]
        if not sp:
            layers.append(
                autopar.RowParallelLinear(
                    6,
                    8,
                    config=cfg,
                    init_method=torch.nn.init.normal_,
                    bias=True,
                    input_is_parallel=False,
                    skip_bias_add=False,
                )
            )
        for layer in layers:
            with pytest.raises(ValueError) as e:
                layer(torch.randn(4, 3, 5))
            messages.append(str(e.value))
    return messages


@pytest.mark.parametrize("world", [1, 2])
def test_layer_k_mismatch_names_the_shape_passed(world):
    for messages in run_ranks(_layer_k_mismatch, world):
        assert len(messages) == 5
        for message in messages:
            assert message.startswith("k mismatch: input_ has k=5 (shape (4, 3, 5)) but "), message
        assert "input_is_parallel=False needs the full input_size=6" in messages[2]


def test_transposed_weight_gets_the_layout_hint():
    for op in OPS:
        with pytest.raises(ValueError) as e:
            op(X, W.T.contiguous())  # [k, n]: the x @ w layout
        message = str(e.value)
        assert "k mismatch: x has k=6" in message and "must be [n, k]" in message, message
        assert "pass weight.T" in message, message
    with pytest.raises(ValueError) as e:
        kernels.matmul_all_reduce(X, torch.randn(5, 7))  # neither layout: no transpose hint
    assert "must be [n, k]" in str(e.value) and "weight.T" not in str(e.value)


X3 = torch.randn(2, 3, 6)


@pytest.mark.parametrize(
    "op,name", [(kernels.all_gather_matmul, "gather_dim"), (kernels.matmul_reduce_scatter, "scatter_dim")]
)
@pytest.mark.parametrize(
    "dim,exc,needle",
    [
        (2, ValueError, "=2 is the last dim of x (shape (2, 3, 6)), the contracted k dim"),
        (-1, ValueError, "=-1 is the last dim of x"),
        (3, ValueError, "=3 is out of range for x of shape (2, 3, 6) (valid: -3 .. 1)"),
        (-4, ValueError, "=-4 is out of range"),
        (1.0, TypeError, " must be an int, got 1.0"),
        (None, TypeError, " must be an int, got None"),
    ],
)
def test_bad_dims(op, name, dim, exc, needle):
    with pytest.raises(exc) as e:
        op(X3, W, **{name: dim})
    assert str(e.value).startswith(name) and needle in str(e.value), str(e.value)


def _scatter_dim_not_divisible(rank, world):
    with pytest.raises(ValueError) as e:
        kernels.matmul_reduce_scatter(torch.randn(3, 4, 6), W, scatter_dim=-2)
    return str(e.value)


def test_scatter_dim_size_not_divisible_names_dim_size_and_world():
    for message in run_ranks(_scatter_dim_not_divisible, 3):
        assert "scatter_dim=-2" in message and "x.shape[1]" in message, message
        assert "m=4" in message and "W=3" in message, message


@pytest.mark.parametrize(
    "weights,biases,exc,needle",
    [
        ([], None, ValueError, "weight: an empty list"),
        ([W, W], B, TypeError, "bias must be None or a list / tuple"),
        ([W, W], [B], ValueError, "bias: 1 entries for 2 weights"),
        ([W, torch.randn(5, 7)], None, ValueError, "k mismatch: x has k=6 (shape (4, 6)) but weight[1] has k=7"),
        ([W, W.double()], None, TypeError, "weight[1] dtype torch.float64"),
        ([W, W], [None, torch.randn(4)], ValueError, "bias[1] must have shape (5,) = [n] of weight[1]"),
        ([W, "w"], None, TypeError, "weight[1] must be a torch.Tensor, got str"),
    ],
)
def test_bad_weight_lists(weights, biases, exc, needle):
    with pytest.raises(exc) as e:
        kernels.all_gather_matmul(X, weights, biases)
    assert needle in str(e.value), str(e.value)
