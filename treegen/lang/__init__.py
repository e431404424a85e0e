"""What users write: the Python DSL and the IR it lowers to."""

from treegen.lang.dsl import (CompiledProgram, Program, assistant, best, collect, concat, gen, program, select,
                               system, top_k, user, vote)
from treegen.lang.interpreter import ForkGroup, State, UnsetVariableError

__all__ = ["CompiledProgram", "ForkGroup", "Program", "State", "UnsetVariableError", "assistant", "best", "collect",
           "concat", "gen", "program", "select", "system", "top_k", "user", "vote"]
