"""Scripts run in a fresh Python process, for the tests of first calls: ``run_python`` starts one, and
``run_at_once`` (importable there) makes calls from threads that start together."""

import os
import subprocess
import sys
import threading
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def run_python(code: str, *args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``python -c code *args`` in the repository root with ``env`` and this folder on its path (for
    ``from fresh_process import run_at_once``); its output captured as text."""
    path = os.pathsep.join(filter(None, (str(TESTS), env.get("PYTHONPATH"))))
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=dict(env, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_at_once(calls: list) -> list:
    """Each of ``calls`` (functions of no argument) called in a thread of its own, the threads released
    together; their results, in order. Fails naming every call that raised."""
    start = threading.Barrier(len(calls))
    results, errors = [None] * len(calls), []

    def run(i):
        start.wait()
        try:
            results[i] = calls[i]()
        except BaseException as exc:
            errors.append(f"case {i}: {exc!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results
