"""GPU tests of the generic path (CUDA only): random models of real head shapes, 2 layers, bf16 and fp32
logits of the Engine (transformers' modules, tree attention through the Triton kernels, the KV store)
against Hugging Face's own model on the same weights; CUDA-graph decode against eager decode.

Run on the device machine with TRITON_INTERPRET=0; skipped elsewhere.
"""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from test_model_families_gpu import TOL, VOCAB, check_tree_logits, decode_with_and_without_graphs  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from treegen.runtime.engine import Engine  # noqa: E402
from treegen.runtime.generic import GenericModel  # noqa: E402
from treegen.runtime.loader import IdTokenizer  # noqa: E402

pytestmark = pytest.mark.gpu  # skipped without CUDA and compiled kernels (tests/conftest.py)
DEVICE = "cuda"
assert set(TOL) == {torch.float32, torch.bfloat16}

# real head shapes (Llama-3-8B, Qwen3-30B-A3B, Pythia-1.4B, gpt-oss-20b), 2 layers, a smaller vocabulary
SHAPES = {
    "llama3-8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                      num_key_value_heads=8, rope_theta=500000.0)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                         num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)),
    "gpt-neox": ("GPTNeoXConfig", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                                       rotary_pct=0.25)),
    # gpt-oss-20b: attention sinks, sliding (128) and full layers, YaRN, biases, 32 experts (top 4)
    "gpt-oss-20b": ("GptOssConfig", dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                         num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                         num_experts_per_tok=4, sliding_window=128,
                                         layer_types=["sliding_attention", "full_attention"],
                                         rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                          "beta_slow": 1.0, "truncate": False,
                                                          "original_max_position_embeddings": 4096,
                                                          "rope_theta": 150000.0})),
}


def real_shape(name: str, dtype: torch.dtype, **options):
    """(HF model, GenericModel over a copy of it) on the same random weights (logits O(1))."""
    cls_name, kw = SHAPES[name]
    config = getattr(transformers, cls_name)(vocab_size=VOCAB, num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
                                             pad_token_id=0, max_position_embeddings=4096, **kw)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, **options).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname or "layernorm" in pname:
                p.normal_(1.0, 0.1) if pname.endswith("weight") else p.zero_()
            elif "embed" in pname:
                p.normal_(0.0, 1.0)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 0.7 / p.shape[-1] ** 0.5)
    return hf, GenericModel(copy.deepcopy(hf))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_generic_engine_tree_logits_match_hf(name, dtype):
    """A shared 300-token prompt, four unbalanced suffixes, three forced decode steps through the Engine
    on the generic path (tree attention over the per-node KV store)."""
    hf, model = real_shape(name, dtype)
    engine = Engine(model, IdTokenizer())
    assert engine.implementation == "generic" and engine.attention_backend == "auto"
    check_tree_logits(engine, hf, dtype)


@pytest.mark.parametrize("name, experts", [("llama3-8b", None), ("qwen3-moe", "grouped_mm"), ("qwen3-moe", "eager")])
def test_generic_decode_with_and_without_cuda_graphs(name, experts):
    """Dense modules and grouped-matmul experts are captured as CUDA graphs; experts that loop over the
    experts they routed to (host syncs) are not, and the engine says so and decodes without graphs.
    Either way the tokens equal eager decoding."""
    options = {} if experts is None else {"experts_implementation": experts}
    _, model = real_shape(name, torch.bfloat16, **options)
    if experts == "eager":
        assert model.graphs_off_reason is not None and "CUDA graph" in model.graphs_off_reason
        engine = Engine(model, IdTokenizer())
        assert not engine.cuda_graphs and "cannot be captured" in repr(engine)
    else:
        assert model.graphs_off_reason is None, model.graphs_off_reason
    outputs = decode_with_and_without_graphs(model, shortest=10)
    assert outputs[True] == outputs[False]
