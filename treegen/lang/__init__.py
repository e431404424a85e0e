"""What users write: the Python DSL and the IR it lowers to."""

from treegen.lang.dsl import CompiledProgram, Program, assistant, gen, program, select, system, user
from treegen.lang.interpreter import ForkGroup, State, UnsetVariableError

__all__ = ["CompiledProgram", "ForkGroup", "Program", "State", "UnsetVariableError", "assistant", "gen", "program",
           "select", "system", "user"]
