"""transformers' own tensor-parallel loading on the CoC ops: :func:`register_hf` / :func:`unregister_hf`.

transformers (the DTensor loading path: ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=W))``)
looks up each tp_plan string in ``ALL_PARALLEL_STYLES`` and calls, on the model still on the meta device,
``layer.shard_param(module, name, mesh)`` for each parameter (a DTensor placeholder: ``Shard`` / ``_StridedShard`` /
``Replicate``) and then ``layer.install_forward(module, mesh)``; the checkpoint loader then reads only each rank's
slice of every tensor into those placeholders. :func:`register_hf` replaces the registered layers of the plan
strings below with subclasses of transformers' own classes (built from the registered instances, their settings
kept): ``shard_param`` is transformers' (each rank still materializes its shards only), ``install_forward`` is the
CoC style of the same string (:func:`autopar.tp.hf.coc_style`) applied with torch's ``parallelize_module`` to the
already-sharded module (its parameter layouts are checked to be the same, then only its forward is installed).

Plan strings run on the CoC ops: ``colwise``, ``colwise_gather_output``, ``colwise_rep``, ``packed_colwise``,
``rowwise``, ``rowwise_split_input``, ``rowwise_rep``, ``embedding_rowwise``, ``sequence_parallel``,
``replicated_with_grad_allreduce``. Every other string keeps transformers' layer (``embedding_colwise``, the MoE
and expert-parallel styles, ``mla_kv_a_proj``, ``all_reduce``, ``local_params``, ``replicate``, ...). A module the
CoC style refuses (not an ``nn.Linear`` / ``nn.Embedding``, a size the mesh size does not divide, a custom
forward) keeps transformers' forward too, with a warning, except under sequence parallelism (raised there: the
residual stream's layout would differ).

Without sequence parallelism the row-parallel linears and the norms of Llama's form run the decode path under
``torch.no_grad()`` (:mod:`autopar.tp.decode`, as :func:`autopar.parallelize_hf` with ``fuse_norm=True``).

Sequence parallelism: ``register_hf(sequence_parallel=True / False)`` fixes it for every load; ``None`` (default)
follows ``DistributedConfig.enable_sequence_parallel`` of each ``from_pretrained`` (a field transformers declares
but does not act on). For it :func:`register_hf` also wraps ``DistributedMixin.maybe_distribute_model`` (the step
that applies the plans): the norms of the residual stream get ``sequence_parallel`` entries (as in
:func:`autopar.parallelize_hf`) and sibling projections share one all-gather.

Expert parallelism: where transformers has ``transformers.distributed.expert_parallel.EPImplementationInterface``
(5.24 does), :func:`register_hf` also registers the implementation ``"coc"`` (:data:`EP_IMPLEMENTATION`), so
``DistributedConfig(tp_size=W, ep_size=W, ep_implementation="coc")`` runs each ``"ep_dispatch_experts"`` module as
``kernels.moe_dispatch_grouped_matmul`` -> this rank's second expert GEMM -> ``kernels.moe_combine``
(:func:`autopar.tp.moe_ep.coc_ep_forward`; transformers still shards the experts with ``"grouped_gemm"``). The ranks
of a TP group share one batch: each dispatches its slice of it over the EP group and the slices' outputs are
gathered over the TP group. Refused by name when the implementation is built (at load): experts modules of a
layout the CoC grouped GEMMs do not compute (biases, transposed or interleaved weights, their own gating: use
``ep_implementation="auto"``), an expert count the EP size does not divide, and sequence parallelism (the sparse
block would see the sequence-sharded stream, which the EP entry does not lay out).

Needs the DTensor API (``shard_param`` / ``install_forward``, transformers 5.x since the ``distributed`` package;
tested on 5.24); older versions (``partition_tensor`` / ``prepare_module_tp``) raise ``RuntimeError`` naming
the installed version. Models already loaded keep their CoC forwards after :func:`unregister_hf`.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from torch.distributed.tensor.parallel import parallelize_module

from .hf import SUPPORTED_PLAN_STRINGS

# parallelize_hf's strings but the experts' (transformers keeps its own MoE layers; expert parallelism goes through
# its EPImplementationInterface below); the registry's keys carry no "[:blocks]".
COC_PLAN_STRINGS = tuple(
    s.partition("[")[0] for s in SUPPORTED_PLAN_STRINGS if s not in ("moe_tp_experts", "ep_dispatch_experts")
)

EP_IMPLEMENTATION = "coc"

# What register_hf replaced, to restore: {"styles": {key: original}, "sp": bool | None, "load_sp": bool,
# "mixin": (class, original attribute) or None, "ep": the EPImplementationInterface class it registered in}.
_STATE: dict[str, Any] = {}
_warned: set[str] = set()


def _version() -> str:
    import transformers

    return getattr(transformers, "__version__", "unknown")


def _registry() -> Any:
    """transformers' ``ALL_PARALLEL_STYLES`` (``transformers.distributed.tensor_parallel``, re-exported by
    ``transformers.integrations.tensor_parallel``), checked to be the DTensor API."""
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES as registry
    except ImportError:
        try:  # the older location, a shim since the distributed package
            from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES as registry
        except ImportError:
            registry = None
    if registry is None or not callable(getattr(registry, "register", None)):
        raise RuntimeError(
            f"autopar.register_hf: transformers {_version()} has no ALL_PARALLEL_STYLES registry with register() "
            "(transformers.distributed.tensor_parallel); it needs transformers 5 with the DTensor tensor-parallel "
            "loader. Use autopar.parallelize_hf(model) on a loaded model instead"
        )
    return registry


def _check_layer(key: str, layer: Any) -> None:
    if not all(callable(getattr(layer, m, None)) for m in ("shard_param", "install_forward")):
        raise RuntimeError(
            f"autopar.register_hf: transformers {_version()}'s tp_plan style {key!r} ({type(layer).__name__}) has no "
            "shard_param / install_forward (the DTensor loading API of transformers 5: older versions shard with "
            "partition_tensor / prepare_module_tp). Use autopar.parallelize_hf(model) on a loaded model instead"
        )


def _load_sequence_parallel() -> bool:
    sp = _STATE.get("sp")
    return bool(_STATE.get("load_sp", False)) if sp is None else sp


def _plan_string(key: str, layer: Any) -> str:
    if key == "packed_colwise":
        return f"packed_colwise:{getattr(layer, 'split_factor', 2)}"
    return key


class _CocForward:
    """Put before one of transformers' TensorParallelLayer classes: its parameter sharding, the CoC forward."""

    _coc_plan_string = ""

    def install_forward(self, module: Any, mesh: Any) -> Any:
        from .hf import coc_style

        sp = _load_sequence_parallel()
        # fuse_norm: the decode path (autopar.tp.decode), its norms installed after sharding (_after_sharding).
        style = coc_style(self._coc_plan_string, sequence_parallel=sp, fuse_norm=not sp)
        try:
            # The parameters are transformers' DTensor placeholders already: the style's distribute_tensor keeps a
            # DTensor of the same layout as it is and raises ValueError on another one.
            return parallelize_module(module, mesh, style)
        except (NotImplementedError, ValueError) as e:
            if sp:
                raise RuntimeError(
                    f"autopar.register_hf: tp_plan style {self._coc_plan_string!r} on {type(module).__name__} cannot "
                    f"run on the CoC ops ({e}); under sequence parallelism every module of the plan must (the "
                    "residual stream's layout would differ). Load without enable_sequence_parallel"
                ) from e
            where = f"{self._coc_plan_string}:{type(module).__name__}"
            if where not in _warned:
                _warned.add(where)
                warnings.warn(
                    f"autopar.register_hf: {type(module).__name__} keeps transformers' {self._coc_plan_string!r} "
                    f"forward (not the CoC ops): {e}. Shown once per style and module type.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return super().install_forward(module, mesh)


def _coc_layer(key: str, original: Any) -> Any:
    """An instance of a subclass of ``type(original)`` with its settings (layouts, split factor), CoC forward."""
    cls = type(f"Coc{type(original).__name__}", (_CocForward, type(original)), {"__module__": __name__})
    layer = object.__new__(cls)
    layer.__dict__.update(vars(original))
    layer._coc_plan_string = _plan_string(key, original)
    return layer


def _wildcard(name: str) -> str:
    """transformers' plan key for a module name: the layer numbers as ``*`` (replace_layer_number_by_wildcard)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _with_sequence_parallel(model: Any) -> None:
    """The model's tp_plan plus the ``sequence_parallel`` entries of the norms of its residual stream."""
    from .hf import hf_plan_strings
    from .moe import plan_key_matches

    plan = dict(model.tp_plan)
    embedding = model.get_input_embeddings()
    name = next((n for n, m in model.named_modules() if m is embedding), None)
    if name is not None and not any(plan_key_matches(name, key) for key in plan):
        # The residual stream starts sequence-sharded at the token embedding (older plans do not name it).
        plan[_wildcard(name)] = "embedding_rowwise"
    added = hf_plan_strings(model, sequence_parallel=True, plan=plan)
    for name, style in added.items():
        plan.setdefault(_wildcard(name), style)
    model.tp_plan = plan


def _wrap_distribute(mixin: type) -> None:
    original = mixin.__dict__["maybe_distribute_model"]
    func = original.__func__

    def maybe_distribute_model(cls: type, model: Any, distributed_config: Any, *args: Any, **kwargs: Any) -> Any:
        # (model, distributed_config, mesh_manager) in transformers 5.24; the rest passed on as given.
        tp = getattr(distributed_config, "tp_size", 1) or 1
        sp = _STATE.get("sp")
        if sp is None:
            sp = bool(getattr(distributed_config, "enable_sequence_parallel", False))
        if tp <= 1 or (args and args[0] is None):
            return func(cls, model, distributed_config, *args, **kwargs)
        from .hf import hf_plan_strings
        from .hf_regions import check_regions, check_sequence_parallel

        if sp:
            _with_sequence_parallel(model)
        # Before anything is sharded, as parallelize_hf: what the plan leaves out is summed or refused by name.
        strings = hf_plan_strings(model, sequence_parallel=sp)
        summed = check_regions(model, strings)
        if sp:
            check_sequence_parallel(model, strings)
        _STATE["load_sp"] = sp
        try:
            model = func(cls, model, distributed_config, *args, **kwargs)
        finally:
            _STATE["load_sp"] = False
        _after_sharding(model, summed, sp)
        return model

    mixin.maybe_distribute_model = classmethod(maybe_distribute_model)
    _STATE["mixin"] = (mixin, original)


def _after_sharding(model: Any, summed: list[str], sp: bool) -> None:
    from torch.distributed.tensor import DTensor

    from .hf import install_norm_fusion, share_gathers
    from .hf_regions import name_mixed_layouts, sum_gradients_over

    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is not None:
        sum_gradients_over(model, summed, mesh.get_group())
    if sp:
        share_gathers(model)
        name_mixed_layouts(model)
    else:
        install_norm_fusion(model)


def _ep_interface() -> type | None:
    try:
        from transformers.distributed.expert_parallel import EPImplementationInterface
    except ImportError:
        return None
    return EPImplementationInterface


def _coc_ep_implementation() -> type:
    """transformers' ``EPImplementation`` on the CoC expert-parallel ops (module docstring)."""
    from transformers.distributed.expert_parallel import EPImplementation

    from .moe_ep import check_ep_experts, coc_ep_forward
    from .style_common import local_of

    class CocEP(EPImplementation):
        """``kernels.moe_dispatch_grouped_matmul`` over the EP group (this rank's experts on the CoC grouped GEMM),
        ``kernels.moe_combine``; a TP group's shared batch split over it first and gathered after."""

        def __init__(self, experts: Any, ep_mesh: Any, tp_mesh: Any) -> None:
            super().__init__(experts, ep_mesh, tp_mesh)
            where = f"ep_implementation={EP_IMPLEMENTATION!r}"
            if _load_sequence_parallel():
                raise NotImplementedError(
                    f"autopar.register_hf: {where} under sequence parallelism is not supported: the sparse block would "
                    "see the sequence-sharded residual stream; load without enable_sequence_parallel, or use "
                    "autopar.parallelize_hf(model, sequence_parallel=True, expert_parallel=True)"
                )
            # The experts' count is the global one (transformers' grouped_gemm placeholders keep the global shape).
            check_ep_experts(experts, ep_mesh.size(), where=where)
            self.experts = experts

        def __call__(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            experts = self.experts
            weights = (local_of(experts.gate_up_proj), local_of(experts.down_proj))
            split = self.tp_mesh.get_group() if self.tp_mesh.size() > 1 else None
            return coc_ep_forward(
                experts,
                (hidden_states, top_k_index, top_k_weights),
                weights,
                ep_group=self.ep_mesh.get_group(),
                split_group=split,
            )

    return CocEP


def _mixin() -> type | None:
    try:
        from transformers.distributed.mixin import DistributedMixin
    except ImportError:
        return None
    wrapped = isinstance(DistributedMixin.__dict__.get("maybe_distribute_model"), classmethod)
    return DistributedMixin if wrapped else None


def register_hf(*, sequence_parallel: bool | None = None) -> None:
    """Make transformers' tensor-parallel loading (``from_pretrained(..., distributed_config=DistributedConfig(
    tp_size=W, enable_sequence_parallel=...))``, or ``tp_plan="auto"``) run the plan's linears, embeddings and
    norms on the CoC ops; transformers still shards the parameters on load. Idempotent (a second call only sets
    ``sequence_parallel``); :func:`unregister_hf` restores transformers' layers.

    Where transformers has ``EPImplementationInterface``, ``ep_implementation="coc"`` becomes available too
    (expert parallelism on ``kernels.moe_dispatch`` / ``moe_combine``; module docstring).

    ``sequence_parallel``: None follows each load's ``DistributedConfig.enable_sequence_parallel``; True / False
    fix it for every load. Raises ``RuntimeError`` naming the transformers version where its API is missing.
    """
    registry = _registry()
    mixin = _mixin()
    if sequence_parallel and mixin is None:
        raise RuntimeError(
            f"autopar.register_hf(sequence_parallel=True): transformers {_version()} has no "
            "DistributedMixin.maybe_distribute_model to add the norms' sequence_parallel entries to; use "
            "autopar.parallelize_hf(model, sequence_parallel=True) instead"
        )
    if "styles" not in _STATE:
        originals = {key: registry[key] for key in COC_PLAN_STRINGS if key in registry}
        if "colwise" not in originals or "rowwise" not in originals:
            raise RuntimeError(
                f"autopar.register_hf: transformers {_version()}'s ALL_PARALLEL_STYLES has no 'colwise' / 'rowwise'"
            )
        for key, layer in originals.items():
            _check_layer(key, layer)
        for key, layer in originals.items():
            registry.register(key, _coc_layer(key, layer))
        _STATE["styles"] = originals
        _STATE["registry"] = registry
        if mixin is not None:
            _wrap_distribute(mixin)
        interface = _ep_interface()
        if interface is not None:
            interface.register(EP_IMPLEMENTATION, _coc_ep_implementation())
            _STATE["ep"] = interface
    _STATE["sp"] = sequence_parallel


def unregister_hf() -> None:
    """transformers' own layers back in ``ALL_PARALLEL_STYLES`` (and its ``maybe_distribute_model``); a no-op
    when :func:`register_hf` was not called. Models already loaded keep the forwards they were given."""
    originals = _STATE.pop("styles", None)
    if originals is None:
        return
    registry = _STATE.pop("registry")
    for key, layer in originals.items():
        registry.register(key, layer)
    saved = _STATE.pop("mixin", None)
    if saved is not None:
        cls, attr = saved
        cls.maybe_distribute_model = attr
    interface = _STATE.pop("ep", None)
    if interface is not None:
        interface._global_mapping.pop(EP_IMPLEMENTATION, None)
    _STATE.clear()


def is_hf_registered() -> bool:
    return "styles" in _STATE


__all__ = ["COC_PLAN_STRINGS", "EP_IMPLEMENTATION", "is_hf_registered", "register_hf", "unregister_hf"]
