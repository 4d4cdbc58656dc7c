"""The import graph of the package, the kernels and the scripts, read from the sources: every import
statement (function-level ones included) and every ``importlib.import_module`` of a literal name. No module
reaches itself again, and the kernels module does not import the layers above it.

``python tests/test_imports_cpu.py`` prints the graph and its strongly connected components.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("q8kv8", "cute_kernels", "scripts")


def modules() -> dict[str, Path]:
    """The modules of ``PACKAGES`` by dotted name (a package is its ``__init__``)."""
    names = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(name: str, path: Path, names: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # ``from package import name``: the submodule when there is one, else the package itself
            targets += [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base for alias in node.names
            ]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "importlib"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets.append(node.args[0].value)
    found = set()
    for target in targets:
        while target and target not in names:  # a module of the package, or nothing
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    names = modules()
    return {name: imported(name, path, names) for name, path in names.items()}


def strongly_connected_components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; every component, each sorted, the largest first."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(edges[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(components, key=lambda component: (-len(component), component))


def test_no_import_cycles():
    edges = graph()
    assert {"q8kv8.api", "cute_kernels.sm90.sparse_prefill", "scripts.bench.common"} <= set(edges)
    cycles = [component for component in strongly_connected_components(edges) if len(component) > 1]
    assert cycles == []


def test_the_kernels_module_imports_no_layer_above_it():
    above = {"q8kv8", "q8kv8.api", "q8kv8.ops", "q8kv8.eager", "q8kv8.native", "q8kv8.contract"}
    assert graph()["q8kv8.kernels"] & above == set()


if __name__ == "__main__":
    edges = graph()
    for module in sorted(edges):
        print(f"{module} -> {', '.join(sorted(edges[module])) or '(none)'}")
    components = strongly_connected_components(edges)
    print(f"\n{len(components)} strongly connected components; largest: {components[0]}")


def test_a_cycle_is_found():
    components = strongly_connected_components({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert components[0] == ["a", "b", "c"]
