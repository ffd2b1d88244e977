"""``python -m bench --mode tune``: the GEMM configuration space timed on this machine, the winners written into
``configs/tuned/<gpu>.yaml``. ``tuner`` (the cases, shapes and timers, the selection and the file), ``problem``
(the shapes, cases and problems it runs, and the bound a plain result is checked with), ``grouped`` (the grouped
GEMM's shapes and problem) and ``gates`` (``all_reduce_rmsnorm``'s size switch, measured).
"""
