"""``python -m q8kv8.compile``, ``python -m q8kv8.info`` / ``q8kv8.info()``, the ptxas reports they list
(kept in the cache), build failures, ``make bench`` without an SM90 GPU, the schedule-timing tool's power
sampler and the SASS counts (CPU).

The commands run in subprocesses on the test run's kernel cache (filled when ``q8kv8`` was imported),
so they load the variants rather than compile them again.
"""

import functools
import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

import cuda_tools
import pytest
import torch

import q8kv8
from q8kv8 import build, disk_cache, kernels, native
from q8kv8 import compile as compile_command
from q8kv8.metadata import PRECISIONS
from scripts.tools import sass_counts

REPO = Path(__file__).resolve().parent.parent


EVERY_VARIANT = list(kernels.LISTED_KEYS)
RUN_ON_LISTING = """
import runpy, sys
from q8kv8 import kernels

module, *names = sys.argv[1:]
kernels.LISTED_KEYS = [kernels._KEYS_BY_NAME[name] for name in names]
sys.argv = [module]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
"""``python -m MODULE`` as it runs with the listings (``kernels.LISTED_KEYS``) cut to the given variants."""


def run_module(module: str, listing: list) -> subprocess.CompletedProcess:
    """``python -m module`` in a subprocess, listing the variants of ``listing`` (the fixture)."""
    if listing == EVERY_VARIANT:
        command = [sys.executable, "-m", module]  # every variant
    else:
        command = [sys.executable, "-c", RUN_ON_LISTING, module, *(key.name for key in listing)]
    return subprocess.run(command, cwd=REPO, env=dict(os.environ), capture_output=True, text=True)


@pytest.fixture(scope="module")
def variants() -> dict:
    """The variants built at import, by name."""
    return {variant.name: variant for variant in kernels.load_variants()}


@pytest.mark.variants
def test_python_m_compile_lists_every_variant_and_the_cache(variants, listing):
    result = run_module("q8kv8.compile", listing)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for variant in variants.values():
        [line] = [line for line in lines if line.split()[0] == variant.name]
        _, source, seconds = line.split()
        assert source == "cache" and float(seconds) < 5.0  # the test run's import filled the cache
    assert lines[-1] == f"cache: {disk_cache.cache_dir()}"


@pytest.mark.variants
def test_compile_main_prints_what_this_process_built(variants, listing, capsys):
    assert compile_command.main([]) == 0
    out = capsys.readouterr().out
    for variant in variants.values():
        assert re.search(rf"^{variant.name}\s+{variant.source}\s+\d+\.\d{{3}}$", out, re.MULTILINE)
    assert f"cache: {disk_cache.cache_dir()}" in out


@pytest.mark.variants
def test_compile_jobs_builds_every_listed_variant_in_worker_processes(variants, listing, capsys):
    """``--jobs 2``: two spawned workers build (here: load from the cache) every listed variant; the listing
    is the same as with one process, each line saying where its worker got it; the environment is restored."""
    environment = dict(os.environ)
    assert compile_command.main(["--jobs", "2"]) == 0
    assert dict(os.environ) == environment
    lines = capsys.readouterr().out.splitlines()
    listed = [variant.name for variant in kernels.listed_variants()]
    assert [line.split()[0] for line in lines[1:-1]] == listed
    assert all(line.split()[1] in ("cache", "compiled") for line in lines[1:-1])
    assert lines[-1] == f"cache: {disk_cache.cache_dir()}"


def test_compile_jobs_workers_say_what_they_build_on_stderr(tmp_path, monkeypatch, capfd):
    """A worker of ``--jobs`` that builds a variant (here a query cast, into an empty cache) prints its
    ``built`` line on the command's stderr; it announces the build only when the command has not."""
    monkeypatch.setenv("Q8KV8_CACHE_DIR", str(tmp_path))
    for d, announced in ((512, True), (576, False)):
        monkeypatch.setattr(
            kernels, "variant_loaders", lambda d=d: [functools.partial(kernels.load, kernels.QCastKey(d))]
        )
        monkeypatch.setattr(disk_cache, "_announced", announced)
        capfd.readouterr()
        [(name, (source, seconds))] = compile_command.build_in_processes(1).items()
        assert (name, source) == (f"cast_q_fp8_sm90_d{d}", "compiled")
        lines = capfd.readouterr().err.splitlines()
        assert lines[-1] == f"q8kv8: built {name} ({seconds:.1f} s)"
        if announced:
            assert len(lines) == 1
        else:
            [announcement, _] = lines
            assert announcement.startswith("q8kv8: building ") and f" into {tmp_path} (" in announcement


def live_descendants(pid: int) -> set[int]:
    """The processes below ``pid`` that still run (from /proc; zombies excluded)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, parent = stat.read_text().rpartition(")")[2].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            children.setdefault(int(parent), []).append(int(stat.parent.name))
    found, pending = set(), [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.add(child)
            pending.append(child)
    return found


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_compile_jobs_stops_at_once_with_its_workers_on_a_signal(tmp_path, signum):
    """``python -m q8kv8.compile --jobs 2`` building into an empty cache, stopped by SIGINT to its process
    group (Ctrl-C) or SIGTERM to it (``kill``) while its workers build: it exits within seconds (it does not
    wait for the builds in progress) with status 128 + the signal's number and one line on stderr, and none
    of its processes (the workers, multiprocessing's resource tracker) is left running."""
    cache = tmp_path / "cache"
    env = dict(os.environ, Q8KV8_CACHE_DIR=str(cache), Q8KV8_COMPILE_AT_IMPORT="0")
    command = subprocess.Popen(
        [sys.executable, "-m", "q8kv8.compile", "--jobs", "2"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(iter(command.stderr.readline, "")), daemon=True)
    reader.start()
    processes: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("q8kv8: building ") for line in stderr):  # a worker builds
            assert command.poll() is None and time.monotonic() < deadline, stderr
            time.sleep(0.2)
        time.sleep(1.0)
        processes = live_descendants(command.pid)
        assert len(processes) >= 3  # two workers and the resource tracker
        start = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(command.pid, signum)
        else:
            command.send_signal(signum)
        assert command.wait(timeout=60) == 128 + signum
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in processes if running(pid)]
        reader.join(timeout=10)
        name = signal.Signals(signum).name
        assert stderr[-1] == (
            f"python -m q8kv8.compile: stopped by {name}; the variants built before are in {cache}\n"
        )
    finally:
        for pid in [command.pid, *processes]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        command.wait()


def test_compile_jobs_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        compile_command.main(["--jobs", "0"])
    assert exit_info.value.code == 2 and "must be at least 1" in capsys.readouterr().err


@pytest.mark.variants
def test_variant_loaders_build_exactly_the_listed_variants(listing):
    """``kernels.variant_loaders()`` (what ``--jobs`` hands the workers): one loader per listed variant."""
    names = [loader().name for loader in kernels.variant_loaders()]
    assert sorted(names) == sorted(variant.name for variant in kernels.listed_variants())
    assert len(set(names)) == len(names)


def test_compile_main_reports_a_failure_in_one_line(monkeypatch, capsys):
    def fail(*_keys):
        raise build.KernelCompileError("q8kv8: building kernel variant v for sm_90a failed: E: boom")

    monkeypatch.setattr(kernels, "load_variants", fail)
    assert compile_command.main([]) == 1
    captured = capsys.readouterr()
    assert captured.err == "q8kv8: building kernel variant v for sm_90a failed: E: boom\n"


def test_dsl_compile_failure_is_one_line_naming_the_variant(tmp_path, monkeypatch):
    mlir = "\n".join(
        f'  %{i} = "cute.gemm"(%a, %b) : (!cute.tensor<...>) -> () loc(#loc{i})' for i in range(3000)
    )

    def compile_fails(*args, **kwargs):
        raise RuntimeError(f"MLIR verification failed: operand #0 must be ...\n{mlir}")

    monkeypatch.setenv("Q8KV8_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_variants", {})
    monkeypatch.setattr(kernels, "cache_stats", build.CacheStats())
    monkeypatch.setattr(kernels.VariantKey, "compile", compile_fails)
    with pytest.raises(build.KernelCompileError) as caught:
        kernels.load_variants()

    error = caught.value
    message = str(error)
    assert "\n" not in message and len(message) < 600
    assert re.match(
        r"q8kv8: building kernel variant sparse_prefill_sm90_d\d+\S* for sm_90a failed: ", message
    )
    assert "RuntimeError: MLIR verification failed: operand #0 must be ..." in message
    assert error.__cause__ is None and error.__suppress_context__  # the MLIR stays out of the traceback
    printed = "".join(traceback.format_exception(error))
    assert "cute.gemm" not in printed and len(printed) < 4000
    assert str(error.log_path) in message and "cute.gemm" in error.log_path.read_text()  # kept for debugging


@pytest.mark.variants
def test_info_reports_versions_gpu_variants_and_cache(variants, listing):
    report = q8kv8.info()  # the module is callable
    assert report == q8kv8.info.info()
    assert report["versions"]["q8kv8"] == q8kv8.__version__
    assert report["versions"]["torch"] == torch.__version__
    for name in ("nvidia-cutlass-dsl", "apache-tvm-ffi", "cuda (torch build)", "ptxas"):
        assert report["versions"][name]
    if torch.cuda.is_available():
        assert report["gpu"] == torch.cuda.get_device_name() and report["arch"].startswith("sm_")
    else:
        assert report["gpu"] == report["arch"] == "none"
    assert [v["name"] for v in report["variants"]] == [v.name for v in kernels.listed_variants()]
    assert {v.name for v in variants.values()} < {v["name"] for v in report["variants"]}
    for described, variant in zip(report["variants"], kernels.listed_variants(), strict=True):
        assert described["shared_memory_bytes"] == kernels.shared_memory_bytes(kernels.key_of(variant))
        assert described["shared_memory_bytes"] <= 227 * 1024  # fits an SM90 CTA
        assert described["registers"] is None or 0 < described["registers"] <= 168
    assert report["cache"]["dir"] == str(disk_cache.cache_dir())
    assert report["cache"]["hits"] + report["cache"]["misses"] >= len(variants)
    assert report["fast_path"] == (
        "built" if native.load() is not None else "unavailable (every call takes the Python path)"
    )


@pytest.mark.variants
def test_printed_info_is_the_table_of_python_m_info(variants, listing, capsys):
    """``print(q8kv8.info())`` (and the report's repr, as a REPL shows it) is the table that ``python -m
    q8kv8.info`` prints: one line per version, setting and variant, not the dict on one line."""
    report = q8kv8.info()
    assert isinstance(report, dict) and repr(report) == str(report)
    print(report)
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"q8kv8\s+{re.escape(q8kv8.__version__)}", lines[0])
    assert max(len(line) for line in lines) < 300
    for described in report["variants"]:
        [line] = [line for line in lines if line.split()[:1] == [described["name"]]]
        assert line.split()[1:3] == [str(described["d_qk"]), described["source"]]
    assert q8kv8.info.main() == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed if line] == [line.split()[0] for line in lines if line]


@pytest.mark.variants
@pytest.mark.skipif(shutil.which("ptxas") is None, reason=cuda_tools.missing("ptxas"))
def test_a_second_info_runs_no_ptxas(variants, listing, monkeypatch):
    """``info()`` reports each variant's registers and spills from ``ptxas -v``, which runs once per variant:
    its report is kept in the cache, so a later ``info()`` (here: the same process, asking the ptxas version
    again as a fresh process does) reads the kept reports and reports the same."""
    first = q8kv8.info()
    assert all(variant["registers"] is not None for variant in first["variants"])
    commands = []
    run = subprocess.run

    def recording_run(command, *args, **kwargs):
        commands.append(command)
        return run(command, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", recording_run)
    build._ptxas_version.cache_clear()
    assert q8kv8.info()["variants"] == first["variants"]
    assert [command[1:] for command in commands] == [["--version"]]


def test_a_kept_ptxas_report_is_used_only_for_the_same_ptx_and_ptxas(tmp_path, monkeypatch):
    """``build.ptxas_report`` keeps ptxas's output beside the PTX and reads it back, also in a fresh process
    (the ptxas version asked again), while the PTX and the ptxas version are the same; otherwise ptxas runs
    again. A stand-in ptxas logs its calls."""
    log, bin_dir = tmp_path / "calls.log", tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ptxas"
    fake.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            echo "$@" >> {log}
            [ "$1" = --version ] && echo "Cuda compilation tools, release $RELEASE" && exit
            echo "ptxas info    : Used 100 registers, used 1 barriers" >&2
            echo "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads" >&2
            """
        )
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RELEASE", "13.0")
    ptx = tmp_path / "v.ptx"
    ptx.write_text("// the PTX\n")
    variant = build.Variant("v", 576, "default", None, "cache", 0.0, tmp_path / "v.o", ptx)

    def ptxas_runs() -> int:
        return sum(" -v " in f" {line} " for line in log.read_text().splitlines())

    def fresh_report() -> build.PtxasReport:
        build._ptxas_version.cache_clear()  # what a fresh process starts with
        return build.ptxas_report(variant)

    first = fresh_report()
    assert (first.registers, first.stack_frame_bytes, first.spill_store_bytes, first.spill_load_bytes) == (
        100, 8, 4, 12
    )  # fmt: skip
    assert ptxas_runs() == 1 and (tmp_path / "v.ptxas.json").exists()
    assert fresh_report() == first and build.ptxas_report(variant) == first and ptxas_runs() == 1
    ptx.write_text("// another PTX\n")
    assert fresh_report() == first and ptxas_runs() == 2
    monkeypatch.setenv("RELEASE", "13.1")
    assert fresh_report() == first and ptxas_runs() == 3
    assert build.ptxas_report(variant) == first and ptxas_runs() == 3


@pytest.mark.variants
def test_python_m_info_prints_a_table(variants, listing):
    result = run_module("q8kv8.info", listing)
    assert result.returncode == 0, result.stderr
    assert "RuntimeWarning" not in result.stderr
    out = result.stdout
    assert re.search(rf"^q8kv8\s+{re.escape(q8kv8.__version__)}$", out, re.MULTILINE)
    assert re.search(r"^gpu\s+\S", out, re.MULTILINE)
    assert re.search(r"^fast path\s+(built|unavailable)", out, re.MULTILINE)
    cache = re.escape(str(disk_cache.cache_dir()))
    assert re.search(rf"^cache\s+{cache} \(this process: ", out, re.MULTILINE)
    for variant in variants.values():
        assert re.search(rf"^{variant.name}\s+{variant.d_qk}\s+(cache|compiled)\s", out, re.MULTILINE)


@pytest.mark.variants
def test_bench_without_an_sm90_gpu_prints_the_build_report_then_says_so_and_exits_2(
    listing, monkeypatch, capsys
):
    """``make bench`` (``python -m scripts.bench``) where no SM90 GPU is visible: the build report of every
    listed variant on stdout, then one line on stderr saying that only it was produced, and status 2."""
    bench = importlib.import_module("scripts.bench.__main__")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--no-serving"]) == bench.NO_SM90_STATUS == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "make bench times the kernels on an SM90 GPU; none is visible here: only the build report above was "
        "produced\n"
    )
    lines = captured.out.splitlines()
    assert lines[0].split()[:2] == ["variant", "from"]
    assert sorted(line.split()[0] for line in lines[1:]) == sorted(v.name for v in kernels.listed_variants())


def test_schedule_timing_power_sampler_averages_the_samples_inside_the_window(tmp_path, monkeypatch):
    """``python -m scripts.tools.schedule_timing --power``: the nvidia-smi samples taken while a cell runs
    are averaged (a stand-in nvidia-smi prints a header, an unreadable sample and steady samples every
    20 ms)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(
            """
            import datetime, time
            print("timestamp, power.draw [W], clocks.sm [MHz]", flush=True)
            print("2026/01/01 00:00:00.000, [N/A], 1980", flush=True)
            for _ in range(500):
                now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
                print(f"{now}, 650.50, 1785", flush=True)
                time.sleep(0.02)
            """
        )
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    from scripts.tools import schedule_timing

    sampler = schedule_timing.PowerSampler()
    calls = []
    try:
        watts, mhz = sampler.window(lambda: calls.append(None), 0.6)
    finally:
        sampler.close()
    assert calls
    assert watts == pytest.approx(650.5) and mhz == pytest.approx(1785.0)
    assert all(sample[1] == 650.5 for sample in sampler.samples)  # the header and "[N/A]" were skipped


@pytest.mark.skipif(shutil.which("nvcc") is None, reason=cuda_tools.missing("nvcc"))
def test_gather_energy_probe_compiles_for_sm90a(tmp_path):
    """``scripts/probes/gather_energy_probe.cu`` (a GPU measurement quoted in docs/perf-notes.md) still
    builds, with every variant (TMA multicast included) for sm_90a."""
    binary = tmp_path / "probe"
    command = [
        "nvcc", "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a",
        "-Wno-deprecated-declarations", "-DPRODUCER_WARPS=8", "-o", str(binary),
        str(REPO / "scripts" / "probes" / "gather_energy_probe.cu"), "-ldl",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert binary.stat().st_size > 0


def test_paged_scales_emulation_backs_the_paged_kernels_readings():
    """``scripts/probes/paged_scales.py`` (a float64 emulation quoted in docs/kernel.md): V read at its rows'
    power-of-two scales keeps the logits of the per-group sums and a cache of small values' precision, which
    V at scale 1 loses; rows rescaled before the QK product keep V3.2's logits only for power-of-two
    scales."""
    from scripts.probes import paged_scales

    for layout, scales in (("v32", "pow2"), ("v32", "float"), ("model1", "pow2")):
        unit = paged_scales.run(layout, scales, "unit")
        small = paged_scales.run(layout, scales, "small")
        for rows in (unit, small):  # (out, lse, max_logits)
            assert rows["groups, V by rows"][1] == pytest.approx(rows["groups"][1], abs=1e-9)
        assert small["groups"][0] > 0.1 and small["workspace"][0] > 0.1  # V at scale 1
        assert small["groups, V by rows"][0] < 3e-2
        assert unit["groups, V by rows"][0] <= unit["groups"][0] + 1e-3
        rows_lse = unit["rows"][1]
        assert rows_lse < 1e-8 if scales == "pow2" else rows_lse > 1e-5


@pytest.mark.variants
@pytest.mark.all_variants  # counts every variant
def test_listings_name_every_variant_once_bf16_q_split_small_heads_paged_and_serving_included():
    """``listed_variants()`` (what ``python -m q8kv8.compile`` and ``q8kv8.info()`` list): the variants built
    at import first, then every other one of the keyed table (attention for a bfloat16 q, split, small heads,
    paged caches; the serving path's gathers, query casts, slot-index, merge and bf16 kernels), each once;
    each listed with its q dtype and cache layout."""
    variants = kernels.listed_variants()
    names = [v.name for v in variants]
    assert names[: len(kernels.IMPORT_KEYS)] == [key.name for key in kernels.IMPORT_KEYS]
    per_precision = len(PRECISIONS)
    # 9 gathers: 4 layouts to 2 dtypes, and the FP4 one to V4.1 records
    assert len(set(names)) == len(names) == 60 * per_precision + 15
    attention = [v for v in variants if v.name.startswith("sparse_prefill_sm90_")]
    assert len(attention) == 60 * per_precision  # a precision's: 24 on gathered rows, 12 a paged layout
    assert len([name for name in names if name.endswith("_split")]) == (4 + 6) * per_precision  # 2 a layout
    assert len([name for name in names if re.search(r"_h(8|16|32)(_|$)", name)]) == (12 + 18) * per_precision
    assert len([name for name in names if "_paged_" in name]) == 36 * per_precision
    for variant in attention:
        described = kernels.describe(variant)
        assert described["q_dtype"] == ("bf16" if "_bf16q" in variant.name else "e4m3")
        assert described["cache"] == next(
            (c for c in ("v32", "model1", "v41") if f"_paged_{c}" in variant.name), None
        )
    serving = {v.name: kernels.describe(v) for v in variants if v not in attention}
    assert sorted(serving) == sorted(
        [
            f"paged_kv_gather_sm90_{c}_{t}"
            for c in ("model1", "v32", "v41", "v41_fp4")
            for t in ("e4m3", "bf16")
        ]
        + ["paged_kv_gather_sm90_v41_fp4_v41"]
        + ["cast_q_fp8_sm90_d512", "cast_q_fp8_sm90_d576", "paged_indices_sm90", "attention_merge_sm90"]
        + ["sparse_prefill_bf16_sm90_d512", "sparse_prefill_bf16_sm90_d576"]
    )
    assert serving["paged_kv_gather_sm90_v32_bf16"]["cache"] == "v32"
    assert serving["paged_kv_gather_sm90_v32_bf16"]["q_dtype"] is None
    assert serving["sparse_prefill_bf16_sm90_d576"]["q_dtype"] == "bf16"
    assert serving["sparse_prefill_bf16_sm90_d576"]["shared_memory_bytes"] > 0
    assert serving["paged_indices_sm90"]["shared_memory_bytes"] == 0
    assert serving["attention_merge_sm90"]["shared_memory_bytes"] == 0


def test_the_bf16_q_and_split_variants_are_not_built_at_import():
    code = "import q8kv8.kernels as k, q8kv8; print(len(k._variants), len(k.IMPORT_KEYS))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "8 8"  # only the variants of the import


def test_ptx_manifest_names_each_difference():
    """``scripts.tools.ptx_manifest.differences``: a line for each variant whose PTX changed, each built one
    the manifest lacks and each recorded one not built; none when they agree."""
    from scripts.tools.ptx_manifest import differences

    recorded = {"a": "1", "b": "2", "c": "3"}
    assert differences(recorded, dict(recorded)) == []
    assert differences(recorded, {"a": "1", "b": "9", "d": "4"}) == [
        "changed: b",
        "not in the manifest: d",
        "not built: c",
    ]


def test_layer_timeline_gaps_span_and_table(monkeypatch, capsys):
    """``scripts.tools.layer_timeline``: kernels ordered by start, each gap from the previous kernel's end
    (the first from the host's start), the span and sums; without an SM90 GPU it says so and exits 2."""
    from scripts.tools import layer_timeline as tl

    spans = [
        tl.KernelSpan("kernel", 30.0, 100.0),
        tl.KernelSpan("gather", 10.0, 15.0),
        tl.KernelSpan("x" * 60, 135.0, 5.0),
    ]
    rows = tl.timeline_rows(spans)
    assert [(r["name"][:6], r["gap_us"]) for r in rows] == [
        ("gather", 10.0),
        ("kernel", 5.0),
        ("xxxxxx", 5.0),
    ]
    assert tl.summary(rows) == {"span_us": 130.0, "kernels_us": 120.0, "gaps_us": 10.0}
    assert tl.summary([]) == {"span_us": 0.0, "kernels_us": 0.0, "gaps_us": 0.0}
    lines = tl.format_rows(rows)
    assert len(lines) == 4 and lines[3].startswith("x" * (tl.NAME_WIDTH - 3) + "...")
    assert lines[2].split()[1:] == ["30.0", "100.0", "5.0"]
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", ["layer_timeline"])
        assert tl.main() == 2
        assert "needs an SM90 GPU" in capsys.readouterr().err


def test_layer_timeline_back_to_back_prints_the_last_two_calls(monkeypatch, capsys):
    """``--back-to-back``: the last two of the queued calls' kernels (each call's count from the total), the
    gap before each, and the time per call."""
    from types import SimpleNamespace

    from scripts.tools import layer_timeline as tl

    calls = 6  # a call every 100 us: its attention 1 us after its gather's end, 9 us before the next gather
    spans = []
    for c in range(calls):
        spans += [
            tl.KernelSpan("gather", 100.0 * c, 30.0),
            tl.KernelSpan("attention", 100.0 * c + 31.0, 60.0),
        ]
    monkeypatch.setattr(tl, "back_to_back", lambda call, n: spans)
    monkeypatch.setattr(tl, "per_call_us", lambda call: (55.0, 100.0))
    args = SimpleNamespace(context=32768, heads=16)
    tl.print_back_to_back("workspace", args, {"q": torch.empty(256, 16, 576)}, call=None, calls=calls)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "workspace, back to back: context 32768, h 16, s_q 256"
    kernels = [line.split() for line in lines[2:6]]
    assert [k[0] for k in kernels] == ["gather", "attention", "gather", "attention"]
    assert [k[1:] for k in kernels[1:]] == [
        ["431.0", "60.0", "1.0"],
        ["500.0", "30.0", "9.0"],
        ["531.0", "60.0", "1.0"],
    ]
    assert lines[6] == "per call: GPU 100.0 us, host 55.0 us; gaps in the last two calls 11.0 us"


def test_sass_counts_count_opcodes_without_guards_or_nops():
    listing = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_18) ;
        /*0020*/               @P1 IADD3 R1, R1, 0x1, RZ ;
        /*0030*/                   NOP;
        /*0040*/             @!UP2 UMOV UR4, 0x1 ;
        /*0050*/                   IADD3 R2, R1, 0x1, RZ ;
        /*0060*/                   EXIT ;
        /*0000*/ 	.byte	0xff, 0xff
"""
    counts = sass_counts.opcode_counts(listing)
    assert counts == {"LDC": 1, "BRA": 1, "IADD3": 2, "UMOV": 1, "EXIT": 1}
    assert sass_counts.summary("k", counts, 1) == "k: 6 instructions | IADD3 2"


@pytest.mark.skipif(
    shutil.which("ptxas") is None or sass_counts.disassembler() is None,
    reason=cuda_tools.missing("ptxas", "nvdisasm"),
)
def test_sass_counts_prints_a_variants_total_and_its_opcodes(capsys):
    assert sass_counts.main(["attention_merge_sm90", "--top", "3"]) == 0
    line = capsys.readouterr().out.strip()
    total, common = re.fullmatch(r"attention_merge_sm90: (\d+) instructions \| (.*)", line).groups()
    counted = [int(n) for n in re.findall(r"[A-Z][A-Z0-9_]* (\d+)", common)]
    assert int(total) > 0 and len(counted) == 3 and sum(counted) <= int(total)
