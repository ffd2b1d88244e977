"""SPMD dispatch of the ops that have rules, one module per op family (imports go downwards only):

* :mod:`.dispatch`: the core (cached rule, reshards, local op, wrapper, autograd node);
* :mod:`.elementwise`: ``+ - * /``, negation, ``gelu``, ``relu``;
* :mod:`.matmul`: ``matmul`` / ``linear`` and their overlapped matmul + collective paths;
* :mod:`.normalization`: ``softmax``, ``layer_norm``;
* :mod:`.reduction`: ``sum``, ``mean``;
* :mod:`.shape`: ``view`` / ``reshape`` and friends, ``permute`` / ``transpose``, ``expand``, basic
  indexing, ``cat``, ``contiguous``;
* :mod:`.nn`: ``embedding``, ``scaled_dot_product_attention``, ``cross_entropy``, ``dropout``.

Each family's ``install()`` registers its handlers with ``DistTensor.__torch_function__``.
"""

from . import elementwise, matmul, nn, normalization, reduction, shape

for _family in (elementwise, matmul, normalization, reduction, shape, nn):
    _family.install()
