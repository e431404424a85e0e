"""Capturing CUDA graphs (treegen.runtime.cuda_graph) when a capture could be disturbed: a garbage
collection inside it, a capture that fails part way into a shared pool. CUDA only."""

import pytest
import torch

from treegen.runtime import cuda_graph

pytestmark = pytest.mark.gpu  # skipped without CUDA and compiled kernels (tests/conftest.py)


class _Cycle:
    """An object only a reference cycle keeps alive: the cycle collector frees it, at a time of its choosing."""

    def __init__(self, graph):
        self.graph, self.me = graph, self


def test_a_collection_inside_a_capture_frees_no_graph():
    """An unreachable graph in a reference cycle (as an earlier run's kept phase graphs) is not freed
    inside a capture — its reset would make the capture fail — even when the captured code allocates
    enough objects to set off the cycle collector."""
    x = torch.zeros(4, device="cuda")
    _Cycle(cuda_graph.capture(lambda: x.add_(1)))  # garbage now, freed by the next collection

    def fn():
        [[i] for i in range(20000)]  # container allocations: past the collector's threshold many times
        x.mul_(2)

    graph, ran = cuda_graph.capture_cold(fn)
    assert not ran  # captured cold, no fallback
    x.fill_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4


def test_a_failed_capture_into_a_shared_pool_leaves_later_captures_working():
    """A capture that fails part way leaves its pool recording for good (torch never ends it): the
    fallback capture, and later ones given that pool, use a fresh pool; the current stream is the one
    from before the capture."""
    pool = torch.cuda.graph_pool_handle()
    x = torch.zeros(4, device="cuda")
    calls = [0]

    def fn():
        calls[0] += 1
        if calls[0] == 1:
            torch.cuda.synchronize()  # not permitted while capturing: the capture is invalidated
        x.add_(1)

    stream = torch.cuda.current_stream()
    graph, ran = cuda_graph.capture_cold(fn, pool)
    assert ran and not cuda_graph.usable(pool)
    assert torch.cuda.current_stream() == stream
    later = cuda_graph.capture(lambda: x.mul_(3), pool)
    x.fill_(0)
    graph.replay()
    later.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [3.0] * 4
    assert torch.randn(2, device="cuda").isfinite().all()  # the generator is out of capture mode
