"""The generic path (``treegen/runtime/generic.py``): transformers' own modules with treegen's tree
attention, against Hugging Face ``generate`` (fp32, CPU).

Tiny random models saved with ``save_pretrained``: two families that also have a fast path (forced
onto the generic one), mixture-of-experts models (Qwen3-MoE, Mixtral) and a family that has no row in our table
(GPT-NeoX: partial rotary, parallel residual, LayerNorm, biases), each loaded through ``Engine.load``.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from test_end_to_end import check_against_hf, gen_records  # noqa: E402
from test_model import PackedCache, hf_logits, random_sequences, randomize_, save_tiny_tokenizer  # noqa: E402
from test_model_families import COMMON, CONFIGS, checkpoints, nested_forks  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import treegen  # noqa: E402
from treegen.runtime.engine import Engine  # noqa: E402
from treegen.runtime.generic import GenericModel  # noqa: E402
from treegen.runtime.loader import IdTokenizer, choose_implementation, load_model  # noqa: E402
from treegen.runtime.requests import GenRequest  # noqa: E402
from treegen.runtime.sampler import SamplingParams  # noqa: E402
from treegen.runtime.model import LlamaFamilyModel  # noqa: E402
from treegen.runtime.model_config import UnsupportedModelError  # noqa: E402


def _cfg(cls_name: str, **kw):
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    return cls(**kw)


GENERIC_CONFIGS = {
    "llama": lambda: _cfg("LlamaConfig", **COMMON),
    "qwen3": CONFIGS["qwen3"],  # q/k norms, head_dim 32, a sliding window (6) on the second layer
    "gemma2": CONFIGS["gemma2"],  # attention soft-cap 1.5, windowed and global layers, GeGLU, sandwich norms
    "qwen3_moe": lambda: _cfg("Qwen3MoeConfig", **COMMON, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True),
    "mixtral": lambda: _cfg("MixtralConfig", **COMMON, num_local_experts=4, num_experts_per_tok=2),
    # attention sinks (a logit per head in every softmax), sliding and full layers, YaRN, biases, a routed MoE
    "gpt_oss": lambda: _cfg("GptOssConfig", **{**COMMON, "head_dim": 16}, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False, "original_max_position_embeddings": 16,
                                             "rope_theta": 150000.0}),
    "gpt_neox": lambda: _cfg("GPTNeoXConfig", vocab_size=128, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                             rotary_pct=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0),
}
FORCED = {"llama", "qwen3", "gemma2"}  # families the fast path runs too: loaded with implementation="generic"


def make_generic_hf(name: str):
    torch.manual_seed(0)
    return randomize_(AutoModelForCausalLM.from_config(GENERIC_CONFIGS[name](), dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (HF model, checkpoint directory with a tiny tokenizer)."""
    return checkpoints(tmp_path_factory, make_generic_hf)


@pytest.mark.parametrize("name", sorted(GENERIC_CONFIGS))
def test_generic_engine_greedy_branches_match_hf_generate(name, saved, caplog):
    """Greedy tokens of every branch of a nested fork program and of a two-program batch equal HF
    generate on that branch's ids; the engine says it runs the generic path."""
    hf, path = saved(name)
    with caplog.at_level(logging.WARNING, logger="treegen.runtime.engine"):
        engine = Engine.load(str(path), implementation="generic" if name in FORCED else "auto")
    assert isinstance(engine.model, GenericModel) and engine.implementation == "generic"
    assert "path='generic'" in repr(engine) and "GenericModel(" in repr(engine)
    notices = [r.getMessage() for r in caplog.records if "generic path" in r.getMessage()]
    assert len(notices) == 1 and "\n" not in notices[0] and hf.config.model_type in notices[0]
    check_against_hf(hf, engine.tokenizer, gen_records(nested_forks.run(engine)), engine.model.eos_token_ids)

    @treegen.program
    def solve(s, question):
        s += "w5 w9 w17 w3 w120 w44" + question
        samples = s.fork(2, content=[" w70", " w71"])
        samples += treegen.gen("x", max_tokens=5)
        s.join(samples)

    batch = [r for root in solve.run_batch(engine, [(" w8 w9",), (" w10",)]) for r in gen_records(root)]
    assert len({tuple(p) for p, _, _, _ in batch}) == 4
    check_against_hf(hf, engine.tokenizer, batch, engine.model.eos_token_ids)


def test_packed_logits_match_hf_and_the_fast_path(saved):
    """Packed prefill of sequences in any order (a tree's rows) gives HF's logits; for a family with a
    fast path, the fast path's too."""
    hf, path = saved("qwen3")
    generic, _ = load_model(path, implementation="generic")
    fast, _ = load_model(path)
    assert isinstance(fast, LlamaFamilyModel) and fast.implementation == "fast"
    seqs = random_sequences([7, 11, 1])
    seq_ids = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    perm = torch.randperm(len(positions), generator=torch.Generator().manual_seed(3))
    out = PackedCache(generic).forward(seq_ids[perm], torch.cat(seqs)[perm], positions[perm])
    torch.testing.assert_close(out, torch.cat([hf_logits(hf, s) for s in seqs])[perm], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, PackedCache(fast).forward(seq_ids[perm], torch.cat(seqs)[perm], positions[perm]),
                               atol=1e-4, rtol=1e-4)
    rows = torch.tensor([0, 5, 18])
    picked = PackedCache(generic).forward(seq_ids[perm], torch.cat(seqs)[perm], positions[perm], rows)
    torch.testing.assert_close(picked, out[rows], atol=1e-5, rtol=1e-5)
    # what the probe read from the modules
    assert (generic.num_layers, generic.num_heads, generic.num_kv_heads, generic.head_dim) == (2, 4, 2, 32)
    assert generic.attn_scale == fast.attn_scale and generic.max_context == fast.max_context == 64
    assert generic.layer_window == fast.layer_window == [None, 6] and generic.attn_softcap is None
    assert generic.eos_token_ids == fast.eos_token_ids


@treegen.program
def two_samples(s):
    s += "w5 w9 w17 w3 w120 w44 w8"
    samples = s.fork(2, content=[" w70", " w71 w72"])
    samples += treegen.gen("x", max_tokens=6)
    s.join(samples)


def test_eight_bit_kv_on_the_generic_path(saved):
    """The KV format is the store's: an int8 cache gives the same greedy tokens on both paths."""
    _, path = saved("llama")
    runs = [Engine.load(str(path), implementation=impl, kv_dtype="int8") for impl in ("fast", "generic")]
    tokens = [[tuple(g) for _, g, _, _ in gen_records(two_samples.run(e))] for e in runs]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 2 and runs[1].kv_format.name == "int8"


def test_fast_path_refusal_falls_to_the_generic_path(tmp_path, monkeypatch):
    """A config feature the fast path does not implement runs through the generic path, exactly, and
    the reason given is the fast path's refusal. (The fast path takes its RoPE types from transformers;
    here it is made to know none but the default, as with a RoPE type newer than it.)"""
    import treegen.runtime.model_config as fast_model_config

    monkeypatch.setattr(fast_model_config, "_rope_init_functions", lambda: {})
    config = _cfg("LlamaConfig", **COMMON, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    path, reason = choose_implementation(config, config)
    assert path == "generic" and reason.startswith("the fast path does not run it (unsupported RoPE type 'linear'")
    with pytest.raises(UnsupportedModelError, match="unsupported RoPE type 'linear'"):
        choose_implementation(config, config, "fast")
    torch.manual_seed(0)
    hf = randomize_(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    engine = Engine.load(str(tmp_path))
    assert engine.implementation == "generic" and "RoPE type 'linear'" in engine.model.reason
    check_against_hf(hf, engine.tokenizer, gen_records(two_samples.run(engine)), engine.model.eos_token_ids)


def test_a_model_only_the_generic_path_runs_is_refused_tensor_parallel_before_any_worker_starts(saved, monkeypatch):
    from treegen.runtime import workers

    def never(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(workers, "start_team", never)
    _, path = saved("qwen3_moe")
    with pytest.raises(UnsupportedModelError, match=r"runs on the generic path \(the fast path does not run it .*\), "
                                                    r"which has no tensor-parallel split: use tensor_parallel=1"):
        Engine.load(str(path), tensor_parallel=2)
    with pytest.raises(UnsupportedModelError, match="qwen3_moe") as e:  # the fast path's own refusal, not the above
        Engine.load(str(path), tensor_parallel=2, implementation="fast")
    assert "generic path (" not in str(e.value)


def test_attention_sinks_over_the_triton_kernels_plans_give_hf_generate(monkeypatch):
    """gpt-oss's sinks with the Triton tree-attention backend (interpreted on the CPU; head_dim 64): its plans
    carry no levels, so each pass is also planned for the rows' LSEs (``PassPlan.lse_layer``); greedy branches
    equal HF ``generate``'s."""
    config = GENERIC_CONFIGS["gpt_oss"]()
    config.head_dim = 64
    torch.manual_seed(0)
    hf = randomize_(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    model = GenericModel(copy.deepcopy(hf))
    assert model.needs_row_lse and model.graphs_off_reason is None  # (on CUDA: off, "attention sinks: ...")
    engine = Engine(model, IdTokenizer())
    engine.attention_backend = "triton"
    run = engine.start()
    planned, plan_rows = [], run.plan_rows

    def spy(*args, **kwargs):
        out = plan_rows(*args, **kwargs)
        planned.append(out[2].lse_by_window is not None and out[2].backend == "triton")
        return out

    monkeypatch.setattr(run, "plan_rows", spy)
    prompt = [5, 9, 13, 7, 21, 3, 8, 11, 40, 41]
    root = run.tree.add_node(None, prompt)
    leaves = [run.tree.add_node(root, [60 + i, 70 + i]) for i in range(3)]
    results, _ = run.execute([GenRequest(leaf, SamplingParams(max_tokens=8, ignore_eos=True), key=i)
                              for i, leaf in enumerate(leaves)], [])
    assert len(planned) > 1 and all(planned)  # (Triton plans, each with its LSE plans)
    for i, r in enumerate(results):
        ids = torch.tensor([prompt + [60 + i, 70 + i]])
        want = hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)[0, 12:].tolist()
        assert list(r.tokens) == want, i


def test_a_model_whose_attention_is_its_own_code_is_refused_saying_so():
    config = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(UnsupportedModelError, match=r"model_type='bloom': none of its 2 layers calls transformers' "
                                                    r"attention interface"):
        GenericModel(hf)


def test_from_hf_takes_the_model_over():
    """GenericModel wraps an HF model in place: its attention becomes treegen's, which refuses to run
    outside treegen's forward rather than attend without a mask."""
    config = _cfg("MixtralConfig", **COMMON, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    hf = randomize_(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    reference = copy.deepcopy(hf)
    model = GenericModel(hf)
    (seq,) = random_sequences([9])
    out = PackedCache(model).forward(torch.zeros(9, dtype=torch.long), seq, torch.arange(9))
    torch.testing.assert_close(out, hf_logits(reference, seq), atol=1e-4, rtol=1e-4)
    assert model.num_layers == 2 and model.hf is hf and model.graphs_off_reason is None  # CPU: no capture probe
    with pytest.raises(RuntimeError, match="runs only inside treegen's GenericModel.forward"):
        hf(torch.tensor([[3, 4]]))


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("config, words", [
    ({"model_type": "mamba"}, ["state-space", "mamba", "qwen3", "llama", "generic path"]),
    ({"model_type": "jamba"}, ["hybrid recurrent", "jamba"]),
    ({"model_type": "no_such_model"}, ["no_such_model", "neither path", "gemma3_text"]),
])
def test_architectures_neither_path_runs_are_named(tmp_path, config, words):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as err:
        load_model(tmp_path)
    for word in words:
        assert word in str(err.value)


def test_encoder_decoder_and_multimodal_configs_are_refused():
    t5 = _cfg("T5Config", vocab_size=128, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    with pytest.raises(UnsupportedModelError, match="'t5' is an encoder-decoder model.*neither path"):
        choose_implementation(t5, t5)
    llava = _cfg("LlavaConfig")
    with pytest.raises(UnsupportedModelError, match="'llava' is a multimodal model"):
        choose_implementation(llava, llava, "generic")
    qwen3 = CONFIGS["qwen3"]()
    with pytest.raises(UnsupportedModelError, match="qwen3_moe.*supports model_type in"):
        choose_implementation(GENERIC_CONFIGS["qwen3_moe"](), GENERIC_CONFIGS["qwen3_moe"](), "fast")
    with pytest.raises(ValueError, match="implementation must be one of auto, fast, generic"):
        choose_implementation(qwen3, qwen3, "fastest")


def test_attention_features_are_read_by_the_probe():
    """Read from the modules' own attention calls: sinks (gpt-oss: rows' LSEs needed), soft caps and windows."""
    oss = _cfg("GptOssConfig", **{**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                   "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]})
    model = GenericModel(AutoModelForCausalLM.from_config(oss, dtype=torch.float32))
    assert model.needs_row_lse and model.layer_window == [32, None]
    gemma2 = _cfg("Gemma2Config", **{**COMMON, "head_dim": 16}, sliding_window=8)  # attn_logit_softcapping=50.0 by default
    model = GenericModel(AutoModelForCausalLM.from_config(gemma2, dtype=torch.float32))
    assert model.attn_softcap == 50.0 and model.layer_window == [gemma2.sliding_window, None] and not model.needs_row_lse
