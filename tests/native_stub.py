"""A stub plan for the C++ fast path's extension (``q8kv8.native``): what it allocates for outputs."""

import torch

from q8kv8 import native
from q8kv8.metadata import OUTPUTS
from q8kv8.prefill_call import PrefillCall


def allocate(extension, q: torch.Tensor, layouts: tuple) -> tuple | None:
    """``extension.launch`` of a call of ``q`` under a stub planner whose plan launches a no-op on q and
    returns new outputs of ``layouts`` (``(shape, dtype)`` of each of ``q8kv8.metadata.OUTPUTS``): the
    tensors the extension allocates for a plan, or None when it declines the call. Configures ``extension``
    so."""
    import tvm_ffi

    no_op = tvm_ffi.convert(lambda *args: None)
    fields = PrefillCall._fields
    outputs = tuple(
        (fields.index(name), shape, dtype) for name, (shape, dtype) in zip(OUTPUTS, layouts, strict=True)
    )
    plan = (
        (0, 1, 0),
        ((fields.index("q"), None, False, 1, None, None),),
        ((no_op.__chandle__(), 0, 1, ()),),
        outputs,
    )
    extension.configure(**with_planner(lambda call: plan))
    return extension.launch(PrefillCall(q, q, q, 0.1, None, q))


def with_planner(planner, fields=None) -> dict:
    """``native.constants()`` with ``planner`` (and ``fields``, when given) for ``PrefillCall``s."""
    constants = native.constants()
    kinds = tuple(
        (kind, kind_fields if fields is None else fields, planner)
        if kind is PrefillCall
        else (kind, kind_fields, plans)
        for kind, kind_fields, plans in constants["kinds"]
    )
    return {**constants, "kinds": kinds}
