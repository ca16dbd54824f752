"""The layout rules the code keeps, read from the source (no Redis, no framework):

* the core (``taskguard/``) imports no task framework;
* the adapters use the core through names its modules export (``__all__``), never a private name;
* no module of the project imports another of its modules inside a function to dodge an import
  cycle (a function-level import is kept only for an optional dependency, listed below with why);
* no module reads another module's private name.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "taskguard"
ADAPTERS = ROOT / "integrations"
PROJECT = ("taskguard", "taskguard_celery", "taskguard_rq")

#: function-level imports of project modules kept on purpose: (file, module imported) -> why
LAZY_ON_PURPOSE = {
    ("taskguard/cli.py", "taskguard.metrics"): "prometheus_client is the optional 'prometheus' extra",
    ("taskguard/cli.py", "taskguard_rq.cron"): "rq is the optional 'rq' extra; the CLI must not import it",
    ("taskguard/pytest_plugin.py", "taskguard.*"): "a pytest plugin entry point imports the library when a "
    "test asks for a fixture, not when pytest starts",
    ("integrations/taskguard_celery/__init__.py", "taskguard_celery"): "the module docstring's example",
    ("integrations/taskguard_rq/__init__.py", "taskguard_rq"): "the module docstring's example",
}


def sources() -> list[Path]:
    return sorted([*CORE.rglob("*.py"), *ADAPTERS.rglob("*.py")])


def module_name(path: Path) -> str:
    rel = path.relative_to(ADAPTERS if ADAPTERS in path.parents else ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def absolute(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module_name(path).split(".")
    if path.name != "__init__.py":
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported(path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [absolute(path, node)]


def in_project(name: str) -> bool:
    return name.split(".")[0] in PROJECT


def function_level_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return found


def lazy_allowed(rel: str, name: str) -> bool:
    return any(rel == f and (name == m or (m.endswith(".*") and name.startswith(m[:-1]))) for f, m in LAZY_ON_PURPOSE)


def test_the_core_imports_no_task_framework():
    bad = []
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported(path, node):
                    if name.split(".")[0] in ("celery", "kombu", "rq", "billiard"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_function_level_import_of_a_project_module_except_for_an_optional_dependency():
    bad = []
    for path in sources():
        rel = str(path.relative_to(ROOT))
        for node in function_level_imports(ast.parse(path.read_text())):
            for name in imported(path, node):
                if in_project(name) and not lazy_allowed(rel, name):
                    bad.append(f"{rel}:{node.lineno} imports {name} inside a function")
    assert not bad, "\n".join(bad)


def test_the_adapters_import_only_exported_names_of_the_core():
    bad = []
    for path in ADAPTERS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            name = absolute(path, node)
            if name.split(".")[0] != "taskguard":
                continue
            exported = set(getattr(importlib.import_module(name), "__all__", ()))
            for alias in node.names:
                if alias.name not in exported:
                    try:  # a submodule imported by name (from taskguard import metrics)
                        importlib.import_module(f"{name}.{alias.name}")
                        continue
                    except ImportError:
                        pass
                    bad.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {name}, "
                        f"which is not in its __all__"
                    )
    assert not bad, "\n".join(bad)


def test_no_module_reads_another_modules_private_names():
    bad = []
    for path in sources():
        tree = ast.parse(path.read_text())
        modules: dict[str, str] = {}  # local name -> project module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = absolute(path, node)
                for alias in node.names:
                    if in_project(base) and alias.name.startswith("_") and not alias.name.startswith("__"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {base}")
                    full = f"{base}.{alias.name}"
                    if in_project(base) and importlib.util.find_spec(base) and _is_module(full):
                        modules[alias.asname or alias.name] = full
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if in_project(alias.name):
                        modules[alias.asname or alias.name.split(".")[0]] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {modules[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.parametrize("module", ["taskguard", "taskguard_celery", "taskguard_rq"])
def test_every_name_in_all_exists(module):
    mod = importlib.import_module(module)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing
