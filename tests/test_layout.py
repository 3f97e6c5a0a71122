"""The package's layout rules: no import cycle in crtn/; in every module of crtn/ (crtn/model/
included) no import inside a function except of optional dependencies, no module over 600
lines, no function over 80 lines, and keywords where a call passes more than four arguments
(CONTRIBUTING.md lists the exceptions below and why)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "crtn"
#: Imported where they are used: optional, or slow to import and needed only by one feature.
OPTIONAL = ("faiss", "matplotlib", "tensorboard", "torch.utils.tensorboard", "submitit")
#: Allowed exceptions (file, module), with the reason; none at present.
NESTED_IMPORT_OK: set[tuple[str, str]] = set()
#: Calls whose extra arguments are a format's values or a tensor's sizes, not parameters, and
#: autograd.Function.apply, which takes its inputs positionally.
VARARGS_CALLS = {"info", "warning", "error", "debug", "exception", "critical"} | {
    "empty",
    "zeros",
    "ones",
    "full",
    "randn",
    "new_empty",
    "new_zeros",
    "view",
    "reshape",
    "permute",
    "expand",
    "repeat",
    "apply",
    "Sequential",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
APP_LAYER = list(MODULES.values())  # the model package keeps the same rules


def rel(path: Path) -> str:
    return str(path.relative_to(PKG.parent))


def test_no_import_cycle():
    """Module-level imports between crtn modules form no cycle (a module's parent packages count)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for t in targets:
                parts = t.split(".")
                deps |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & set(MODULES)
        own_parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = deps - {name} - own_parents
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join([*path[path.index(d) :], d])
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("path", APP_LAYER, ids=rel)
def test_application_layer_limits(path):
    source = path.read_text()
    tree = ast.parse(source)
    assert len(source.splitlines()) <= 600, f"{rel(path)} has more than 600 lines"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= 80, f"{rel(path)}:{node.lineno}: {node.name} has {length} lines"
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    mod = sub.module if isinstance(sub, ast.ImportFrom) else sub.names[0].name
                    ok = mod.startswith(OPTIONAL) or (rel(path), mod) in NESTED_IMPORT_OK
                    assert ok, f"{rel(path)}:{sub.lineno}: import of {mod} inside {node.name}"
        if isinstance(node, ast.Call):
            positional = sum(not isinstance(a, ast.Starred) for a in node.args)
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if positional + len(node.keywords) > 4 and func not in VARARGS_CALLS:
                assert positional <= 3, (
                    f"{rel(path)}:{node.lineno}: {func}() with {positional} positional arguments"
                )
