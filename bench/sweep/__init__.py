"""``python -m bench --mode hf-sweep``: every causal-LM family of the installed transformers with a tensor-parallel
plan, parallelized with ``autopar.parallelize_hf`` and compared with one process. ``hf`` (the families, their tiny
models, the comparison and the mode) and ``hf_report`` (the Markdown table and the summary).
"""
