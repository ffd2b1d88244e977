"""kernels.testing.compile: Inductor's graph passes, no code generation, the eager result."""

from __future__ import annotations

import torch

from kernels.testing.compile import graph_passes_backend


def test_graph_passes_run_and_the_rewritten_graph_computes_the_result(monkeypatch):
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.graph import GraphLowering

    def no_codegen(*args, **kwargs):
        raise AssertionError("Inductor generated code")

    monkeypatch.setattr(GraphLowering, "compile_to_module", no_codegen)
    seen: list[list[str]] = []

    class Rewrite(CustomGraphPass):
        """Records each graph's ops and turns every aten.sin into aten.cos: the result shows which graph ran."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            seen.append([str(n.target) for n in graph.nodes if n.op == "call_function"])
            for node in graph.nodes:
                if node.target is torch.ops.aten.sin.default:
                    node.target = torch.ops.aten.cos.default

        def uuid(self) -> None:
            return None

    monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", Rewrite())
    torch._dynamo.reset()
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(3, 4)
    fn = torch.compile(lambda x: torch.sin(x @ w).sum(), backend=graph_passes_backend, fullgraph=True)
    out = fn(x)
    out.backward()
    torch._dynamo.reset()
    # The forward graph ran rewritten (sin as cos); the backward graph, d sin(h) = cos(h), holds no sin.
    h = x.detach() @ w
    assert torch.allclose(out, torch.cos(h).sum())
    assert len(seen) == 2 and "aten.sin.default" in seen[0] and "aten.sin.default" not in seen[1], seen
    assert torch.allclose(x.grad, torch.cos(h) @ w.T)
