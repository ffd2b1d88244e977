"""Host cost, measured on this machine's CPU: what the op layers add above the same work written by hand.

``admission`` (the admission every call on a group of several ranks makes, and a whole small call beside the same
math in torch), ``host`` (each backend of the kernels ops, eager and compiled), ``dispatch`` (autopar.DistTensor's
per-op dispatch against PyTorch DTensor) and ``decode`` (the decode path's ops, beside their modelled latencies
from :mod:`bench.model.decode`). Each runs as ``python -m bench.cost.<name>``; ``output`` writes the JSON of those
that save their figures.
"""
