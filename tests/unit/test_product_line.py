"""The product line: what a wheel of kvstore takes (transfer, kvstore, conductor) and which way the
three import each other. The test scaffolding (kvstore_testing/, tests/helpers) and the benchmarks
live in the source checkout only; the product must neither ship them nor import them, or an
installed kvstore would fail where a checkout works.

Reads the packages setuptools finds from pyproject.toml (what `pip wheel .` packs, in about a second
instead of a native build) and every product module's imports (ast, nothing imported)."""
from __future__ import annotations

import ast
from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("transfer", "kvstore", "conductor")


def wheel_packages() -> list[str]:
    config = read_configuration(ROOT / "pyproject.toml", expand=True)  # finds packages beside the file
    return sorted(config["tool"]["setuptools"]["packages"])


def imports_of(package: str) -> dict[str, set[str]]:
    """path -> the absolute module names each product module imports (relative imports resolved)."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        relative = path.relative_to(ROOT)
        here = list(relative.with_suffix("").parts)
        if here[-1] == "__init__":
            here = here[:-1]
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(relative))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # from .x / ..x: relative to this module's package
                    base = here[:len(here) - node.level + (path.name == "__init__.py")]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                names.add(module)
                names.update(f"{module}.{alias.name}" for alias in node.names)
        out[str(relative)] = names
    return out


def test_the_wheel_takes_the_product_alone():
    """Kills: `benchmarks*` in the find patterns (benchmarks and their results installed as a
    top-level package), a `kvstore*` pattern (which also takes kvstore_testing), test scaffolding
    moved back under kvstore/ or conductor/ (kvstore.testing, conductor.testing)."""
    packages = wheel_packages()
    assert {name.split(".")[0] for name in packages} == set(PRODUCT), packages
    scaffolding = [name for name in packages if name.split(".")[-1] in ("testing", "tests", "benchmarks")]
    assert scaffolding == [], scaffolding
    modules = [path for package in PRODUCT for path in (ROOT / package).rglob("testing.py")]
    assert modules == [], modules


def test_the_product_imports_nothing_the_wheel_leaves_out():
    """Kills: a product module importing kvstore_testing, benchmarks or a tests/helpers module (the
    demo reaching for the test harness, `kvstore bench` importing benchmarks at the top)."""
    left_out = {path.stem if path.suffix == ".py" else path.name
                for path in list(ROOT.iterdir()) + list((ROOT / "tests" / "helpers").iterdir())
                if (path.is_dir() and path.name not in PRODUCT and not path.name.startswith("."))
                or path.suffix == ".py"}
    assert {"kvstore_testing", "benchmarks", "tests", "tests_support"} <= left_out
    wrong = [(path, name) for package in PRODUCT for path, names in imports_of(package).items()
             for name in names if name.split(".")[0] in left_out]
    assert wrong == [], wrong


def test_imports_run_one_way():
    """Kills: conductor importing the vLLM integration (kvstore.integrations: the gateway's and the
    stand-in engines' block keys come from kvstore.keys, the loadable prefix from kvstore.prefix),
    transfer importing kvstore or conductor, kvstore's core importing conductor."""
    wrong = []
    for path, names in imports_of("conductor").items():
        wrong += [(path, name) for name in names if name.startswith("kvstore.integrations")]
    for path, names in imports_of("transfer").items():
        wrong += [(path, name) for name in names if name.split(".")[0] in ("kvstore", "conductor")]
    for path, names in imports_of("kvstore").items():
        wrong += [(path, name) for name in names if name.split(".")[0] == "conductor"]
    assert wrong == [], wrong
