"""What runs: model loading, the per-node KV store, the sampler and the engine."""

from treegen.runtime.engine import Engine
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.model_config import ModelNotFoundError, UnsupportedModelError
from treegen.runtime.requests import GenRequest, GenResult, Job, ScoreRequest
from treegen.runtime.sampler import SamplingParams
from treegen.runtime.tree_run import TreeRun

__all__ = ["Engine", "GenRequest", "GenResult", "Job", "LlamaFamilyModel", "ModelNotFoundError", "SamplingParams",
           "ScoreRequest", "TreeRun", "UnsupportedModelError"]
