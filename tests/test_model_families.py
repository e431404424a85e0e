"""Every decoder family of ``treegen/runtime/families.py`` against transformers' own model (fp32, CPU).

Each family is a tiny random model built from its real transformers config class with the family's
features on (q/k norms, sandwich / post norms, (1 + w) norms, scaled embeddings, GeGLU, fused
checkpoint weights, LongRoPE with partial rotary, local/global RoPE bases, attention and final-logit
soft-caps, sliding windows shorter than the prompts),
saved with ``save_pretrained`` and loaded back through treegen's own safetensors reader."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from test_end_to_end import check_against_hf, gen_records  # noqa: E402
from test_model import PackedCache, hf_logits, random_sequences, randomize_, save_tiny_tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import treegen  # noqa: E402
from treegen.runtime.engine import Engine  # noqa: E402
from treegen.runtime.families import FAMILIES  # noqa: E402
from treegen.runtime.loader import load_model  # noqa: E402
from treegen.runtime.model import LlamaFamilyModel  # noqa: E402
from treegen.runtime.model_config import UnsupportedModelError, layer_types_of, max_context_of  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)


def _cfg(cls_name: str, **kw):
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    return cls(**{**COMMON, **kw})


PHI_ROTARY = 8  # head_dim 16 x partial_rotary_factor 0.5
CONFIGS = {
    # per-head q/k RMSNorm, head_dim 32 != hidden / heads; a sliding window on the second layer
    "qwen3": lambda: _cfg("Qwen3Config", head_dim=32, use_sliding_window=True, sliding_window=6,
                          max_window_layers=1),
    "qwen3-tied-bias": lambda: _cfg("Qwen3Config", head_dim=16, attention_bias=True, tie_word_embeddings=True),
    # fused qkv_proj / gate_up_proj in the checkpoint, LongRoPE (short factors below the original
    # context, attention factor from max / original) on half of each head, a window on every layer
    "phi3-longrope-partial": lambda: _cfg(
        "Phi3Config", max_position_embeddings=256, original_max_position_embeddings=40, sliding_window=9,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [2.0, 4.0, 8.0, 16.0]}),
    "phi3-mha": lambda: _cfg("Phi3Config", num_key_value_heads=4),
    # Phi-4-mini's config: a window (262,144) past its longest context (131,072): no window at all
    "phi3-window-past-context": lambda: _cfg("Phi3Config", sliding_window=4096),
    # norms after attention and MLP only, q/k norm over the whole projection, RoPE in fp32
    "olmo2": lambda: _cfg("Olmo2Config"),
    "olmo3": lambda: _cfg("Olmo3Config", sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    # scaled embeddings, (1 + w) norms, GeGLU (tanh); Gemma ties its embeddings, which makes a random
    # model repeat its last token: untied here so that greedy branches differ
    "gemma": lambda: _cfg("GemmaConfig", head_dim=16, tie_word_embeddings=False),
    # + sandwich norms, query_pre_attn_scalar, attention and final-logit soft-caps (small, so they bite),
    # local (windowed) and global layers alternating
    "gemma2": lambda: _cfg("Gemma2Config", head_dim=16, query_pre_attn_scalar=24, sliding_window=7,
                           attn_logit_softcapping=1.5, final_logit_softcapping=4.0, tie_word_embeddings=False),
    # + per-head (1 + w) q/k norms, local/global layers with their own RoPE (global: linear scaling)
    "gemma3": lambda: _cfg(
        "Gemma3TextConfig", num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], final_logit_softcapping=6.0,
        tie_word_embeddings=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}),
}


def make_hf(name: str, seed: int = 0):
    """Small random HF model; every parameter (norms included) gets non-trivial values."""
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return randomize_(hf, 0.0 if FAMILIES[config.model_type].norm_style == "gemma" else 1.0)


def checkpoints(tmp_path_factory, make):
    """name -> (HF model ``make(name)``, checkpoint directory written by save_pretrained, with a tiny
    tokenizer), each made once."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = make(name)
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            save_tiny_tokenizer(path)
            cache[name] = hf, path
        return cache[name]

    return get


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return checkpoints(tmp_path_factory, make_hf)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_prefill_and_decode_match_hf(name, saved):
    """Loaded from its checkpoint: packed prefill of three sequences in any order, then incremental
    chunks of two sequences, against HF's logits."""
    hf, path = saved(name)
    model, _ = load_model(path)
    assert model.config.model_type == hf.config.model_type
    seqs = random_sequences([7, 11, 1])
    seq_ids = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    perm = torch.randperm(len(positions), generator=torch.Generator().manual_seed(3))
    out = PackedCache(model).forward(seq_ids[perm], torch.cat(seqs)[perm], positions[perm])
    torch.testing.assert_close(out, torch.cat([hf_logits(hf, s) for s in seqs])[perm], atol=1e-4, rtol=1e-4)

    seqs = random_sequences([30, 19], seed=5)
    full = [hf_logits(hf, s) for s in seqs]
    cache, done = PackedCache(model), [0, 0]
    for chunk in ([5, 3], [1, 1], [17, 4], [1, 0], [6, 11]):
        ids, pos, sid, want, rows = [], [], [], [], []
        for i, n in enumerate(chunk):
            ids += seqs[i][done[i]: done[i] + n].tolist()
            pos += range(done[i], done[i] + n)
            sid += [i] * n
            if n:
                rows.append(len(ids) - 1)
                want.append(full[i][done[i] + n - 1])
            done[i] += n
        out = cache.forward(torch.tensor(sid), torch.tensor(ids), torch.tensor(pos), torch.tensor(rows))
        torch.testing.assert_close(out, torch.stack(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_from_hf_equals_loaded_checkpoint(name, saved):
    """The HF-module path and the safetensors path build the same model."""
    hf, path = saved(name)
    a, (b, _) = LlamaFamilyModel.from_hf(hf), load_model(path)
    (seq,) = random_sequences([13], seed=9)
    pos = torch.arange(len(seq))
    torch.testing.assert_close(PackedCache(a).forward(torch.zeros_like(seq), seq, pos),
                               PackedCache(b).forward(torch.zeros_like(seq), seq, pos), atol=0, rtol=0)
    assert a.attn_scale == b.attn_scale and a.max_context == b.max_context and a.eos_token_ids == b.eos_token_ids


@treegen.program
def nested_forks(s):
    s += "w5 w9 w17 w3 w120 w44 w7"
    problems = s.fork(3, content=[" w11 w12", " w30", " w99 w98 w97 w96"])
    problems += [treegen.gen("a", max_tokens=4), treegen.gen("a", max_tokens=7), treegen.gen("a", max_tokens=5)]
    checks = problems.fork(2, content=lambda i: [" w60", " w61 w62"][i])
    checks += lambda i: treegen.gen("b", max_tokens=3 + 2 * i)
    problems.join(checks)
    s.join(problems)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_greedy_branches_match_hf_generate(name, saved):
    """Engine.load(checkpoint): greedy tokens of every branch of a nested fork program and of a
    two-program batch (a shared prefix found by the radix pass) equal HF generate on that branch's ids."""
    hf, path = saved(name)
    engine = Engine.load(str(path))
    root = nested_forks.run(engine)
    records = gen_records(root)
    assert len(records) == 3 + 6
    check_against_hf(hf, engine.tokenizer, records, engine.model.eos_token_ids)

    @treegen.program
    def solve(s, question):
        s += "w5 w9 w17 w3 w120 w44" + question
        samples = s.fork(2, content=[" w70", " w71"])
        samples += treegen.gen("x", max_tokens=5)
        s.join(samples)

    roots = solve.run_batch(engine, [(" w8 w9",), (" w10",)])
    batch = [r for root in roots for r in gen_records(root)]
    assert len({tuple(p) for p, _, _, _ in batch}) == 4
    check_against_hf(hf, engine.tokenizer, batch, engine.model.eos_token_ids)


def test_family_switches_seen_by_the_model(saved):
    phi = load_model(saved("phi3-longrope-partial")[1])[0]
    assert phi.rotary_dim == PHI_ROTARY and phi.head_dim == 16
    assert phi.max_context == 40  # the LongRoPE original context (the window, 48, is longer)
    assert phi.layers[0].q_w.data_ptr() == phi.layers[0].qkv_w.data_ptr()  # views of the fused checkpoint weight
    gemma3 = load_model(saved("gemma3")[1])[0]
    assert gemma3.attn_scale == 24**-0.5 and gemma3.final_softcap == 6.0
    assert gemma3.rope_keys == ["sliding_attention", "full_attention", "sliding_attention"]
    assert gemma3.max_context == 64 and gemma3.layer_window == [8, None, 8] and gemma3.lm_head is not gemma3.embed
    tied = load_model(saved("qwen3-tied-bias")[1])[0]
    assert tied.lm_head is tied.embed and tied.layers[0].q_b is not None and tied.layers[0].o_b is not None
    assert "gemma3_text" in repr(gemma3) and "fused=none" in repr(gemma3)  # CPU
    qwen3 = load_model(saved("qwen3")[1])[0]
    assert qwen3.layer_types == ["full_attention", "sliding_attention"] and qwen3.layer_window == [None, 6]
    gemma2 = load_model(saved("gemma2")[1])[0]
    assert gemma2.attn_softcap == 1.5 and gemma2.layer_window == [7, None]
    assert qwen3.layers[0].qk_norm.shape == (4 + 2, 32)
    olmo2 = load_model(saved("olmo2")[1])[0]
    assert olmo2.layers[0].attn_norm is None and olmo2.layers[0].attn_post_norm is not None
    assert olmo2.layers[0].q_norm.shape == (64,) and olmo2.max_context == 64


def test_random_weights_for_every_family():
    """LlamaFamilyModel.random (benchmarks) builds each family's layout from the config alone."""
    for name, make in CONFIGS.items():
        config = make()
        model = LlamaFamilyModel.random(config, dtype=torch.float32, device="cpu")
        out = PackedCache(model).forward(torch.zeros(5, dtype=torch.long), torch.arange(5), torch.arange(5))
        assert out.shape == (5, 128) and torch.isfinite(out).all(), name


# --------------------------------------------------------------------------- refusals


def test_quantized_checkpoint_is_refused(tmp_path):
    config = _cfg("Qwen3Config")
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    config.save_pretrained(tmp_path)  # no weights: refused from the config alone
    save_tiny_tokenizer(tmp_path)
    with pytest.raises(UnsupportedModelError, match="quantized checkpoints.*fp8"):
        load_model(tmp_path)


def test_bidirectional_gemma3_is_refused(tmp_path):
    config = _cfg("Gemma3TextConfig", head_dim=16, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        LlamaFamilyModel.random(config, dtype=torch.float32, device="cpu")


def test_a_window_longer_than_the_context_is_no_window():
    from treegen.runtime.model import LlamaFamilyModel

    cfg = CONFIGS["phi3-window-past-context"]()
    model = LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu")
    assert model.layer_types == ["sliding_attention"] * cfg.num_hidden_layers
    assert model.layer_window == [None] * cfg.num_hidden_layers and model.max_context < 4096
    cfg.sliding_window = model.max_context - 1  # (one shorter: a window)
    assert LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu").layer_window == [model.max_context - 1] * 2


def test_partial_rotary_outside_phi3_is_refused():
    config = _cfg("LlamaConfig", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        LlamaFamilyModel.random(config, dtype=torch.float32, device="cpu")


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(UnsupportedModelError, match="mamba") as err:
        load_model(tmp_path)
    for family in ("qwen3", "phi3", "olmo2", "gemma3_text", "llama"):
        assert family in str(err.value)


def test_window_rule_per_family():
    """Which layers get the window, by the family's rule; windows never limit the context."""
    assert layer_types_of(_cfg("Phi3Config", sliding_window=20)) == ["sliding_attention"] * 2  # phi3: every layer
    assert layer_types_of(_cfg("Phi3Config")) == ["full_attention"] * 2
    assert layer_types_of(_cfg("Qwen3Config", sliding_window=20)) == ["full_attention"] * 2  # use_sliding_window off
    assert layer_types_of(_cfg("Olmo2Config", sliding_window=20)) == ["full_attention"] * 2  # no windows in olmo2
    assert max_context_of(_cfg("Gemma3TextConfig", head_dim=16, sliding_window=20)) == 64


# --------------------------------------------------------------------------- the safetensors reader


@pytest.mark.parametrize("name", ["phi3-mha", "gemma3", "qwen3-tied-bias"])
def test_sharded_bf16_checkpoint_is_read_directly(name, tmp_path, monkeypatch):
    """A bf16 checkpoint in several shards loads as bf16 through treegen's reader (HF's loader is
    never asked), every weight is the file's tensor unchanged, and logits stay close to HF's in bf16."""
    hf = make_hf(name).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    save_tiny_tokenizer(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2

    def refuse(*args, **kwargs):
        raise AssertionError("the HF loader was used")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    model, _ = load_model(tmp_path, dtype=torch.bfloat16)
    layer = model.layers[0]
    assert model.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in (layer.qkv_w, layer.gate_up_w, layer.down_w, model.embed))
    state = hf.state_dict()
    q_name = "model.layers.0.self_attn." + ("qkv_proj" if name.startswith("phi3") else "q_proj") + ".weight"
    assert torch.equal(layer.qkv_w[: state[q_name].shape[0]], state[q_name])
    (seq,) = random_sequences([16])
    out = PackedCache(model).forward(torch.zeros(16, dtype=torch.long), seq, torch.arange(16))
    want = hf_logits(hf, seq)
    assert (out - want).abs().max() < 0.05 * want.abs().max()


def test_fp32_checkpoint_loaded_as_bf16_rounds_each_tensor_once(tmp_path, saved):
    hf, path = saved("olmo2")
    model, _ = load_model(path, dtype=torch.bfloat16)
    want = hf.state_dict()["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16)
    assert torch.equal(model.layers[1].down_w, want)
    assert model.layers[1].q_norm.dtype == torch.float32  # olmo-style norm scale: fp32, as HF computes it


def test_checkpoint_errors_name_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = make_hf("qwen3")
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(tmp_path)
    state["model.layers.1.self_attn.k_norm.weight"] = torch.ones(7)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"k_norm\.weight.*shape \(7,\).*\(32,\)"):
        load_model(tmp_path)


def test_hub_id_is_read_from_its_cached_snapshot(tmp_path, monkeypatch):
    """A hub id in the local HF cache (offline) goes through the same safetensors reader."""
    import huggingface_hub.constants

    repo = tmp_path / "models--treegen-test--tiny-phi3"
    snapshot = repo / "snapshots" / ("a" * 40)
    hf = make_hf("phi3-mha")
    hf.save_pretrained(snapshot)
    save_tiny_tokenizer(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))

    def refuse(*args, **kwargs):
        raise AssertionError("the HF loader was used")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    model, _ = load_model("treegen-test/tiny-phi3")
    (seq,) = random_sequences([9])
    out = PackedCache(model).forward(torch.zeros(9, dtype=torch.long), seq, torch.arange(9))
    torch.testing.assert_close(out, hf_logits(hf, seq), atol=1e-4, rtol=1e-4)


def test_multimodal_gemma3_checkpoint_runs_its_text_model(tmp_path):
    """Gemma 3 4B and larger ship as Gemma3ForConditionalGeneration: treegen reads the language model's
    tensors (as the hub stores them) and matches HF's model on text, greedy branches included."""
    config = transformers.Gemma3Config(
        text_config={**COMMON, "vocab_size": 128, "head_dim": 16, "sliding_window": 48, "query_pre_attn_scalar": 24,
                     "layer_types": ["sliding_attention", "full_attention"]},
        tie_word_embeddings=False,  # the lm_head is stored (HF ties by this outer flag)
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=127, boi_token_index=125, eoi_token_index=126)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "language_model" in pname:
                p.normal_(0.0, 0.2 if "norm" in pname else 1.0 if "embed" in pname else 0.5 / p.shape[-1] ** 0.5)
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    engine = Engine.load(str(tmp_path))
    assert engine.model.config.model_type == "gemma3_text" and engine.model.max_context == 64 and engine.model.layer_window[0] == 48
    assert engine.model.lm_head is not engine.model.embed
    (seq,) = random_sequences([12], vocab=120)
    out = PackedCache(engine.model).forward(torch.zeros(12, dtype=torch.long), seq, torch.arange(12))
    torch.testing.assert_close(out, hf_logits(hf, seq), atol=1e-4, rtol=1e-4)
    from_modules = LlamaFamilyModel.from_hf(hf)
    torch.testing.assert_close(PackedCache(from_modules).forward(torch.zeros(12, dtype=torch.long), seq,
                                                                 torch.arange(12)), out, atol=0, rtol=0)
    check_against_hf(hf, engine.tokenizer, gen_records(nested_forks.run(engine)), engine.model.eos_token_ids)
