"""The SWA importance kernel (:func:`treegen.kernels.own_importance.own_importance`, Triton in the
interpreter here, fp32) against its PyTorch reference, and the reference against plain softmax maths."""

import os
import subprocess
import sys

import pytest
import torch

from treegen.kernels import own_importance as module
from treegen.kernels.own_importance import own_importance, own_importance_reference

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _case(seed, group, head_dim, quant):
    g = torch.Generator().manual_seed(seed)
    layers, branches, steps, kv_heads, slots = 2, 3, 5, 2, 220
    heads = kv_heads * group
    q = torch.randn(layers, branches, steps, heads, head_dim, generator=g)
    if quant:
        k = torch.randint(-127, 128, (layers, slots, kv_heads, head_dim), generator=g, dtype=torch.int8)
        k_scale = torch.rand(layers, slots, kv_heads, generator=g) * 0.02 + 0.001
    else:
        k, k_scale = torch.randn(layers, slots, kv_heads, head_dim, generator=g), None
    anc = torch.randn(layers, branches, steps, heads, generator=g) + 3
    anc[:, 1] = float("-inf")  # a branch without ancestors
    start = torch.tensor([0, 60, 150])
    written = torch.tensor([45, 70, 9])
    seg_pos = torch.tensor([100, 30, 5])
    # positions: past every own key, inside them (a key after a row is hidden), a padding row (-1)
    qpos = torch.tensor([[140, 141, 143, 144, -1], [80, 90, 97, 98, 99], [10, 11, 12, 13, 13]])
    return q, k, k_scale, anc, start, written, qpos, seg_pos


@pytest.mark.skipif(not INTERPRETING, reason="the kernel runs on CPU tensors in the interpreter only "
                                              "(tests/test_swa_gpu.py checks the compiled one)")
@pytest.mark.parametrize("group,head_dim", [(1, 16), (3, 64), (4, 32)])
@pytest.mark.parametrize("quant", [False, True])
def test_kernel_equals_the_reference(group, head_dim, quant):
    q, k, k_scale, anc, start, written, qpos, seg_pos = _case(group + head_dim, group, head_dim, quant)
    scale = head_dim**-0.5
    want = own_importance_reference(q, k, k_scale, anc, start, written, qpos, seg_pos, scale)
    launches = module._LAUNCH.triton_launches + module._LAUNCH.fast_launches
    got = own_importance(q, k, k_scale, anc, start, written, qpos, seg_pos, scale, width=80)
    assert module._LAUNCH.triton_launches + module._LAUNCH.fast_launches == launches + 1  # (the kernel ran)
    assert got.shape == (3, 2, 2, 80)
    torch.testing.assert_close(got[..., :70], want, atol=1e-5, rtol=1e-4)
    assert not got[..., 70:].any()  # past every branch's written keys
    assert not got[2, :, :, 9:].any()


def test_reference_is_the_softmax_weight_over_own_and_ancestor_keys():
    q, k, _, anc, start, written, qpos, seg_pos = _case(1, 2, 16, False)
    scale = 0.3
    got = own_importance_reference(q, k, None, anc, start, written, qpos, seg_pos, scale)
    layer, b, kv_head = 1, 0, 1  # (group 2: query heads 2 and 3)
    keys = k[layer, start[b]: start[b] + written[b], kv_head].double()
    hidden_after = seg_pos[b] + torch.arange(int(written[b]))
    want = torch.zeros(int(written[b]), dtype=torch.float64)
    for head in (2, 3):
        for t in range(q.shape[2]):
            if qpos[b, t] < 0:  # a padding row adds nothing
                continue
            s = keys @ q[layer, b, t, head].double() * scale
            s[hidden_after > qpos[b, t]] = float("-inf")
            lse = torch.logaddexp(torch.logsumexp(s, 0), anc[layer, b, t, head].double())
            want += (s - lse).exp()
    torch.testing.assert_close(got[b, layer, kv_head, : int(written[b])].double(), want, atol=1e-6, rtol=1e-5)


def test_the_tf32_switch_restores_either_api_and_leaves_other_kvs_alone():
    """SWA's TF32 switch (on only for 16-bit queries and keys on CUDA) puts back what it found, through the
    older flag or, in a process that set the newer one (torch >= 2.9, where reading the older then raises),
    through that — in a fresh interpreter, since setting the newer API is for the whole process."""
    code = """
import types, torch
from treegen.runtime.swa import _tf32_when_exact
kv = types.SimpleNamespace(device=torch.device("cuda"), format=types.SimpleNamespace(quantized=False),
                           dtype=torch.bfloat16)
q = [torch.zeros(1, dtype=torch.bfloat16)]
matmul = torch.backends.cuda.matmul
with _tf32_when_exact(kv, q):
    assert matmul.allow_tf32
assert not matmul.allow_tf32
if hasattr(matmul, "fp32_precision"):
    matmul.fp32_precision = "ieee"
    with _tf32_when_exact(kv, q):
        assert matmul.fp32_precision == "tf32"
    assert matmul.fp32_precision == "ieee"
with _tf32_when_exact(types.SimpleNamespace(device=torch.device("cpu"), format=kv.format, dtype=torch.bfloat16), q):
    pass
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
