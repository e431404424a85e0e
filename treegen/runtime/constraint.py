"""What a constrained ``gen`` must produce, checked when the program is written and compiled once per tokenizer.

A :class:`Constraint` is one of: a regular expression the whole text must match, a list of choices
(the text is exactly one of them), a JSON schema (the text is a JSON value that validates against it,
written on one line with ``", "`` and ``": "`` between items), or an EBNF grammar (xgrammar's
dialect, rule ``root`` first). It is plain, hashable data carried by
:class:`~treegen.runtime.sampler.SamplingParams`; building one parses it with xgrammar, so a bad
regex, schema or grammar is refused where the ``gen`` is written.

:class:`Grammars` compiles constraints against one tokenizer (once each: every branch with the same
constraint, forked or not, shares the compiled grammar) and makes a fresh matcher per branch, for the
constraints that no token automaton on the device serves (:mod:`~treegen.runtime.token_automata`:
regexes, choices and string-free JSON schemas of ASCII text). Those automata and token masks are
xgrammar's: it compiles a grammar into a pushdown automaton with a precomputed token mask cache, and fills a branch's next-token bitmask (``[ceil(vocab / 32)]`` int32,
bit ``i % 32`` of word ``i // 32`` set = token ``i`` allowed) in microseconds.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

KINDS = ("regex", "choices", "json_schema", "grammar")

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class ConstraintError(ValueError):
    """An invalid regex, choice list, JSON schema or grammar; the message says what is wrong."""


@dataclass(frozen=True)
class Constraint:
    """kind: one of ``KINDS``. spec: the regex; the choices (a tuple of non-empty strings); the JSON
    schema as JSON text (a dict given to :meth:`of` is written as JSON, its key order kept); the EBNF grammar."""

    kind: str
    spec: str | tuple[str, ...]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; the kinds are {', '.join(KINDS)}")
        if self.kind == "choices":
            if isinstance(self.spec, str) or not isinstance(self.spec, (list, tuple)) or not self.spec \
                    or not all(isinstance(c, str) and c for c in self.spec):
                raise ConstraintError(f"choices must be a non-empty list of non-empty strings, got {self.spec!r}")
            object.__setattr__(self, "spec", tuple(self.spec))
        elif not isinstance(self.spec, str) or not self.spec:
            raise ConstraintError(f"{self.kind} must be a non-empty string, got {self.spec!r}")
        _parse(self.kind, self.spec)  # raises ConstraintError; cached, so a gen built per branch parses once

    @classmethod
    def of(cls, *, regex=None, choices=None, json_schema=None, grammar=None) -> "Constraint | None":
        """The constraint the keyword arguments of a ``gen`` give (at most one of them), or None."""
        given = {k: v for k, v in (("regex", regex), ("choices", choices), ("json_schema", json_schema),
                                   ("grammar", grammar)) if v is not None}
        if len(given) > 1:
            raise ConstraintError(f"a gen takes at most one constraint, got {' and '.join(given)}")
        if not given:
            return None
        (kind, spec), = given.items()
        if kind == "json_schema" and isinstance(spec, dict):
            spec = json.dumps(spec)  # key order kept: properties are written in schema order
        elif kind == "json_schema" and isinstance(spec, type) and hasattr(spec, "model_json_schema"):
            spec = json.dumps(spec.model_json_schema())  # a pydantic model class
        return cls(kind, spec)

    def grammar(self):
        """The xgrammar ``Grammar`` (parsed once per distinct constraint)."""
        return _parse(self.kind, self.spec)

    def __str__(self) -> str:
        shown = list(self.spec) if self.kind == "choices" else self.spec
        text = repr(shown)
        return f"{self.kind}={text if len(text) <= 60 else text[:57] + '...'}"


@functools.lru_cache(maxsize=256)
def _parse(kind: str, spec):
    grammar = _parse_plain(kind, spec)
    return _fast_repetitions(grammar)


# xgrammar 0.2.8 expands a counted repetition of at most this many items; a longer one is matched with a
# counter whose cost per accepted token grows with the items matched so far (``[a-z]{1153,}``: 0.7 ms a
# token after 300 tokens, ~100x a plain rule), or stays ~10x for a bounded one (``{0,1000}``)
_EXPANDED = 128
_CHUNK = 64
_REPEAT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\{(\d+), (-?\d+)\}")


def _fast_repetitions(grammar):
    """``grammar`` with each long counted repetition of a rule written as one xgrammar matches fast, the
    same language: ``X{n, -1}`` (n > 128) as ``X{n} X*`` (an exact count is fast at any size), and
    ``X{n, m}`` (m > 128) as ``X{n}`` and ``X{0, m - n}`` in chunks of 64 (``Y ::= X{64}``, ``X{0, M}`` =
    ``(Y{0, q - 1} X{0, 63}) | (Y{q} X{0, r})`` for ``M = 64 q + r``, each count one way). Grammar text
    is xgrammar's own printing, rewritten outside string literals and character classes; unchanged when
    there is no long repetition or the printed text does not parse back to itself."""
    import xgrammar as xgr

    text = str(grammar)
    if not any(int(n) > _EXPANDED or int(m) > _EXPANDED for _, n, m in _REPEAT.findall(text)):
        return grammar
    try:
        if str(xgr.Grammar.from_ebnf(text)) != text:  # printing and parsing disagree: keep the original
            return grammar
    except RuntimeError:
        return grammar
    extra: list[str] = []

    def chunked(rule: str, most: int) -> str:  # rule{0, most}, most > _EXPANDED
        chunk = f"treegen_rep_{len(extra)}"
        extra.append(f"{chunk} ::= (({rule}{{{_CHUNK}, {_CHUNK}}}))")
        q, r = divmod(most, _CHUNK)
        head = chunked(chunk, q - 1) if q - 1 > _EXPANDED else f"{chunk}{{0, {q - 1}}}"
        return f"(({head} {rule}{{0, {_CHUNK - 1}}}) | ({chunk}{{{q}, {q}}} {rule}{{0, {r}}}))"

    def rewrite(match: re.Match) -> str:
        rule, least, most = match.group(1), int(match.group(2)), int(match.group(3))
        if least <= _EXPANDED and most <= _EXPANDED:  # (most == -1: unbounded)
            return match.group(0)
        exact = f"{rule}{{{least}, {least}}}" if least else ""
        if most == -1:
            rest = f"{rule}*"
        elif most - least <= _EXPANDED:
            rest = f"{rule}{{0, {most - least}}}" if most > least else ""
        else:
            rest = chunked(rule, most - least)
        return "(" + " ".join(p for p in (exact, rest) if p) + ")"

    out, i = [], 0
    while i < len(text):  # copy string literals and character classes as they are
        c = text[i]
        if c in "\"[":
            close = "\"" if c == "\"" else "]"
            j = i + 1
            while j < len(text) and text[j] != close:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
            continue
        match = _REPEAT.match(text, i) if (c.isalpha() or c == "_") and (i == 0 or not (
            text[i - 1].isalnum() or text[i - 1] == "_")) else None
        if match:
            out.append(rewrite(match))
            i = match.end()
        else:
            out.append(c)
            i += 1
    rewritten = "".join(out).rstrip("\n") + "\n" + "\n".join(extra) + "\n"
    return xgr.Grammar.from_ebnf(rewritten)


def _parse_plain(kind: str, spec):
    import xgrammar as xgr

    try:
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "json_schema":
            try:
                json.loads(spec)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"json_schema is not valid JSON: {e}") from None
            # one line, ", " and ": " between items: no runs of free whitespace to wander into
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False, separators=(", ", ": "))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec)
        # choices: one EBNF alternative per choice, a sequence of string literals (JSON escapes are EBNF
        # escapes). Each non-ASCII or control character is a literal of its own: xgrammar 0.2.8 keeps a
        # grammar as text with \xNN escapes and reads them back greedily, so "\xef" + "c" would become
        # U+0EFC and "\x01" + "b" would become "\x1b"
        pieces = [re.findall(r"[\x20-\x7e]+|[^\x20-\x7e]", c) for c in spec]
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(
            "(" + " ".join(json.dumps(p, ensure_ascii=False) for p in parts) + ")" for parts in pieces))
    except RuntimeError as e:  # xgrammar's parse errors: "[time] file.cc:line: message"
        message = _XGR_PREFIX.sub("", str(e).strip())
        raise ConstraintError(f"invalid {kind}: {message}") from None


class Grammars:
    """Constraints compiled for one tokenizer and vocabulary (see the module doc).

    vocab_size: the model's (its logits' width, which may pad the tokenizer's). stop_token_ids: the
    tokens that end a branch (the model's EOS set); the grammar allows one only where its text is
    complete, and a branch's matcher terminates when it takes one."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = self._info = None
        self._compiled: dict[Constraint, object] = {}
        self._forced: dict[Constraint, tuple[int, ...]] = {}

    @property
    def mask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    def compile(self, constraint: Constraint):
        """The xgrammar ``CompiledGrammar`` of ``constraint``, compiled on first use."""
        compiled = self._compiled.get(constraint)
        if compiled is None:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(self.tokenizer_info())
            compiled = self._compiled[constraint] = self._compiler.compile_grammar(constraint.grammar())
        return compiled

    def tokenizer_info(self):
        """xgrammar's ``TokenizerInfo`` of this tokenizer: each token's bytes (``decoded_vocab``), the
        special and stop tokens (made once)."""
        if self._info is None:
            import xgrammar as xgr

            if hasattr(self.tokenizer, "token_strings"):  # a stand-in with its own vocabulary (PieceTokenizer)
                self._info = xgr.TokenizerInfo(self.tokenizer.token_strings(), vocab_size=self.vocab_size,
                                               stop_token_ids=self.stop_token_ids)
            else:
                self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self.stop_token_ids)
        return self._info

    def forced_prefix(self, constraint: Constraint) -> tuple[int, ...]:
        """The tokens a text under ``constraint`` starts with whatever the model draws (jump-forward): the
        string xgrammar says is forced from the start, tokenized as the tokenizer writes it, less its last
        token (``"The answer is "`` ends in a space the model writes joined to the number: ``" 4"``), up to
        the first token the constraint's matcher refuses (a tokenization it does not allow). Cached."""
        forced = self._forced.get(constraint)
        if forced is None:
            matcher = self.matcher(constraint)
            text = matcher.find_jump_forward_string()
            ids = self.tokenizer(text, add_special_tokens=False).input_ids[:-1] if text else []
            taken = []
            for t in ids:
                if t in self.stop_token_ids or not matcher.accept_token(t):
                    break
                taken.append(t)
            forced = self._forced[constraint] = tuple(taken)
        return forced

    def matcher(self, constraint: Constraint):
        """A fresh xgrammar ``GrammarMatcher`` for one branch (its own state, the shared compiled grammar)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(constraint))
