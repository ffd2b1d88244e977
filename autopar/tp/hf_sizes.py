"""The sizes a transformers tp_plan splits over the mesh, checked before anything is sharded.

A column-parallel projection hands each rank ``1/W`` of its output features. Inside attention those are
heads of ``head_dim`` features, which the attention module reshapes per rank with ``view(b, s, -1, head_dim)``:
a shard that is not a whole number of heads passes ``parallelize_module`` and fails at the first forward
(``shape '[2, 8, -1, 16]' is invalid``), e.g. ``num_key_value_heads=1`` at W = 2 (multi-query attention). A
size that does not divide by W at all (``intermediate_size``, ``vocab_size``) fails in the style, after the
model was partly sharded, with the module's feature count but not the config field it comes from.
:func:`check_shardable` refuses both at parallelize time, naming the config fields, their values, W and the
mesh sizes that would work.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from .style_common import is_conv1d

# Config fields that count attention heads (several families' spellings); aliases in a config's
# ``attribute_map`` (GPT-2's num_attention_heads for n_head) are skipped so that each field is named once.
HEAD_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "n_head",
    "num_heads",
    "n_heads",
    "num_kv_heads",
    "n_head_kv",
    "multi_query_group_num",
)
KV_FIELDS = {"num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"}
SIZE_FIELDS = (
    "intermediate_size",
    "moe_intermediate_size",
    "n_inner",
    "ffn_dim",
    "ffn_hidden_size",
    "d_ff",
    "hidden_size",
    "n_embd",
    "d_model",
    "vocab_size",
)
_COLUMN = ("colwise", "colwise_gather_output", "colwise_rep")
_ROW = ("rowwise", "rowwise_split_input", "rowwise_rep")


def _fields(config: Any, names: tuple[str, ...], values: set[int]) -> list[str]:
    aliases = getattr(config, "attribute_map", None) or {}
    return [
        f"{name}={getattr(config, name)}"
        for name in names
        if name not in aliases and isinstance(getattr(config, name, None), int) and getattr(config, name) in values
    ]


def _attention(model: nn.Module, name: str) -> nn.Module | None:
    """The nearest module above ``name`` whose class is an attention (``LlamaAttention``, ``GPT2Attention``, ...)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = model.get_submodule(".".join(parts[:i]))
        if "Attention" in type(parent).__name__:
            return parent
    return None


def _head_dim(attention: nn.Module, config: Any) -> int | None:
    head_dim = getattr(attention, "head_dim", None) or getattr(config, "head_dim", None)
    if not isinstance(head_dim, int):
        hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
        head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    return head_dim


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_shardable(model: nn.Module, sharded: list[tuple[str, str, str]], world: int) -> None:
    """Raise ``ValueError`` if the plan would split an attention head or a size that W does not divide.

    ``sharded``: ``(module name, plan key, tp_plan string)`` of every module the plan parallelizes. Column
    projections inside an attention module must give each rank whole heads: the heads of each (packed) block,
    ``out_features / packed / head_dim``, divisible by W. Every column and row linear's sharded features must
    divide by W (times ``packed``). The message names the config fields with those values, the plan keys, W, and
    the mesh sizes that divide everything the plan shards.
    """
    config = getattr(model, "config", None)
    problems: dict[tuple[str, str, str], list[str]] = {}  # (fields, style, why) -> plan keys
    needs: list[int] = []  # what W must divide for this model and plan
    kv_short = False
    for name, key, style in sharded:
        module = model.get_submodule(name)
        column = style in _COLUMN or style.startswith("packed_colwise")
        if not (column or style in _ROW) or not (isinstance(module, nn.Linear) or is_conv1d(module)):
            continue  # embeddings, norms and other modules: their styles check them
        conv = is_conv1d(module)
        if column:
            size, what = (module.weight.shape[1], "nf") if conv else (module.out_features, "out_features")
        else:
            size, what = (module.weight.shape[0], "nx") if conv else (module.in_features, "in_features")
        blocks = int(style.partition(":")[2] or 2) if style.startswith("packed_colwise") else 1
        attention = _attention(model, name) if column else None
        head_dim = _head_dim(attention, config) if attention is not None else None
        block = size // blocks
        if head_dim and size % blocks == 0 and block % head_dim == 0:
            heads = block // head_dim
            needs.append(heads)
            if heads % world:
                fields = _fields(config, HEAD_FIELDS, {heads})
                kv_short = kv_short or (heads < world and any(f.partition("=")[0] in KV_FIELDS for f in fields))
                named = " and ".join(fields or [f"{heads} heads"])
                why = (
                    f"each rank would get {heads}/{world} heads of {head_dim} features, which the attention "
                    "cannot reshape into heads: the first forward would fail"
                )
                problems.setdefault((named, style, why), []).append(key)
            continue
        needs.append(block if size % blocks == 0 else size)
        if size % (world * blocks):
            named = " and ".join(_fields(config, SIZE_FIELDS, {size, block}) or [f"{what}={size}"])
            why = f"{blocks} blocks of {block} features" if blocks > 1 else f"{size} features"
            problems.setdefault((named, style, f"{why} in {world} equal shards"), []).append(key)
    if not problems:
        return
    listed = "; ".join(
        f"{named}, split by {style} of {', '.join(dict.fromkeys(keys))} ({why})"
        for (named, style, why), keys in problems.items()
    )
    works = ", ".join(map(str, _divisors(math.gcd(*needs))))
    hint = (
        " With fewer KV heads than ranks (multi-query / grouped-query attention) each KV head would have to be "
        "replicated on several ranks, which parallelize_hf does not do."
        if kv_short
        else ""
    )
    raise ValueError(
        f"parallelize_hf: the mesh size W={world} does not divide what the tp_plan shards: {listed}. "
        f"Mesh sizes that divide everything this plan shards: {works}.{hint}"
    )


__all__ = ["check_shardable"]
