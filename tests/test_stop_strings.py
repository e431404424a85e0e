"""Stop strings: the cheap test on a block's tail text never misses a stop string that the exact check
(the whole text decoded after each token) finds, and a run takes the same tokens either way."""

import random

import pytest

import treegen
from treegen.runtime.stop_strings import StopStrings
from treegen.runtime.engine import Engine


def exact_stop(tokenizer, out, new, stops) -> bool:
    """The reference: after some token of ``new``, the whole text holds a stop string."""
    return any(any(s in tokenizer.decode(out + new[:k]) for s in stops) for k in range(1, len(new) + 1))


def texts_with_many_kinds_of_tokens(tokenizer) -> list[int]:
    text = ("Question: what is 12 × 7?\n\nAnswer: 84.  Réponse — «quatre-vingt-quatre» 🙂 ok\n"
            "def f(x):\n    return x ** 2  # ünïcödé, 中文, 日本語のテキスト\n\n</answer> The end.") * 3
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sentencepiece_style():
    """A small tokenizer decoded as Llama 2's SentencePiece ones are: "▁" for spaces, bytes as <0xNN>
    tokens, the text's leading space stripped."""
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *string.ascii_letters, *string.digits, *".,:;!?'\"()[]{}<>/-_=+*#\n", "▁the", "▁quick",
                  "▁answer", "▁is", "Question", "▁Question", "swer", "an", "er", "on", "ing", "▁a", ":\n", "\n\n"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_the_tail_test_never_misses_a_stop_string(tokenizer, kind):
    """Random cuts of a text with multi-byte characters and random token soup, stop strings taken from the
    text (so they do occur), blocks of 1-8 new tokens, a byte-level BPE tokenizer (SmolLM2's) and a
    SentencePiece-style one with byte fallback: wherever the exact check stops, the test says maybe; and it
    says no for many blocks (it is a filter, not a constant)."""
    tokenizer = tokenizer if kind == "byte-level" else sentencepiece_style()
    rng = random.Random(0)
    scan = StopStrings(tokenizer)
    ids = texts_with_many_kinds_of_tokens(tokenizer)
    text = tokenizer.decode(ids)
    said_no = hits = 0
    for trial in range(600):
        seq = ids if trial % 2 else [rng.randrange(len(tokenizer)) for _ in range(len(ids))]
        cut, width = rng.randrange(0, len(seq) - 8), rng.randrange(1, 9)
        out, new = seq[:cut], seq[cut : cut + width]
        if trial % 3:  # a stop string that ends in the new tokens' text (if they add any)
            whole, before = tokenizer.decode(out + new), len(tokenizer.decode(out))
            end = rng.randrange(min(before + 1, len(whole)), len(whole) + 1)
            stops = (whole[max(0, end - rng.randrange(1, 12)) : end] or "x",)
        else:  # one from anywhere in the text
            start = rng.randrange(0, len(text) - 12)
            stops = tuple(text[start : start + rng.randrange(1, 12)] for _ in range(rng.randrange(1, 3)))
        if any(s in tokenizer.decode(out) for s in stops):  # (the branch would have ended before)
            continue
        maybe = scan.may_stop([out], [new], [stops])[0]
        exact = exact_stop(tokenizer, out, new, stops)
        assert maybe or not exact, (out[-20:], new, stops)
        hits += exact
        said_no += not maybe
    assert hits > 50 and said_no > 40


def test_the_tail_is_a_few_tokens_of_ordinary_text(tokenizer):
    """Before a block's new tokens the test decodes enough tokens for the longest stop string's characters
    and one more, also with a tokenizer without a vocabulary size (token ids as text, "90" counted as one
    character: a SentencePiece start or a clean-up may take one), whose tokens it learns as they come."""
    from treegen.runtime.loader import IdTokenizer

    out = tokenizer("The quick brown fox jumps over the lazy dog, and then some.", add_special_tokens=False)["input_ids"]
    assert 3 <= StopStrings(tokenizer).tail(out, ("Question:",)) <= 6
    assert StopStrings(IdTokenizer()).tail(list(range(100)), ("Question:",)) == 9 + 1


def test_stop_strings_that_may_vanish_take_the_exact_check(tokenizer):
    """A replacement character, or a space where the tokenizer cleans spaces up, may be in the text after
    one token and gone after the next: such stop strings always take the exact check."""
    ids = tokenizer("plain words", add_special_tokens=False)["input_ids"]
    assert StopStrings(tokenizer).may_stop([ids], [ids], [("\ufffd",)]) == [True]
    assert StopStrings(tokenizer).may_stop([ids], [ids], [("zz",)]) == [False]


def test_decoders_that_are_not_local_take_the_exact_check(tokenizer):
    """WordPiece's "##" pieces write fewer characters inside a word than alone, so the tail's count would
    be wrong: a tokenizer with such a decoder (or one that cleans up spaces) sends every block to the exact
    check; the embedded byte-level one and SentencePiece's do not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from treegen.runtime.stop_strings import local_decoding

    t = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "x": 1, "##a": 2, "##bc": 3}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")
    out, new, stop = [1, 2, 3, 3, 3, 3], [3], ("xabcbcbcbcbc",)
    assert exact_stop(wordpiece, out, new, stop)
    assert StopStrings(wordpiece).may_stop([out], [new], [stop]) == [True]
    assert local_decoding(tokenizer) and local_decoding(sentencepiece_style()) and not local_decoding(wordpiece)


@treegen.program
def stopping(s, stop):
    s += "Once upon a time"
    b = s.fork(24)
    b += treegen.gen("x", max_tokens=40, temperature=1.0, stop=stop)
    s.join(b)


@pytest.mark.parametrize("every", [1, 8])
def test_a_run_stops_where_the_exact_check_stops(tiny_llama, tokenizer, monkeypatch, every):
    """Sampled branches of a random model with stop strings that its token soup hits at many places:
    the same tokens, texts and finish reasons with the tail test as with the exact check after every token
    (the test's "maybe" everywhere), whether the host takes tokens one at a time or in blocks of 8."""
    from treegen.runtime.decode import Decoder

    _, model = tiny_llama
    init = Decoder.__init__

    def with_blocks(self, run):
        init(self, run)
        self.sync_every = every

    monkeypatch.setattr(Decoder, "__init__", with_blocks)
    stops = ("ing", "ation", "\n")

    def results():
        root = stopping.run(Engine(model, tokenizer), stops)
        return [(st.gen_tokens("x"), st["x"], st.info["x"]["finish_reason"])
                for st in root._run.states[1:]]

    verdicts = []
    real = StopStrings.may_stop

    def counted(self, *args):
        verdicts.extend(out := real(self, *args))
        return out

    monkeypatch.setattr(StopStrings, "may_stop", counted)
    fast = results()
    monkeypatch.setattr(StopStrings, "may_stop", lambda self, outs, news, stops: [True] * len(outs))
    exact = results()
    assert fast == exact
    reasons = [r for _, _, r in fast]
    assert reasons.count("stop") >= 4 and reasons.count("length") >= 1
    assert verdicts.count(False) > verdicts.count(True) > 0


def test_the_batched_decode_writes_what_decode_writes(tokenizer):
    """``Engine.batch_decode`` (the stop test's tails, the texts of the branches a block finishes): the texts
    of ``tokenizer.decode`` for each sequence, special tokens skipped or not — through the Rust batch for the
    embedded fast tokenizer, the tokenizer's own decode for treegen's stand-in."""
    from treegen.runtime.loader import IdTokenizer
    from treegen.runtime.text_decode import BatchDecoder

    ids = texts_with_many_kinds_of_tokens(tokenizer)
    specials = tokenizer.all_special_ids
    sequences = [ids[:40], ids[40:41] + specials + ids[41:90], [], specials, ids[3:7]]
    for tok, rust in ((tokenizer, True), (sentencepiece_style(), True), (IdTokenizer(), False)):
        decode = BatchDecoder(tok)
        for skip in (False, True):
            want = [tok.decode(q, skip_special_tokens=skip) for q in sequences]
            assert decode(sequences, skip_special_tokens=skip) == want
            assert (decode._rust(skip) is not None) == rust


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_its_own_decode(tokenizer):
    """transformers cleans up spaces (" ," → ",") after the backend's decode, where a tokenizer asks: the Rust
    batch would skip that, so such a tokenizer's texts come from its own decode."""
    import copy

    from treegen.runtime.text_decode import BatchDecoder

    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    decode = BatchDecoder(cleaning)
    ids = tokenizer("Hello , world . It 's fine", add_special_tokens=False)["input_ids"]
    assert decode._rust(True) is None and decode([ids], skip_special_tokens=True) == [cleaning.decode(ids, skip_special_tokens=True)]
