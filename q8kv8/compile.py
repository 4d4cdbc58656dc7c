"""``python -m q8kv8.compile``: build every kernel variant ahead of time, into the disk cache.

Run it once per machine (or in a container build) so that no process pays the compile: it builds each
kernel variant (``q8kv8.kernels.listed_variants()``: every attention variant, those for a bfloat16 q
included, and the serving path's kernels) for sm_90a (no GPU needed) or loads it when the cache already
holds it, and prints, for each,
its name, where it came from (``compiled`` or ``cache``) and the seconds it took, then the cache
location. The cache is ``$Q8KV8_CACHE_DIR`` (default ``~/.cache/q8kv8``); see ``q8kv8.build``.

Each variant compiled says so on stderr as it is done (``q8kv8: built NAME (SECONDS s)``, after one line that
says where the build goes), so a build in progress shows its progress; loads are silent.

``--jobs N`` builds them in N processes (each variant compiles on one CPU core; the listing then shows where
each came from in its process; the workers' lines reach stderr too, without repeating the announcement the
command made). The variants that ``import q8kv8`` builds are built before the command starts, in one
process, unless ``Q8KV8_COMPILE_AT_IMPORT=0`` is set.

Exits with status 1, printing the one-line ``KernelCompileError``, when a variant fails to build.

SIGINT (Ctrl-C) or SIGTERM stops it at once, its worker processes with it (a build in progress is abandoned;
an entry it left incomplete is rebuilt when next loaded): it says so in one line on stderr and exits with
status 128 + the signal's number (130, 143). The variants built before stay cached. A failed build stops the
other workers' builds too.
"""

import argparse
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import ProcessPoolExecutor

COMPILE_AT_IMPORT_ENV = "Q8KV8_COMPILE_AT_IMPORT"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class _Stopped(BaseException):
    """SIGINT or SIGTERM arrived (a ``BaseException``, as ``KeyboardInterrupt``, so no handler of
    ``Exception`` takes it for a failed build)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum, _frame):
    raise _Stopped(signum)


def _init_worker(announced: bool) -> None:
    """(In a worker process.) Ctrl-C reaches the whole process group: a worker leaves it to the command,
    which terminates its workers."""
    from q8kv8 import disk_cache

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    disk_cache.set_build_announced(announced)


def _build(loader) -> tuple[str, str, float]:
    """(In a worker process.) Build or load one variant: its name, where it came from and the seconds."""
    variant = loader()
    return variant.name, variant.source, variant.seconds


def build_in_processes(jobs: int) -> dict[str, tuple[str, float]]:
    """Every listed variant, built or loaded by ``jobs`` worker processes; by name: (from, seconds)."""
    from q8kv8 import disk_cache, kernels

    previous = os.environ.get(COMPILE_AT_IMPORT_ENV)
    os.environ[COMPILE_AT_IMPORT_ENV] = "0"  # a worker's import of q8kv8 builds nothing of its own
    try:
        context = multiprocessing.get_context("spawn")  # no CUDA or DSL state forked into the workers
        others = set(multiprocessing.active_children())
        pool = ProcessPoolExecutor(
            jobs,
            mp_context=context,
            initializer=_init_worker,
            initargs=(disk_cache.build_announced(),),
        )
        try:
            results = list(pool.map(_build, kernels.variant_loaders()))
        except BaseException:
            # A failed build, or a signal: the other workers' builds are not waited for. A second signal
            # waits until the workers are gone.
            stopping = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                pool.shutdown(wait=False, cancel_futures=True)
                workers = [child for child in multiprocessing.active_children() if child not in others]
                for worker in workers:
                    worker.terminate()
                for worker in workers:
                    worker.join()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, stopping)
            raise
        finally:
            pool.shutdown(wait=True)
    finally:
        if previous is None:
            del os.environ[COMPILE_AT_IMPORT_ENV]
        else:
            os.environ[COMPILE_AT_IMPORT_ENV] = previous
    return {name: (source, seconds) for name, source, seconds in results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m q8kv8.compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--jobs", type=_positive, default=1, help="processes that build (default 1)")
    args = parser.parse_args(argv)
    from q8kv8 import build, disk_cache, kernels

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.signal(signum, _stop) for signum in STOP_SIGNALS} if in_main_thread else {}
    try:
        built = build_in_processes(args.jobs) if args.jobs > 1 else {}
        variants = kernels.listed_variants()
    except build.KernelCompileError as error:
        print(error, file=sys.stderr)
        return 1
    except _Stopped as stopped:
        print(
            f"{parser.prog}: stopped by {stopped}; the variants built before are in {disk_cache.cache_dir()}",
            file=sys.stderr,
        )
        return 128 + stopped.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    width = max(32, *(len(variant.name) for variant in variants))
    print(f"{'variant':{width}s} {'from':9s} {'seconds':>8s}")
    for variant in variants:
        source, seconds = built.get(variant.name, (variant.source, variant.seconds))
        print(f"{variant.name:{width}s} {source:9s} {seconds:8.3f}")
    print(f"cache: {disk_cache.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
