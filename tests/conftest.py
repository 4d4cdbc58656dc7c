"""Shared test setup: the kernels built (or loaded) before collection with their build lines on the terminal,
skipping of ``gpu`` tests off SM90, the per-variant build checks on a representative subset of the variants
unless ``--all-variants`` (``variant_subset``), per-test random generators and input builders."""

import hashlib
import sys
import types

import pytest
import torch

ALL_VARIANTS = "--all-variants"


def pytest_addoption(parser):
    parser.addoption(
        ALL_VARIANTS,
        action="store_true",
        help="run the per-variant build checks (marked `variants`) on every kernel variant, not only on the "
        "representative ones of tests/variant_subset.py (`make test-variants`)",
    )


def pytest_configure(config):
    """Import q8kv8, which builds or loads its kernel variants and the C++ fast path, with pytest's output
    capture off: on a fresh cache that build takes a minute or more, and its lines on stderr say so."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        import q8kv8  # noqa: F401


def _sm90_missing_reason() -> str | None:
    """None when an SM90 GPU is usable, else why the ``gpu`` tests are skipped."""
    if not torch.cuda.is_available():
        return "needs an SM90 GPU (found: no CUDA device)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"needs an SM90 GPU (found: {torch.cuda.get_device_name()}, sm_{major}{minor})"
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:  # a case of every variant is a per-variant check too
        if item.get_closest_marker("all_variants") is not None:
            item.add_marker(pytest.mark.variants)
    if not config.getoption(ALL_VARIANTS):
        deselected = [item for item in items if item.get_closest_marker("all_variants") is not None]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item.get_closest_marker("all_variants") is None]
    reason = _sm90_missing_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header(config):
    if not config.getoption(ALL_VARIANTS):
        return (
            "per-variant build checks: on the representative variants (tests/variant_subset.py); "
            "`make test-variants` runs them on every variant"
        )
    return "per-variant build checks: on every kernel variant"


@pytest.fixture
def listing(request, monkeypatch) -> list:
    """The variants that the listings (``kernels.listed_variants()``: ``python -m q8kv8.compile``,
    ``q8kv8.info()``, ``make bench``'s report) list in this test: every one with ``--all-variants``, else the
    representative ones (``kernels.LISTED_KEYS`` patched for the test). Their keys."""
    from variant_subset import listed_keys

    from q8kv8 import kernels

    if not request.config.getoption(ALL_VARIANTS):
        monkeypatch.setattr(kernels, "LISTED_KEYS", listed_keys())
    return list(kernels.LISTED_KEYS)


@pytest.fixture
def generator(request) -> torch.Generator:
    """A CPU generator seeded from the test's node id: fresh data for every test, reproducible per test."""
    seed = int.from_bytes(hashlib.sha256(request.node.nodeid.encode()).digest()[:8], "little")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def randn_fp8(generator):
    """``randn_fp8(*shape, device="cpu", scale=1.0)``: standard-normal values times ``scale``, as fp8 e4m3."""

    def make(*shape: int, device="cpu", scale: float = 1.0) -> torch.Tensor:
        values = torch.randn(shape, generator=generator) * scale
        return values.to(torch.float8_e4m3fn).to(device)

    return make


@pytest.fixture
def make_inputs(generator, randn_fp8):
    """``make_inputs(...)``: keyword arguments for one valid ``sparse_mla_q8kv8_prefill_fwd`` call.

    Indices are uniform in ``[0, s_kv)`` with about ``invalid_fraction`` of the slots set to -1 (all of
    them when s_kv is 0); ``attn_sink`` and ``topk_length`` are random when asked for, else None.
    ``q_dtype=torch.bfloat16``: q is the same standard-normal values rounded to bfloat16 instead of e4m3, and
    ``q_scale`` None (the kernel scales each row); every other input is the same.
    """

    def make(
        s_q: int = 4,
        h_q: int = 64,
        s_kv: int = 256,
        d_qk: int = 576,
        topk: int = 128,
        *,
        device="cpu",
        invalid_fraction: float = 0.25,
        with_sink: bool = False,
        with_topk_length: bool = False,
        q_dtype: torch.dtype = torch.float8_e4m3fn,
    ) -> dict:
        indices = torch.randint(0, max(s_kv, 1), (s_q, 1, topk), generator=generator, dtype=torch.int32)
        dropped = torch.rand(indices.shape, generator=generator) < (invalid_fraction if s_kv > 0 else 1.0)
        indices = indices.masked_fill(dropped, -1)
        if q_dtype == torch.bfloat16:
            q = torch.randn((s_q, h_q, d_qk), generator=generator).to(torch.bfloat16).to(device)
        else:
            q = randn_fp8(s_q, h_q, d_qk, device=device)
        inputs = {
            "q": q,
            "kv": randn_fp8(s_kv, 1, d_qk, device=device),
            "indices": indices.to(device),
            "sm_scale": d_qk**-0.5,
            "q_scale": (0.5 + torch.rand(1, generator=generator)).to(device),
            "kv_scale": (0.5 + torch.rand(1, generator=generator)).to(device),
            "d_v": 512,
            "attn_sink": None,
            "topk_length": None,
        }
        if q_dtype == torch.bfloat16:
            inputs["q_scale"] = None
        if with_sink:
            inputs["attn_sink"] = torch.randn(h_q, generator=generator).to(device)
        if with_topk_length:
            lengths = torch.randint(0, topk + 1, (s_q,), generator=generator, dtype=torch.int32)
            inputs["topk_length"] = lengths.to(device)
        return inputs

    return make


@pytest.fixture
def make_valid_args(make_inputs):
    """``make_valid_args(s_q, h_q, s_kv, d_qk, topk, **options)``: the keyword arguments of
    ``make_inputs(s_q, h_q, s_kv, d_qk, topk, with_sink=True, with_topk_length=True, **options)`` (options
    may turn the sink or topk_length off) with ``precision="default"`` and new output buffers: a call the
    contract accepts on CPU tensors but for the device check."""

    def make(*sizes: int, **options) -> dict:
        args = make_inputs(*sizes, **{"with_sink": True, "with_topk_length": True, **options})
        s_q, h_q = args["q"].shape[:2]
        return {
            **args,
            "precision": "default",
            "out": torch.empty(s_q, h_q, args["d_v"], dtype=torch.bfloat16),
            "max_logits": torch.empty(s_q, h_q),
            "lse": torch.empty(s_q, h_q),
        }

    return make


@pytest.fixture
def fake_kernels(monkeypatch):
    """``fake_kernels(launch)``: a module whose ``launch_sparse_prefill`` is ``launch`` stands for
    ``q8kv8.kernels`` for this test only, wherever the package launches from (``from q8kv8 import kernels``
    included)."""

    import q8kv8
    from q8kv8 import eager, paged_gather, query, serving

    def install(launch) -> types.ModuleType:
        module = types.ModuleType("q8kv8.kernels")
        module.launch_sparse_prefill = launch
        monkeypatch.setitem(sys.modules, "q8kv8.kernels", module)
        monkeypatch.setattr(q8kv8, "kernels", module, raising=False)
        for user in (eager, paged_gather, query, serving):
            monkeypatch.setattr(user, "kernels", module)
        return module

    return install
