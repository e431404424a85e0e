"""Stop strings found without decoding a branch's whole text at every token.

A ``gen`` with stop strings ends at the first token after which its text — ``tokenizer.decode`` of
every token it made — contains one of them (:func:`~treegen.runtime.decode.finished`). Checking that
by decoding the whole text after each token costs time in the text's length per token: a 256-token
answer decodes ~33K tokens' worth, and 1,024 such branches spend far longer on the host than the GPU
spends on their steps.

:func:`may_stop` is the cheap test in front of that check. For a block of new tokens it decodes only
the tail of each branch's tokens — the new ones and ``window(stops)`` before them — in one batched
call; the branches whose tail text contains none of their stop strings go on without the exact,
token-by-token check. The test may say "maybe" where the exact check then finds nothing (it costs a
few decodes), never "no" where a stop string ends in the new tokens' text:

- decoding is local: the text of ``tokens[s:]`` equals the tail of the text of ``tokens`` except for
  its first few characters (a byte-level tokenizer's partial UTF-8 character at the cut renders as
  replacement characters; SentencePiece drops the first token's leading space; the clean-up of
  spaces before punctuation looks at a character's neighbour);
- a stop string that ends within the new tokens' text starts at most ``len(stop) - 1`` characters
  before it, and the tail keeps ``4 x len(stop) + 8`` tokens before the new ones: at least one
  character each four tokens (a character is at most four bytes), so ``len(stop) + 2`` characters
  and more cover the stop string and the few that may differ at the cut.

The exact check runs after every token, the test once on the whole block: a stop string that is in
the text after some of the new tokens but gone after the last would escape it. Text changes behind
its end only where a token completes a UTF-8 character (the partial one rendered as U+FFFD before)
or where the tokenizer cleans up spaces (``clean_up_tokenization_spaces``: ``" ."`` becomes ``"."``,
``" 's"`` ``"'s"``): a stop string with U+FFFD in it, or with a space in it under such a tokenizer,
always takes the exact check.
"""

from __future__ import annotations

# tokens the tail keeps before the new ones: per character of the longest stop string, and beyond it
TOKENS_PER_CHAR, SPARE_TOKENS = 4, 8


def window(stops: tuple[str, ...]) -> int:
    """How many tokens before a block's new ones :func:`may_stop` decodes with them."""
    return TOKENS_PER_CHAR * max(map(len, stops)) + SPARE_TOKENS


def may_stop(tokenizer, outs: list[list[int]], news: list[list[int]], stops: list[tuple[str, ...]]) -> list[bool]:
    """For each branch — its tokens so far ``outs[i]``, a block of new ones ``news[i]``, its stop strings
    ``stops[i]`` (none of them in the text of ``outs[i]``) — whether one of them may be in the text once
    some of the new tokens are appended: False only where none can be (see the module doc)."""
    cleans_spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    exact = [any("\ufffd" in s or (cleans_spaces and " " in s) for s in stop) for stop in stops]
    asked = [i for i, e in enumerate(exact) if not e]
    tails = [outs[i][max(0, len(outs[i]) - window(stops[i])):] + news[i] for i in asked]
    batch = getattr(tokenizer, "batch_decode", None)
    texts = batch(tails) if batch is not None else [tokenizer.decode(t) for t in tails]
    for i, text in zip(asked, texts):
        exact[i] = any(s in text for s in stops[i])
    return exact
