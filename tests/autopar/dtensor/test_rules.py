"""SPMD rules: output placements, required input placements, conflicts and Partial outputs.

Pure functions of shapes and placements, checked in one process without communication.
"""

import pytest
import torch

from autopar import Partial, Replicate, Shard
from autopar.dtensor.placements import from_dims_mapping, normalize_placements, to_dims_mapping, to_partial_status
from autopar.dtensor.rules import broadcast_labels, einsum_rule, matmul_labels, reduction_labels

R, P = Replicate(), Partial()


def _matmul(sa, sb, pa, pb):
    labels, out, forbidden = matmul_labels(sa, sb)
    return einsum_rule(labels, out, [sa, sb], [pa, pb], "linear", forbidden=forbidden, priority=(1, 0))


def _elementwise(shapes, pls, kind="add"):
    labels, out, forbidden = broadcast_labels(shapes)
    return einsum_rule(labels, out, shapes, pls, kind, forbidden=forbidden)


@pytest.mark.parametrize(
    "pa,pb,need_a,need_b,out",
    [
        ((Shard(0),), (R,), (Shard(0),), (R,), (Shard(0),)),  # row (batch) parallel
        ((R,), (Shard(1),), (R,), (Shard(1),), (Shard(1),)),  # column parallel
        ((Shard(1),), (Shard(0),), (Shard(1),), (Shard(0),), (P,)),  # contracted k: Partial
        ((Shard(1),), (R,), (Shard(1),), (Shard(0),), (P,)),  # b sliced to match k
        ((Shard(0),), (Shard(1),), (R,), (Shard(1),), (Shard(1),)),  # SP column: gather x
        ((P,), (R,), (P,), (R,), (P,)),  # Partial is linear
        ((P,), (Shard(1),), (R,), (Shard(1),), (Shard(1),)),  # P meets a shard: reduce
        ((P,), (P,), (P,), (R,), (P,)),  # only one P survives
        ((Partial("max"),), (R,), (R,), (R,), (R,)),  # max is not linear
        ((Shard(0), R), (R, Shard(1)), (Shard(0), R), (R, Shard(1)), (Shard(0), Shard(1))),  # 2-D mesh
    ],
)
def test_matmul_rule(pa, pb, need_a, need_b, out):
    res = _matmul((6, 4), (4, 5), pa, pb)
    assert res.in_placements == (need_a, need_b)
    assert res.out_placements == out
    assert res.out_shape == torch.Size([6, 5])


def test_matmul_batch_broadcast_and_1d():
    # [b, s, k] @ [k, n]: sharding the batch or the sequence dim gives a sharded output.
    res = _matmul((2, 6, 4), (4, 5), (R, Shard(1)), (R, R))
    assert res.out_placements == (R, Shard(1)) and res.out_shape == torch.Size([2, 6, 5])
    # batch broadcast of a size-1 dim: that axis is never sharded
    res = _matmul((1, 6, 4), (3, 4, 5), (Shard(0),), (R,))
    assert res.in_placements[0] == (R,) and res.out_shape == torch.Size([3, 6, 5])
    res = _matmul((4,), (4, 5), (Shard(0),), (R,))
    assert res.out_placements == (P,) and res.out_shape == torch.Size([5])


def test_conflict_is_an_error_naming_axis_and_mesh_dims():
    with pytest.raises(ValueError, match=r"mesh dim 0.*mesh dim 1"):
        _matmul((6, 4), (4, 5), (Shard(1), R), (R, Shard(0)))
    with pytest.raises(ValueError, match="conflicting"):
        _elementwise([(6, 4), (6, 4)], [(Shard(0), R), (R, Shard(0))])


def test_same_mesh_dim_two_axes_first_input_wins():
    res = _elementwise([(6, 4), (6, 4)], [(Shard(0),), (Shard(1),)])
    assert res.in_placements == ((Shard(0),), (Shard(0),)) and res.out_placements == (Shard(0),)


def test_elementwise_broadcast_and_partial():
    # bias [4] broadcast over a sharded batch dim stays Replicate
    res = _elementwise([(6, 4), (4,)], [(Shard(0),), (R,)])
    assert res.in_placements == ((Shard(0),), (R,)) and res.out_placements == (Shard(0),)
    # bias sharded along the hidden dim slices x to match
    res = _elementwise([(6, 4), (4,)], [(R,), (Shard(0),)])
    assert res.in_placements == ((Shard(1),), (Shard(0),)) and res.out_placements == (Shard(1),)
    assert _elementwise([(6, 4), (6, 4)], [(P,), (P,)]).out_placements == (P,)
    res = _elementwise([(6, 4), (6, 4)], [(P,), (R,)])
    assert res.in_placements == ((R,), (R,)) and res.out_placements == (R,)
    res = _elementwise([(6, 4), (6, 4)], [(P,), (R,)], kind="linear")  # mul: P * R
    assert res.out_placements == (P,)
    res = _elementwise([(6, 4)], [(P,)], kind="nonlinear")  # gelu(P) needs R
    assert res.in_placements == ((R,),)
    with pytest.raises(ValueError, match="broadcast"):
        broadcast_labels([(6, 4), (5, 4)])


def test_reductions():
    lab, out = reduction_labels(3, (0, 1))
    res = einsum_rule([lab], out, [(2, 6, 4)], [(R, Shard(1))], "linear")
    assert res.out_placements == (R, P) and res.out_shape == torch.Size([4])
    lab, out = reduction_labels(2, (1,))
    res = einsum_rule([lab], out, [(6, 4)], [(Shard(0),)], "linear")
    assert res.out_placements == (Shard(0),)
    lab, out = reduction_labels(2, (0, 1))
    assert einsum_rule([lab], out, [(6, 4)], [(P,)], "linear").out_placements == (P,)


def test_softmax_and_layer_norm_never_shard_the_normalized_dim():
    res = einsum_rule(["ab"], "ab", [(6, 4)], [(Shard(1),)], "nonlinear", forbidden=frozenset("b"))
    assert res.in_placements == ((R,),) and res.out_placements == (R,)
    res = einsum_rule(
        ["ab", "b", "b"], "ab", [(6, 4), (4,), (4,)], [(Shard(0),), (R,), (R,)], "nonlinear", forbidden=frozenset("b")
    )
    assert res.out_placements == (Shard(0),)


def test_placement_views_round_trip():
    pl = normalize_placements([Shard(-1), Partial("avg"), R], 3, 2)
    assert pl == (Shard(1), Partial("avg"), R)
    assert to_dims_mapping(pl, 2) == [-1, 0] and to_partial_status(pl) == {1: "avg"}
    assert from_dims_mapping([-1, 0], 3, {1: "avg"}) == pl
    with pytest.raises(ValueError, match="at most one mesh dim"):
        normalize_placements([Shard(0), Shard(0)], 2, 2)
    # torch's Partial takes any reduce op; a DistTensor refuses the ones it does not implement.
    with pytest.raises(ValueError, match="reduce op must be one of"):
        normalize_placements([Partial("prod")], 1, 2)
    with pytest.raises(ValueError, match="reduce op must be one of"):
        from_dims_mapping([-1, -1], 1, {0: "product"})
    with pytest.raises(TypeError):
        Shard(1.5)
