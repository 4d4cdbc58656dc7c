"""Repository plumbing: the pre-commit hooks run the same lint as ``make lint``, and CI runs ``make lint``."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_COMMANDS = ("ruff check .", "ruff format --check .")


def hook_entries(text: str) -> list[str]:
    """The ``entry:`` values of a pre-commit config (without needing PyYAML)."""
    return [entry.strip() for entry in re.findall(r"^\s*entry:\s*(.+)$", text, re.MULTILINE)]


def test_pre_commit_runs_the_make_lint_commands():
    config = (REPO / ".pre-commit-config.yaml").read_text()
    assert re.search(r"^\s*- repo: local$", config, re.MULTILINE)
    assert hook_entries(config) == [f"python3 -m {command}" for command in LINT_COMMANDS]
    assert config.count("language: system") == 2 and config.count("pass_filenames: false") == 2

    makefile = (REPO / "Makefile").read_text()
    [lint_recipe] = re.findall(r"^lint:\n\t(.+)$", makefile, re.MULTILINE)
    assert lint_recipe == " && ".join(f"$(PYTHON) -m {command}" for command in LINT_COMMANDS)


def test_pre_commit_config_parses_as_yaml_when_pyyaml_is_installed():
    yaml = pytest.importorskip("yaml")  # optional: the test above reads the entries without it
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    [repo] = config["repos"]
    assert repo["repo"] == "local"
    assert [hook["entry"] for hook in repo["hooks"]] == [f"python3 -m {command}" for command in LINT_COMMANDS]


def test_ci_runs_lint_and_tests():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in ci if line.strip() and not line.lstrip().startswith("#")]
    assert "make lint" in commands and "make test" in commands
    assert commands.index("make lint") < commands.index("make test")


def _module_imports(package_dirs: tuple[str, ...]) -> dict[str, set[str]]:
    """Every module of ``package_dirs`` and the modules of the same tree it imports (any scope)."""
    paths = {}
    for package in package_dirs:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            paths[name] = path
    graph = {}
    for name, path in paths.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {module for module in imported if module in paths and module != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return components


def test_no_import_cycles():
    """No module of the package, the kernels or the scripts imports (any scope) one that imports it back."""
    graph = _module_imports(("q8kv8", "cute_kernels", "scripts"))
    assert "q8kv8.api" in graph and "scripts.bench.common" in graph
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
