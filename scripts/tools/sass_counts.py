"""Static SASS instruction counts of kernel variants, from ptxas on each variant's kept PTX and ``nvdisasm``:
the total (NOPs left out) and the most frequent opcodes, to compare a change's instructions without a GPU.

    python -m scripts.tools.sass_counts sparse_prefill_sm90_d512_paged_v41_bf16q [NAME ...] [--top N]

Variants are named as ``python -m q8kv8.compile`` lists them; each is built or loaded from the disk cache.
The counts are static (every instruction of the kernel once, whatever runs how often); ``docs/perf-notes.md``
cites them beside the executed counts of a profile.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def disassembler() -> str | None:
    """nvdisasm on PATH or in the CUDA toolkit beside ptxas (None when neither has it)."""
    found = shutil.which("nvdisasm")
    ptxas = shutil.which("ptxas")
    if found is None and ptxas is not None:
        candidate = Path(ptxas).resolve().parent / "nvdisasm"
        found = str(candidate) if candidate.exists() else None
    return found


def sass(ptx_path: Path, workdir: Path) -> str:
    """The SASS of the PTX at ``ptx_path`` (ptxas for the build's arch into a cubin in ``workdir``, then
    ``nvdisasm -c``). Raises FileNotFoundError when ptxas or nvdisasm is missing."""
    from q8kv8.build import TARGET_ARCH

    ptxas, nvdisasm = shutil.which("ptxas"), disassembler()
    if ptxas is None or nvdisasm is None:
        raise FileNotFoundError("sass_counts needs ptxas and nvdisasm (a CUDA toolkit's bin folder on PATH)")
    cubin = workdir / (ptx_path.stem + ".cubin")
    subprocess.run([ptxas, f"-arch={TARGET_ARCH}", str(ptx_path), "-o", str(cubin)], check=True)
    return subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def opcode_counts(sass_text: str) -> collections.Counter:
    """How often each opcode stands in ``sass_text`` (``nvdisasm -c``'s listing; a predicate guard is not
    part of the opcode, NOPs are left out)."""
    return collections.Counter(op for op in _INSTRUCTION.findall(sass_text) if op != "NOP")


def summary(name: str, counts: collections.Counter, top: int) -> str:
    common = ", ".join(f"{op} {n}" for op, n in counts.most_common(top))
    return f"{name}: {sum(counts.values())} instructions | {common}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", help="kernel variant names")
    parser.add_argument("--top", type=int, default=12, help="how many opcodes to list (default 12)")
    args = parser.parse_args(argv)
    from q8kv8 import kernels

    keys = {key.name: key for key in kernels.LISTED_KEYS}
    unknown = [name for name in args.names if name not in keys]
    if unknown:
        parser.error(f"no kernel variant named {', '.join(unknown)} (python -m q8kv8.compile lists them)")
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.names:
            variant = kernels.load(keys[name])
            if variant.ptx_path is None:
                parser.error(f"{name} keeps no PTX")
            counts = opcode_counts(sass(variant.ptx_path, Path(workdir)))
            print(summary(name, counts, args.top), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
