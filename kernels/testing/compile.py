"""A ``torch.compile`` backend for tests of graph rewrites: Inductor's graph passes without its code generation.

:func:`graph_passes_backend` runs what Inductor runs up to lowering: AOTAutograd with Inductor's
decompositions, the joint-graph passes and the partitioner, then on each forward and backward graph
``view_to_reshape``, fake-tensor propagation and the post-grad passes (``post_grad_custom_post_pass``,
hence the coc pass of :mod:`kernels.inductor.rewrite`, included). It then runs the resulting graph with
eager kernels instead of lowering it to C++ and compiling that. So the graphs a test inspects are the
ones Inductor would lower, and the numbers it checks come from the rewritten graph; what it leaves out
is Inductor's lowering and C++ code generation, which is the cost of a CPU compile (about 13 s of a
one-layer Llama's forward and backward with an empty cache) and which the tests that compile with
Inductor itself cover.

The hook is the ``inner_compile`` argument of ``torch._inductor.compile_fx.compile_fx`` and three of
its private helpers. Where those are missing (a torch other than the ones this was written against),
the backend warns and compiles with Inductor itself: a slower test, never a weaker one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _post_grad_graph_runner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
    """``inner_compile``: the graph passes of Inductor's ``codegen_and_compile``, then the graph itself."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import _recursive_post_grad_passes, fake_tensor_prop, view_to_reshape
    from torch._inductor.virtualized import V

    view_to_reshape(gm)
    with torch.no_grad():
        fake_mode = fake_tensor_prop(gm, example_inputs)
    with V.set_fake_mode(fake_mode):
        _recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", False))
    gm.recompile()
    return make_boxed_func(gm.forward)


def graph_passes_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """``torch.compile(model, backend=graph_passes_backend)``: Inductor's graphs run eagerly (module docstring)."""
    from torch._inductor.compile_fx import compile_fx

    try:
        from torch._functorch.aot_autograd import make_boxed_func  # noqa: F401
        from torch._inductor.compile_fx import _recursive_post_grad_passes, fake_tensor_prop, view_to_reshape  # noqa: F401
        from torch._inductor.virtualized import V  # noqa: F401
    except ImportError:
        warnings.warn(
            "kernels.testing.graph_passes_backend: this torch lacks the Inductor hooks it uses; "
            "compiling with Inductor itself",
            stacklevel=2,
        )
        return compile_fx(gm, example_inputs)
    return compile_fx(gm, example_inputs, inner_compile=_post_grad_graph_runner)
