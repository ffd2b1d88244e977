"""One placement vocabulary (issue 28 item 7): autopar's ``Shard`` / ``Replicate`` / ``Partial`` /
``Placement`` are ``torch.distributed.tensor``'s own classes, a DistTensor holds torch's placement
objects, refuses torch's placements it cannot implement by name, and files saved while autopar had
classes of its own still load. DTensor conversions keeping the very placement objects:
``test_module.py::test_dtensor_interop_every_placement``.
"""

import importlib
import io
import pickle
import pkgutil
import sys

import pytest
import torch
import torch.distributed.tensor as tdt
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

import autopar
import autopar.dtensor
from autopar import DistTensor, ProcessMesh, reshard, shard_tensor

NAMES = ("Shard", "Replicate", "Partial", "Placement")


def test_autopar_exports_torchs_placement_classes_and_no_others():
    for name in NAMES:
        assert getattr(autopar, name) is getattr(tdt, name), name
        assert name in autopar.__all__
    for info in pkgutil.walk_packages(autopar.dtensor.__path__, "autopar.dtensor."):
        importlib.import_module(info.name)
    modules = [m for n, m in sorted(sys.modules.items()) if n == "autopar" or n.startswith("autopar.")]
    assert len(modules) > 20
    for module in modules:
        for attr, value in vars(module).items():
            if attr in NAMES:
                assert value is getattr(tdt, attr), f"{module.__name__}.{attr} is {value!r}, not torch's"
            if isinstance(value, type) and value.__module__.startswith("autopar"):
                assert value.__name__ not in NAMES, f"{value.__module__}.{value.__name__} shadows torch's"


def test_constructor_spellings():
    assert autopar.Partial() == autopar.Partial("sum") == tdt.Partial(reduce_op="sum")
    assert autopar.Partial("avg").reduce_op == "avg" and autopar.Shard(1).dim == 1
    # The keyword is torch's; the contract's earlier Partial(reduce_type=...) is not accepted.
    with pytest.raises(TypeError):
        autopar.Partial(reduce_type="avg")


def test_a_dist_tensor_holds_torchs_placements_and_refuses_the_rest():
    mesh = ProcessMesh([[0]], dim_names=["dp", "tp"])
    G = torch.arange(6.0).reshape(2, 3)
    x = shard_tensor(G, mesh, [tdt.Shard(-1), tdt.Partial("max")])
    assert x.placements == (tdt.Shard(1), tdt.Partial("max"))
    assert [type(p) for p in x.placements] == [tdt.Shard, tdt.Partial]
    assert x.dims_mapping == [-1, 0] and x.partial_status == {1: "max"}
    y = reshard(x, mesh, [tdt.Replicate()])
    assert y.placements == (tdt.Replicate(), tdt.Replicate()) and torch.equal(y.full_tensor(), G)
    bad = [
        (tdt.Partial("product"), ValueError, r"Partial\(product\).*reduce op must be one of"),
        (_StridedShard(0, split_factor=2), ValueError, "not _StridedShard"),
        (_MaskPartial(), ValueError, "not _MaskPartial"),
        ("S(0)", TypeError, "must be a torch.distributed.tensor Shard/Replicate/Partial"),
    ]
    for p, err, match in bad:
        with pytest.raises(err, match=match):
            shard_tensor(G, mesh, [p])
        with pytest.raises(err, match=match):
            DistTensor.from_local(G, mesh, [tdt.Replicate(), p])
        with pytest.raises(err, match=match):
            reshard(y, mesh, [p])


class _OldNames:
    """A pickle module writing placements as autopar did while it had classes of its own: the calls
    ``Shard(dim)``, ``Replicate()``, ``Partial(reduce_type)`` under ``autopar.dtensor.placements``."""

    class Pickler(pickle._Pickler):
        def reducer_override(self, obj):
            if type(obj) is tdt.Shard:
                return tdt.Shard, (obj.dim,)
            if type(obj) is tdt.Replicate:
                return tdt.Replicate, ()
            if type(obj) is tdt.Partial:
                return tdt.Partial, (obj.reduce_op,)
            return NotImplemented

        def save_global(self, obj, name=None):
            if obj in (tdt.Shard, tdt.Replicate, tdt.Partial):
                self.write(pickle.GLOBAL + f"autopar.dtensor.placements\n{obj.__name__}\n".encode())
                self.memoize(obj)
                return
            super().save_global(obj, name)


def test_files_saved_with_autopars_former_placement_classes_load():
    mesh = ProcessMesh([[0]], dim_names=["dp", "tp"])
    x = shard_tensor(torch.arange(6.0).reshape(2, 3), mesh, [tdt.Shard(0), tdt.Partial("avg")])
    buf = io.BytesIO()
    torch.save({"x": x, "r": tdt.Replicate()}, buf, pickle_module=_OldNames, pickle_protocol=2)
    assert b"autopar.dtensor.placements\nShard\n" in buf.getvalue()
    for weights_only in (True, False):
        buf.seek(0)
        state = torch.load(buf, weights_only=weights_only)
        y = state["x"]
        assert isinstance(y, DistTensor) and y.placements == x.placements and state["r"] == tdt.Replicate()
        assert [type(p) for p in y.placements] == [tdt.Shard, tdt.Partial]
        assert torch.equal(y.to_local(), x.to_local())
