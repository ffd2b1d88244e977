"""The Inductor post-grad pass that rewrites compiled torch-native tensor-parallel patterns into the coc ops
(docs/inductor.md): :mod:`.rewrite` (the pass: switching it on, the all-gather / reduce-scatter / all-reduce +
matmul rewrites), :mod:`.patterns` (matching helpers), :mod:`.scaled` (FP8 matmuls), :mod:`.int8` (int8 weights),
:mod:`.norm` (all-reduce + residual + RMSNorm)."""

from .rewrite import disable_inductor_pass, enable_from_environment, enable_inductor_pass, use_inductor_pass

__all__ = ["disable_inductor_pass", "enable_from_environment", "enable_inductor_pass", "use_inductor_pass"]
