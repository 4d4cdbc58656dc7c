"""Repository plumbing: the pre-commit hooks run the same lint as ``make lint``, and CI runs ``make lint``."""

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
