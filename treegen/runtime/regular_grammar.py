"""An xgrammar grammar's language as one regular expression, where the grammar is plainly regular.

A JSON schema without free strings (integers, numbers, booleans, enums, fixed keys, bounded arrays of
those) or a small EBNF grammar describes a regular language, and a regular constraint can run as a
token automaton on the device (:mod:`~treegen.runtime.token_automata`) instead of xgrammar's matchers
on the host. xgrammar compiles the schema or EBNF to its own grammar, whose printed form
(``str(grammar)``: one ``name ::= body`` rule a line) is what is read here, so the language is exactly
the one xgrammar's matchers would enforce: the same whitespace and separators, key order, integer
ranges.

:func:`grammar_regex` inlines the rules reachable from ``root`` into one Python regex. A rule that refers
to itself only as the last item of some of its alternatives (``R ::= (x R) | (y)``, how xgrammar writes
``x+`` and repetitions) is ``(x)*(y)``; any other recursion (nested brackets: not regular), a lookahead
assertion (xgrammar's JSON strings), or a literal with a character outside printable ASCII, tab, newline
and carriage return gives None — xgrammar serves the constraint. Character classes are copied as they
are; the token automata's own check (:func:`~treegen.runtime.token_automata.ascii_regex`) then refuses
what could match a non-ASCII character (negated classes, ``\\0``/``\\x`` escapes) and long repetitions.
That check is also what keeps the printed form's one ambiguity out: xgrammar prints the class ``[\\^a]``
(``^`` or ``a``) as ``[^a]``, so every class that begins with ``^`` must be refused, never read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LONGEST_REGEX = 1 << 16  # characters: a grammar whose inlined regex is longer stays with xgrammar

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REPEAT = re.compile(r"\{\s*(\d+)\s*,\s*(-?\d+)\s*\}")
_LITERAL_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "r": "\r", "'": "'"}
_REGEX_SPECIAL = set("\\.^$*+?{}[]|()")


class NotRegular(Exception):
    """The grammar is not one this module turns into a regex (see the module doc)."""


@dataclass
class _Lit:
    text: str


@dataclass
class _Class:
    raw: str  # "[...]" as printed


@dataclass
class _Ref:
    name: str


@dataclass
class _Alt:
    options: list  # of lists (sequences) of items


@dataclass
class _Repeat:
    item: object
    least: int
    most: int | None  # None: unbounded


def _parse_body(text: str, i: int = 0, closing: str | None = None) -> tuple[_Alt, int]:
    """An alternation from ``text[i:]`` up to ``closing`` (or the end): (its tree, the index after it)."""
    options, seq = [], []
    while True:
        while i < len(text) and text[i] in " \t":
            i += 1
        if i == len(text) or text[i] == closing:
            options.append(seq)
            return _Alt(options), i + (i < len(text))
        c = text[i]
        if c == "|":
            options.append(seq)
            seq, i = [], i + 1
        elif text.startswith("(=", i):
            raise NotRegular("a lookahead assertion")
        elif c == "(":
            group, i = _parse_body(text, i + 1, ")")
            seq.append(group)
        elif c == '"':
            out, i = [], i + 1
            while i < len(text) and text[i] != '"':
                if text[i] == "\\":
                    e = text[i + 1:i + 2]
                    if e in _LITERAL_ESCAPES:
                        out.append(_LITERAL_ESCAPES[e])
                    elif e and " " <= e <= "~" and not e.isalnum():  # (xgrammar prints "?" as "\?")
                        out.append(e)
                    else:  # \x.., \u.., \0 ...: characters this reader leaves to xgrammar
                        raise NotRegular(f"the literal escape \\{e}")
                    i += 2
                else:
                    out.append(text[i])
                    i += 1
            if i == len(text):
                raise NotRegular("an unclosed literal")
            seq.append(_Lit("".join(out)))
            i += 1
        elif c == "[":
            j = i + 1
            while j < len(text) and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            if j >= len(text):
                raise NotRegular("an unclosed character class")
            seq.append(_Class(text[i:j + 1]))
            i = j + 1
        elif c in "*+?" or c == "{":
            if not seq:
                raise NotRegular(f"a repetition of nothing at {i}")
            if c == "{":
                m = _REPEAT.match(text, i)
                if not m:
                    raise NotRegular(f"a repetition at {i}")
                least, most = int(m.group(1)), int(m.group(2))
                seq[-1] = _Repeat(seq[-1], least, None if most < 0 else most)
                i = m.end()
            else:
                seq[-1] = _Repeat(seq[-1], *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
                i += 1
        else:
            m = _IDENT.match(text, i)
            if not m:
                raise NotRegular(f"{c!r} at {i}")
            if text.startswith("(", m.end()):  # a macro (Regex("..."), TagDispatch(...)), not a rule
                raise NotRegular(f"the macro {m.group(0)}")
            seq.append(_Ref(m.group(0)))
            i = m.end()


def _rules(grammar_text: str) -> dict[str, str]:
    """Each rule's body text by name (parsed only when ``root`` reaches it: xgrammar prints rules that
    the root never uses, a JSON grammar's string rules with their lookaheads among them)."""
    rules = {}
    for line in grammar_text.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition(" ::= ")
        if not sep or not _IDENT.fullmatch(name.strip()):
            raise NotRegular(f"a line that is not a rule: {line[:60]!r}")
        rules[name.strip()] = body
    if "root" not in rules:
        raise NotRegular("no root rule")
    return rules


def _parse_rule(name: str, body: str) -> _Alt:
    alt, end = _parse_body(body)
    if end < len(body):
        raise NotRegular(f"text after the rule {name}")
    return alt


def _literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in "\n\t\r":
            out.append({"\n": r"\n", "\t": r"\t", "\r": r"\r"}[ch])
        elif not " " <= ch <= "~":
            raise NotRegular(f"the character {ch!r} in a literal")
        else:
            out.append("\\" + ch if ch in _REGEX_SPECIAL else ch)
    return "".join(out)


def _mentions(node, name: str) -> bool:
    if isinstance(node, _Ref):
        return node.name == name
    if isinstance(node, _Repeat):
        return _mentions(node.item, name)
    if isinstance(node, _Alt):
        return any(_mentions(x, name) for seq in node.options for x in seq)
    return False


def _flat(alt: _Alt) -> _Alt:
    """``alt`` with options that are one parenthesised alternation spliced in: ``((x R) | (y))`` as the
    options ``x R`` and ``y``."""
    options = []
    for seq in alt.options:
        if len(seq) == 1 and isinstance(seq[0], _Alt):
            options.extend(_flat(seq[0]).options)
        else:
            options.append(seq)
    return _Alt(options)


class _Inliner:
    def __init__(self, rules: dict[str, str]) -> None:
        self.rules, self.open, self.done = rules, set(), {}

    def rule(self, name: str) -> str:
        if name in self.done:
            return self.done[name]
        if name in self.open:
            raise NotRegular(f"the rule {name} is recursive")
        if name not in self.rules:
            raise NotRegular(f"no rule {name}")
        self.open.add(name)
        alt = _flat(_parse_rule(name, self.rules[name]))
        if _mentions(alt, name):  # right-linear: R ::= (x R) | (y)  ->  (x)*(y)
            loops, ends = [], []
            for seq in alt.options:
                if seq and isinstance(seq[-1], _Ref) and seq[-1].name == name and \
                        not any(_mentions(x, name) for x in seq[:-1]):
                    if not seq[:-1]:
                        raise NotRegular(f"the rule {name} refers to itself alone")
                    loops.append(seq[:-1])
                elif any(_mentions(x, name) for x in seq):
                    raise NotRegular(f"the rule {name} is recursive other than at its end")
                else:
                    ends.append(seq)
            if not ends:
                raise NotRegular(f"the rule {name} never ends")
            text = f"(?:{self.alt(_Alt(loops))})*{self.alt(_Alt(ends))}"
        else:
            text = self.alt(alt)
        self.open.discard(name)
        if len(text) > LONGEST_REGEX:
            raise NotRegular(f"the regex grows past {LONGEST_REGEX} characters")
        self.done[name] = text
        return text

    def alt(self, alt: _Alt) -> str:
        parts = ["".join(self.item(x) for x in seq) for seq in alt.options]
        filled = [p for p in parts if p]
        if not filled:
            return ""
        text = "(?:" + "|".join(filled) + ")"
        return text + "?" if len(filled) < len(parts) else text

    def item(self, node) -> str:
        if isinstance(node, _Lit):
            return f"(?:{_literal(node.text)})" if node.text else ""
        if isinstance(node, _Class):
            return node.raw
        if isinstance(node, _Ref):
            return f"(?:{self.rule(node.name)})"
        if isinstance(node, _Alt):
            return self.alt(node)
        inner = self.item(node.item)
        if not inner:
            return ""
        if node.most is None:
            suffix = {0: "*", 1: "+"}.get(node.least, f"{{{node.least},}}")
        else:
            suffix = f"{{{node.least},{node.most}}}"
        return f"(?:{inner}){suffix}"


def grammar_regex(grammar_text: str) -> str | None:
    """The regex (Python syntax) of the language of the grammar printed as ``grammar_text`` (xgrammar's
    ``str(grammar)``), or None where it is not plainly regular (see the module doc)."""
    try:
        return _Inliner(_rules(grammar_text)).rule("root")
    except (NotRegular, RecursionError):  # (RecursionError: a chain of rules deeper than Python's stack)
        return None


__all__ = ["LONGEST_REGEX", "grammar_regex"]
