"""The CUDA toolkit's tools that CPU tests run on the kernels' PTX (``ptxas``, ``nvdisasm``, ``nvcc``), and
the reason a test gives when one is missing: where to get it (docs/usage.md, "Build cache")."""

WHERE = (
    "a CUDA toolkit's bin folder (release 12.9 or later) on PATH, or `pip install nvidia-cuda-nvcc "
    "nvidia-cuda-nvdisasm` with its nvidia/cu13/bin folder on PATH; docs/usage.md, 'Build cache'"
)


def missing(*tools: str) -> str:
    """The skip reason of a test that needs ``tools``."""
    return f"needs {' and '.join(tools)} ({WHERE})"
