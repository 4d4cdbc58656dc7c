"""The README and ``docs/usage.md`` agree with the code and with each other (CPU tests): the signatures they
show are the functions' own, and figures they quote from ``docs/perf-notes.md`` (the record of what was
measured) are quoted whole, with the quantity they measure."""

import ast
import inspect
import re
from pathlib import Path

import pytest

import q8kv8

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/usage.md")
DOCUMENTED = {
    "sparse_mla_q8kv8_prefill_fwd": q8kv8.sparse_mla_q8kv8_prefill_fwd,
    "sparse_mla_q8kv8_paged_fwd": q8kv8.sparse_mla_q8kv8_paged_fwd,
    "SparsePrefill": q8kv8.SparsePrefill,
    "forward": q8kv8.SparsePrefill.forward,
    "forward_merged": q8kv8.SparsePrefill.forward_merged,
}
"""The callables whose signatures the docs show in their code blocks, by the name the blocks call."""


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def shown_signatures(text: str) -> list[tuple[str, ast.arguments]]:
    """Each call of a ``DOCUMENTED`` name in the Python code blocks whose arguments read as a parameter list
    (names and ``name=default``, perhaps a ``*``): (name, the parameters). Example calls with expressions as
    arguments are not signatures and are left out."""
    shown = []
    for block in code_blocks(text):
        for match in re.finditer(rf"\b({'|'.join(DOCUMENTED)})\(", block):
            depth, end = 1, match.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(block[end], 0)
                end += 1
            parameters = block[match.end() : end - 1]
            try:
                tree = ast.parse(f"def shown({parameters}): pass")
            except SyntaxError:
                continue
            shown.append((match.group(1), tree.body[0].args))
    return shown


def real_parameters(name: str) -> list[inspect.Parameter]:
    parameters = list(inspect.signature(DOCUMENTED[name]).parameters.values())
    return parameters[1:] if parameters and parameters[0].name == "self" else parameters


def shown_parameters(arguments: ast.arguments) -> list[tuple[str, inspect._ParameterKind, object]]:
    """A shown parameter list as (name, kind, default): ``inspect.Parameter.empty`` for no default."""
    positional = [argument.arg for argument in arguments.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(arguments.defaults))
    defaults += [ast.literal_eval(default) for default in arguments.defaults]
    keyword_only = [argument.arg for argument in arguments.kwonlyargs]
    keyword_defaults = [
        inspect.Parameter.empty if default is None else ast.literal_eval(default)
        for default in arguments.kw_defaults
    ]
    return [
        *(
            (name, inspect.Parameter.POSITIONAL_OR_KEYWORD, d)
            for name, d in zip(positional, defaults, strict=True)
        ),
        *(
            (name, inspect.Parameter.KEYWORD_ONLY, d)
            for name, d in zip(keyword_only, keyword_defaults, strict=True)
        ),
    ]


@pytest.mark.parametrize("doc", DOCS)
def test_shown_signatures_are_the_functions_own(doc):
    """A shown parameter is a real one of the same kind (positional, or keyword-only after ``*``); one without
    a default is the real one at its position, one with a default has that default; a list with a ``*``
    leaves none out."""
    shown = shown_signatures((REPO / doc).read_text())
    assert {"sparse_mla_q8kv8_prefill_fwd", "sparse_mla_q8kv8_paged_fwd", "forward"} <= {n for n, _ in shown}
    for name, arguments in shown:
        real = real_parameters(name)
        by_name = {parameter.name: parameter for parameter in real}
        parameters = shown_parameters(arguments)
        for index, (parameter, kind, default) in enumerate(parameters):
            where = (doc, name, parameter)
            assert parameter in by_name and by_name[parameter].kind is kind, where
            if default is inspect.Parameter.empty:
                assert real[index].name == parameter, where
            else:
                assert by_name[parameter].default == default, where
        if arguments.kwonlyargs:
            assert [parameter for parameter, _, _ in parameters] == list(by_name), (doc, name)


MEASURED = re.compile(
    r"`max_logits` at dominant logits of 20-30 \(worst relative error\): [^`]*?\(accurate\)"
)
"""The paged and workspace paths' logit errors as ``docs/perf-notes.md`` records them."""


def test_quoted_logit_errors_are_perf_notes_figures_with_their_quantity():
    """Every doc that gives the dominant-logit errors quotes the record whole (figures, paths, precisions and
    the quantity: ``max_logits``), and its figures appear nowhere else in it, under another name."""
    normalised = {name: " ".join((REPO / name).read_text().split()) for name in (*DOCS, "docs/perf-notes.md")}
    records = MEASURED.findall(normalised["docs/perf-notes.md"])
    assert len(records) == 1, records
    [record] = records
    figures = re.findall(r"-\d\.\de-\d", record)
    assert len(figures) == 4
    for name, text in normalised.items():
        assert MEASURED.findall(text) == [record], name
        for figure in figures:
            assert text.count(figure) == record.count(figure), (name, figure)


def test_schedule_describe_in_the_readme_takes_num_sms_as_without_a_gpu_it_must():
    """The README shows ``describe``'s signature as the code has it and says when to pass ``num_sms``; the
    answer for 8 decode tokens of 16 heads at topk 2048 is a split of 64-head tiles, the README's exception to
    the small-head rule."""
    from q8kv8 import schedule

    readme = " ".join((REPO / "README.md").read_text().split())
    parameters = inspect.signature(schedule.describe).parameters.values()
    empty = inspect.Parameter.empty
    shown = ", ".join(p.name if p.default is empty else f"{p.name}={p.default}" for p in parameters)
    assert f"`q8kv8.schedule.describe({shown})`" in readme
    assert "without a GPU pass `num_sms=`" in readme
    assert "except a few tokens at a long top-k (8 decode tokens at topk 2048, say)" in readme
    assert inspect.signature(schedule.describe).parameters["num_sms"].default is None
    assert schedule.describe(8, 16, 2048, num_sms=132).startswith("split in ")
    assert schedule.describe(4096, 16, 2048, num_sms=132).startswith("small heads")


def test_the_readme_counts_the_variants_the_build_checks_run_on():
    """The README's counts of the variants the per-variant build checks run on: the representative ones of
    ``make test`` (``tests/variant_subset.py``) and every listed one of ``make test-variants``."""
    from variant_subset import REPRESENTATIVE

    from q8kv8 import kernels

    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"run in `make test` on {len(REPRESENTATIVE)} representative variants" in readme
    assert f"in `make test-variants` on all {len(kernels.LISTED_KEYS)} (CI runs both)" in readme
