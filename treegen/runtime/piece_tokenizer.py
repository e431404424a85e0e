"""A stand-in tokenizer with a synthetic vocabulary of text pieces, for random-weight models of real
shapes that run constrained gens (benchmarks, GPU tests): a grammar needs every token's text, which
:class:`~treegen.runtime.loader.IdTokenizer` does not have, and no real tokenizer need be downloaded.

Vocabulary, ``vocab_size`` ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (the EOS of a Llama config's
defaults), special, with no text; then newline and the 95 printable ASCII characters; the numbers
0-999, bare and after a space; then lowercase pieces of 2-8 letters (seeded), bare and after a space,
until the vocabulary is full. So digits, JSON punctuation and words can all be written, as in a
real BPE vocabulary, with several ways to split most texts.
"""

from __future__ import annotations

import random
import string
from types import SimpleNamespace

SPECIALS = ("<unk>", "<s>", "</s>")


class PieceTokenizer:
    """See the module doc. ``token_strings()`` gives each id's text (``""`` for the special ids),
    which :class:`~treegen.runtime.constraint.Grammars` reads instead of a Hugging Face vocabulary."""

    bos_token_id = 1
    eos_token_id = 2
    chat_template = None

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        pieces = ["\n", *string.printable[:95]]
        pieces += [p for n in range(1000) for p in (str(n), f" {n}")]
        if vocab_size < len(SPECIALS) + len(pieces):
            raise ValueError(f"PieceTokenizer needs vocab_size >= {len(SPECIALS) + len(pieces)}, got {vocab_size}")
        seen = set(pieces)
        rng = random.Random(seed)
        while len(pieces) < vocab_size - len(SPECIALS):
            word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8)))
            for p in (word, " " + word):
                if p not in seen and len(pieces) < vocab_size - len(SPECIALS):
                    seen.add(p)
                    pieces.append(p)
        self._strings = ["", "", ""] + pieces
        self._ids = {p: i for i, p in enumerate(self._strings) if p}
        self._longest = max(map(len, pieces))

    def token_strings(self) -> list[str]:
        return list(self._strings)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self._strings[i] or ("" if skip_special_tokens else SPECIALS[i]) for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = True):
        """Greedy longest-match encoding (every character of printable ASCII and newline has a piece)."""
        ids, i = [], 0
        while i < len(text):
            for size in range(min(self._longest, len(text) - i), 0, -1):
                found = self._ids.get(text[i:i + size])
                if found is not None:
                    ids.append(found)
                    i += size
                    break
            else:
                raise ValueError(f"PieceTokenizer has no piece for {text[i]!r}")
        return SimpleNamespace(input_ids=ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self(text).input_ids
