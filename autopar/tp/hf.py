"""Hugging Face transformers models on the CoC styles: their own ``tp_plan`` strings, mapped.

transformers 5 declares a tensor-parallel plan per model (``model.tp_plan``: module-name patterns
to style strings such as ``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"``,
``"embedding_rowwise"``). :func:`hf_tp_plan` turns it into a plan of CoC styles for torch's
``parallelize_module``; :func:`parallelize_hf` applies it, with sequence parallelism if asked, and
keeps a tied input embedding / output head tied (both vocabulary-parallel on one DTensor). ``fp8=`` gives
every linear of the plan the FP8 recipe's GEMMs.
"""

from __future__ import annotations

import datetime
import itertools
import os
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from . import decode
from .fp8 import Fp8Recipe, resolve_recipe
from .hf_load import load_shards
from .hf_regions import check_regions, check_sequence_parallel, name_mixed_layouts, sum_gradients_over
from .hf_sizes import check_shardable
from .moe import CocMoeExpertsParallel, check_moe_plan, parallelize_moe_blocks, plan_key_matches, without_expert_params
from .moe_ep import CocEpDispatchExpertsParallel, check_ep_plan, with_ep_plan
from .styles import CocColwiseParallel, CocRowwiseParallel, CocSequenceParallel, share_input_gather

# Models whose transformers config declares no plan; the names are their module paths.
BUILTIN_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {
        "transformer.wte": "embedding_rowwise",
        "transformer.h.*.attn.c_attn": "packed_colwise:3",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "colwise_gather_output",
    },
}
# Position embeddings added to sequence-sharded token embeddings must be sharded the same way.
_SP_EXTRA: dict[str, dict[str, str]] = {"gpt2": {"transformer.wpe": "embedding_rowwise"}}

SEQ_DIM = 1  # [batch, sequence, hidden], as transformers' models lay out activations


def coc_style(
    name: str, *, sequence_parallel: bool = False, fp8: Fp8Recipe | None = None, fuse_norm: bool = False
) -> ParallelStyle:
    """The CoC style for one of transformers' tp_plan strings.

    With ``sequence_parallel`` the residual stream is sequence-sharded (``Shard(1)`` DTensors
    between the blocks): row outputs reduce-scatter, column inputs all-gather, embeddings
    reduce-scatter their lookups. ``fp8``: the FP8 recipe of the linear styles (None: the
    default recipe when ``COC_FP8=1``, as for the styles); embeddings and norms have no GEMM.
    ``fuse_norm``: the row-parallel linears' ``fuse_norm`` (:class:`CocRowwiseParallel`).
    """
    if name.startswith("packed_colwise"):
        _, _, blocks = name.partition(":")
        return CocColwiseParallel(packed=int(blocks or 2), fp8=fp8)
    out = Shard(SEQ_DIM) if sequence_parallel else Replicate()
    local = not sequence_parallel
    row = {
        "output_layouts": out,
        "use_local_output": local,
        "fp8": fp8,
        "fuse_norm": fuse_norm and not sequence_parallel,
    }
    styles: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": lambda: CocColwiseParallel(fp8=fp8),
        "colwise_gather_output": lambda: CocColwiseParallel(output_layouts=Replicate(), fp8=fp8),
        "colwise_rep": lambda: CocColwiseParallel(output_layouts=Replicate(), fp8=fp8),
        "rowwise": lambda: CocRowwiseParallel(**row),
        # Under SP the residual it is added to is sequence-sharded: its output must be too (a plain replicated
        # tensor beside a Shard(1) DTensor fails in the add).
        "rowwise_split_input": lambda: CocRowwiseParallel(input_layouts=Replicate(), **row),
        "rowwise_rep": lambda: CocRowwiseParallel(input_layouts=Replicate(), **row),
        "embedding_rowwise": lambda: CocRowwiseParallel(
            input_layouts=Replicate(), output_layouts=out, use_local_output=local
        ),
        "sequence_parallel": lambda: CocSequenceParallel(sequence_dim=SEQ_DIM, use_local_output=local),
        # Under sequence parallelism parallelize_hf also puts CocMoeBlockSequenceParallel on the sparse block.
        "moe_tp_experts": CocMoeExpertsParallel,
        # Whole experts per rank over the same mesh (transformers' ep_size == tp_size); under sequence parallelism
        # the sparse block gets CocMoeBlockSequenceParallel too.
        "ep_dispatch_experts": CocEpDispatchExpertsParallel,
        # Qwen3's q / k norms, on this rank's heads (a plain local tensor in both modes): replicated weights whose
        # gradient on each rank covers its own heads only, summed over the mesh in the backward (the same sum
        # CocSequenceParallel makes over each rank's rows).
        "replicated_with_grad_allreduce": lambda: CocSequenceParallel(sequence_dim=SEQ_DIM, use_local_output=True),
    }
    style = styles.get(name)
    if style is None:
        why = REFUSED_PLAN_STRINGS.get(name, "not a transformers tp_plan string this version of autopar knows")
        raise ValueError(
            f"tp_plan style {name!r} has no CoC equivalent: {why}. Supported: {', '.join(SUPPORTED_PLAN_STRINGS)}"
        )
    return style()


SUPPORTED_PLAN_STRINGS = (
    "colwise",
    "colwise_gather_output",
    "colwise_rep",
    "packed_colwise[:blocks]",
    "rowwise",
    "rowwise_split_input",
    "rowwise_rep",
    "embedding_rowwise",
    "sequence_parallel",
    "replicated_with_grad_allreduce",
    "moe_tp_experts",
    "ep_dispatch_experts",
)
_HF_OWN = (
    "parallelize the model with transformers' own loader instead "
    "(from_pretrained(..., distributed_config=DistributedConfig(tp_size=W)))"
)
# transformers' tp_plan strings (transformers.distributed.parallel_utils.ALL_PARALLEL_STYLES) with no CoC style,
# each with why and what to do instead; tests/autopar/tp/test_hf.py fails on a registered string in neither table.
REFUSED_PLAN_STRINGS = {
    "embedding_colwise": "an embedding sharded on the hidden dim has no GEMM to fuse; pass plan= with "
    "'embedding_rowwise' (vocabulary-parallel) for it, or leave it out of the plan",
    "packed_rowwise": "weights packed along their input features (a parameter style no plan of a model this autopar "
    "parallelizes uses) are not supported yet; " + _HF_OWN,
    "moe_identity_expert": "identity (zero-computation) experts beside moe_tp_experts are not supported yet; "
    + _HF_OWN,
    "grouped_gemm": "it shards an experts module's gate_up_proj / down_proj by expert only beside "
    "'ep_dispatch_experts' on that module; use the model's ep_plan instead (parallelize_hf(expert_parallel=True))",
    "mla_kv_a_proj": "DeepSeek-style MLA's kv_a_proj (a rope slice whose gradient is summed) is not supported yet; "
    + _HF_OWN,
    "all_reduce": "a module whose output is a partial sum to all-reduce is not supported yet; " + _HF_OWN,
    "local_params": "modules that run on local parameter shards are not supported yet; " + _HF_OWN,
    "replicate": "replicated parameters outside a sharded layer (a quantization scale) are not supported yet; "
    + _HF_OWN,
}


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def hf_plan_strings(
    model: nn.Module, *, sequence_parallel: bool = False, plan: dict[str, str] | None = None
) -> dict[str, str]:
    """``plan`` (default: the model's transformers tp_plan, ``model.tp_plan``, else a built-in one), plus,
    with sequence parallelism, the entries it needs that ``plan`` does not name: ``"sequence_parallel"`` for
    every norm of the residual stream, the input embedding (:func:`_input_embedding_entry`) and the model
    type's own (an explicit entry wins)."""
    own = plan is None
    if plan is None:
        plan = getattr(model, "tp_plan", None) or BUILTIN_PLANS.get(_model_type(model) or "", {})
    plan = dict(plan)
    if plan and (own or sequence_parallel):
        plan.update(_input_embedding_entry(model, plan, any_name=sequence_parallel))
    if not plan:
        raise ValueError(
            f"{type(model).__name__} (model_type={_model_type(model)!r}) declares no tp_plan; pass plan= "
            "(module-name patterns to tp_plan strings)"
        )
    if sequence_parallel:
        for key, style in _SP_EXTRA.get(_model_type(model) or "", {}).items():
            plan.setdefault(key, style)
        for name, module in model.named_modules():
            if (
                _is_norm(module)
                and not any(plan_key_matches(name, key) for key in plan)
                and not _beside_linears(name, plan)
            ):
                plan[name] = "sequence_parallel"
    return plan


def _input_embedding_entry(model: nn.Module, plan: dict[str, str], *, any_name: bool) -> dict[str, str]:
    """``{name: "embedding_rowwise"}`` for the input embedding when the plan names no style for it: the base
    model's ``embed_tokens`` (``any_name``: whatever ``get_input_embeddings()`` returns, GPT-NeoX's ``embed_in``).

    transformers adds the ``embed_tokens`` entry to every model's own plan in recent 5.x
    (``init_parallel_plans``), not in 5.17, which this package supports: added here so that every version shards
    the same modules. Under sequence parallelism (``any_name``) the entry is what makes the residual stream a
    ``Shard(1)`` DTensor from its start: without it the first norm would take the full embedding output for this
    rank's sequence shard (the sequence doubled, silently where nothing checks its length)."""
    base = getattr(model, "base_model", model)
    embedding = getattr(base, "embed_tokens", None)
    if any_name and not isinstance(embedding, nn.Embedding):
        try:
            embedding = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            embedding = None
    if not isinstance(embedding, nn.Embedding):
        if (
            any_name
            and embedding is not None
            and not any(plan_key_matches(n, key) for n, m in model.named_modules() if m is embedding for key in plan)
        ):
            raise ValueError(
                f"parallelize_hf: sequence parallelism starts the sequence-sharded residual stream at the input "
                f"embedding, and {type(embedding).__name__} is not an nn.Embedding the plan could shard; name its "
                "style in plan= or run without sequence_parallel"
            )
        return {}
    name = next(n for n, m in model.named_modules() if m is embedding)
    if any(plan_key_matches(name, key) for key in plan):
        return {}
    return {name: "embedding_rowwise"}


def _beside_linears(name: str, plan: dict[str, str]) -> bool:
    """Whether module ``name`` sits beside sharded linears (OLMo's q / k norms in the attention): its input is
    their output, not the sequence-sharded residual stream, so it is no sequence-parallel norm."""
    parent = name.rpartition(".")[0]
    return any(
        style.startswith(("colwise", "rowwise", "packed")) and plan_key_matches(parent, key.rpartition(".")[0])
        for key, style in plan.items()
    )


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def hf_tp_plan(
    model: nn.Module,
    *,
    sequence_parallel: bool = False,
    plan: dict[str, str] | None = None,
    fp8: Fp8Recipe | None = None,
) -> dict[str, ParallelStyle]:
    """A ``parallelize_module`` plan of CoC styles for a transformers model (``plan``: tp_plan
    strings to use instead of the model's own; ``fp8``: the FP8 recipe of its linears)."""
    strings = without_expert_params(hf_plan_strings(model, sequence_parallel=sequence_parallel, plan=plan))
    recipe = resolve_recipe(fp8)
    return {key: coc_style(s, sequence_parallel=sequence_parallel, fp8=recipe) for key, s in strings.items()}


def _style_of(name: str, strings: dict[str, str]) -> str | None:
    for key, s in strings.items():
        if plan_key_matches(name, key):
            return s
    return None


def _sharded_modules(model: nn.Module, strings: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(module name, plan key, tp_plan string)`` of every module the plan parallelizes (the first key
    that matches, as in :func:`_style_of`)."""
    found = []
    for name, _ in model.named_modules():
        key = next((k for k in strings if plan_key_matches(name, k)), None)
        if key is not None:
            found.append((name, key, strings[key]))
    return found


def tied_weights_to_keep(model: nn.Module, strings: dict[str, str]) -> list[tuple[str, str]]:
    """Parameters shared by several modules (tied weights), checked against a tp_plan.

    Parallelizing replaces a module's parameter with a DTensor on that module only, which unties
    it: the other module keeps the old tensor and never sees the first one's gradient (a silently
    wrong model). A tie is kept when every module holding it is sharded the same way on the
    vocabulary (an ``embedding_rowwise`` embedding and a ``colwise`` head: both ``Shard(0)``);
    returns those ``(module.param, owner.param)`` pairs to re-tie after ``parallelize_module``. Any
    other tie touched by the plan raises ``ValueError`` naming the modules and their styles.
    """
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mname, module, pname))
    retie = []
    vocab_sharded = {"embedding_rowwise", "colwise", "colwise_gather_output", "colwise_rep"}
    for holders in owners.values():
        unique = {(m, p): mod for m, mod, p in holders}
        if len(unique) < 2:
            continue
        styles = {(m, p): _style_of(m, strings) for (m, p) in unique}
        if all(s is None for s in styles.values()):
            continue
        head_styles = vocab_sharded - {"embedding_rowwise"}
        ok = all(
            p == "weight"
            and (
                styles[(m, p)] == "embedding_rowwise"
                if isinstance(unique[(m, p)], nn.Embedding)
                else styles[(m, p)] in head_styles
            )
            for (m, p) in unique
        )
        desc = ", ".join(f"{m}.{p} ({styles[(m, p)] or 'not in the plan'})" for (m, p) in unique)
        if not ok:
            raise ValueError(
                f"tied weight shared by {desc}: parallelizing would untie it and the modules would train "
                "different copies (silently wrong). Shard every module that holds it on the vocabulary "
                "(embedding: embedding_rowwise, head: colwise / colwise_gather_output), or untie it before "
                "parallelizing (config.tie_word_embeddings=False and a cloned weight)"
            )
        first, *rest = sorted(unique)
        retie += [(f"{m}.{p}", f"{first[0]}.{first[1]}") for m, p in rest]
    return retie


def _adjust_gpt2(model: nn.Module, world: int) -> None:
    # GPT-2 splits c_attn's output into q / k / v by the full width; the local output has 1/W of it.
    for module in model.modules():
        if type(module).__name__ == "GPT2Attention" and hasattr(module, "split_size"):
            if not getattr(module, "_coc_split", False):
                module.split_size //= world
                module._coc_split = True


def parallelize_hf(
    model: nn.Module,
    device_mesh: DeviceMesh | None = None,
    *,
    sequence_parallel: bool = False,
    plan: dict[str, str] | None = None,
    fp8: Fp8Recipe | None = None,
    checkpoint: str | os.PathLike | None = None,
    fuse_norm: bool = True,
    expert_parallel: bool = False,
) -> nn.Module:
    """Parallelize a transformers model in place with CoC styles; returns it.

    ``device_mesh``: a 1-D tensor-parallel mesh (default: every rank of the default group, on the
    model's device type). ``plan``: tp_plan strings instead of the model's own. Tied input /
    output embeddings stay tied (see :func:`tied_weights_to_keep`). A plan that would split an
    attention head or a size the mesh size does not divide raises ``ValueError`` before anything is
    sharded, naming the config fields (``autopar.tp.hf_sizes.check_shardable``).

    With ``sequence_parallel=True`` activations between the blocks are ``Shard(1)`` DTensors and
    the model's inputs keep their full shape: every rank passes the same ``input_ids`` and gets the
    full logits. A forward whose sequence length does not divide by the mesh size runs replicated.

    ``fp8``: an :class:`~autopar.Fp8Recipe`: every linear of the plan (the output head included) runs its
    forward, dgrad and wgrad GEMMs in FP8; None: the default recipe when ``COC_FP8=1``, else none.

    ``checkpoint``: a ``save_pretrained`` directory (safetensors) whose weights each rank then reads, its
    shards only (:func:`autopar.tp.hf_load.load_shards`), onto the mesh's device: build the model on the meta
    device (``with torch.device("meta"): model = AutoModelForCausalLM.from_config(config)``) and no rank ever
    holds the full model.

    ``expert_parallel``: the model's expert-parallel plan (``model.ep_plan``, transformers' ``base_model_ep_plan``)
    replaces the TP entries of its experts: each rank holds E / W whole experts and tokens reach them through
    ``kernels.moe_dispatch`` / ``moe_combine`` (:mod:`autopar.tp.moe_ep`), over the same mesh as the rest of the
    plan. ``plan=`` may name ``"ep_dispatch_experts"`` / ``"grouped_gemm"`` itself.
    """
    recipe = resolve_recipe(fp8)
    if device_mesh is None:
        device_mesh = _default_mesh(model)
    strings, retie, summed = _checked_plan(
        model, device_mesh.size(), sequence_parallel=sequence_parallel, plan=plan, expert_parallel=expert_parallel
    )
    if _model_type(model) == "gpt2":
        _adjust_gpt2(model, device_mesh.size())
    fuse = fuse_norm and not sequence_parallel and recipe is None
    styles = {
        key: coc_style(s, sequence_parallel=sequence_parallel, fp8=recipe, fuse_norm=fuse) for key, s in strings.items()
    }
    parallelize_module(model, device_mesh, styles)
    if fuse:
        install_norm_fusion(model)
    if sequence_parallel:
        share_gathers(model)
        parallelize_moe_blocks(model, device_mesh, SEQ_DIM)
        name_mixed_layouts(model)
    for target, source in retie:
        owner, _, pname = source.rpartition(".")
        tmod, _, tname = target.rpartition(".")
        setattr(model.get_submodule(tmod), tname, getattr(model.get_submodule(owner), pname))
    if checkpoint is not None:
        load_shards(model, checkpoint, device=_mesh_device(device_mesh))
    sum_gradients_over(model, summed, device_mesh.get_group())
    if callable(getattr(type(model), "save_pretrained", None)):
        # A bound method, not a closure: copy.deepcopy(model) rebinds it to the copy.
        model.save_pretrained = types.MethodType(_save_pretrained_gathered, model)
    return model


def _default_mesh(model: nn.Module) -> DeviceMesh:
    """Every rank of the default group, on the model's device type (a meta model: the accelerator's, if any)."""
    if not dist.is_initialized():
        raise RuntimeError("parallelize_hf: torch.distributed is not initialized and no device_mesh was given")
    device = next(model.parameters()).device.type
    if device == "meta":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),))


def _checked_plan(
    model: nn.Module, world: int, *, sequence_parallel: bool, plan: dict[str, str] | None, expert_parallel: bool
) -> tuple[dict[str, str], list[tuple[str, str]], list[str]]:
    """``(the plan's tp_plan strings, the ties to restore after sharding, the parameters whose gradients are
    summed over the mesh)``, every check of the plan against the model and the mesh size run: before anything
    is sharded."""
    strings = hf_plan_strings(model, sequence_parallel=sequence_parallel, plan=plan)
    strings = without_expert_params(with_ep_plan(model, strings) if expert_parallel else strings)
    retie = tied_weights_to_keep(model, strings)
    check_shardable(model, _sharded_modules(model, strings), world)
    check_moe_plan(model, strings, world)
    check_ep_plan(model, strings, world)
    summed = check_regions(model, strings)
    if sequence_parallel:
        check_sequence_parallel(model, strings)
    return strings, retie, summed


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device of the mesh's type (a checkpoint's shards are read onto it)."""
    local = torch.device(mesh.device_type)
    if local.type == "cuda":
        local = torch.device("cuda", torch.cuda.current_device())
    return local


def install_norm_fusion(model: nn.Module) -> None:
    """The norms of Llama's form run pending layer ends fused (:func:`autopar.tp.decode.fuse_rmsnorm`); the
    model's outputs hold no pending value (:func:`autopar.tp.decode.resolve_outputs`)."""
    norms = [m for m in model.modules() if decode.is_llama_rmsnorm(m)]
    for norm in norms:
        decode.fuse_rmsnorm(norm)
    model.register_forward_hook(decode.resolve_outputs)


# Sibling projections that read one input in the transformers models with a plan (Llama, Qwen2, Mistral, ...).
_SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def share_gathers(model: nn.Module) -> None:
    """q/k/v and gate/up share one all-gather of their sequence-sharded input (autopar.tp.shared_gather) where
    their outputs stay sharded on the features; gathered outputs (OLMo's colwise_gather_output q/k/v, whose norms
    read all heads) gather on their own."""
    for parent in model.modules():
        for names in _SHARED_INPUTS:
            members = [getattr(parent, n, None) for n in names]
            styles = [getattr(m, "_coc_style", None) for m in members]
            if (
                all(isinstance(s, CocColwiseParallel) and s.output_layouts[0] == Shard(-1) for s in styles)
                and len({repr(s) for s in styles}) == 1
            ):
                share_input_gather(members)


def _save_pretrained_gathered(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``save_pretrained`` of a model :func:`parallelize_hf` sharded: call it on every rank.

    transformers gathers DTensor parameters only for models it sharded itself; safetensors cannot
    read a DTensor's storage. Without an explicit ``state_dict`` every rank gathers the full one
    (collective), transformers writes it on rank 0 only, and every rank returns once the files exist.
    """
    explicit = "state_dict" in kwargs or len(args) >= 3  # (save_directory, is_main_process, state_dict)
    if not explicit:
        _every_rank_calls(self, "save_pretrained")
        kwargs["state_dict"] = full_state_dict(self)
    out = type(self).save_pretrained(self, *args, **kwargs)
    if not explicit:
        from torch.distributed.tensor import DTensor

        mesh = next((p.device_mesh for p in self.parameters() if isinstance(p, DTensor)), None)
        if mesh is not None:
            dist.barrier(group=mesh.get_group())
    return out


_ARRIVALS = itertools.count()


def _every_rank_calls(model: nn.Module, what: str) -> None:
    """Raise, naming the ranks that did not come, when a rank of the model's mesh does not call ``what`` within
    ``COC_TIMEOUT``: ``what`` gathers the sharded parameters (collective), and called on one rank only (under
    ``if rank == 0:``) it would wait for the others forever. Each rank marks its arrival in the default group's
    store and waits for its peers' marks there, with the timeout."""
    from torch.distributed.tensor import DTensor

    from kernels.config import get_config

    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is None or mesh.size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    ranks = dist.get_process_group_ranks(mesh.get_group())
    prefix = f"coc/{what}/{next(_ARRIVALS)}/"
    store.set(f"{prefix}{dist.get_rank()}", "1")
    timeout = get_config().timeout
    try:
        store.wait([f"{prefix}{r}" for r in ranks], datetime.timedelta(seconds=timeout))
    except RuntimeError as e:  # the store's timeout (DistStoreError, or RuntimeError from a FileStore)
        missing = [r for r in ranks if not store.check([f"{prefix}{r}"])]
        raise RuntimeError(
            f"{what}: rank(s) {missing} of the tensor-parallel group did not call it within {timeout:g} s "
            "(COC_TIMEOUT); it gathers the sharded parameters, so call it on every rank (transformers writes the "
            "files on rank 0 only), not under `if rank == 0:`"
        ) from e


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """Every rank gets the full (unsharded) state dict: DTensor entries gathered with
    ``full_tensor()`` (collective: call it on every rank)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}


__all__ = [
    "coc_style",
    "full_state_dict",
    "hf_plan_strings",
    "hf_tp_plan",
    "parallelize_hf",
    "tied_weights_to_keep",
]
