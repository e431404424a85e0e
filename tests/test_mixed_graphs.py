"""Mixed steps (new work prefilled beside the live decode rows) in kept, padded buffers
(treegen.runtime.mixed_graphs): on the CPU eagerly in the same buffers a CUDA graph replays, with the Triton
kernels in the interpreter — the same tokens and log-probabilities as mixed steps in tensors of their own, and
later steps reusing earlier steps' buffers. The graphs themselves: tests/test_runtime_gpu.py."""

import pytest
import torch

from test_continuous import grows, inputs
from treegen.runtime.decode import Decoder
from treegen.runtime.engine import Engine
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.mixed_graphs import MIXED_ROWS_MAX, MixedKey, mixed_key
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.phase_graphs import PhaseGraphs


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    return LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu", std=1.0)  # (a wrong key changes tokens)


def _batch(model, monkeypatch, keep: bool, joins: bool = False):
    """``joins``: forks after a gen join decode phases (TreeRun.joins_phase) rather than run mixed steps."""
    engine = Engine(model, IdTokenizer())
    monkeypatch.setenv("TREEGEN_JOIN_PHASES", "1" if joins else "0")
    engine.attention_backend = "triton"
    init = Decoder.__init__

    def with_kept(self, run):
        init(self, run)
        self.kept = PhaseGraphs() if keep else None

    monkeypatch.setattr(Decoder, "__init__", with_kept)
    monkeypatch.setenv("TREEGEN_KEEP_MIXED_GRAPHS", "1")
    try:
        # rounds of equal shape (mixed steps that fit an earlier one's buffers), then some of their own
        same = [{"question": " 7 8 9", "lengths": [[4, 3]] * 3} for _ in range(4)]
        roots = grows.run_batch(engine, [dict(x, temperature=1.0) for x in same + inputs(2, seed=2)], seed=4)
    finally:
        monkeypatch.setattr(Decoder, "__init__", init)
    run = roots[0]._run.tree_run
    logprobs = [st.info["a"]["logprob"] for st in roots[0]._run.states if "logprob" in st.info.get("a", {})]
    return [r.ret_value for r in roots], logprobs, run


@pytest.fixture(scope="module")
def plain(model):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _batch(model, monkeypatch, keep=False)


def test_mixed_steps_in_kept_buffers_give_the_same_tokens(model, plain, monkeypatch):
    kept, kept_logprobs, run = _batch(model, monkeypatch, keep=True)
    plain, plain_logprobs, plain_run = plain
    assert kept == plain
    assert len(kept_logprobs) > 20 and kept_logprobs == pytest.approx(plain_logprobs, abs=1e-4)
    assert plain_run.mixed_kept == 0
    assert run.mixed_kept == run.mixed_steps > 3 and run.mixed_reused >= 1, (run.mixed_kept, run.mixed_reused)
    assert any(isinstance(key, MixedKey) for key, _ in run.decoder.kept.kept.values())


@pytest.mark.parametrize("keep", [False, True], ids=["own-tensors", "kept-buffers"])
def test_gens_joining_decode_phases_give_the_tokens_of_mixed_steps(model, plain, monkeypatch, keep):
    """Rounds whose fork follows one appended token join a decode phase at its first step — its slots moved
    from the conditioning token's (or a spare one) to the gen's node after it, in kept buffers too — with the
    tokens and log-probabilities of mixed steps."""
    joined, joined_logprobs, run = _batch(model, monkeypatch, keep=keep, joins=True)
    plain, plain_logprobs, plain_run = plain
    assert joined == plain and joined_logprobs == pytest.approx(plain_logprobs, abs=1e-4)
    assert run.phase_joins > 3 and run.mixed_steps < plain_run.mixed_steps
    assert (run.decoder.kept is not None and run.decoder.kept.hits >= 1) == keep


def test_padding_rows_writing_over_a_written_slot_would_be_seen(model, plain, monkeypatch):
    """The comparison above sees where padding rows write: given the prompt's first slot (written KV) as their
    pad slot, tokens change."""
    from treegen.runtime.tree_run import TreeRun

    monkeypatch.setattr(TreeRun, "_pad_slot", lambda run, *ends: min(seg.start for seg in run.kv.segments.values()))
    kept, _, run = _batch(model, monkeypatch, keep=True)
    assert run.mixed_kept > 3 and kept != plain[0]


def test_a_mixed_step_too_large_or_with_a_library_segment_runs_uncaptured():
    class Plan:
        def __init__(self, key):
            self.key = key

        def shape_key(self):
            return self.key

    assert mixed_key(Plan(("k",)), rows=MIXED_ROWS_MAX + 1, logits_rows=4, gather=True, pool_generation=0) is None
    assert mixed_key(Plan(None), rows=40, logits_rows=4, gather=True, pool_generation=0) is None
    key = mixed_key(Plan(("k",)), rows=40, logits_rows=3, gather=True, pool_generation=0)
    assert key.rows == 40 and key.logits_rows == 8 and key.kind == "mixed"
