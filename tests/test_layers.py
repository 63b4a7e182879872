"""The packages import one way: each only the packages of the layers below it.

Every import of the project's packages is read from their source (imports inside functions and
under TYPE_CHECKING included), so a new import against the order fails here with the module and
the line, before it turns into a cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Bottom to top; a package may import its own layer's packages only if it is itself.
LAYERS: list[set[str]] = [
    {"devtools", "resources"},
    {"cdc_assets"},
    {"checks", "demo"},
    {"sensors", "shop_analytics"},
    {"code_location", "emr"},  # the two code locations: in process, and through EMR Pipes
]
LAYER_OF = {package: n for n, layer in enumerate(LAYERS) for package in layer}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _violations() -> list[str]:
    wrong = []
    for package, layer in LAYER_OF.items():
        for path in sorted((REPO / package).rglob("*.py")):
            for line, module in _imports(path):
                target = module.split(".")[0]
                if target == package or target not in LAYER_OF:
                    continue
                if LAYER_OF[target] >= layer:
                    wrong.append(
                        f"{path.relative_to(REPO)}:{line} imports {module} "
                        f"({package} is layer {layer}, {target} is layer {LAYER_OF[target]})"
                    )
    return wrong


def test_every_package_is_in_a_layer():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert packages <= set(LAYER_OF), f"place {packages - set(LAYER_OF)} in LAYERS"


def test_packages_import_only_the_layers_below():
    assert _violations() == []


def test_the_rule_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An import of checks from cdc_assets, as the run once had, is reported."""
    fake = tmp_path / "repo"
    for package in LAYER_OF:
        (fake / package).mkdir(parents=True)
        (fake / package / "__init__.py").write_text("")
    (fake / "cdc_assets" / "hour_run.py").write_text(
        "def f():\n    from checks.expectations import audit_changes\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", fake)
    assert _violations() == [
        "cdc_assets/hour_run.py:2 imports checks.expectations (cdc_assets is layer 1, "
        "checks is layer 2)"
    ]
