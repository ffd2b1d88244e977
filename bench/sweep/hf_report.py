"""The Markdown table and the summary of ``python -m bench --mode hf-sweep`` (:mod:`bench.sweep.hf`)."""

from __future__ import annotations

import collections
import shlex
from typing import Any

_RANK = {"ok": 0, "skipped": 0, "refused": 1, "wrong": 2, "error": 3}


def family_status(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Each family's worst status over its rows: ``ok`` (every row matches), ``refused`` (some row refused, none
    wrong or in error), ``wrong``, ``error`` or ``skipped``."""
    out: dict[str, str] = {}
    for r in rows:
        now = out.get(r["family"])
        if now is None or _RANK[r["status"]] > _RANK[now]:
            out[r["family"]] = r["status"]
    return out


def _short(detail: str) -> str:
    """A refusal's reason without the list of supported strings that follows it."""
    return detail.split(". Supported:")[0].rstrip(".")


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Families per status (sorted names), rows per status, and the families behind each refusal, error and
    skip reason."""
    by_family = family_status(rows)
    families: dict[str, list[str]] = collections.defaultdict(list)
    for family, status in sorted(by_family.items()):
        families[status].append(family)
    reasons: dict[str, dict[str, list[str]]] = {s: collections.defaultdict(list) for s in ("refused", "error")}
    reasons["skipped"] = collections.defaultdict(list)
    for r in rows:
        if r["status"] in reasons:
            names = reasons[r["status"]][_short(r.get("detail", ""))]
            if r["family"] not in names:
                names.append(r["family"])
    return {
        "families": {s: families.get(s, []) for s in ("ok", "refused", "wrong", "error", "skipped")},
        "rows": dict(collections.Counter(r["status"] for r in rows)),
        "reasons": {s: dict(v) for s, v in reasons.items()},
    }


def summary_line(rows: list[dict[str, Any]]) -> str:
    counts = {s: len(f) for s, f in summary(rows)["families"].items()}
    total = sum(counts.values())
    return (
        f"{total} {'family' if total == 1 else 'families'}: {counts['ok']} match one process, "
        f"{counts['refused']} refused by name, {counts['wrong']} WRONG, {counts['error']} in error, "
        f"{counts['skipped']} skipped"
    )


def _cell(r: dict[str, Any] | None, notes: dict[tuple[str, str], int]) -> str:
    if r is None:
        return "-"
    status = r["status"]
    if status in ("refused", "error"):
        key = (status, _short(r.get("detail", "")))
        notes.setdefault(key, len(notes) + 1)
        return f"{status} [{notes[key]}]"
    cell = f"{r['logits']:.1e} / {r['grads']:.1e}"
    if r.get("missing_grads"):
        cell += f" ({len(r['missing_grads'])} grads missing)"
    if r.get("within_noise_only"):
        cell += " \u2020"
    if status == "wrong":
        cell = f"**WRONG** {cell}" + (f" (`{r['worst_grad']}`)" if r.get("worst_grad") else "")
    if r.get("ran") is not None and r["ran"] != [r["backend"]]:
        cell += f" (ran: {', '.join(r['ran']) or 'no CoC op'})"
    return cell


def markdown(rows: list[dict[str, Any]], *, backends: tuple[str, ...], meta: dict[str, Any]) -> str:
    """The table: one line per swept family, one column per (backend, SP), each cell the max logits / gradient
    error, ``refused [n]`` or ``error [n]`` (numbered reasons below the table); the skipped families by reason."""
    sum_ = summary(rows)
    cols = [(b, sp) for b in backends for sp in (False, True)]
    found = {(r["family"], r["backend"], r["sp"]): r for r in rows if r["status"] != "skipped"}
    families = sorted({r["family"] for r in rows if r["status"] != "skipped"})
    layers = {}
    for r in rows:
        if r["status"] != "skipped" and "layers" in r:
            layers.setdefault(r["backend"], set()).add(r["layers"])
    fused = meta.get("fused_families")
    command = "python -m bench " + shlex.join(meta.get("argv", [])[1:])
    lines = [
        f"`{command}` ({meta['date_utc'][:10]}, transformers {meta.get('transformers')}, torch "
        f"{meta['versions']['torch']}, world {meta.get('world')}, gloo CPU ranks, fp32, "
        f"tolerance {meta.get('tolerance')}):",
        f"{summary_line(rows)}.",
        "",
        "Each cell: the largest absolute error of the logits / of any gradient against the same model in one process "
        "(one forward and backward, `labels=input_ids`); `refused [n]`: `parallelize_hf` raised the named error n "
        "below; `error [n]`: anything else (a failure of the sweep). Layers per backend: "
        + ", ".join(f"{b} {'/'.join(str(n) for n in sorted(ls))}" for b, ls in sorted(layers.items()))
        + " (hybrid families get one layer of each kind)."
        + (f" `-`: not run (fused, interpreted: {', '.join(meta['fused_families'])} only)." if fused else ""),
        "",
        "| family | " + " | ".join(f"{b}, SP {'on' if sp else 'off'}" for b, sp in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    notes: dict[tuple[str, str], int] = {}
    for family in families:
        cells = [_cell(found.get((family, b, sp)), notes) for b, sp in cols]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    lines.append("")
    raised = sorted({r["family"] for r in rows if r.get("within_noise_only")})
    if raised:
        lines.append(
            f"\u2020 {', '.join(raised)}: above {meta.get('tolerance')} but within {meta.get('noise_factor')}x the "
            "one-process fp32 run's own error against the same model in fp64 (JSON: `fp32_noise`), the tolerance "
            "where that is larger.\n"
        )
    for (status, text), n in sorted(notes.items(), key=lambda kv: kv[1]):
        names = sum_["reasons"][status].get(text, [])
        lines.append(f"{n}. {status}: {text} ({', '.join(names)})")
    skipped = sum_["reasons"]["skipped"]
    if skipped:
        lines += ["", "Skipped:", ""]
        for reason, names in sorted(skipped.items()):
            lines.append(f"- {reason} ({len(names)}): {', '.join(names)}")
    return "\n".join(lines) + "\n"
