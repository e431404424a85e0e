"""Capturing a function as a CUDA graph (the decode step; benchmarks time kernels the same way)."""

from __future__ import annotations

import torch


def capture(fn, pool=None) -> torch.cuda.CUDAGraph:
    """Run ``fn`` once for real on a side stream (compiles kernels, warms the allocator), then capture
    it. The capture records ``fn``'s kernels without running them; ``graph.replay()`` runs them.
    ``pool``: another graph's ``pool()`` to allocate from (graphs always replayed one after the
    other, in capture order, may share their temporaries' memory)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            fn()
    except BaseException:
        _end_generator_capture()
        raise
    return graph


def capture_cold(fn, pool=None) -> tuple[torch.cuda.CUDAGraph, bool]:
    """Capture ``fn`` without running it first: once its kernels are compiled and loaded (an earlier
    capture ran the same code), the warm-up run of :func:`capture` only costs host time — as long again
    as the recording. Should the capture fail (say a kernel variant compiled and loaded inside it), as
    :func:`capture`. Returns ``(graph, ran)``; ``ran``: ``fn`` ran for real (the fallback), so the
    graph's first replay would repeat it. Only for one process: ranks that must run collectives in
    step could fall back differently."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph, False
    except Exception:
        _end_generator_capture()
        return capture(fn, pool), True


def _end_generator_capture() -> None:
    """A capture that fails part way never ends the default CUDA generator's capture mode, and every
    random op after it raises ("Offset increment outside graph capture encountered unexpectedly").
    Give the generator a fresh copy of its state: same seed and offset, not capturing."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    gen.graphsafe_set_state(gen.clone_state())
