"""pyproject.toml declares what dask-shm imports, and bounds distributed at
the releases it is tested with."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import dask
import distributed
from packaging.requirements import Requirement

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "python" / "dask_shm"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml"}
#: extras that exist for development, not for a feature of the package
DEVELOPMENT_EXTRAS = {"bench", "test", "all"}


def requirement_names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name.lower().replace("-", "_") for r in requirements}


def imported_distributions() -> set[str]:
    """Third-party top-level modules that python/dask_shm imports anywhere
    (module level or inside functions), as distribution names."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    third_party = names - set(sys.stdlib_module_names) - {"dask_shm", "__future__"}
    return {DISTRIBUTIONS.get(name, name) for name in third_party}


def test_every_imported_package_is_a_dependency_or_in_an_extra() -> None:
    extras = PROJECT["optional-dependencies"]
    declared = requirement_names(PROJECT["dependencies"])
    for name, requirements in extras.items():
        if name not in DEVELOPMENT_EXTRAS:
            declared |= requirement_names(requirements)
    assert imported_distributions() - declared == set()


def test_optional_imports_are_in_their_extras_not_in_the_dependencies() -> None:
    dependencies = requirement_names(PROJECT["dependencies"])
    extras = PROJECT["optional-dependencies"]
    for extra, package in (("spans", "pandas"), ("prometheus", "prometheus_client")):
        assert package in requirement_names(extras[extra])
        assert package not in dependencies
    assert "matplotlib" in requirement_names(extras["demo"])
    everything = Requirement(extras["all"][0])
    assert everything.name == "dask-shm"
    assert everything.extras == set(extras) - DEVELOPMENT_EXTRAS


def test_dask_and_distributed_are_bounded_above_and_the_installed_release_is_within() -> None:
    """dask-shm hooks distributed's internals (dask_shm.compat): a release
    CI has not tested is refused by pip rather than half-working."""
    installed = {"dask": dask.__version__, "distributed": distributed.__version__}
    for requirement in map(Requirement, PROJECT["dependencies"]):
        if requirement.name in installed:
            assert any(s.operator == "<" for s in requirement.specifier), requirement
            assert requirement.specifier.contains(installed[requirement.name]), requirement
