"""The shape of the product, checked: module sizes, one-way imports, no lookups by name, few positional parameters.

* no product module (kernels/, autopar/, bench/) over 600 lines;
* no import cycle, counting imports inside functions too (a function-level import hides a cycle, it does
  not remove it); imports under ``if TYPE_CHECKING`` are left out;
* no implementation found by name: no ``importlib.import_module`` and no ``getattr(<module>, <computed name>)``
  in the product (an explicit table, ``kernels.ops.table.OPS``, maps each op to its implementations), and that
  table covers every registered operator;
* no private name used outside its module (but the few named with their reason);
* product functions with more than 5 positional parameters (ruff's PLR0917) within a budget that only goes down;
* no ``@triton.jit`` function in kernels/ reads a tuple argument by constant index (``PROTO[1]``): constexpr bundles
  are named tuples read by field, runtime bundles are unpacked by name.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from kernels.testing import REPO_ROOT

PACKAGES = ("kernels", "autopar", "bench")
MAX_LINES = 600
# Lowered as the positional parameters go (152 before issue 28); issue 28's goal is 40. 20 at its end, all
# but 5 of them Triton kernels (launch bundles; rank, targets and timeouts stay separate arguments so that
# Triton does not specialize on them); +2 for all_reduce_rmsnorm's row push and norm kernels. The registered
# operators' bodies take their schema's arguments as one tuple (kernels.protocol.OpSpec): 20.
POSITIONAL_BUDGET = 20


# ``path:function: expression`` of the indexed tuple reads still allowed in @triton.jit functions: none.
INDEXED_TUPLES_ALLOWED: frozenset[str] = frozenset()


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every product module."""
    out = {}
    for package in PACKAGES:
        for path in sorted(Path(REPO_ROOT, package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """``(imported product module, line)`` of every import in ``path``, at module level or in a function."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the submodule when there is one.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found += [(t, node.lineno) for t in targets if t in modules and t != name]
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_over_600_lines() -> None:
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_import_cycle() -> None:
    modules = _modules()
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], int] = {}
    for name, path in modules.items():
        for target, line in _imports(name, path, modules):
            # A package's __init__ runs before its submodules: importing a submodule imports its package.
            edges.setdefault(name, set()).add(target)
            where[(name, target)] = line
    cycles = _cycles(edges)
    described = [
        " -> ".join(f"{a} (line {where[(a, b)]})" for a, b in zip(c, c[1:] + c[:1], strict=True) if (a, b) in where)
        or " <-> ".join(c)
        for c in cycles
    ]
    assert not cycles, described


def _module_aliases(tree: ast.AST, modules: dict[str, Path], package: str) -> set[str]:
    """Names bound to product modules by the file's imports (a computed attribute of torch, say a dtype
    named in a config file, is data, not an implementation)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.asname or alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
            names.update(alias.asname or alias.name for alias in node.names if f"{base}.{alias.name}" in modules)
    return names


def test_no_lookup_of_an_implementation_by_name() -> None:
    modules = _modules()
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        aliases = _module_aliases(tree, modules, package)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            # bench probes third-party installs by name (gpu-check's environment report): data, not dispatch.
            if func in ("importlib.import_module", "import_module", "__import__") and not name.startswith("bench"):
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {func}")
            if func == "getattr" and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
                target = node.args[0]
                if isinstance(target, ast.Name) and target.id in aliases:
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: getattr({target.id}, ...)")
    assert not found, found


def test_positional_parameters_within_budget() -> None:
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    cmd = [ruff, "check", "--no-cache", "--select", "PLR0917", "--preview", "--output-format", "concise"]
    out = subprocess.run(cmd + list(PACKAGES), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    rows = [line for line in out.stdout.splitlines() if "PLR0917" in line or "too-many-positional" in line]
    assert len(rows) <= POSITIONAL_BUDGET, f"{len(rows)} functions take more than 5 positional parameters:\n" + (
        "\n".join(rows)
    )


def test_one_table_covers_every_registered_operator() -> None:
    """``kernels.ops.table.OPS`` is the one table: an entry per ``torch.ops.coc`` operator, each keyed by its
    operator's name, its call class derived from the one call base, its backends among the three."""
    import torch

    from kernels.ops.table import OPS
    from kernels.protocol import Call

    names = torch._C._dispatch_get_all_op_names()
    registered = {name.removeprefix("coc::") for name in names if name.startswith("coc::")}
    assert set(OPS) == registered, (sorted(set(OPS) - registered), sorted(registered - set(OPS)))
    for key, spec in OPS.items():
        assert spec.name == key and spec.operator is getattr(torch.ops.coc, key).default, key
        assert issubclass(spec.call, Call) and spec.call is not Call, key
        assert set(spec.backends) <= {"sequential", "chunked", "fused"} and "sequential" in spec.backends, key


# Private names one product module uses from another, each with its reason; a new one is a name to make public
# in the module that owns it (or a sign the code lives in the wrong module).
PRIVATE_USES: dict[str, str] = {}


def test_no_private_name_used_across_modules() -> None:
    modules = _modules()
    uses = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        aliases[alias.asname or alias.name] = full
                    elif base in modules and alias.name.startswith("_") and not alias.name.startswith("__"):
                        uses.add(f"{name} -> {full}")
            elif isinstance(node, ast.Import):
                aliases.update({(a.asname or a.name.split(".")[0]): a.name for a in node.names if a.name in modules})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = aliases.get(node.value.id) if isinstance(node.value, ast.Name) else None
                if owner is not None and owner != name:
                    uses.add(f"{name} -> {owner}.{node.attr}")
    assert uses <= set(PRIVATE_USES), sorted(uses - set(PRIVATE_USES))
    assert len(PRIVATE_USES) <= 5


def _is_triton_jit(decorator: ast.expr) -> bool:
    return ast.unparse(decorator.func if isinstance(decorator, ast.Call) else decorator) == "triton.jit"


def _constant_index(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def _indexed_tuple_reads(source: str) -> tuple[int, list[tuple[str, int, str]]]:
    """``(@triton.jit functions, (function, line, expression) of each read by constant index)`` in ``source``.

    A read counts when its target is a parameter of the function, or a local bound with a ``tl.constexpr``
    annotation (a field of a named constexpr taken out of its bundle): ``PROTO[0]`` gives a position a meaning
    that only the launch site's tuple states, and the same position of another kernel's bundle can mean another
    thing. Slices and tensor indexing (``offs_m[:, None]``) are not constant indices."""
    functions, found = 0, []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef) or not any(_is_triton_jit(d) for d in fn.decorator_list):
            continue
        functions += 1
        names = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
        names |= {
            node.target.id
            for node in ast.walk(fn)
            if isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and ast.unparse(node.annotation) == "tl.constexpr"
        }
        found += [
            (fn.name, node.lineno, ast.unparse(node))
            for node in ast.walk(fn)
            if isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in names
            and _constant_index(node.slice)
        ]
    return functions, found


def test_indexed_tuple_reads_are_found() -> None:
    source = """
import triton
import triton.language as tl


@triton.jit
def k(X, dims, PROTO: tl.constexpr, CONFIG: tl.constexpr):
    x_ptr, stride_xm = X
    TILE: tl.constexpr = CONFIG.TILE
    offs = tl.arange(0, TILE.BLOCK_M)
    tl.store(x_ptr + offs[:, None], PROTO.WORLD + dims[3] + PROTO[-1] + TILE[0])


def host(t):
    return t[0]
"""
    functions, found = _indexed_tuple_reads(source)
    assert functions == 1
    assert sorted(expr for _, _, expr in found) == ["PROTO[-1]", "TILE[0]", "dims[3]"]


def test_triton_kernels_read_no_tuple_by_index() -> None:
    functions, unexpected = 0, []
    for path in sorted(Path(REPO_ROOT, "kernels").rglob("*.py")):
        n, reads = _indexed_tuple_reads(path.read_text(encoding="utf-8"))
        functions += n
        where = path.relative_to(REPO_ROOT).as_posix()
        unexpected += [
            f"{where}:{line}: {fn}: {expr}"
            for fn, line, expr in reads
            if f"{where}:{fn}: {expr}" not in INDEXED_TUPLES_ALLOWED
        ]
    # The walk sees the kernels at all (a decorator spelled otherwise would hide them).
    assert functions > 50, functions
    assert not unexpected, "tuple arguments read by index in @triton.jit functions:\n" + "\n".join(unexpected)
