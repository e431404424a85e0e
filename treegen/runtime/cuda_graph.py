"""Capturing a function as a CUDA graph (the decode step; benchmarks time kernels the same way)."""

from __future__ import annotations

import contextlib
import gc

import torch

# pools given to a capture that failed: captures given one of them use a fresh pool (one failed capture's
# pool, recording left on by torch, made the next capture into it fail; _end_pool_recording now ends it)
_stuck_pools: set = set()


def usable(pool) -> bool:
    """Whether graphs can still be captured into ``pool`` (a ``graph_pool_handle`` or a graph's ``pool()``)."""
    return pool not in _stuck_pools


@contextlib.contextmanager
def _recording(graph: torch.cuda.CUDAGraph, pool):
    """``torch.cuda.graph(graph, pool=pool)`` with Python's cycle collector held off: a collection inside
    the capture could free an unreachable graph (an earlier run's kept phase graphs), whose reset is not
    permitted while a stream captures, and the capture would fail. A failed capture marks its pool stuck,
    ends the allocator's recording into it and the generator's capture, and makes the stream current
    before it current again."""
    # (a pool named here, never None: a failed capture's recording into it is ended by its id, which the
    # graph no longer gives once its capture failed)
    given, pool = pool, pool if pool is not None and usable(pool) else torch.cuda.graph_pool_handle()
    stream, collecting = torch.cuda.current_stream(), gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    except BaseException:
        if given is not None:
            _stuck_pools.add(given)
        _end_pool_recording(pool)
        _end_generator_capture()
        torch.cuda.set_stream(stream)  # (torch.cuda.graph leaves its capture stream current when ending fails)
        raise
    finally:
        if collecting:
            gc.enable()


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
    with _recording(graph, pool):
        fn()
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
        with _recording(graph, pool):
            fn()
        return graph, False
    except Exception:
        return capture(fn, pool), True  # (into a fresh pool if this one is now stuck)


def _end_pool_recording(pool) -> None:
    """torch ends a capture's recording into its memory pool only after ``cudaStreamEndCapture`` succeeds:
    a capture that fails there leaves the caching allocator recording (its ``captures_underway``), and the
    next call that synchronizes the allocator fails an internal assert — a ``MemPool`` freed (as a
    symmetric-memory rank's at exit) aborts the process (seen: two-GPU ``torchrun`` runs exiting with
    SIGABRT after writing their results; ``tests/test_cuda_graph_gpu.py``). End the recording into ``pool``
    here; a capture that failed in its body had it ended by torch already."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or \
        getattr(torch._C, "_cuda_endAllocateCurrentStreamToPool", None)  # (its name before torch 2.8)
    if end is None:
        return
    try:
        end(torch.cuda.current_device(), pool)
    except RuntimeError:  # "not currently recording": torch ended it
        pass


def _end_generator_capture() -> None:
    """A capture that fails part way never ends the default CUDA generator's capture mode, and every
    random op after it raises ("Offset increment outside graph capture encountered unexpectedly").
    Give the generator a fresh copy of its state: same seed and offset, not capturing."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    gen.graphsafe_set_state(gen.clone_state())
