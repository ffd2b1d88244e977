"""Transitional: the rank spawner moved to :mod:`kernels.testing` (import it from there)."""

from kernels.testing.ranks import REPO_ROOT, RankFailure, close_pools, get_pool, run_ranks

__all__ = ["REPO_ROOT", "RankFailure", "close_pools", "get_pool", "run_ranks"]
