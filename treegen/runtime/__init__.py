"""What runs: model loading, the per-node KV store, the sampler and the engine."""

from treegen.runtime.engine import Engine, GenRequest, GenResult, Job, ScoreRequest, TreeRun
from treegen.runtime.model import LlamaFamilyModel, ModelNotFoundError, UnsupportedModelError
from treegen.runtime.sampler import SamplingParams

__all__ = ["Engine", "GenRequest", "GenResult", "Job", "LlamaFamilyModel", "ModelNotFoundError", "SamplingParams",
           "ScoreRequest", "TreeRun", "UnsupportedModelError"]
