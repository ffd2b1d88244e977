"""``torch.distributed.checkpoint`` of models ``autopar.parallelize_hf`` made, packed (strided) weights included:
GPT-2's ``c_attn`` (q/k/v, ``_StridedShard(1, split_factor=3)``), Qwen3-MoE's fused expert ``gate_up_proj``
(``_StridedShard(1, split_factor=2)``) and Llama (plain shards, the control), tiny fp32 configs at world 2.

A model and its Adam state (``get_state_dict``) saved with ``dcp.save`` load with ``dcp.load`` + ``set_state_dict``
into a freshly parallelized model: parameters, moments, logits and the next step's logits equal bitwise. The same
checkpoint loads into one process (``dcp.load`` into a plain model's state dict, ``dcp_to_torch_save``) equal
bitwise to the parallel model's gathered weights and moments. Without :mod:`autopar.tp.strided_dcp` the save
fails ("overlapping chunks": torch describes a strided shard as one chunk at one offset).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.testing import run_ranks
from tests.autopar.tp.hf_cases import TOL, B, S, _max_diff, build

pytest.importorskip("transformers")

MODELS: dict[str, dict[str, Any]] = {
    "gpt2": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "llama": {},
}
TIMEOUT = 300


def _ids() -> torch.Tensor:
    return torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(1))


def _trained(model_name: str, overrides: dict[str, Any], seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A parallelized model and its Adam after one step (moments nonzero)."""
    import autopar

    model = autopar.parallelize_hf(build(model_name, seed=seed, **overrides))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _next_logits(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _round_trip(
    rank: int, world: int, model_name: str, overrides: dict[str, Any], path: str, *, one_process_path: str
) -> dict[str, Any]:
    """Save a trained model + Adam with dcp, load into a fresh one (other weights): the largest local differences
    (0.0 is bitwise), the strided keys, and on rank 0 the gathered weights / moments and logits for one process.
    ``one_process_path``: a checkpoint one process saved, loaded into a third model (``loaded_full``: gathered)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    import autopar

    model, opt = _trained(model_name, overrides, seed=0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    fresh, fresh_opt = _trained(model_name, overrides, seed=1)
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": fmsd, "optim": fosd}, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=fmsd, optim_state_dict=fosd)

    names = dict(model.named_parameters())
    fresh_names = dict(fresh.named_parameters())
    params = max(_max_diff(_local(p), _local(fresh_names[n])) for n, p in names.items())
    moments = max(
        _max_diff(_local(value), _local(fresh_opt.state[fresh_names[n]][key]))
        for n, p in names.items()
        for key, value in opt.state[p].items()
    )
    ids = _ids()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        logits_err = _max_diff(logits, fresh(input_ids=ids).logits)
    strided = sorted(
        n
        for n, p in names.items()
        if isinstance(p, DTensor) and any(isinstance(q, _StridedShard) for q in p.placements)
    )
    # copies: a replicated DTensor's full tensor is its local one, which the next step below updates in place
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}
    full_osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    full_state = {k: {n: v.clone() for n, v in m.items()} for k, m in full_osd["state"].items()}
    third = autopar.parallelize_hf(build(model_name, seed=3, **overrides))
    third_sd = third.state_dict()
    dcp.load(third_sd, checkpoint_id=one_process_path)
    loaded_full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in third_sd.items()}
    res = {"params": params, "moments": moments, "logits": logits_err, "strided": strided}
    res["next_logits"] = _max_diff(_next_logits(model, opt), _next_logits(fresh, fresh_opt))
    if rank == 0:
        res.update(full=full, full_state=full_state, logits_out=logits, loaded_full=loaded_full)
    return res


# this process has no process group by design (the one-process side); torch warns that it assumes so
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("model_name", list(MODELS))
def test_dcp_round_trip_and_one_process_load(model_name: str, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    overrides = MODELS[model_name]
    path, one_process_path = str(tmp_path / "ckpt"), str(tmp_path / "one_process")
    source = build(model_name, seed=2, **overrides).state_dict()
    dcp.save(source, checkpoint_id=one_process_path, no_dist=True)
    results = run_ranks(_round_trip, 2, model_name, overrides, path, one_process_path=one_process_path, timeout=TIMEOUT)
    for res in results:
        assert res["params"] == 0.0 and res["moments"] == 0.0, res
        assert res["logits"] == 0.0 and res["next_logits"] == 0.0, res
        assert bool(res["strided"]) == (model_name != "llama"), res["strided"]
    full, full_state = results[0]["full"], results[0]["full_state"]
    # A checkpoint one process saved loads into the shards (the other direction).
    assert all(_max_diff(results[0]["loaded_full"][k], v) == 0.0 for k, v in source.items())

    # One process, no process group: dcp.load into a plain model's own state dict.
    plain = build(model_name, seed=1, **overrides)
    state = plain.state_dict()
    dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state)
    assert {k: _max_diff(state[k], v) for k, v in full.items() if _max_diff(state[k], v) != 0.0} == {}
    with torch.no_grad():
        assert _max_diff(plain(input_ids=_ids()).logits, results[0]["logits_out"]) < TOL

    # The whole checkpoint as one torch.save file: the weights and every Adam moment.
    out = tmp_path / "full.pt"
    dcp_to_torch_save(path, out)
    saved = torch.load(out, weights_only=False)
    assert all(_max_diff(saved["model"][k], v) == 0.0 for k, v in full.items())
    for fqn, moments in full_state.items():
        for key, value in moments.items():
            assert _max_diff(saved["optim"]["state"][fqn][key], value) == 0.0, (fqn, key)


def _unhooked_save(rank: int, world: int, model_name: str, path: str) -> str:
    """``dcp.save`` of a parallelized model with torch's own DTensor checkpoint methods (the hooks' originals)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    import autopar
    from autopar.tp import strided_dcp

    model = autopar.parallelize_hf(build(model_name, **MODELS[model_name]))
    hooked = {name: DTensor.__dict__[name] for name in strided_dcp._PROTOCOL}
    for name, method in hooked.items():
        setattr(DTensor, name, method.__wrapped__)
    try:
        dcp.save(model.state_dict(), checkpoint_id=path)
        return "saved"
    except (Exception, dcp.CheckpointException) as e:  # the coordinator's ValueError, wrapped (a BaseException)
        return str(e)
    finally:
        for name, method in hooked.items():
            setattr(DTensor, name, method)


@pytest.mark.parametrize(("model_name", "packed"), [("gpt2", "c_attn"), ("qwen3_moe", "gate_up_proj")])
def test_without_the_fix_dcp_save_of_packed_weights_fails(model_name: str, packed: str, tmp_path: Path) -> None:
    messages = run_ranks(_unhooked_save, 2, model_name, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    assert any("overlapping chunks" in m and packed in m for m in messages), messages


def _plain_chunks_unchanged(rank: int, world: int) -> list[str]:
    """Every DTensor of a parallelized GPT-2 without more than one box gets torch's own chunk list; the packed
    ones get three chunks each, which tile the global tensor with the other rank's."""
    from torch.distributed.tensor import DTensor

    import autopar

    model = autopar.parallelize_hf(build("gpt2"))
    wrong = []
    for name, p in model.state_dict().items():
        if not isinstance(p, DTensor):
            continue
        ours, torch_own = p.__create_chunk_list__(), type(p).__create_chunk_list__.__wrapped__(p)
        if "c_attn" in name:
            if len(ours) != 3 or sum(c.sizes.numel() for c in ours) != p.to_local().numel():
                wrong.append(f"{name}: {ours}")
        elif ours != torch_own:
            wrong.append(f"{name}: {ours} != {torch_own}")
    return wrong


def test_other_dtensors_keep_torch_chunks() -> None:
    assert run_ranks(_plain_chunks_unchanged, 2, timeout=TIMEOUT) == [[], []]


def test_strided_dcp_warns_where_torch_internals_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.tensor import DTensor

    from autopar.tp import strided_dcp

    assert strided_dcp.install() and strided_dcp.install()  # idempotent: wrapped once
    assert all(DTensor.__dict__[name]._coc_strided for name in strided_dcp._PROTOCOL)
    monkeypatch.setattr(DTensor, "__get_tensor_shard__", lambda self, index, other: None)
    with pytest.warns(RuntimeWarning, match="dcp.save / dcp.load"):
        assert not strided_dcp.install()
