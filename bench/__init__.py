"""Benchmarks of the fused / overlapped tensor-parallel ops, and a performance model.

Run ``python -m bench --help`` (``__main__``: the command line only). Sub-packages by job: ``harness`` (the suites
of configs/bench/*.yaml and their cases, rank launching, do_bench-style timing across ranks, the reports),
``model`` (predicted times from GEMM time and the link model of configs/links.yaml), ``dense`` (the dense ops
measured: ``--mode run``, ``single``, ``model``), ``moe`` (the mixture-of-experts ops: ``--mode moe``),
``gpu_check`` (``--mode gpu-check``: a GPU machine's correctness and speed report), ``tune`` (``--mode tune``:
the GEMM tiles timed, the tuned file written), ``sweep`` (``--mode hf-sweep``: Hugging Face families under
``parallelize_hf``), ``cost`` (host cost per call, ``python -m bench.cost.<name>``).
"""
