"""The mixture-of-experts ops benchmarked (``python -m bench --mode moe``, the suites of ``configs/moe-bench.yaml``):
``mode`` (the suites, the table, the model-only run and the measured one) and ``ranks`` (what every rank runs:
each case's operands, its check against plain torch math, the timings and the link model).
"""
