"""The ``%%treegen`` cell magic: a ``.tg`` program written in a notebook cell.

    %load_ext treegen.display

    %%treegen sc --run n=4 question=QUESTION
    param question = "Ben has 6 marbles and wins 3 more. How many marbles does he have now?"
    param n = 8
    include "fewshot/arithmetic.tg"
    "Q: {question}\\nA:"
    fork n { gen solution(max_tokens=16, temperature=0.7, stop="\\n") }
    join { answer = vote(solution, extract="The answer is (-?[0-9]+)") }

The cell is parsed and checked by :func:`treegen.lang.tg.loads` (``include`` paths are relative to
the notebook's folder) and the program is bound to ``NAME`` (default ``program``) in the notebook.
Then, by flag:

* none: the cell shows the program (parameters and source);
* ``--tree``: compiles it with the engine's tokenizer and shows its sharing tree (nothing runs);
* ``--run``: runs it on the engine (with progress bars), binds the result to ``--out`` (default
  ``result``) and shows it.

``key=expression`` words after the name are the program's parameters, evaluated in the notebook's
namespace (no spaces inside an expression). ``--engine VAR`` names the engine variable (default
``engine``); ``--seed N`` the seed. Mistakes in the program are reported as ``file:line:col``.
"""

from __future__ import annotations

import importlib

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

from treegen.display.progress import progress
from treegen.display.show import show

#: where the ``.tg`` front end lives, and its function ``(text, path) -> program``
TG_MODULE, TG_LOADER = "treegen.lang.tg", "loads"


def tg_loader():
    """``treegen.lang.tg.loads``, or a UsageError saying what is missing."""
    try:
        module = importlib.import_module(TG_MODULE)
    except ImportError as e:
        raise UsageError(f"%%treegen needs the .tg front end ({TG_MODULE}), which is not installed: {e}") from None
    loader = getattr(module, TG_LOADER, None)
    if loader is None:
        raise UsageError(f"%%treegen: {TG_MODULE} has no {TG_LOADER}(text, path) in this version of treegen")
    return loader


def _tg_errors():
    """The exception type of user mistakes in .tg programs (nothing when the front end is absent)."""
    try:
        return importlib.import_module(TG_MODULE).TgError
    except (ImportError, AttributeError):
        return ()


@magics_class
class TreegenMagics(Magics):
    @magic_arguments()
    @argument("words", nargs="*", help="[NAME] [key=expression ...]: the variable for the program, then its arguments")
    @argument("--run", action="store_true", help="run the program on the engine and show the result")
    @argument("--tree", action="store_true", help="show the compiled sharing tree (no model run)")
    @argument("--engine", default="engine", help="the engine variable (default: engine)")
    @argument("--out", default="result", help="the variable for the result of --run (default: result)")
    @argument("--seed", type=int, default=0, help="the program seed for --run (default: 0)")
    @cell_magic
    def treegen(self, line: str, cell: str):
        """Parse a ``.tg`` program from the cell; show it, its tree (--tree), or run it (--run)."""
        # options may come anywhere among the words (parse_argstring would stop at the first option)
        args = self.treegen.parser.parse_intermixed_args(arg_split(line))
        ns = self.shell.user_ns
        name, kwargs = "program", {}
        for i, word in enumerate(args.words):
            if "=" not in word:
                if i:
                    raise UsageError(f"%%treegen: expected key=expression, got {word!r}")
                if not word.isidentifier():
                    raise UsageError(f"%%treegen: {word!r} is not a valid variable name")
                name = word
                continue
            key, _, expr = word.partition("=")
            if not key.isidentifier():
                raise UsageError(f"%%treegen: {key!r} is not a parameter name")
            try:
                kwargs[key] = eval(expr, ns)  # noqa: S307 - the user's own notebook expression
            except Exception as e:
                raise UsageError(f"%%treegen: cannot evaluate {key}={expr}: {type(e).__name__}: {e}") from None
        loader, mistakes = tg_loader(), _tg_errors()
        try:
            program = loader(cell, f"<cell {name}>")
        except mistakes as e:
            raise UsageError(str(e)) from None
        ns[name] = program
        if not (args.run or args.tree):
            return show(program)
        if args.engine not in ns:
            raise UsageError(f"%%treegen: no engine variable {args.engine!r}; load one with "
                             f"{args.engine} = treegen.Engine.load()")
        engine = ns[args.engine]
        try:
            if args.tree:
                return show(program.compile(tokenizer=engine.tokenizer, **kwargs), engine)
            with progress(engine):
                result = program.run(engine, seed=args.seed, **kwargs)
        except mistakes as e:
            raise UsageError(str(e)) from None
        ns[args.out] = result
        return show(result)


def _html_formatters(ipython) -> None:
    """Show classes with no ``_repr_html_`` of their own (the ``.tg`` TgProgram and TgResult) through the
    display functions; Program, CompiledProgram and State have hooks, rendered by the views this package
    registers in :mod:`treegen.lang.views`, and a hook a class defines is never replaced."""
    from treegen.display.html import compiled_html, program_html, result_html
    from treegen.display.text import compiled_text, program_text, result_text
    from treegen.lang.dsl import CompiledProgram, Program
    from treegen.lang.state import State

    classes = [(Program, program_html, program_text), (CompiledProgram, compiled_html, compiled_text),
               (State, result_html, result_text)]
    try:
        from treegen.lang.tg import TgProgram, TgResult

        classes += [(TgProgram, program_html, program_text), (TgResult, result_html, result_text)]
    except ImportError:
        pass
    html = ipython.display_formatter.formatters["text/html"]
    plain = ipython.display_formatter.formatters["text/plain"]
    for cls, to_html, to_text in classes:
        if getattr(cls, "_repr_html_", None) is None:
            html.for_type(cls, to_html)
            plain.for_type(cls, lambda obj, p, cycle, to_text=to_text: p.text(to_text(obj)))


def register(ipython) -> None:
    ipython.register_magics(TreegenMagics)
    _html_formatters(ipython)


__all__ = ["TG_LOADER", "TG_MODULE", "TreegenMagics", "register", "tg_loader"]
