"""What users write: the Python DSL and the IR it lowers to.

Layering: lang imports tree and runtime, never the display layer; how its classes look in notebooks
and terminals is registered from above, in :mod:`treegen.lang.views`.
"""

from treegen.lang.batch import BatchInterrupted, EngineFailed, InputsFailed, ProgramError
from treegen.lang.dsl import (CompiledProgram, Program, assistant, best, collect, concat, gen, program, select,
                               system, top_k, user, vote)
from treegen.lang.state import ForkGroup, State, TokenStream, UnsetVariableError

__all__ = ["BatchInterrupted", "EngineFailed", "InputsFailed", "CompiledProgram", "ForkGroup", "Program", "ProgramError", "State", "TokenStream",
           "UnsetVariableError", "assistant", "best", "collect", "concat", "gen", "program", "select", "system",
           "top_k", "user", "vote"]
