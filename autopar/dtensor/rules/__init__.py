"""SPMD rules: from input shapes and placements to the placements the op needs and produces.

All rules reduce to :func:`einsum_rule`; see :mod:`autopar.dtensor.rules.einsum` for the semantics.
Results are pure functions of (op, shapes, placements, args), so :mod:`autopar.dtensor.ops` caches
them per key and a repeated op costs one dict lookup.
"""

from .einsum import RuleResult, broadcast_labels, einsum_rule, matmul_labels, reduction_labels

__all__ = ["RuleResult", "einsum_rule", "broadcast_labels", "matmul_labels", "reduction_labels"]
