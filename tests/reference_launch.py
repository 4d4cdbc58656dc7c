"""A float64-reference stand-in for ``q8kv8.kernels.launch_sparse_prefill`` on CPU tensors (installed with
the ``fake_kernels`` fixture): the launch's arguments by name, and its outputs written from the reference."""

import inspect

from q8kv8 import kernels
from q8kv8.metadata import D_V
from q8kv8.reference import sparse_mla_prefill_reference

PAGED_PARAMETERS = ("cache", "extra_cache", "extra_from")
LAUNCH_PARAMETERS = tuple(
    name
    for name in inspect.signature(kernels.launch_sparse_prefill).parameters
    if name not in PAGED_PARAMETERS
)
"""The launch's parameters that the eager path passes, in order (all but a paged call's)."""


def launch_arguments(args: tuple) -> dict:
    """A launch's positional arguments (every one of ``LAUNCH_PARAMETERS``), by name."""
    return dict(zip(LAUNCH_PARAMETERS, args, strict=True))


def write_reference_outputs(launch: dict) -> None:
    """Write a launch's ``out``, ``max_logits`` and ``lse`` from the float64 reference of its inputs."""
    reference = sparse_mla_prefill_reference(
        launch["q"],
        launch["kv"],
        launch["indices"],
        launch["sm_scale"],
        launch["q_scale"],
        launch["kv_scale"],
        D_V,
        launch["attn_sink"],
        launch["topk_length"],
    )
    for buffer, values in zip((launch["out"], launch["max_logits"], launch["lse"]), reference, strict=True):
        buffer.copy_(values)
