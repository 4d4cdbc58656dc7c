"""Repository plumbing: the pre-commit hooks run the same lint as ``make lint``, CI runs ``make lint``,
``make test`` and ``make test-variants``, and no Makefile step hides the output of a kernel build."""

import os
import re
import shutil
import subprocess
import sys
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
    assert "make lint" in commands and "make test" in commands and "make test-variants" in commands
    assert commands.index("make lint") < commands.index("make test") < commands.index("make test-variants")


def test_make_test_variants_runs_the_per_variant_checks_on_every_variant():
    """``make test`` runs every test (the per-variant checks on the representative variants); ``make
    test-variants`` builds every variant in parallel, then runs the per-variant checks alone, on every
    variant."""
    makefile = (REPO / "Makefile").read_text()
    [test] = re.findall(r"^test: deps\n\t(.+)$", makefile, re.MULTILINE)
    [variants] = re.findall(r"^test-variants: deps\n((?:\t.+\n)+)", makefile, re.MULTILINE)
    assert test == "$(PYTHON) -m pytest -q -ra $(TEST_WORKERS) tests"
    assert variants.splitlines() == [
        "\tQ8KV8_COMPILE_AT_IMPORT=0 $(PYTHON) -m q8kv8.compile --jobs $(JOBS)",
        "\t$(PYTHON) -m pytest -q -ra --all-variants -m variants tests",
    ]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_runs_in_workers_only_where_pytest_xdist_imports():
    """``make test`` passes ``-n $(TEST_JOBS)`` to pytest when pytest-xdist imports, and runs the tests in one
    process where it does not (``python -S``: no site-packages, so no pytest-xdist)."""
    pytest.importorskip("xdist")

    def test_recipe(python: str, *variables: str) -> list[str]:
        result = subprocess.run(
            ["make", "-n", "--no-print-directory", "test", f"PYTHON={python}", *variables],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()[-1].split()

    pytest_args = ["-m", "pytest", "-q", "-ra"]
    assert test_recipe(sys.executable, "TEST_JOBS=3") == [sys.executable, *pytest_args, "-n", "3", "tests"]
    assert test_recipe(f"{sys.executable} -S") == [sys.executable, "-S", *pytest_args, "tests"]


def makefile_commands() -> list[str]:
    """The shell commands of the Makefile's recipes, each recipe line split at ``||``, ``&&``, ``;`` and
    braces."""
    recipes = re.findall(r"^\t(.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    return [part.strip() for line in recipes for part in re.split(r"\|\||&&|;|[{}]", line) if part.strip()]


def test_no_makefile_step_that_builds_kernels_hides_its_stderr():
    """A build says what it builds on stderr (a minute or more on a fresh cache), so a command whose stderr
    goes to /dev/null must build nothing: it imports q8kv8 with ``Q8KV8_COMPILE_AT_IMPORT=0`` and runs
    neither the tests, the benchmark nor ``q8kv8.compile``."""
    quiet = [c for c in makefile_commands() if re.search(r"(2|&)>\s*/dev/null|>\s*/dev/null\s+2>&1", c)]
    for command in quiet:
        assert "Q8KV8_COMPILE_AT_IMPORT=0 " in command, command
        assert not re.search(r"-m\s+(pytest|scripts\.bench|q8kv8\.compile)\b", command), command


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_deps_checks_the_imports_without_building(tmp_path):
    """``make deps`` (before ``make test`` and ``make bench``) imports torch, cutlass and q8kv8 and builds
    nothing into an empty cache: the kernels are built where their build lines are seen. ``MAKE=true``: the
    install it would fall back to is not run here."""
    environment = {**os.environ, "Q8KV8_CACHE_DIR": str(tmp_path)}
    environment.pop("Q8KV8_COMPILE_AT_IMPORT", None)
    result = subprocess.run(
        ["make", "--no-print-directory", "deps", f"PYTHON={sys.executable}", "MAKE=true"],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Installing" not in result.stdout  # the imports worked
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []
