"""The packages import one way: each only the packages of the layers below it.

Every import of the project's packages is read from their source (imports inside functions and
under TYPE_CHECKING included), so a new import against the order fails here with the module and
the line, before it turns into a cycle.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Bottom to top; a package may import its own layer's packages only if it is itself.
LAYERS: list[set[str]] = [
    {"resources"},
    {"cdc_assets", "devtools"},  # devtools' Spark Connect server runs resources.spark's session
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


# --- the wheel holds the product, never the workshop ---------------------------------------------

# Run from the checkout only (scripts/*.sh, the tests, the demo): never in the wheel.
WORKSHOP = {"demo", "devtools", "benchmarks"}


def _wheel_packages(root: Path) -> set[str]:
    """The top-level packages pyproject.toml puts in the wheel."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    return {
        p.removesuffix("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]
    }


def _imports_outside_the_wheel(root: Path) -> list[str]:
    """Imports, at import or run time, of a checkout package the wheel lacks, from the wheel's."""
    product = _wheel_packages(root)
    outside = {p.parent.name for p in root.glob("*/__init__.py")} - product
    return [
        f"{path.relative_to(root)}:{line} imports {module}"
        for package in sorted(product)
        for path in sorted((root / package).rglob("*.py"))
        for line, module in _imports(path)
        if module.split(".")[0] in outside
    ]


def test_the_wheel_is_the_product_and_imports_nothing_outside_it():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages - WORKSHOP == _wheel_packages(REPO)
    assert _imports_outside_the_wheel(REPO) == []


def test_an_import_of_the_workshop_is_reported(tmp_path: Path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.packages.find]\ninclude = ["resources*"]\n'
    )
    for package in ("resources", "devtools"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "resources" / "jvm.py").write_text("def f():\n    import devtools.processes\n")
    assert _imports_outside_the_wheel(tmp_path) == ["resources/jvm.py:2 imports devtools.processes"]


# --- no module-level import cycle -------------------------------------------------------------


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports when it is imported: its top-level statements (an
    import inside a function, or under `if TYPE_CHECKING:`, runs later or never)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` imports the module, `from module import name` the
            # module: whichever of the two is a project module.
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in known
                else node.module
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _import_cycles(root: Path) -> list[list[str]]:
    """The import cycles among the modules of the layered packages, each as its modules."""
    paths = {
        _module_name(path, root): path
        for package in LAYER_OF
        for path in sorted((root / package).rglob("*.py"))
    }
    known = set(paths)
    graph = {module: _top_level_imports(path, known) - {module} for module, path in paths.items()}
    # Tarjan's strongly connected components: a component of two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_through_others_when_imported():
    assert _import_cycles(REPO) == []


def test_the_cycle_rule_can_fail(tmp_path: Path):
    fake = tmp_path / "repo"
    for package in LAYER_OF:
        (fake / package).mkdir(parents=True)
        (fake / package / "__init__.py").write_text("")
    (fake / "cdc_assets" / "decode.py").write_text("from cdc_assets.batch_decode import run\n")
    (fake / "cdc_assets" / "batch_decode.py").write_text("from cdc_assets import decode\n")
    (fake / "cdc_assets" / "tally.py").write_text("def f():\n    from cdc_assets import decode\n")
    assert _import_cycles(fake) == [["cdc_assets.batch_decode", "cdc_assets.decode"]]


PRODUCT = ("cdc_assets", "checks", "sensors", "resources", "shop_analytics", "emr", "code_location")


def _private_imports(root: Path) -> list[str]:
    """`from <product module> import _name` in another module of the product packages (ruff's
    SLF001 catches `module._name`, not this)."""
    found = []
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                    continue
                if node.module.split(".")[0] not in PRODUCT:
                    continue
                found += [
                    f"{path.relative_to(root)}:{node.lineno} imports {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    return found


def test_no_module_imports_another_modules_private_name():
    assert _private_imports(REPO) == []


def test_the_private_import_rule_can_fail(tmp_path: Path):
    for package in PRODUCT:
        (tmp_path / package).mkdir()
    (tmp_path / "checks" / "a.py").write_text("from cdc_assets.decoding.fast import _Group\n")
    assert _private_imports(tmp_path) == ["checks/a.py:1 imports cdc_assets.decoding.fast._Group"]
