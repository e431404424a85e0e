"""treegen: prompt programs that ask a language model many related questions at once.

Programs (Python DSL in :mod:`treegen.lang`) compile to an explicit sharing tree
(:mod:`treegen.tree`), which the runtime (:mod:`treegen.runtime`) runs with hierarchical
Hydragen attention (:mod:`treegen.kernels`): every node's KV is stored and read once.
Notebook and terminal views (:mod:`treegen.display`) sit on top; importing treegen imports them, which
registers the reprs of programs, compiled trees and results (:mod:`treegen.lang.views`).
"""

from treegen.lang import (
    BatchInterrupted,
    EngineFailed,
    InputsFailed,
    CompiledProgram,
    ForkGroup,
    Program,
    ProgramError,
    State,
    TokenStream,
    UnsetVariableError,
    assistant,
    best,
    collect,
    concat,
    gen,
    program,
    select,
    system,
    top_k,
    user,
    vote,
)
from treegen.runtime import Engine, ModelNotFoundError, SamplingParams, UnsupportedModelError
from treegen.tree import KVShape, SharingTree, TreeStats
from treegen import display  # noqa: F401  (sits on top of lang; importing it registers lang's views)

__all__ = [
    "BatchInterrupted", "EngineFailed", "InputsFailed", "CompiledProgram", "ProgramError", "TokenStream", "Engine", "ForkGroup", "KVShape", "ModelNotFoundError", "Program", "SamplingParams",
    "SharingTree", "State", "TreeStats", "UnsetVariableError", "UnsupportedModelError", "assistant", "gen",
    "program", "select", "system", "user", "vote", "best", "top_k", "collect", "concat",
]
