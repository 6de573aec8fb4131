"""The import layering of `tmax/`: what `lint-imports` checks (the contracts in
pyproject.toml: layers, the learner's sources, no cycles between siblings), proved to
catch an upward import, and the one rule it cannot check: no private name (`_x`) imported
from another module."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "tmax"


def _module_name(path: Path, top: Path) -> str:
    """The dotted name of the module at `path`, `top` being the directory above the package."""
    parts = list(path.relative_to(top).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_module(node: ast.ImportFrom, importer: Path, top: Path) -> str:
    """The absolute module of a `from X import ...`, relative forms resolved."""
    if not node.level:
        return node.module or ""
    package = _module_name(importer, top).split(".")
    if importer.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(root: Path) -> list[str]:
    """`file:line: from tmax.x import _name` for every private name (or private module)
    that a module under `root` imports from another tmax module, at any depth of the file."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom):
                module = _imported_module(node, path, root.parent)
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                module, names = "", [a.name for a in node.names]
            else:
                continue
            for name in names:
                target = f"{module}.{name}" if module else name
                if target.split(".")[0] != "tmax":
                    continue
                if any(_private(part) for part in target.split(".")[1:]):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: imports {target}")
    return found


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with the contracts of `root`/pyproject.toml, on the `tmax` under `root`."""
    code = "import sys\nfrom importlinter.cli import lint_imports_command\nlint_imports_command()\n"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo"], cwd=root, capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_no_private_name_is_imported_from_another_module():
    assert private_imports(PACKAGE) == []


def test_the_private_name_check_sees_every_form(tmp_path):
    pkg = tmp_path / "tmax" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "tmax" / "__init__.py").write_text("from tmax import __version__\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from tmax.sub.b import _hidden, shown\n")
    (pkg / "c.py").write_text("from . import _private_mod\nfrom .b import _x\nimport tmax.sub._impl\n")
    assert private_imports(tmp_path / "tmax") == [
        "tmax/sub/a.py:2: imports tmax.sub.b._hidden",
        "tmax/sub/c.py:1: imports tmax.sub._private_mod",
        "tmax/sub/c.py:2: imports tmax.sub.b._x",
        "tmax/sub/c.py:3: imports tmax.sub._impl",
    ]


def test_the_contracts_hold_and_catch_an_upward_import(tmp_path):
    """The tree as it is passes; the same tree with the harness importing the CLI (a layer
    above it) fails, naming the import."""
    shutil.copytree(PACKAGE, tmp_path / "tmax", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    kept = lint_imports(tmp_path)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "BROKEN" not in kept.stdout and "0 broken" in kept.stdout
    loop = tmp_path / "tmax" / "agents" / "loop.py"
    loop.write_text(loop.read_text(encoding="utf-8") + "\n\ndef _upward():\n    import tmax.cli.ui\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "tmax.agents is not allowed to import tmax.cli" in broken.stdout
    assert "tmax.agents.loop -> tmax.cli.ui" in broken.stdout
