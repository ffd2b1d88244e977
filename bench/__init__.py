"""Benchmarks of the fused / overlapped tensor-parallel ops, and a performance model.

Run ``python -m bench --help``. Modules: ``suites`` (configs/bench/*.yaml -> cases), ``timing``
(do_bench-style timing across ranks), ``launch`` (own ranks or torchrun), ``runner`` (what each
rank does), ``single`` (single-GPU fixed costs), ``model`` (predicted times from GEMM time and the
link model of configs/links.yaml), ``report`` (table, JSON, CSV, PNG).
"""
