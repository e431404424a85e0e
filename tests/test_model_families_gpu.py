"""GPU tests of every decoder family (CUDA only): random models of real head shapes, 2 layers, bf16 and
fp32 logits of treegen's forward (fused element-wise kernels on) and of the Engine (tree attention,
RoPE writing the KV cache) against Hugging Face's model on the same weights.

Run on the device machine with TRITON_INTERPRET=0; skipped elsewhere.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from test_model import PackedCache  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from treegen.runtime.engine import Engine, GenRequest  # noqa: E402
from treegen.runtime.families import FAMILIES  # noqa: E402
from treegen.runtime.loader import IdTokenizer  # noqa: E402
from treegen.runtime.model import LlamaFamilyModel  # noqa: E402
from treegen.runtime.sampler import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu  # skipped without CUDA and compiled kernels (tests/conftest.py)
DEVICE = "cuda"
VOCAB = 32000
# max |treegen - HF| as a fraction of the largest |HF logit|, by dtype: bf16 rounds each of our fused
# q/k/v and gate/up products (and the fused kernels' steps) where HF rounds its separate ones
TOL = {torch.float32: 2e-3, torch.bfloat16: 5e-2}

# real head shapes (Qwen3-1.7B, Phi-4-mini, OLMo-2-1B, Gemma-2-2B, Gemma-3-1B, Mistral-7B), 2 layers, smaller
# vocab; windows shorter than the tests' 300-token prompts so that they matter
SHAPES = {
    "qwen3": ("Qwen3Config", dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                                  num_key_value_heads=8, head_dim=128, rope_parameters={"rope_type": "default",
                                                                                        "rope_theta": 1e6})),
    "phi4-mini": ("Phi3Config", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.05 * i for i in range(48)],
                         "long_factor": [2.0 + 0.5 * i for i in range(48)]})),
    "olmo2": ("Olmo2Config", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                                  num_key_value_heads=16, max_position_embeddings=4096)),
    "gemma2": ("Gemma2Config", dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                                    num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                                    sliding_window=128, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        hidden_size=1152, intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=128, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
    # every layer windowed, head_dim 128: the Triton kernels apply the window
    "mistral-window": ("MistralConfig", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                             num_key_value_heads=8, sliding_window=64)),
}


def real_shape(name: str, dtype: torch.dtype):
    """(HF model, treegen model) on the same random weights; weights scaled so logits are O(1)."""
    cls_name, kw = SHAPES[name]
    cls = getattr(transformers, cls_name)
    config = cls(vocab_size=VOCAB, num_hidden_layers=2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                 pad_token_id=0, **kw)
    gemma_norm = FAMILIES[config.model_type].norm_style == "gemma"
    torch.manual_seed(0)
    with torch.device(DEVICE):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.normal_(0.0 if gemma_norm else 1.0, 0.1)
            elif "embed" in pname:
                p.normal_(0.0, 1.0)
            elif not pname.endswith("bias"):
                p.normal_(0.0, 0.7 / p.shape[1] ** 0.5)
    return hf, LlamaFamilyModel.from_hf(hf)


def assert_close_to(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, atol=TOL[dtype] * scale, rtol=0)
    # (no argmax check: a random model's top logits lie within a bf16 ulp of each other; measured 3 of 4
    # rows agreeing on an H100 with every logit inside the tolerance)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids], device=DEVICE)).logits[0].float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_forward_logits_match_hf(name, dtype):
    """Two packed sequences (300 and 77 tokens) through treegen's forward with the fused kernels on,
    attention by plain causal softmax; and the same with the fused kernels off."""
    hf, model = real_shape(name, dtype)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (300, 77)]
    seq_ids = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)]).to(DEVICE)
    positions = torch.cat([torch.arange(len(s)) for s in seqs]).to(DEVICE)
    tokens = torch.cat(seqs).to(DEVICE)
    want = torch.cat([hf_logits(hf, s.tolist()) for s in seqs])
    assert model.fused == (DEVICE == "cuda")
    fused = PackedCache(model).forward(seq_ids, tokens, positions)
    assert_close_to(fused, want, dtype)
    model.fused = False
    assert_close_to(PackedCache(model).forward(seq_ids, tokens, positions), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_engine_tree_logits_match_hf(name, dtype):
    """A shared 300-token prompt, four unbalanced suffixes, three forced decode steps through the Engine
    (tree attention; the fused RoPE kernel writes the KV cache, partial rotary included))."""
    hf, model = real_shape(name, dtype)
    engine = Engine(model, IdTokenizer())
    assert engine.attention_backend == "auto"  # every shape here runs the Triton kernels
    check_tree_logits(engine, hf, dtype)


def check_tree_logits(engine: Engine, hf, dtype: torch.dtype) -> None:
    """A shared 300-token prompt, four unbalanced suffixes, three forced decode steps through ``engine``:
    each step's logits close to HF's on that branch's whole sequence."""
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    prompt, suffixes = rand(300), [rand(k) for k in (1, 20, 37, 5)]
    forced = [rand(3) for _ in suffixes]
    run = engine.start()
    root = run.tree.add_node(None, prompt)
    leaves = [run.tree.add_node(root, s) for s in suffixes]
    first = run.prefill(leaves)
    got = {i: [first[leaf][-1:]] for i, leaf in enumerate(leaves)}
    for step in range(3):
        for i, leaf in enumerate(leaves):
            run.tree.extend(leaf, [forced[i][step]])
        out = run.prefill(leaves)
        for i, leaf in enumerate(leaves):
            got[i].append(out[leaf])
    for i, s in enumerate(suffixes):
        want = hf_logits(hf, prompt + s + forced[i])[-4:]
        assert_close_to(torch.cat(got[i]).float(), want, dtype)


@pytest.mark.parametrize("name", ["qwen3", "phi4-mini", "olmo2", "mistral-window"])
def test_cuda_graph_decode_equals_eager_decode(name):
    _, model = real_shape(name, torch.bfloat16)
    outputs = decode_with_and_without_graphs(model, shortest=4)
    assert outputs[True] == outputs[False]


def decode_with_and_without_graphs(model, shortest: int) -> dict[bool, list[list[int]]]:
    """Eight branches below a 200-token prompt (greedy and sampled, ``shortest`` to ``shortest + 4``
    tokens) decoded without and with CUDA graphs: their tokens by ``cuda_graphs``."""
    prompt = torch.randint(3, VOCAB, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    outputs = {}
    for graphs in (False, True):
        run = Engine(model, IdTokenizer(), cuda_graphs=graphs).start()
        root = run.tree.add_node(None, prompt)
        leaves = [run.tree.add_node(root) for _ in range(8)]
        gens = [GenRequest(leaf, SamplingParams(max_tokens=shortest + 2 * (i % 3), temperature=0.8 if i % 2 else 0.0,
                                                top_p=0.9, ignore_eos=True), key=i) for i, leaf in enumerate(leaves)]
        results, _ = run.execute(gens, [])
        outputs[graphs] = [r.tokens for r in results]
    return outputs


def test_fused_ops_chosen_per_family():
    """Which steps run as fused kernels follows the family's maths (and is visible in the repr)."""
    expected = {"qwen3": (True, True, True), "phi4-mini": (True, True, True), "olmo2": (False, True, True),
                "gemma3": (False, True, False)}
    for name, ops in expected.items():
        _, model = real_shape(name, torch.bfloat16)
        assert tuple(model.fused_ops) == ops, name
        assert "fused=" in repr(model)
