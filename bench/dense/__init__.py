"""The dense tensor-parallel ops benchmarked (``all_gather_matmul``, ``matmul_reduce_scatter``,
``matmul_all_reduce`` in every operand format): ``modes`` (``python -m bench --mode run | single | model``),
``runner`` (what every rank runs: the check against sequential, then the timings and the derived figures),
``single`` (one GPU's fixed costs) and ``formats`` (each operand format's operands, op, unfused baseline and bound).
"""
