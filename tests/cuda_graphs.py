"""CUDA-graph checks the GPU tests share."""

import math

import torch


def capture_and_replay(launch, buffers) -> None:
    """Capture ``launch()`` in a CUDA graph on the current stream, poison ``buffers`` with NaN, replay the
    graph and wait for it: what the buffers hold afterwards is what the captured launch wrote."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a launch on any other stream than the capturing one would fail here
        launch()
    for buffer in buffers:
        buffer.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
