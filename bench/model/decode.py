"""The decode path's layer end, modelled: PREDICTED latencies of all-reduce + residual + RMSNorm, never measurements.

Model (:mod:`bench.model.dense`'s link and device parameters, configs/links.yaml), for ``x [tokens, hidden]`` in bf16
on ``W`` ranks of one NVSwitch node, each algorithm of ``kernels.all_reduce_rmsnorm``:

* ``unfused``: the collective library's all-reduce (``collective_time``) then a separate RMSNorm kernel;
* ``one_shot``: one launch; every rank stores its ``B`` bytes into each of the ``W - 1`` peers (one signal,
  ``(W - 1) B`` over its link), then reads ``W B`` from HBM to sum, and the norm pass (fp32 h, 2 launches);
* ``two_shot``: each rank sends ``(W - 1) / W`` of ``B`` to the owners, reduces its rows, sends the fp32 rows
  back (``(W - 1) / W`` of ``2 B``), two signals, three launches with the norm.

and the choice ``auto`` makes with the tuned file's default gates (:func:`model_rows`). :data:`ANCHORS` holds the
published figures the issue cites (not measured here). ``python -m bench.cost.decode`` prints both, beside the host cost
of the decode ops measured on this machine.
"""

from __future__ import annotations

from bench.model import dense as perf_model

# Published figures the issue cites (8 x H100 unless said otherwise): label -> (tokens, hidden, W, us).
ANCHORS = {
    "NCCL all-reduce, 8 KB": (None, None, 8, 21.4),
    "Triton one-shot all-reduce, 8 KB": (None, None, 8, 13.4),
    "multimem all-reduce, up to 256 KB": (None, None, 8, 11.5),
    "Triton all-reduce + residual + RMSNorm, 6 tokens, hidden 6144": (6, 6144, 8, 6.7),
    "fused all-reduce + RMSNorm, 128 tokens, H100 TP2": (128, None, 2, 30.0),
    "unfused all-reduce + RMSNorm, 128 tokens, H100 TP2": (128, None, 2, 17.0),
}
BF16 = 2


def modelled(link: perf_model.LinkModel, tokens: int, hidden: int, world: int) -> dict[str, float]:
    """Predicted microseconds of each algorithm for ``x [tokens, hidden]`` bf16 on ``world`` ranks."""
    b = tokens * hidden * BF16
    hbm = link.hbm_bytes_per_s or 1.0
    bw = link.link_bytes_per_s or 1.0
    norm = link.launch_s + (4 * tokens * hidden * 2 + 2 * b) / hbm  # fp32 h read twice, residual + y written
    unfused = link.collective_time("all_reduce", b, world) + norm
    one_shot = link.launch_s + link.signal_latency_s + (world - 1) * b / bw + world * b / hbm + norm
    part = (world - 1) / world
    two_shot = 2 * link.launch_s + 2 * link.signal_latency_s + part * b / bw + part * 2 * b / bw + b / hbm + norm
    return {"unfused": unfused * 1e6, "one_shot": one_shot * 1e6, "two_shot": two_shot * 1e6}


def _auto(b: int) -> str:
    from kernels.fused import tuned

    if b <= tuned.DEFAULT_ONE_SHOT_MAX_BYTES:
        return "one_shot"
    return "two_shot" if b <= tuned.DEFAULT_FUSED_MAX_BYTES else "unfused"


def model_rows(generation: str, *, tokens: list[int], hidden: list[int], worlds: list[int]) -> list[dict]:
    link, _ = perf_model.load_gpu(generation)
    rows = []
    for w in worlds:
        for h in hidden:
            for t in tokens:
                times = modelled(link, t, h, w)
                rows.append(dict(world=w, hidden=h, tokens=t, bytes=t * h * BF16, auto=_auto(t * h * BF16), **times))
    return rows
