"""CUDA-graph checks the GPU tests share."""

import math

import torch

OUTPUT_NAMES = ("out", "max_logits", "lse")


def capture(launch) -> torch.cuda.CUDAGraph:
    """``launch()`` captured in a CUDA graph on the current stream (a launch on any other stream than the
    capturing one would fail here)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    return graph


def poison_and_replay(graph: torch.cuda.CUDAGraph, buffers) -> None:
    """Fill ``buffers`` with NaN, then replay ``graph`` (queued: not waited for)."""
    for buffer in buffers:
        buffer.fill_(math.nan)
    graph.replay()


def capture_and_replay(launch, buffers) -> None:
    """Capture ``launch()`` in a CUDA graph on the current stream, poison ``buffers`` with NaN, replay the
    graph and wait for it: what the buffers hold afterwards is what the captured launch wrote."""
    torch.cuda.synchronize()
    poison_and_replay(capture(launch), buffers)
    torch.cuda.synchronize()


def assert_same_outputs(got, want) -> None:
    """``got`` and ``want`` (``(out, max_logits, lse)``) bit for bit."""
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def assert_replays_match_eager(run, launch, replays: int = 1) -> tuple[torch.cuda.CUDAGraph, dict]:
    """A call captured in a CUDA graph gives its eager outputs: ``run(**buffers)`` runs it eagerly and waits
    (no buffers: into outputs of its own), ``launch(**buffers)`` queues it into ``out``, ``max_logits`` and
    ``lse``. Its eager outputs, then ``run`` into new buffers outside a capture (the warm-up), then
    ``launch`` into them captured; each of ``replays`` replays into the buffers poisoned with NaN must give
    the eager outputs bit for bit. Returns the graph and its buffers, by name."""
    eager = [t.clone() for t in run()]
    buffers = {name: torch.empty_like(t) for name, t in zip(OUTPUT_NAMES, eager, strict=True)}
    run(**buffers)  # warm-up outside capture
    graph = capture(lambda: launch(**buffers))
    for _ in range(replays):
        poison_and_replay(graph, buffers.values())
        torch.cuda.synchronize()
        assert_same_outputs(buffers.values(), eager)
    return graph, buffers
