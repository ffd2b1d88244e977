"""docs/api.md section 1 matches the code: the signatures it shows, the registered operators' schemas and
the table of where each op lives (files, functions, operators and the backends each operator has). A
signature, schema, backend or file that changes without its contract fails here."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

import kernels

ROOT = Path(__file__).resolve().parents[1]
API = (ROOT / "docs" / "api.md").read_text()
SECTION_1 = API[API.index("## 1. `kernels`") : API.index("## 2. `autopar`")]
PUBLIC_OPS = {
    name
    for name in kernels.__all__
    if name.endswith("matmul")
    or "matmul_" in name
    or name.startswith(("quantize_", "dequantize_", "all_reduce_", "moe_"))
}


def _code_blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks opened with ```` ```lang ```` (``""``: a bare fence)."""
    blocks: list[str] = []
    current: list[str] | None = None
    opened = ""
    for line in text.splitlines():
        if not line.startswith("```"):
            if current is not None:
                current.append(line)
        elif current is None:
            current, opened = [], line[3:].strip()
        else:
            if opened == lang:
                blocks.append("\n".join(current) + "\n")
            current = None
    return blocks


def _documented_calls(text: str) -> dict[str, list[str]]:
    """``kernels.<name>(...)`` in the section's Python blocks -> the argument text of each, balanced parens."""
    calls: dict[str, list[str]] = {}
    for block in _code_blocks(text, "python"):
        for match in re.finditer(r"kernels\.(\w+)\(", block):
            depth, i = 1, match.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(block[i], 0)
                i += 1
            calls.setdefault(match.group(1), []).append(block[match.end() : i - 1])
    return calls


def _parameters(args: str) -> list[tuple[str, str, str | None]]:
    """(name, kind, default source) of a documented argument list read as a ``def``."""
    fn = ast.parse(f"def f({args}): pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    out: list[tuple[str, str, str | None]] = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, default in zip(positional, defaults, strict=True):
        out.append((arg.arg, "POSITIONAL_OR_KEYWORD", None if default is None else ast.unparse(default)))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append((arg.arg, "KEYWORD_ONLY", None if default is None else ast.unparse(default)))
    return out


def _actual(fn: object) -> list[tuple[str, str, str | None]]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        out.append((p.name, p.kind.name, default))
    return out


DOCUMENTED = _documented_calls(SECTION_1)


def test_every_public_op_has_its_signature_in_section_1() -> None:
    assert PUBLIC_OPS - set(DOCUMENTED) == set()


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_documented_signature_is_the_function_signature(name: str) -> None:
    actual = _actual(getattr(kernels, name))
    for args in DOCUMENTED[name]:
        assert _parameters(args) == actual, f"docs/api.md shows kernels.{name}({args})"


def test_registered_operator_schemas() -> None:
    schemas = [line for block in _code_blocks(SECTION_1, "") for line in block.splitlines() if line.startswith("coc::")]
    names = {s.split("(")[0].removeprefix("coc::") for s in schemas}
    assert names == {
        "all_gather_matmul",
        "matmul_reduce_scatter",
        "matmul_all_reduce",
        "matmul",
        "all_reduce_rmsnorm",
        "grouped_matmul",
        "matmul_all_reduce_rmsnorm",
        "all_gather_grouped_matmul",
        "grouped_matmul_reduce_scatter",
        "moe_dispatch",
        "moe_combine",
        "moe_dispatch_grouped_matmul",
    }
    assert names == set(kernels.OPS)
    assert len(schemas) == len(names)
    for schema in schemas:
        name = schema.split("(")[0].removeprefix("coc::")
        assert str(getattr(torch.ops.coc, name).default._schema) == schema
        assert str(kernels.OPS[name].operator._schema) == schema


def _where_table() -> list[list[str]]:
    start = SECTION_1.index("Where each op lives")
    lines = SECTION_1[start:].splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    table = []
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("pattern",) or not cells[1].startswith("`"):
            continue
        table.append(cells)
        if cells[0] == "local GEMM":
            break
    return table


def test_where_each_op_lives() -> None:
    table = _where_table()
    listed: set[str] = set()
    operators: list[str] = []
    for _pattern, functions, registered, backends, implementation, fused, tests in table:
        (impl_path,) = re.findall(r"`([^`]+)`", implementation)
        for path in [impl_path] + re.findall(r"`([^`]+)`", fused) + re.findall(r"`([^`]+)`", tests):
            assert (ROOT / path).is_file(), path
        for name in re.findall(r"`(\w+)`", functions):
            listed.add(name)
            source = Path(inspect.getsourcefile(getattr(kernels, name))).resolve()
            assert source == (ROOT / impl_path).resolve(), (name, source)
        shown = tuple(re.findall(r"\b(sequential|chunked|fused)\b", backends))
        for name in re.findall(r"`coc::(\w+)`", registered):
            operators.append(name)
            assert shown == kernels.OPS[name].backends, (name, backends)
            spec = kernels.OPS[name]
            for fn in (*spec.impl.values(), spec.fake):
                source = Path(inspect.getsourcefile(fn)).resolve()
                assert source == (ROOT / impl_path).resolve(), (name, fn, source)
    ops = {n for n in PUBLIC_OPS if not n.startswith(("quantize_", "dequantize_"))}
    assert listed == ops
    assert sorted(operators) == sorted(kernels.OPS)


def test_api_doc_names_existing_files() -> None:
    paths = {p for p in re.findall(r"`((?:kernels|autopar|tests|configs|docs|bench)/[^`<>{}\s:]*)", API)}
    assert len(paths) > 20
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


# docs/fused.md names files of the repository in backticks: each must exist.
FUSED_DOC = (ROOT / "docs" / "fused.md").read_text()


def test_fused_doc_names_existing_files() -> None:
    paths = {p for p in re.findall(r"`((?:kernels|tests|configs|docs|bench)/[^`<>{}\s]*)`", FUSED_DOC)}
    assert paths, "docs/fused.md names no file"
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


# docs/api.md's capability table: pattern x formats x backend rows, one cell per capability, each cell made of
# "; "-separated parts that say yes / GPU only / no / n/a / untested; a part that says yes or GPU only names a test.
CAPABILITIES = (
    "gather_dim / scatter_dim",
    "several weights",
    "tuned tiles",
    "Inductor pass",
    "CUDA graphs",
    "deterministic",
)
VALUES = ("yes", "GPU only", "no", "n/a", "untested")
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]`]*\])?`")


def _capability_section() -> str:
    start = SECTION_1.index("### Capabilities by pattern, format and backend")
    return SECTION_1[start:]


def _capability_table() -> tuple[list[str], list[list[str]]]:
    lines = [line for line in _capability_section().splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    return header, rows


def test_capability_table_covers_every_pattern_format_and_backend() -> None:
    header, rows = _capability_table()
    assert header == ["pattern", "formats", "backend", *CAPABILITIES]
    keys = [tuple(row[:3]) for row in rows]
    patterns = ("all-gather + GEMM", "GEMM + reduce-scatter", "GEMM + all-reduce")
    want = [(p, f, b) for p in patterns for f in ("plain", "FP8", "int8") for b in ("sequential", "chunked", "fused")]
    assert keys == want
    notes = set(re.findall(r"^- \[(\w)\]", _capability_section(), flags=re.MULTILINE))
    for row in rows:
        assert len(row) == 3 + len(CAPABILITIES), row
        for capability, cell in zip(CAPABILITIES, row[3:], strict=True):
            where = (*row[:3], capability)
            for part in cell.split("; "):
                words = re.sub(r"`[^`]*`|\[\w\]", "", part)
                said = [v for v in VALUES if re.search(rf"(^|[\s:]){re.escape(v)}($|[\s,])", words)]
                assert said, (where, part)
                if "yes" in said or "GPU only" in said:
                    assert TEST_REF.search(part), ("names no test", where, part)
            assert set(re.findall(r"\[(\w)\]", re.sub(r"`[^`]*`", "", cell))) <= notes, (where, cell)


def test_capability_table_names_existing_tests() -> None:
    refs = set(TEST_REF.findall(_capability_section()))
    assert len(refs) > 10
    for path, name in sorted(refs):
        source = ROOT / path
        assert source.is_file(), path
        assert re.search(rf"^def {name}\(", source.read_text(), flags=re.MULTILINE), f"{path}::{name}"
