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
    """A capture that fails part way: the fallback capture, and later ones given that pool, use a fresh
    pool; the allocator no longer records into it (``empty_cache`` works: torch's own capture_end leaves the
    recording on, and it failed an internal assert); the current stream is the one from before the capture."""
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
    torch.cuda.empty_cache()  # (raised "captures_underway.empty() INTERNAL ASSERT FAILED")
    later = cuda_graph.capture(lambda: x.mul_(3), pool)
    x.fill_(0)
    graph.replay()
    later.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [3.0] * 4
    assert torch.randn(2, device="cuda").isfinite().all()  # the generator is out of capture mode


def test_a_process_whose_capture_failed_exits_cleanly(tmp_path):
    """A process that had a capture fail, then frees a memory pool (as a symmetric-memory rank does at
    exit), exits with status 0 — it aborted (SIGABRT in the pool's destructor) while the allocator kept
    recording into the failed capture's pool."""
    import subprocess
    import sys

    script = tmp_path / "failed_capture.py"
    script.write_text(
        "import torch\n"
        "from treegen.runtime import cuda_graph\n"
        "x = torch.zeros(4, device='cuda')\n"
        "def fn():\n"
        "    torch.cuda.synchronize()\n"
        "    x.add_(1)\n"
        "try:\n"
        "    with cuda_graph._recording(torch.cuda.CUDAGraph(), None):\n"
        "        fn()\n"
        "except Exception:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('the capture did not fail')\n"
        "pool = torch.cuda.MemPool()\n"
        "with torch.cuda.use_mem_pool(pool):\n"
        "    y = torch.ones(1024, device='cuda')\n"
        "del y, pool\n"
        "print('done')\n")
    import os
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
