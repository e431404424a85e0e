"""Many token sequences decoded to text in one call, each as ``tokenizer.decode`` decodes it.

The host decodes texts in bulk in two places: the stop-string test's text tails, one per branch with
stop strings per block (:mod:`~treegen.runtime.stop_strings`), and the texts of the branches that a
block finishes (:meth:`~treegen.runtime.token_accept.TokenAcceptance._settle`: at a phase's end, every branch at
once, while the GPU has nothing queued). A fast tokenizer's Rust backend decodes a batch in one call,
on several threads; ``transformers``' ``batch_decode`` is a Python loop over ``decode`` (~28 us for a
128-token text on one core of the development machine, ~4x the Rust batch there). The Rust batch serves
where it writes the same texts as ``tokenizer.decode`` — checked once per ``skip_special_tokens`` on
slices of the vocabulary and the special tokens, and never for a tokenizer that cleans up spaces after
decoding (``clean_up_tokenization_spaces``: transformers 4 does it for BPE too); otherwise the
tokenizer's own ``batch_decode``, or ``decode`` one by one.
"""

from __future__ import annotations


class BatchDecoder:
    """``decoder(sequences, skip_special_tokens=False)`` → their texts (see the module doc); the engine
    holds one (``Engine.batch_decode``)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ways: dict[bool, object] = {}  # skip_special_tokens → the batched decode chosen for it

    def __call__(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        way = self._ways.get(skip_special_tokens)
        if way is None:
            way = self._ways[skip_special_tokens] = self._rust(skip_special_tokens) or self._python(skip_special_tokens)
        return way(sequences)

    def _python(self, skip: bool):
        tokenizer = self.tokenizer
        batch = getattr(tokenizer, "batch_decode", None)
        if batch is not None:
            return lambda seqs: batch(seqs, skip_special_tokens=skip)
        return lambda seqs: [tokenizer.decode(q, skip_special_tokens=skip) for q in seqs]

    def _rust(self, skip: bool):
        tokenizer = self.tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        if (not hasattr(backend, "decode_batch") or not hasattr(tokenizer, "__len__")
                or getattr(tokenizer, "clean_up_tokenization_spaces", False)):
            return None  # (the clean-up runs in Python after the backend's decode; samples seldom show it)
        size = len(tokenizer)
        specials = [t for t in getattr(tokenizer, "all_special_ids", []) if 0 <= t < size]
        samples = [list(range(a, min(size, a + 64))) for a in range(0, size, max(1, size // 8))]
        samples += [specials + list(range(min(size, 16))) + specials[:1]] if specials else []

        def batch(seqs):
            return backend.decode_batch(seqs, skip_special_tokens=skip)
        try:
            same = batch(samples) == [tokenizer.decode(q, skip_special_tokens=skip) for q in samples]
        except Exception:  # (a backend that differs: the tokenizer's own decode serves)
            return None
        return batch if same else None
