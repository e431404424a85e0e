"""Full collections of Python's garbage collector are paused during a batch run (treegen.runtime.collector)."""

import gc
import threading

import pytest

import treegen
from treegen.runtime import collector
from treegen.runtime.collector import full_collections_paused

pytestmark = pytest.mark.skipif(not collector.APPLIES,
                                reason="the third gc threshold does not govern full collections here")


def test_pause_raises_the_oldest_threshold_and_restores_it_after_an_error():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError, match="inside"):
        with full_collections_paused():
            assert gc.get_threshold() == (before[0], before[1], collector._PAUSED_THRESHOLD)
            raise RuntimeError("inside")
    assert gc.get_threshold() == before


def test_pauses_nest_and_overlap_across_threads():
    before = gc.get_threshold()
    inside, leave = threading.Event(), threading.Event()

    def other():
        with full_collections_paused():
            inside.set()
            leave.wait(10)

    with full_collections_paused():
        with full_collections_paused():
            t = threading.Thread(target=other)
            t.start()
            assert inside.wait(10)
        assert gc.get_threshold()[2] == collector._PAUSED_THRESHOLD
    assert gc.get_threshold()[2] == collector._PAUSED_THRESHOLD  # the other thread is still inside
    leave.set()
    t.join(10)
    assert gc.get_threshold() == before


def test_young_collections_still_free_cycles_while_paused():
    class Node:
        pass

    freed = []
    with full_collections_paused():
        a, b = Node(), Node()
        a.other, b.other = b, a
        import weakref

        ref = weakref.ref(a)
        del a, b
        gc.collect(0)
        freed.append(ref() is None)
    assert freed == [True]


def test_a_batch_runs_with_full_collections_paused(tok_engine):
    seen = []

    @treegen.program
    def looks(s, x):
        seen.append(gc.get_threshold()[2])
        s += x

    before = gc.get_threshold()
    looks.run_batch(tok_engine, [{"x": " 5 6"}, {"x": " 7"}])
    assert seen == [collector._PAUSED_THRESHOLD] * 2
    assert gc.get_threshold() == before


def test_the_pause_covers_binding_the_inputs(tok_engine, monkeypatch):
    """A full collection that a batch's own set-up would start (binding hundreds of inputs) waits too."""
    from treegen.lang import dsl

    seen = []
    bind = dsl._bind
    monkeypatch.setattr(dsl, "_bind", lambda program, x: (seen.append(gc.get_threshold()[2]), bind(program, x))[1])

    @treegen.program
    def looks(s, x):
        s += x

    looks.run_batch(tok_engine, [{"x": " 5"}])
    assert seen == [collector._PAUSED_THRESHOLD]


@pytest.fixture(scope="module")
def tok_engine():
    import torch
    from transformers import LlamaConfig

    from treegen.runtime.engine import Engine
    from treegen.runtime.loader import IdTokenizer
    from treegen.runtime.model import LlamaFamilyModel

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    return Engine(LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu"), IdTokenizer())
