"""Regular constraints as token automata on the device: a step's masks and next states without the host.

A constraint served by xgrammar (:mod:`~treegen.runtime.token_masks`) needs the host every step: each
matcher must see its branch's token before the next mask can be filled, so a constrained decode phase
syncs per step and its host work must hide under each forward. A *regular* constraint — a regex, a
list of choices, a JSON schema without free strings — has a finite token-level automaton instead:
states, each with the tokens it allows and, for each of those, the next state. Kept on the device, a step's masks are one gather
(``masks[state]``) and its next states one lookup (``(state, token)`` in sorted keys), both inside the
captured decode step, so such phases run the unconstrained loop (the host reads tokens every 8 steps,
pipelined) at the unconstrained speed.

A regex's automaton over characters is interegular's (a maintained pure-Python library that
reads Python's regex syntax and builds a finite automaton, as outlines and lm-format-enforcer do);
walking every token's characters from every state (numpy, all at once) gives the token-level one.
outlines-core, which builds token automata itself, was measured first and left out: its 0.2.14 index
drops every token that leads from a final state into a non-final one (``(a0)*`` allows ``a0`` but not
``a`` at the start). Both libraries must give a constraint the same language and the same masks as
xgrammar: a regex was parsed by xgrammar when its ``gen`` was written (its syntax and meaning are
xgrammar's), so the automaton takes only regexes and choices whose text is ASCII (see
:func:`ascii_regex` for what stays out, and why; ``\\d`` and ``\\w`` are written as xgrammar's ASCII
classes) and whose automaton is small: no counted repetition of more than ``LONGEST_REPETITION`` items
(``[a-z]{1000,}`` has a thousand states, each allowing thousands of tokens), at most
``MOST_TRANSITIONS`` (state, token) pairs. A JSON schema is served too where xgrammar's own grammar of
it is plainly regular and ASCII (:mod:`~treegen.runtime.regular_grammar`: integers, numbers, booleans,
enums, fixed keys, arrays of those — no free strings), read as one regex. xgrammar serves every other
constraint, EBNF grammars included (a small one can make the character automaton's construction take
minutes; a JSON schema's grammar is regular in the tame way xgrammar writes it). (Tests compare the masks of the two along
random walks.)

State ids are global to an engine: 0 is *free* (every token allowed, no transitions; unconstrained and
padding rows, and a branch after its EOS), each automaton's states follow. The tables grow when a new
constraint is compiled (``generation`` changes, so kept CUDA graphs that read the old tables are not
replayed). The host tracks each branch's state by walking the same transitions over the tokens it
reads (:meth:`Automata.walk`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import numpy as np
import torch

from treegen.runtime.constraint import Constraint, Grammars
from treegen.runtime.regular_grammar import grammar_regex
from treegen.runtime.token_masks import stop_row

FREE = 0  # the state of a row without an automaton: every token allowed, stays free
LONGEST_REPETITION = 128  # a counted repetition beyond this many items stays with xgrammar (as constraint._EXPANDED)
MOST_REPEATED = 1024  # the product of a regex's counted repetitions' bounds (nested ones multiply states)
MOST_TRANSITIONS = 1 << 22  # an automaton with more (state, token) pairs stays with xgrammar
MOST_WALKED = 1 << 26  # states x tokens walked to build one (~0.25 GB of int32): more stays with xgrammar

# xgrammar's readings of the ASCII class escapes (its regex parser: `\d` -> [0-9], `\w` -> [a-zA-Z0-9_])
_CLASS_BODY = {"d": "0-9", "w": "a-zA-Z0-9_"}
_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def ascii_regex(regex: str) -> str | None:
    r"""``regex`` (xgrammar has parsed it) with xgrammar's meaning spelled out for interegular (``\d`` and
    ``\w`` as xgrammar's ASCII classes), when its language is text of ASCII characters only; else None
    (xgrammar serves it). Only ASCII, because the token walk here is over characters and a language of
    ASCII text has no token that ends inside a multi-byte character: anything that can match a
    non-ASCII character stays with xgrammar — ``.``, a negated class, ``\D``/``\W``/``\S``, ``\s``
    (xgrammar's includes U+00A0), non-ASCII text, code-point escapes — as do anchors, back-references,
    a counted repetition of more than ``LONGEST_REPETITION`` items and counted repetitions whose bounds
    multiply past ``MOST_REPEATED`` (nested ones multiply the automaton's states)."""
    out, i, in_class, opened = [], 0, False, False  # opened: the class began at the character before
    while i < len(regex):
        c = regex[i]
        if ord(c) > 127:
            return None
        if c == "\\":
            e = regex[i + 1:i + 2]
            if e in _CLASS_BODY:
                out.append(_CLASS_BODY[e] if in_class else f"[{_CLASS_BODY[e]}]")
            elif not e or e.isalnum() and e not in "ntrfv":  # \D \W \s \S \b \A \1 \x \u \p ...
                return None
            else:
                out.append(c + e)
            i += 2
            opened = False
            continue
        if in_class:
            in_class = c != "]" or opened  # (a ']' first in a class is one of its characters)
            opened = False
        elif c == "[":
            if regex[i + 1:i + 2] == "^" or regex[i + 1:i + 3] == "\\^":  # (xgrammar reads "[\^" as "[^")
                return None
            in_class = opened = True
        elif c in ".^$":
            return None
        out.append(c)
        i += 1
    if in_class:
        return None
    text = "".join(out)
    product = 1  # (nested repetitions multiply states: bound them all together, before interegular builds any)
    for least, most in _COUNTED.findall(text):
        if int(least) > LONGEST_REPETITION or (most and int(most) > LONGEST_REPETITION):
            return None
        product *= max(int(least), int(most or 0), 1)
    return text if product <= MOST_REPEATED else None


def choices_regex(choices: tuple[str, ...]) -> str | None:
    """A regex whose language is exactly ``choices`` (ASCII text only, else None: see :func:`ascii_regex`)."""
    if any(ord(ch) > 127 for c in choices for ch in c):
        return None
    return "|".join(f"(?:{re.escape(c)})" for c in choices)


def char_automaton(regex: str):
    """interegular's automaton of ``regex`` over characters, as ``(initial, table [states, 128] int32 —
    the next state after each ASCII character, -1 where none or where no final state can follow —,
    final states)``; None when interegular cannot read the regex."""
    import interegular

    try:
        fsm = interegular.parse_pattern(regex).to_fsm()
    except Exception:  # (its parse errors have no common base class)
        return None
    states = sorted(fsm.states)
    number = {st: k for k, st in enumerate(states)}
    table = np.full((len(states), 128), -1, dtype=np.int32)
    symbol_of = [fsm.alphabet[chr(c)] for c in range(128)]
    for st, moves in fsm.map.items():
        for c in range(128):
            nxt = moves.get(symbol_of[c])
            if nxt is not None:
                table[number[st], c] = number[nxt]
    finals = {number[st] for st in fsm.finals}
    before: dict[int, set[int]] = {}  # state -> the states with a move into it
    for st in range(len(states)):
        for nxt in set(table[st].tolist()) - {-1}:
            before.setdefault(nxt, set()).add(st)
    live, todo = set(finals), list(finals)  # states from which a final state can be reached
    while todo:
        for st in before.get(todo.pop(), ()):
            if st not in live:
                live.add(st)
                todo.append(st)
    table[~np.isin(table, sorted(live))] = -1  # (no move into a state that cannot end)
    return number[fsm.initial], table, finals


def most_tokens(states: int, sources: np.ndarray, targets: np.ndarray, finals: set[int]) -> list[float]:
    """Per state of a token automaton (``states`` of them, a move from ``sources[i]`` to ``targets[i]``
    for each allowed token), the most tokens a branch there can still draw before it must stop: the
    longest path to a final state, plus its stop token; ``inf`` where a cycle can be reached (the text
    can grow without end). Every state can reach a final one (see :func:`char_automaton`)."""
    edges = np.unique(np.stack([sources, targets]).astype(np.int64), axis=1) if len(sources) else np.zeros((2, 0), int)
    after: list[list[int]] = [[] for _ in range(states)]
    for a, b in edges.T.tolist():
        after[a].append(b)
    most: list[float | None] = [None] * states
    for start in range(states):  # depth first, iteratively; a state met again on the path is a cycle
        if most[start] is not None:
            continue
        stack, on_path = [(start, 0)], {start}
        while stack:
            st, i = stack[-1]
            if i < len(after[st]):
                stack[-1] = (st, i + 1)
                nxt = after[st][i]
                if nxt in on_path:
                    most[st] = float("inf")
                elif most[nxt] is None:
                    stack.append((nxt, 0))
                    on_path.add(nxt)
                continue
            stack.pop()
            on_path.discard(st)
            longest = max([1 + most[n] for n in after[st] if most[n] is not None], default=0)
            most[st] = max(longest, 1 if st in finals else 0, most[st] or 0)
    return [float(m) for m in most]


@dataclass(frozen=True)
class Automaton:
    """One constraint's automaton in the engine's tables: its states are ``base .. base + states - 1``."""

    constraint: Constraint
    base: int
    states: int
    initial: int  # (global id)
    transitions: int
    build_seconds: float


@dataclass(frozen=True)
class AutomatonTables:
    """Every automaton of an engine on the device: ``masks [states, words]`` int32 (a bitmask row per
    state, as xgrammar's), ``keys [transitions]`` int64 sorted (``state * vocab_size + token``),
    ``targets [transitions]`` int64 (the next state). ``generation``: which build of the tables."""

    masks: torch.Tensor
    keys: torch.Tensor
    targets: torch.Tensor
    vocab_size: int
    generation: int

    def bitmask(self, states: torch.Tensor, also: torch.Tensor | None = None) -> torch.Tensor:
        """``[rows, words]`` int32: the allowed tokens of each row's state (free rows: all), and of
        ``also`` (another bitmask of the same rows, e.g. xgrammar's) when given."""
        own = self.masks.index_select(0, states)
        return own if also is None else own & also

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Each row's next state after its token (none — a free row, a stop token —: free)."""
        query = states * self.vocab_size + tokens
        at = torch.searchsorted(self.keys, query).clamp_(max=self.keys.numel() - 1)
        return torch.where(self.keys[at] == query, self.targets[at], torch.zeros_like(states))


class Automata:
    """The token automata of one engine's constraints (see the module doc), each built on first use:
    their device :attr:`tables`, and the host's copy of the transitions (:meth:`walk`) and of the
    ``final`` states (where the text is a complete match; they allow the stop tokens)."""

    def __init__(self, grammars: Grammars, device) -> None:
        self.grammars, self.device = grammars, torch.device(device)
        self.vocab_size, self.words = grammars.vocab_size, grammars.mask_width
        self.stop_ids = list(grammars.stop_token_ids)
        self._by_constraint: dict[Constraint, Automaton | None] = {}
        self._tokens = None  # (ids, characters) of the ASCII tokens (see _ascii_tokens)
        self._host_masks = [np.full(self.words, -1, dtype=np.int32)]  # state 0: free
        self._next: dict[int, int] = {}  # state * vocab + token -> next state (the host's copy)
        self.final: set[int] = set()
        self._most: list[float] = [float("inf")]  # per state, the most tokens a branch can still make (see most)
        self._tables = AutomatonTables(masks=torch.full((1, self.words), -1, dtype=torch.int32, device=self.device),
                                       keys=torch.full((1,), -1, dtype=torch.int64, device=self.device),
                                       targets=torch.zeros(1, dtype=torch.int64, device=self.device),
                                       vocab_size=self.vocab_size, generation=0)

    # ---------------------------------------------------------------------------------------------
    def get(self, constraint: Constraint | None) -> Automaton | None:
        """``constraint``'s automaton (built now if new), or None when xgrammar serves it (see the module doc)."""
        if constraint is None:
            return None
        if constraint not in self._by_constraint:
            self._by_constraint[constraint] = self._build(constraint)
        return self._by_constraint[constraint]

    def _regex(self, constraint: Constraint) -> str | None:
        if constraint.kind == "choices":
            return choices_regex(constraint.spec)
        if constraint.kind == "regex":
            return ascii_regex(constraint.spec)
        if constraint.kind == "json_schema":  # xgrammar's own grammar of it, where that is plainly regular
            regex = grammar_regex(str(constraint.grammar()))
            return None if regex is None else ascii_regex(regex)
        # an EBNF grammar stays with xgrammar: a small one can make interegular's automaton construction
        # run for minutes (nested repetitions of alternatives), and it runs where the gen is submitted
        return None

    def _build(self, constraint: Constraint) -> Automaton | None:
        regex = self._regex(constraint)
        started = time.perf_counter()
        chars = None if regex is None else char_automaton(regex)
        if chars is None:
            return None
        initial, table, finals = chars
        ids, text = self._ascii_tokens()
        if table.shape[0] * len(ids) > MOST_WALKED:  # (the walk's memory: states x tokens)
            return None
        # every (state, token) walked at once: ends[s, j] = the state after token ids[j] from s (-1: not allowed);
        # tokens longest first, so the columns still walking at character p are a prefix
        ends = np.repeat(np.arange(table.shape[0], dtype=np.int32)[:, None], len(ids), axis=1)
        for p in range(text.shape[1]):
            n = int(np.count_nonzero(text[:, p] >= 0))
            cur = ends[:, :n]
            ends[:, :n] = np.where(cur >= 0, table[np.maximum(cur, 0), text[:n, p][None, :]], -1)
        state, column = np.nonzero(ends >= 0)
        if state.size > MOST_TRANSITIONS:
            return None
        base, vocab = self.states, self.vocab_size
        token = ids[column]
        masks = np.zeros((table.shape[0], self.words), dtype=np.uint32)
        np.bitwise_or.at(masks, (state, token // 32), np.left_shift(np.uint32(1), (token % 32).astype(np.uint32)))
        masks[sorted(finals)] |= stop_row(self.stop_ids, self.words)  # a complete text may end: the stop tokens
        keys = (base + state.astype(np.int64)) * vocab + token
        targets = base + ends[state, column].astype(np.int64)
        self._next.update(zip(keys.tolist(), targets.tolist()))
        self._host_masks.extend(masks.view(np.int32))
        self.final |= {base + f for f in finals}
        self._most.extend(most_tokens(table.shape[0], state, ends[state, column], finals))
        self._upload()
        return Automaton(constraint, base=base, states=table.shape[0], initial=base + initial,
                         transitions=int(state.size), build_seconds=time.perf_counter() - started)

    def _upload(self) -> None:
        keys = np.fromiter(self._next, dtype=np.int64, count=len(self._next))
        if not keys.size:  # (automata without a move, e.g. of the empty text: lookups need one key)
            keys = np.full(1, -1, dtype=np.int64)
        order = np.argsort(keys)
        targets = np.fromiter(self._next.values(), dtype=np.int64, count=len(self._next))
        targets = targets[order] if targets.size else np.zeros(1, dtype=np.int64)
        self._tables = AutomatonTables(masks=torch.from_numpy(np.stack(self._host_masks)).to(self.device),
                                       keys=torch.from_numpy(keys[order]).to(self.device),
                                       targets=torch.from_numpy(targets).to(self.device),
                                       vocab_size=self.vocab_size, generation=self._tables.generation + 1)

    def _ascii_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """The tokens whose bytes are all ASCII (xgrammar's decoding of the tokenizer; special and stop
        tokens left out, as text nor grammar can hold them), longest first: their ids, and their
        characters ``[tokens, longest]`` (-1 after each token's end)."""
        if self._tokens is None:
            info = self.grammars.tokenizer_info()
            special = set(info.special_token_ids) | set(self.stop_ids)
            found = [(i, bytes(b)) for i, b in enumerate(info.decoded_vocab[: self.vocab_size])
                     if b and i not in special and max(bytes(b)) < 128]
            found.sort(key=lambda x: -len(x[1]))
            text = np.full((len(found), len(found[0][1]) if found else 1), -1, dtype=np.int32)
            for j, (_, b) in enumerate(found):
                text[j, : len(b)] = np.frombuffer(b, dtype=np.uint8)
            self._tokens = (np.array([i for i, _ in found], dtype=np.int64), text)
        return self._tokens

    @property
    def states(self) -> int:
        """How many states the tables hold (ids ``0 .. states - 1``; 0 is free)."""
        return len(self._host_masks)

    @property
    def tables(self) -> "AutomatonTables":
        """The device tables as they are now (a step keeps the object it read: a later constraint's
        build makes new tables and leaves these be)."""
        return self._tables

    # --------------------------------------------------------------------------------------------- host
    def walk(self, state: int, tokens) -> int:
        """The state after ``tokens`` from ``state`` (as :meth:`AutomatonTables.advance`, on the host)."""
        step, vocab = self._next, self.vocab_size
        for t in tokens:
            if state == FREE:
                return FREE
            state = step.get(state * vocab + t, FREE)
        return state

    def most(self, state: int) -> float:
        """The most tokens a branch in ``state`` can still draw, its stop token included (``inf`` where
        the text can grow without end, and for a free row)."""
        return self._most[state]

    def allows(self, state: int, token: int) -> bool:
        """Whether ``state``'s mask allows ``token``."""
        return bool((int(self._host_masks[state][token // 32]) >> (token % 32)) & 1)
