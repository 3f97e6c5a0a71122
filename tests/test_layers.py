"""The layer order of crtn's imports (CONTRIBUTING.md, after the package tree), read from the module-level and
nested imports of every module with ``ast``:

- the base (``crtn.errors``, ``crtn.utils``) imports no other crtn module;
- ``crtn.model`` and ``crtn.data`` import only the base and themselves (a model knows no corpus,
  a corpus no model);
- the libraries (everything that is not an app) import no app; ``crtn.analysis``'s libraries
  included;
- an app (a ``console_scripts`` entry point's module, or a module of an app's own package)
  imports no other app;
- no module imports a ``_private`` name of another module;
- a name is imported from the module that defines it, or from a package that lists it in its
  ``__all__`` (its public API), never through another module that imports it (one import path).
"""

from __future__ import annotations

import ast
import configparser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "crtn"
BASE = ("crtn.errors", "crtn.utils")
#: packages that belong to one app each: every module in them is that app's
APP_PACKAGES = ("crtn.bench", "crtn.convert", "crtn.report")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def entry_points() -> dict[str, str]:
    """console script -> its module, from setup.cfg."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return {k.strip(): v.split(":")[0].strip() for k, v in (line.split("=") for line in lines)}


def app_of(module: str) -> str | None:
    """The app ``module`` belongs to (its entry point's module or app package), None: a library."""
    for package in APP_PACKAGES:
        if module == package or module.startswith(package + "."):
            return package
    return module if module in set(entry_points().values()) else None


def imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) of every crtn import in ``path`` (name None for ``import crtn.x``)."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "crtn"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "crtn":
                found += [(node.module, a.name) for a in node.names]
    return found


def target(module: str, name: str | None) -> str:
    """The crtn module an import reaches: ``from crtn.model import spec`` reaches ``crtn.model.spec``."""
    full = f"{module}.{name}" if name else module
    return full if full in MODULES else module


def inside(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_entry_points_are_modules_of_crtn():
    """The rules below know the apps by setup.cfg's entry points: each names a module here."""
    points = entry_points()
    assert "crtn-eval" in points and "crtn-train" in points
    assert set(points.values()) <= set(MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_follow_the_layers(name):
    own_app = app_of(name)
    for module, imported in imports(MODULES[name]):
        reached = target(module, imported)
        if inside(name, *BASE):
            assert not inside(reached, "crtn") or inside(reached, *BASE), f"{name} (base) imports {reached}"
        for layer in ("crtn.model", "crtn.data"):
            if inside(name, layer):
                assert inside(reached, layer, *BASE), (
                    f"{name} imports {reached}: {layer} imports itself and the base only"
                )
        reached_app = app_of(reached)
        if reached_app is not None and reached_app != own_app:
            kind = "a library" if own_app is None else f"of the app {own_app}"
            pytest.fail(f"{name} ({kind}) imports the app {reached}")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_name_is_imported_from_another_module(name):
    for module, imported in imports(MODULES[name]):
        if imported is not None and imported.startswith("_") and not imported.startswith("__"):
            pytest.fail(f"{name} imports the private name {imported} of {module}: make it public there")


def defined(path: Path) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments), and for a
    package the names its ``__all__`` lists."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            if path.name == "__init__.py" and any(
                getattr(t, "id", None) == "__all__" for t in getattr(node, "targets", [])
            ):
                names |= set(ast.literal_eval(node.value))
    return names


@pytest.mark.parametrize("path", [*MODULES.values(), *sorted((ROOT / "tests").glob("*.py"))], ids=str)
def test_names_are_imported_from_their_owner(path):
    for module, imported in imports(path):
        if imported is None or imported == "*" or f"{module}.{imported}" in MODULES or module not in MODULES:
            continue
        assert imported in defined(MODULES[module]), (
            f"{path.relative_to(ROOT)} imports {imported} from {module}, which does not define it: import it from its owner"
        )
