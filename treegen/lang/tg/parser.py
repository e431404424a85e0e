"""Parse ``.tg`` text into the AST of :mod:`treegen.lang.tg.ast`; resolve ``include``.

The grammar is ``treegen.lark`` (package data), parsed LALR(1) with positions kept. Syntax errors
become :class:`~treegen.lang.tg.errors.TgError` with a message chosen by matching the failure against
known malformed examples (lark's ``match_examples``), else naming what was found and what may follow.

Strings: ``"..."`` on one line, or ``\"\"\"...\"\"\"`` over several (a newline right after the opening
quotes is dropped and the lines' common indentation removed). Escapes: ``\\n \\t \\r \\\\ \\" \\'``;
any other backslash is kept as written (so regular expressions read naturally: ``"(\\d+)"``). Only
prompt text (text statements and message contents) is interpolated: ``{name}`` reads a variable,
``{{`` and ``}}`` are literal braces.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import replace

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError

from treegen.lang.tg import ast
from treegen.lang.tg.errors import Pos, Source, TgError

_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*\Z")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}
_MAX_NESTING = 100


@functools.lru_cache(maxsize=None)
def _lark() -> Lark:
    return Lark.open_from_package("treegen.lang.tg", "treegen.lark", parser="lalr", propagate_positions=True,
                                  maybe_placeholders=True)


# strings --------------------------------------------------------------------------------------------
Chars = list[tuple[str, int, int]]  # (character, line, column) after escapes


def _raw_chars(tok: Token) -> tuple[Chars, bool]:
    long = tok.type == "LONG_STRING"
    q = 3 if long else 1
    line, col, out = tok.line, tok.column + q, []
    for ch in tok.value[q:-q]:
        out.append((ch, line, col))
        line, col = (line + 1, 1) if ch == "\n" else (line, col + 1)
    return out, long


def _dedent(chars: Chars) -> Chars:
    """Drop a leading newline, then the common indentation of the non-blank lines."""
    if chars and chars[0][0] == "\n":
        chars = chars[1:]
    lines: list[Chars] = [[]]
    for c in chars:
        lines[-1].append(c)
        if c[0] == "\n":
            lines.append([])
    def body(ln):
        return "".join(c[0] for c in ln).rstrip("\n")
    indents = [re.match(r"[ \t]*", body(ln)).group() for ln in lines if body(ln).strip(" \t")]
    common = os.path.commonprefix(indents) if indents else ""
    out: Chars = []
    for ln in lines:
        if not body(ln).strip(" \t"):  # blank line: keep only its newline
            out += [c for c in ln if c[0] == "\n"]
        else:
            out += ln[len(common):]
    return out


def _chars(tok: Token) -> Chars:
    raw, long = _raw_chars(tok)
    if long:
        raw = _dedent(raw)
    out, i = [], 0
    while i < len(raw):
        ch, line, col = raw[i]
        if ch == "\\" and i + 1 < len(raw) and raw[i + 1][0] in _ESCAPES:
            out.append((_ESCAPES[raw[i + 1][0]], line, col))
            i += 2
            continue
        if ch == "\\" and i + 1 < len(raw) and raw[i + 1][0] == "\n":  # line continuation
            i += 2
            continue
        out.append(raw[i])
        i += 1
    return out


class _Str:
    """A string token; turned into a literal or into interpolated text by its context."""

    def __init__(self, tok: Token, source: Source) -> None:
        self.tok, self.source = tok, source
        self.pos = Pos(source, tok.line, tok.column)

    def literal(self) -> ast.Lit:
        return ast.Lit("".join(c[0] for c in _chars(self.tok)), self.pos)

    def text(self) -> ast.Text:
        chars, parts, buf, i = _chars(self.tok), [], [], 0
        while i < len(chars):
            ch, line, col = chars[i]
            nxt = chars[i + 1][0] if i + 1 < len(chars) else ""
            if ch in "{}" and nxt == ch:
                buf.append(ch)
                i += 2
            elif ch == "}":
                raise TgError("a single '}' in text; write '}}' for a literal brace", Pos(self.source, line, col))
            elif ch == "{":
                end = next((j for j in range(i + 1, len(chars)) if chars[j][0] in "{}\n"), None)
                if end is None or chars[end][0] != "}":
                    raise TgError("'{' opens a variable that is not closed by '}' (write '{{' for a literal brace)",
                                  Pos(self.source, line, col))
                name = "".join(c[0] for c in chars[i + 1:end]).strip()
                if not _NAME.match(name):
                    raise TgError(f"{{{name}}} is not a variable: inside text, {{name}} reads a variable "
                                  "(write '{{' and '}}' for literal braces)", Pos(self.source, line, col))
                if buf:
                    parts.append("".join(buf))
                    buf = []
                parts.append(ast.Var(name, Pos(self.source, line, col + 1)))
                i = end + 1
            else:
                buf.append(ch)
                i += 1
        if buf:
            parts.append("".join(buf))
        return ast.Text(tuple(parts), self.pos)


# parse tree -> AST ---------------------------------------------------------------------------------
def _lit(x):
    return x.literal() if isinstance(x, _Str) else x


def _attach_joins(items) -> tuple:
    """A ``join`` belongs to the fork just before it in the same block."""
    out: list = []
    for st in items:
        if not isinstance(st, ast.Join):
            out.append(st)
        elif out and isinstance(out[-1], ast.Fork) and out[-1].join is None:
            out[-1] = replace(out[-1], join=st)
        elif out and isinstance(out[-1], ast.Fork):
            raise TgError("this fork already has a join", st.pos)
        else:
            raise TgError("join outside a fork: 'join' must come right after the closing '}' of a fork", st.pos)
    return tuple(out)


@v_args(meta=True)
class _ToAst(Transformer):
    def __init__(self, source: Source) -> None:
        super().__init__()
        self.source = source

    def _pos(self, meta) -> Pos:
        return Pos(self.source, getattr(meta, "line", 1), getattr(meta, "column", 1))

    def _tpos(self, tok: Token) -> Pos:
        return Pos(self.source, tok.line, tok.column)

    def start(self, meta, items):
        return _attach_joins(items)

    def block(self, meta, items):
        return _attach_joins(items)

    def param(self, meta, c):
        name, type_, default = c
        return ast.Param(str(name), str(type_) if type_ is not None else None,
                         _lit(default) if default is not None else None, self._pos(meta),
                         self._tpos(type_) if type_ is not None else None)

    def include(self, meta, c):
        return ast.Include(c[0].literal().value, None, self._pos(meta))

    def text(self, meta, c):
        return c[0].text()

    def role(self, meta, c):
        return str(c[0])

    def message(self, meta, c):
        role, content = c
        body = (content.text(),) if isinstance(content, _Str) else content
        return ast.Message(role, body, self._pos(meta))

    def gen(self, meta, c):
        name, args = c
        return ast.Gen(str(name), args or (), self._pos(meta))

    def gen_args(self, meta, c):
        return tuple(x for x in c if x is not None)

    def keyword(self, meta, c):
        return ast.Keyword(str(c[0]), _lit(c[1]), self._tpos(c[0]))

    def select(self, meta, c):
        return ast.Select(str(c[0]), _lit(c[1]), self._pos(meta))

    def _count(self, x):
        return ast.Lit(int(x), self._tpos(x)) if isinstance(x, Token) else x

    def fork_count(self, meta, c):
        return "count", None, self._count(c[0])

    def fork_range(self, meta, c):
        return "range", str(c[0]), self._count(c[1])

    def fork_each(self, meta, c):
        return "each", str(c[0]), _lit(c[1])

    def fork(self, meta, c):
        (kind, var, source), body = c
        return ast.Fork(kind, var, source, body, None, self._pos(meta))

    def join(self, meta, c):
        return ast.Join(c[0] or (), self._pos(meta))

    def reductions(self, meta, c):
        return tuple(c)

    def reduction(self, meta, c):
        target, fn, *rest = c
        args, kwargs = [], []
        for a in (_lit(x) for x in rest if x is not None):
            if isinstance(a, ast.Keyword):
                kwargs.append(a)
            elif kwargs:
                raise TgError("a positional argument cannot follow a keyword argument", a.pos)
            else:
                args.append(a)
        return ast.Reduction(str(target), str(fn), tuple(args), tuple(kwargs), self._tpos(target))

    def var(self, meta, c):
        return ast.Var(str(c[0]), self._tpos(c[0]))

    def number(self, meta, c):
        tok = c[0]
        return ast.Lit(int(tok) if tok.type == "INT" else float(tok), self._tpos(tok))

    def list(self, meta, c):
        return ast.ListLit(tuple(_lit(x) for x in c if x is not None), self._pos(meta))

    def string(self, meta, c):
        return _Str(c[0], self.source)


# syntax errors --------------------------------------------------------------------------------------
_EXAMPLES = {
    "a gen needs the name of the variable it sets: gen NAME or gen NAME(max_tokens=..., ...)":
        ["gen", 'gen "x"', "gen (max_tokens=3)", "gen 3"],
    "gen parameters are written name=value and separated by commas, e.g. gen x(max_tokens=32, stop=\"\\n\")":
        ["gen x(3)", "gen x(max_tokens 3)", "gen x(max_tokens=3 temperature=1)", "gen x(max_tokens=)"],
    'select is written: select NAME from ["choice", ...]':
        ['select x ["a"]', 'select ["a"]', "select x from", "select", 'select x from "a"'],
    "fork is written: fork N { ... }, fork NAME in range(N) { ... } or fork NAME in LIST { ... }":
        ["fork { }", 'fork 3 "a"', "fork x in { }", "fork", "fork 3", "fork x in range 3 { }", "fork 1.5 { }"],
    "a join's reductions are written NAME = FUNCTION(ARGUMENTS), e.g. answer = vote(solution)":
        ["fork 2 {} join { vote(x) }", "fork 2 {} join { x }", "fork 2 {} join { x = }", "fork 2 {} join { x = 3 }"],
    "param is written: param NAME, param NAME = DEFAULT or param NAME: TYPE = DEFAULT":
        ["param", "param = 3", "param x = ", "param x:", "param 3"],
    'include needs a file name in quotes: include "library.tg"': ["include", "include x"],
    'a message is written ROLE "text" or ROLE { ... }, with ROLE one of system, user, assistant':
        ["user", "user x", "assistant gen x", "system 3"],
}


def _describe(name: str) -> str:
    names = {"NAME": "a name", "INT": "an integer", "FLOAT": "a number", "STRING": "a string",
             "LONG_STRING": "a string", "$END": "the end of the file"}
    if name in names:
        return names[name]
    for t in _lark().terminals:
        if t.name == name:
            return repr(t.pattern.value.replace("\\", ""))
    return name


def _end_pos(source: Source) -> Pos:
    lines = source.text.split("\n")
    return Pos(source, len(lines), len(lines[-1]) + 1)


def _syntax_error(e: UnexpectedInput, source: Source) -> TgError:
    try:
        label = e.match_examples(_lark().parse, _EXAMPLES, use_accepts=True)
    except Exception:  # noqa: BLE001 - a better message is optional, the error itself is not
        label = None
    if isinstance(e, UnexpectedCharacters):
        ch = source.text[e.pos_in_stream] if e.pos_in_stream < len(source.text) else ""
        pos = Pos(source, e.line, e.column)
        if ch == '"':
            return TgError('this string is not closed: a "..." string ends on its own line '
                           '(use """...""" for text over several lines)', pos)
        found = f"unexpected character {ch!r}"
        return TgError(f"{label} ({found})" if label else found, pos)
    if isinstance(e, UnexpectedToken):
        tok = e.token
        end = tok.type == "$END"
        pos = _end_pos(source) if end else Pos(source, tok.line, tok.column)
        found = _found(tok)
        if label:
            return TgError(f"{label} ({found})", pos)
        expected = sorted({_describe(t) for t in (e.accepts or e.expected)})
        if end and "'}'" in expected:
            return TgError("unexpected end of file: a '{' is not closed by '}'", pos)
        if tok.type == "NAME" and "'fork'" in expected:
            hint = ("; a statement starts with a string, param, include, system, user, assistant, gen, select, "
                    "fork or join (reductions such as x = vote(...) go inside join { ... } after a fork)")
            return TgError(found + hint, pos)
        return TgError(f"{found}; expected {_or(expected)}", pos)
    return TgError(label or "syntax error", Pos(source, max(e.line, 1), max(e.column, 1)))


def _found(tok: Token) -> str:
    if tok.type == "$END":
        return "unexpected end of file"
    if tok.type == "NAME":
        return f"unexpected name {str(tok)!r}"
    if tok.type in ("INT", "FLOAT"):
        return f"unexpected number {tok}"
    if tok.type in ("STRING", "LONG_STRING"):
        return "unexpected string"
    return f"unexpected {_describe(tok.type)}"


def _or(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


# entry points ---------------------------------------------------------------------------------------
def parse_source(text: str, path: str = "<string>") -> tuple[ast.Statement, ...]:
    """Parse one source text (``include`` left unresolved). Raises :class:`TgError`."""
    source = Source(path, text)
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, source) from None
    try:
        return _ToAst(source).transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, TgError):
            raise e.orig_exc from None
        if isinstance(e.orig_exc, RecursionError):
            raise TgError("the program nests too deeply", Pos(source, 1, 1)) from None
        raise
    except RecursionError:
        raise TgError("the program nests too deeply", Pos(source, 1, 1)) from None


def _read(path: str, at: Pos | None) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        if at is not None:
            raise TgError(f"include: no such file {path!r}", at) from None
        raise TgError("no such file", path=path) from None
    except IsADirectoryError:
        raise TgError(f"{path!r} is a directory, not a .tg file", at, path=path) from None
    except UnicodeDecodeError as e:
        raise TgError(f"cannot read {path!r}: not UTF-8 text ({e.reason} at byte {e.start})", at, path=path) from None
    except OSError as e:
        raise TgError(f"cannot read {path!r}: {e.strerror}", at, path=path) from None


def _resolve(body: tuple, source_path: str, stack: tuple[tuple[str, str], ...], depth: int = 0) -> tuple:
    """Replace each ``include`` by the included file's statements; ``stack``: (real path, shown path)
    of the files being included, to detect cycles."""
    if depth > _MAX_NESTING:
        raise TgError("the program nests too deeply", body[0].pos if body else None, path=source_path)
    out = []
    for st in body:
        if isinstance(st, ast.Include):
            base = os.path.dirname(source_path) if not source_path.startswith("<") else ""
            target = os.path.normpath(os.path.join(base, st.path))
            real = os.path.realpath(target)
            reals = [r for r, _ in stack]
            if real in reals:
                chain = [shown for _, shown in stack[reals.index(real):]] + [target]
                raise TgError("include cycle: " + " -> ".join(chain), st.pos)
            if not os.path.isfile(target):
                where = os.path.abspath(target)
                raise TgError(f"include: no such file {st.path!r} (looked for {where})", st.pos)
            inner = parse_source(_read(target, st.pos), target)
            params = [p for p in inner if isinstance(p, ast.Param)]
            if params:
                raise TgError("an included file cannot declare parameters (declare them in the main file)",
                              params[0].pos)
            st = replace(st, body=_resolve(inner, target, stack + ((real, target),), depth + 1), resolved=target)
        elif isinstance(st, (ast.Fork, ast.Message)):
            st = replace(st, body=_resolve(st.body, source_path, stack, depth + 1))
        out.append(st)
    return tuple(out)


def parse(text: str, path: str = "<string>") -> ast.TgFile:
    """Parse a main program from text; ``include`` paths are relative to ``path``'s folder (or the cwd)."""
    body = parse_source(text, path)
    real = os.path.realpath(path) if not path.startswith("<") else path
    body = _resolve(body, path, ((real, path),))
    params = tuple(st for st in body if isinstance(st, ast.Param))
    return ast.TgFile(Source(path, text), params, body)


def parse_file(path: str | os.PathLike) -> ast.TgFile:
    """Read and parse a ``.tg`` file, resolving its includes."""
    path = os.fspath(path)
    return parse(_read(path, None), path)
