"""Stop strings found without decoding a branch's whole text at every token.

A ``gen`` with stop strings ends at the first token after which its text — ``tokenizer.decode`` of
every token it made — contains one of them (:func:`~treegen.runtime.token_accept.finished`). Checking that
by decoding the whole text after each token costs time in the text's length per token: a 256-token
answer decodes ~33K tokens' worth, and 1,024 such branches decoded at 0.14 of the speed of branches
without stop strings (``benchmarks/bench_stop_strings.py``).

:meth:`StopStrings.may_stop` is the cheap test in front of that check. For a block of new tokens it
decodes only the tail of each branch's tokens — the new ones and a few before them — in one batched
call; the branches whose tail text contains none of their stop strings go on without the exact,
token-by-token check. The test may say "maybe" where the exact check then finds nothing (it costs a
few decodes), never "no" where a stop string ends in the new tokens' text:

- decoding is local: the text of ``tokens[s:]`` equals the tail of the text of ``tokens`` except for
  the first token's few characters (SentencePiece drops the first token's leading space), provided the
  cut is not inside a
  character: the first token must not be *partial* — a token whose text alone holds a replacement
  character, a piece of a multi-byte character (a byte-level tokenizer renders a cut character as
  U+FFFD; SentencePiece's byte fallback renders a whole run of byte tokens as U+FFFD once any of them
  does not decode);
- a stop string of ``L`` characters that ends within the new tokens' text starts at most ``L - 1``
  characters before it. The tail takes tokens before the new ones until they write at least ``L``
  characters, counting each as the fewest it can write in any text (its text alone, less the one space
  a SentencePiece start may take; none for a partial token), then one more token, the
  first, which is not counted and not partial (the tail goes back further while it is).

The exact check runs after every token, the test on the block's text: a stop string that is in the
text after some of the new tokens but gone after the last would escape it. Text changes behind its
end only where a partial token follows (it may complete a character rendered as U+FFFD before; under
byte fallback, a byte token that does not decode turns its whole run of byte tokens into U+FFFD, also
the characters before it). So the test also decodes the tail up to each new partial token, and a stop
string with U+FFFD in it always takes the exact check.

The argument holds for the decoders of the tokenizers language models ship: byte-level BPE (GPT-2,
Llama 3, Qwen, SmolLM) and SentencePiece's ("▁" for spaces, byte fallback, the leading space stripped),
and for treegen's stand-ins (:class:`~treegen.runtime.loader.IdTokenizer`,
:class:`~treegen.runtime.piece_tokenizer.PieceTokenizer`). Not for others (WordPiece's ``##`` pieces
write fewer characters in a word than alone; CTC merges repeats; a clean-up of spaces after decoding,
``clean_up_tokenization_spaces`` — ``" ."`` becomes ``"."`` — may take a token's leading and trailing
space, and change text behind its end): under those every block takes the exact check
(:attr:`StopStrings.local` is False).
"""

from __future__ import annotations

import json

from treegen.runtime.text_decode import BatchDecoder

# the decoder steps (tokenizers' JSON "type") whose output is a concatenation of per-token text, save the
# first token's leading space and U+FFFD for a cut character (see the module doc)
LOCAL_DECODERS = frozenset({"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip", "Sequence"})


def local_decoding(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` is local in the sense of the module doc: a fast tokenizer whose decoder
    is made of :data:`LOCAL_DECODERS` steps and that cleans up no spaces, or one of treegen's stand-ins."""
    if type(tokenizer).__module__.startswith("treegen."):
        return True
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str") or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, TypeError):
        return False
    steps, types = [decoder], set()
    while steps:
        step = steps.pop()
        if step is None:
            continue
        types.add(step.get("type"))
        steps.extend(step.get("decoders") or [])
    return decoder is not None and types <= LOCAL_DECODERS


class StopStrings:
    """The tail test of one tokenizer (see the module doc); the engine holds one (``Engine.stop_strings``)."""

    def __init__(self, tokenizer, decode: BatchDecoder | None = None) -> None:
        """``decode``: the engine's batched decode of this tokenizer (None: one of the test's own)."""
        self.tokenizer = tokenizer
        self._decode = decode or BatchDecoder(tokenizer)
        self.local = local_decoding(tokenizer)  # (False: every block takes the exact check)
        # per token id: the fewest characters it writes in any text, and whether it is partial (see the module
        # doc); a vocabulary's all at once at the first test, else (no vocabulary size) each id when first seen
        self._least: list[int] | dict[int, int] | None = None
        self._partial: list[bool] | dict[int, bool] | None = None

    def _learn(self, ids) -> None:
        for t, text in zip(ids, self._decode([[t] for t in ids])):
            self._partial[t] = "\ufffd" in text
            self._least[t] = 0 if self._partial[t] else max(0, len(text) - 1)

    def _tables(self, ids: list[int]):
        """The per-token tables, knowing ``ids``; and the vocabulary's size (None: tables are dicts)."""
        if self._least is None:
            if hasattr(self.tokenizer, "__len__"):
                size = len(self.tokenizer)
                self._least, self._partial = [0] * size, [False] * size
                self._learn(range(size))
            else:
                self._least, self._partial = {}, {}
        if isinstance(self._least, list):
            return self._least, self._partial, len(self._least)
        unknown = {t for t in ids if t not in self._least}
        if unknown:
            self._learn(sorted(unknown))
        return self._least, self._partial, None

    def tail(self, out: list[int], stops: tuple[str, ...]) -> int:
        """How many of ``out``'s last tokens the test decodes before a block's new ones."""
        longest = max(map(len, stops))
        return self._tail(out, longest, *self._tables(out[-4 * longest - 4:]))

    def _tail(self, out: list[int], longest: int, least, partial, size: int | None) -> int:
        chars = taken = 0
        while taken < len(out):
            t = out[-taken - 1]
            taken += 1
            if size is not None and not 0 <= t < size:  # (beyond the tokenizer's vocabulary: no text)
                continue
            if size is None and t not in least:
                least, partial, _ = self._tables([t])
            if chars >= longest and not partial[t]:  # the first token: its text may differ at the cut
                break
            chars += least[t]
        return taken

    def may_stop(self, outs: list[list[int]], news: list[list[int]], stops: list[tuple[str, ...]]) -> list[bool]:
        """For each branch — its tokens so far ``outs[i]``, a block of new ones ``news[i]``, its stop strings
        ``stops[i]`` (none of them in the text of ``outs[i]``) — whether one of them may be in the text once
        some of the new tokens are appended: False only where none can be (see the module doc)."""
        if not self.local:
            return [True] * len(outs)
        maybe = [any("\ufffd" in s for s in stop) for stop in stops]
        longest = [max(map(len, stop)) for stop in stops]
        seen = [] if isinstance(self._least, list) else [  # (learnt per block; _tail learns any beyond)
            t for out, new, n in zip(outs, news, longest) for t in (*out[-4 * n - 4:], *new)]
        least, partial, size = self._tables(seen)
        texts, owner = [], []  # the tails to decode, and whose each is
        for i, (out, new) in enumerate(zip(outs, news)):
            if maybe[i]:
                continue
            before = out[len(out) - self._tail(out, longest[i], least, partial, size):]
            for k in range(1, len(new)):  # the text just before each partial new token
                t = new[k]
                if (size is None or 0 <= t < size) and partial[t]:
                    texts.append(before + new[:k])
                    owner.append(i)
            texts.append(before + new)
            owner.append(i)
        for i, text in zip(owner, self._decode(texts)):
            maybe[i] = maybe[i] or any(s in text for s in stops[i])
        return maybe
