"""First calls from several threads at once, without a GPU: the kernels build concurrently (each once), and no
function on a call's path imports a module, which could race another thread's import of it (a thread that
finds a module in ``sys.modules`` while another still runs its body sees it partly initialised).

``test_first_calls_gpu.py`` makes the first attention calls themselves from threads on an SM90 GPU."""

import ast
import os
import textwrap
from pathlib import Path

from fresh_process import REPO, run_python

# The modules an eager call, a custom op or a serving layer call runs through.
CALL_PATH = ("api", "contract", "eager", "kernels", "native", "ops", "paged_gather", "query", "serving")


def package_imports_in_functions(path: Path) -> dict[str, list[str]]:
    """The imports of q8kv8's own modules inside each function of ``path``: {function: [modules]}. (The
    third-party imports inside functions are the DSL's and the C++ extension's build tools, under the locks of
    ``q8kv8.build`` and ``q8kv8.native``.)"""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = []
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    names += [alias.name for alias in inner.names]
                elif isinstance(inner, ast.ImportFrom) and not inner.level:
                    names.append(inner.module or "")
            names = [name for name in names if name.split(".")[0] == "q8kv8"]
            if names:
                found[node.name] = names
    return found


def test_no_function_on_the_call_path_imports_the_package():
    offending = {}
    for module in CALL_PATH:
        imports = package_imports_in_functions(REPO / "q8kv8" / f"{module}.py")
        if imports:
            offending[module] = imports
    assert not offending, f"imports inside functions on the call path: {offending}"


CONCURRENT_BUILDS = textwrap.dedent(
    """
    from fresh_process import run_at_once
    from q8kv8 import kernels

    results = run_at_once([
        lambda: kernels.load(kernels.QCastKey(512)),
        lambda: kernels.load(kernels.QCastKey(576)),
        lambda: kernels.load(kernels.PagedGatherKey("v32")),
        lambda: kernels.load(kernels.QCastKey(512)),
    ])
    assert all(result is not None and result.function is not None for result in results)
    assert results[0].name == results[3].name == "cast_q_fp8_sm90_d512"
    print(kernels.cache_stats.misses)
    """
)


def test_threads_build_their_first_kernels_at_once(tmp_path):
    """A fresh process with an empty cache, builds deferred: four threads load three kernels at once (two ask
    for the same one); each succeeds, and each kernel is built once."""
    env = dict(os.environ, Q8KV8_CACHE_DIR=str(tmp_path), Q8KV8_COMPILE_AT_IMPORT="0")
    env.pop("CUTE_DSL_ARCH", None)
    result = run_python(CONCURRENT_BUILDS, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["3"], (result.stdout, result.stderr[-3000:])
