"""treegen.kernels.launch: a Triton kernel launched through its compiled handle gives what Triton's own
launch gives, with every specialization Triton would choose.

CI (the Triton interpreter) checks that launchers go through Triton there; on a CUDA device
(TRITON_INTERPRET=0) the fast path itself is exercised.
"""

import os

import pytest
import torch

from treegen.kernels import fused_ops
from treegen.kernels.launch import Launcher, next_power_of_2, set_fast_launch

COMPILED = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0"
gpu = pytest.mark.skipif(not COMPILED, reason="needs a CUDA device with compiled Triton (TRITON_INTERPRET=0)")


def _norm_inputs(rows, hidden, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(device, dtype)
    y = torch.randn(rows, hidden, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    return h, y, w


def test_next_power_of_2_is_tritons():
    triton = pytest.importorskip("triton")
    assert [next_power_of_2(n) for n in range(4100)] == [triton.next_power_of_2(n) for n in range(4100)]


def test_set_fast_launch_takes_a_bool():
    with pytest.raises(TypeError, match="True or False"):
        set_fast_launch(1)


@pytest.mark.skipif(COMPILED, reason="the interpreter's case")
def test_the_interpreter_launches_through_triton():
    launcher = fused_ops._LAUNCH["_add_rms_norm_kernel"]
    assert not launcher.supported and not launcher.enabled
    before = launcher.triton_launches
    h, y, w = _norm_inputs(3, 64, torch.float32, "cpu")
    want = fused_ops.rms_norm_reference(h + y, w, 1e-5)
    torch.testing.assert_close(fused_ops.add_rms_norm(h, y, w, 1e-5), want, rtol=1e-5, atol=1e-5)
    assert launcher.triton_launches == before + 1 and launcher.fast_launches == 0
    set_fast_launch(True)  # (not supported here: stays off)
    assert not launcher.enabled


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_launches_equal_triton_launches_across_specializations(dtype):
    """Shapes whose strides are or are not multiples of 16, one row (an integer equal to 1), another
    constexpr block, views at odd offsets: each gets Triton's own variant, and the same bits as a launch
    through Triton."""
    launcher = Launcher(fused_ops._add_rms_norm_kernel)
    import triton

    def run(h, y, w, fast):
        launcher.enabled = fast
        x = torch.empty_like(h)
        launcher[(h.shape[0],)](h, y, w, x, h.shape[1], h.stride(0), y.stride(0), x.stride(0), 1e-5,
                                HAS_Y=True, BLOCK=triton.next_power_of_2(h.shape[1]), num_warps=4)
        return h, x

    def at_offset(t, offset):  # a copy of t whose data starts ``offset`` elements into its buffer
        buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
        return buf[offset:].view_as(t).copy_(t)

    cases = [(5, 64), (1, 64), (7, 200), (5, 64), (3, 1000), (1, 200), (7, 200)]
    for rows, hidden in cases:
        for offset in (0, 1):  # 1: pointers not 16-byte aligned
            h, y, w = _norm_inputs(rows, hidden, dtype, "cuda", seed=rows * hidden)
            want_h, want_x = run(at_offset(h, offset), at_offset(y, offset), w, fast=False)
            got_h, got_x = run(at_offset(h, offset), at_offset(y, offset), w, fast=True)
            assert torch.equal(got_h, want_h) and torch.equal(got_x, want_x), (rows, hidden, offset)
    assert launcher.fast_launches > 0
    # as many variants as distinct specializations, each compiled by Triton (its cache holds them too)
    assert len(launcher.compiled) >= 4


@gpu
def test_a_launch_hook_sends_launches_through_triton():
    from triton import knobs

    launcher = Launcher(fused_ops._add_rms_norm_kernel)
    h, y, w = _norm_inputs(4, 64, torch.float32, "cuda")
    x = torch.empty_like(h)
    args = (h, y, w, x, 64, h.stride(0), y.stride(0), x.stride(0), 1e-5)
    for _ in range(2):
        launcher[(4,)](*args, HAS_Y=False, BLOCK=64, num_warps=4)
    assert launcher.fast_launches == 1
    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # (Triton >= 3.5: a chain of hooks)
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        launcher[(4,)](*args, HAS_Y=False, BLOCK=64, num_warps=4)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert seen and launcher.fast_launches == 1  # the hook saw it: Triton's path


@gpu
def test_fast_launch_is_captured_by_a_cuda_graph():
    launcher = Launcher(fused_ops._silu_mul_kernel)
    gate_up = torch.randn(6, 2 * 300, device="cuda")
    out = torch.empty(6, 300, device="cuda")
    args = (gate_up, out, 300, gate_up.stride(0), out.stride(0))
    launcher[(6, 1)](*args, BLOCK=1024, num_warps=4)  # (compiles: Triton's path)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher[(6, 1)](*args, BLOCK=1024, num_warps=4)
    assert launcher.fast_launches == 1
    out.zero_()
    gate_up.normal_()
    graph.replay()
    torch.testing.assert_close(out, fused_ops.silu_mul_reference(gate_up), rtol=1e-5, atol=1e-5)
