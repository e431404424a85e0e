"""The fused decoder-layer kernels (treegen/kernels/fused_ops.py) against their PyTorch references.

CI runs them in the Triton interpreter on CPU tensors (fp32, fp16); on a CUDA device (TRITON_INTERPRET=0)
the same tests run compiled, bf16 included. A model with the fused path forced on gives the same logits
as the reference path.
"""

import os

import pytest
import torch
from transformers import LlamaConfig

from treegen.kernels.fused_ops import (add_rms_norm, rms_norm_reference, rope_, rope_reference, silu_mul,
                                       silu_mul_reference)
from treegen.runtime.model import LlamaFamilyModel

COMPILED = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0"
DEVICE = "cuda" if COMPILED else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if COMPILED else [])
# one rounding step of the dtype (the kernels round where the references do; sums may differ in order)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_add_rms_norm_matches_residual_add_then_reference_norm(dtype, hidden):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, hidden, generator=g).to(DEVICE, dtype)
    y = torch.randn(5, hidden, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    want_h = h + y
    want = rms_norm_reference(want_h, w, 1e-5)
    got = add_rms_norm(h, y, w, 1e-5)  # adds y into h in place
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(add_rms_norm(h, None, w, 1e-5), want, rtol=TOL[dtype], atol=TOL[dtype])


def _qkv_and_rope(dtype, head_dim, tokens=7, nh=6, nkv=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, nh + 2 * nkv, head_dim, generator=g).to(DEVICE, dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 50
    emb = torch.cat((angles, angles), -1)
    return qkv, emb.cos().to(DEVICE, dtype)[:, None], emb.sin().to(DEVICE, dtype)[:, None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_in_place_on_the_query_and_key_heads_of_a_fused_qkv(dtype, head_dim):
    nh, nkv = 6, 2
    qkv, cos, sin = _qkv_and_rope(dtype, head_dim, nh=nh, nkv=nkv)
    want_q, want_k = rope_reference(qkv[:, :nh], cos, sin), rope_reference(qkv[:, nh : nh + nkv], cos, sin)
    v = qkv[:, nh + nkv :].clone()
    rope_(qkv, cos[:, 0], sin[:, 0], nh, nkv)
    torch.testing.assert_close(qkv[:, :nh], want_q, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(qkv[:, nh : nh + nkv], want_k, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(qkv[:, nh + nkv :], v)  # values untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_rotates_the_first_dims_and_passes_the_rest(dtype):
    """Phi-3/4: RoPE over the first 48 of 64 dims of each head (HF: rotate the slice, concatenate the rest)."""
    nh, nkv, rot = 6, 2, 48
    qkv, _, _ = _qkv_and_rope(dtype, 64, nh=nh, nkv=nkv)
    _, cos, sin = _qkv_and_rope(dtype, rot, nh=nh, nkv=nkv, seed=2)
    want = [torch.cat((rope_reference(x[..., :rot], cos, sin), x[..., rot:]), -1)
            for x in (qkv[:, :nh], qkv[:, nh : nh + nkv])]
    rope_(qkv, cos[:, 0], sin[:, 0], nh, nkv)
    torch.testing.assert_close(qkv[:, :nh], want[0], rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(qkv[:, nh : nh + nkv], want[1], rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nkv", [1, 3])
def test_rope_writes_keys_and_values_into_the_cache_slots(dtype, nkv):
    nh, tokens = 6, 5
    qkv, cos, sin = _qkv_and_rope(dtype, 64, tokens=tokens, nh=nh, nkv=nkv)
    want_q, want_k = rope_reference(qkv[:, :nh], cos, sin), rope_reference(qkv[:, nh : nh + nkv], cos, sin)
    want_v = qkv[:, nh + nkv :].clone()
    k_cache = torch.zeros(20, nkv, 64, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, 0, 9, 4], device=DEVICE)
    rope_(qkv, cos[:, 0], sin[:, 0], nh, nkv, store=(k_cache, v_cache, slots))
    torch.testing.assert_close(qkv[:, :nh], want_q, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(k_cache[slots], want_k, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(v_cache[slots], want_v)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not k_cache[untouched.to(DEVICE)].any() and not v_cache[untouched.to(DEVICE)].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = (3 * torch.randn(4, 2 * 1500, generator=g)).to(DEVICE, dtype)  # more than one block wide
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_reference(gate_up), rtol=TOL[dtype], atol=TOL[dtype])


def test_bad_shapes_are_named():
    x = torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match="h must be"):
        add_rms_norm(x, None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="qkv must be"):
        rope_(x, torch.zeros(2, 8), torch.zeros(2, 8), 2, 1)
    with pytest.raises(ValueError, match="cos/sin must be"):
        rope_(x, torch.zeros(2, 16), torch.zeros(2, 16), 1, 1)
    with pytest.raises(ValueError, match="cos/sin must be"):
        rope_(x, torch.zeros(2, 3), torch.zeros(2, 3), 1, 1)
    with pytest.raises(ValueError, match="store needs"):
        rope_(x, torch.zeros(2, 8), torch.zeros(2, 8), 1, 1, store=(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8),
                                                                     torch.zeros(2, dtype=torch.long)))
    with pytest.raises(ValueError, match="even width"):
        silu_mul(torch.zeros(2, 7))


def test_model_logits_equal_with_the_fused_path():
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    model = LlamaFamilyModel.random(cfg, dtype=torch.float32, device=DEVICE)
    ids = torch.randint(0, 100, (9,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    pos = torch.arange(9, device=DEVICE)
    caches = torch.zeros(2, 2, 12, 2, 32, device=DEVICE)  # [k/v, layer, slot, kv head, D]
    slots = torch.arange(2, 11, device=DEVICE)

    def attend(layer, q, k, v):  # causal attention over the 9 tokens (GQA), keys/values through the cache
        if k is not None:
            caches[0, layer, slots], caches[1, layer, slots] = k, v
        k, v = caches[0, layer, slots].repeat_interleave(2, 1), caches[1, layer, slots].repeat_interleave(2, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * model.attn_scale
        s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    model.fused = False
    want = model.forward(ids, pos, attend)
    model.fused = True
    torch.testing.assert_close(model.forward(ids, pos, attend), want, rtol=1e-4, atol=1e-4)
    caches.zero_()
    attend.cache = lambda layer: (caches[0, layer], caches[1, layer], slots)  # the model writes the cache
    torch.testing.assert_close(model.forward(ids, pos, attend), want, rtol=1e-4, atol=1e-4)
