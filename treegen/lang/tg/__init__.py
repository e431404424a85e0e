"""The ``.tg`` text language: prompt programs written as files, lowered to the same IR as the Python DSL.

A short example (``treegen run`` it, or ``treegen show`` its sharing tree)::

    # Self-consistency: N sampled solutions share the prompt; the majority answer wins.
    param question = "Ann has 7 pens and gives 3 away. How many are left?"
    param n = 5

    include "fewshot/arithmetic.tg"          # a few-shot library, pasted in place
    "Q: {question}\\nA:"                       # text; {name} reads a variable

    fork n {                                 # n branches, each runs the block
        gen solution(max_tokens=64, temperature=0.7, stop="\\n\\n")
    }
    join {                                   # each branch's `solution` comes back as a list
        answer = vote(solution, extract="The answer is (-?[0-9]+)")
    }

Statements: ``param``, ``include``, text (``"..."`` or ``\"\"\"...\"\"\"``), ``system`` / ``user`` /
``assistant`` messages (``user "..."`` or ``assistant { ... gen x }``), ``gen NAME(...)``,
``select NAME from [...]``, ``fork N { }``, ``fork i in range(N) { }``, ``fork x in LIST { }``,
``join`` / ``join { NAME = collect|vote|best|top_k(...) }``. The reference is ``docs/tg.md``; strings
are described in :mod:`treegen.lang.tg.parser`, types in :mod:`treegen.lang.tg.check`, reductions in
:mod:`treegen.lang.reduce`.

Layers: ``treegen.lark`` (grammar) -> :mod:`.parser` (AST of :mod:`.ast`, includes) -> :mod:`.check`
(scopes, types, ranges) -> :mod:`.lower` (drives the :class:`~treegen.lang.state.State` API,
the IR the Python DSL uses) -> :mod:`.program` (parameters, compile, run, JSON).
"""

from treegen.lang.tg.errors import Pos, Source, TgError
from treegen.lang.tg.parser import parse, parse_file
from treegen.lang.tg.program import TgProgram, TgResult, load, loads

__all__ = ["Pos", "Source", "TgError", "TgProgram", "TgResult", "load", "loads", "parse", "parse_file"]
