"""The custom ops (``q8kv8.ops``) on CPU: schemas, fake implementations, and ``torch.compile(fullgraph=True)``
through ``sparse_mla_q8kv8_prefill_fwd``.

Compiled calls run for real on CPU tensors: the device check is patched to accept them and the kernel
launch is a float64-reference stand-in, so a compiled call must give exactly the eager call's outputs.
"""

import math

import pytest
import torch
from reference_launch import launch_arguments, write_reference_outputs
from torch._subclasses.fake_tensor import FakeTensorMode

from q8kv8 import contract, ops, sparse_mla_q8kv8_prefill_fwd
from q8kv8.prefill_call import PrefillCall

S_Q, S_KV, D_V, TOPK = 5, 200, 512, 128
FUNCTIONAL = torch.ops.q8kv8.sparse_mla_q8kv8_prefill.default
OUT = torch.ops.q8kv8.sparse_mla_q8kv8_prefill_out.default
OPCHECK_TESTS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
"""opcheck's tests but ``test_schema``: its SchemaCheckMode compares the fp8 inputs before and after with
``torch.allclose``, which PyTorch does not implement for float8 (the op's own mutation contract is checked
by ``test_out_op_writes_only_its_buffers``)."""


def reference_launch(*args):
    write_reference_outputs(launch_arguments(args))


@pytest.fixture(autouse=True)
def cpu_launch(monkeypatch, fake_kernels):
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    fake_kernels(reference_launch)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def positional(args: dict) -> tuple:
    """The functional op's arguments, in its schema's order."""
    return tuple(args[name] for name in ("q", "kv", "indices", "sm_scale", "q_scale", "kv_scale", "d_v"))


def empty_buffers(s_q: int, h_q: int) -> dict:
    return {
        "out": torch.full((s_q, h_q, D_V), math.nan, dtype=torch.bfloat16),
        "max_logits": torch.full((s_q, h_q), math.nan),
        "lse": torch.full((s_q, h_q), math.nan),
    }


def assert_same(got, want):
    assert len(got) == len(want) == 3
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_schemas():
    functional = {argument.name: argument for argument in FUNCTIONAL._schema.arguments}
    assert str(functional["sm_scale"].type) == "float" and str(functional["precision"].type) == "str"
    assert str(functional["q_scale"].type) == "Optional[Tensor]"  # None for a bfloat16 q
    assert str(functional["kv_scale"].type) == "Tensor"
    assert str(functional["attn_sink"].type) == "Optional[Tensor]"
    assert str(functional["topk_length"].type) == "Optional[Tensor]"
    assert functional["precision"].default_value == "default" and functional["d_v"].default_value == 512
    assert not any(argument.alias_info for argument in FUNCTIONAL._schema.arguments)
    assert [str(r.type) for r in FUNCTIONAL._schema.returns] == ["Tensor"] * 3

    out_arguments = {argument.name: argument for argument in OUT._schema.arguments}
    assert str(out_arguments["q_scale"].type) == "Optional[Tensor]"
    writes = {a.name for a in OUT._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert writes == {"out", "max_logits", "lse"}
    assert OUT._schema.returns == []


def test_schemas_read_the_call_structures_fields():
    """The ops' parameters are PrefillCall's fields: its first ``ops.INPUT_FIELDS`` in order, then precision
    (and the out op's three buffers), with PrefillCall's defaults."""
    inputs = list(PrefillCall._fields[: ops.INPUT_FIELDS])
    assert [a.name for a in FUNCTIONAL._schema.arguments] == [*inputs, "precision"]
    assert [a.name for a in OUT._schema.arguments] == [*inputs, "precision", "out", "max_logits", "lse"]
    for argument in FUNCTIONAL._schema.arguments:
        if argument.has_default_value():
            assert argument.default_value == PrefillCall._field_defaults[argument.name], argument.name


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize(("s_q", "h_q", "d_qk"), [(7, 64, 576), (3, 48, 512), (0, 16, 576)])
def test_fake_implementation_gives_output_metadata(s_q, h_q, d_qk, q_dtype):
    with FakeTensorMode():
        q = torch.empty(s_q, h_q, d_qk, dtype=q_dtype, device="cuda")
        kv = torch.empty(S_KV, 1, d_qk, dtype=torch.float8_e4m3fn, device="cuda")
        indices = torch.empty(s_q, 1, TOPK, dtype=torch.int32, device="cuda")
        scale = torch.empty(1, device="cuda")
        q_scale = None if q_dtype == torch.bfloat16 else scale
        sink = torch.empty(h_q, device="cuda")
        out, max_logits, lse = FUNCTIONAL(q, kv, indices, 0.1, q_scale, scale, D_V, sink, None, "default")
        buffers = (
            torch.empty(s_q, h_q, D_V, dtype=torch.bfloat16, device="cuda"),
            torch.empty(s_q, h_q, device="cuda"),
            torch.empty(s_q, h_q, device="cuda"),
        )
        assert OUT(q, kv, indices, 0.1, q_scale, scale, D_V, None, None, "default", *buffers) is None
    assert (out.shape, max_logits.shape, lse.shape) == ((s_q, h_q, D_V), (s_q, h_q), (s_q, h_q))
    assert (out.dtype, max_logits.dtype, lse.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert out.device == max_logits.device == lse.device == torch.device("cuda:0")


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("buffers", ["none", "all", "out only"])
@pytest.mark.parametrize("h_q", [64, 48])
def test_compiled_call_matches_eager(make_inputs, backend, buffers, h_q, q_dtype):
    args = make_inputs(S_Q, h_q, S_KV, 576, TOPK, with_sink=True, with_topk_length=True, q_dtype=q_dtype)
    eager = sparse_mla_q8kv8_prefill_fwd(**args)
    given = {"none": {}, "all": empty_buffers(S_Q, h_q), "out only": {"out": empty_buffers(S_Q, h_q)["out"]}}
    given = given[buffers]

    def call(q, kv, indices, q_scale, kv_scale, attn_sink, topk_length, **buffers):
        return sparse_mla_q8kv8_prefill_fwd(
            q, kv, indices, args["sm_scale"], q_scale, kv_scale, 512, attn_sink, topk_length, **buffers
        )

    tensors = {
        name: args[name] for name in ("q", "kv", "indices", "q_scale", "kv_scale", "attn_sink", "topk_length")
    }
    compiled = torch.compile(call, fullgraph=True, backend=backend)(**tensors, **given)
    assert_same(compiled, eager)
    for name, index in (("out", 0), ("max_logits", 1), ("lse", 2)):
        if name in given:  # a given buffer is the one written and returned
            assert compiled[index] is given[name]


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
def test_compiled_call_is_one_op_in_the_graph(make_inputs, q_dtype):
    args = make_inputs(S_Q, 64, S_KV, 512, TOPK, q_dtype=q_dtype)
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def call(q, kv, indices, q_scale, kv_scale, out=None):
        return sparse_mla_q8kv8_prefill_fwd(q, kv, indices, 0.05, q_scale, kv_scale, out=out)

    tensors = [args[name] for name in ("q", "kv", "indices", "q_scale", "kv_scale")]
    torch.compile(call, fullgraph=True, backend=backend)(*tensors)
    torch.compile(call, fullgraph=True, backend=backend)(*tensors, out=empty_buffers(S_Q, 64)["out"])
    ops = [
        [node.target for node in graph.graph.nodes if isinstance(node.target, torch._ops.OpOverload)]
        for graph in graphs
    ]
    assert ops == [[FUNCTIONAL], [OUT]]  # no graph break (fullgraph), nothing else traced as an op


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
def test_compiled_dynamic_shapes(make_inputs, q_dtype):
    compiled = torch.compile(sparse_mla_q8kv8_prefill_fwd, fullgraph=True, backend="aot_eager", dynamic=True)
    for s_q in (3, 9):
        args = make_inputs(s_q, 64, S_KV, 576, TOPK, with_topk_length=True, q_dtype=q_dtype)
        assert_same(compiled(**args), sparse_mla_q8kv8_prefill_fwd(**args))


def test_contract_runs_inside_compiled_code(make_inputs):
    args = make_inputs(S_Q, 64, S_KV, 576, TOPK) | {"indices": torch.zeros(S_Q, 1, 100, dtype=torch.int32)}
    compiled = torch.compile(sparse_mla_q8kv8_prefill_fwd, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="a positive multiple of 128, got 100"):
        compiled(**args)


def test_out_op_writes_only_its_buffers(make_inputs):
    args = make_inputs(S_Q, 64, S_KV, 576, TOPK, with_sink=True)
    before = {name: value.clone() for name, value in args.items() if isinstance(value, torch.Tensor)}
    buffers = empty_buffers(S_Q, 64)
    assert OUT(*positional(args), args["attn_sink"], None, "default", *buffers.values()) is None
    assert_same(tuple(buffers.values()), sparse_mla_q8kv8_prefill_fwd(**args))
    for name, value in before.items():  # inputs untouched, bit for bit
        assert torch.equal(args[name].view(torch.uint8), value.view(torch.uint8)), name


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
def test_opcheck(make_inputs, q_dtype):
    args = make_inputs(S_Q, 64, S_KV, 576, TOPK, with_sink=True, with_topk_length=True, q_dtype=q_dtype)
    options = (args["attn_sink"], args["topk_length"], "default")
    torch.library.opcheck(FUNCTIONAL, (*positional(args), *options), test_utils=OPCHECK_TESTS)
    buffers = tuple(empty_buffers(S_Q, 64).values())
    torch.library.opcheck(OUT, (*positional(args), *options, *buffers), test_utils=OPCHECK_TESTS)
