"""What a checkpoint's transformers config says about the decoder treegen runs: its family row
(``families.py``), whether treegen supports it (architecture, attention options, RoPE type), each
layer's attention type and sliding window, the RoPE frequencies per layer type, and the longest context.
Read from the config alone, before any weight is loaded (:func:`check_supported`); the model
(:mod:`treegen.runtime.model`) and the loader build on it."""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor

from .families import FAMILIES, SUPPORTED_MODEL_TYPES, TEXT_ONLY, Family

_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or one of its options) is not supported."""


class ModelNotFoundError(ValueError):
    """The model id / path could not be resolved to a checkpoint."""


def family_for(model_type: str | None) -> Family:
    """The family row of ``model_type``; raises :class:`UnsupportedModelError` naming what is supported."""
    family = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        raise UnsupportedModelError(
            f"unsupported model architecture model_type={model_type!r}; "
            f"treegen's decoder supports model_type in {list(SUPPORTED_MODEL_TYPES)}"
        )
    return family


def check_model_type(model_type: str | None) -> None:
    """Raise :class:`UnsupportedModelError` unless ``model_type`` has a family row (or is a multimodal
    checkpoint whose text model has one, see ``families.TEXT_ONLY``)."""
    if model_type not in TEXT_ONLY:
        family_for(model_type)


def text_config_of(config):
    """The config of the language model treegen runs: ``config`` itself, or the text config inside a
    multimodal checkpoint's config (``families.TEXT_ONLY``)."""
    wrapper = TEXT_ONLY.get(getattr(config, "model_type", None))
    return config if wrapper is None else getattr(config, wrapper.config_attr)


def checkpoint_names(names) -> Callable[[str], str]:
    """Maps HF's ``*ForCausalLM`` tensor names (``model.layers.0...``, ``lm_head.weight``) to where a
    checkpoint with tensor ``names`` keeps them: the same names, or a multimodal checkpoint's text model."""
    if "model.embed_tokens.weight" in names:
        return lambda name: name
    for wrapper in TEXT_ONLY.values():
        for body, head in wrapper.prefixes:
            if body + "embed_tokens.weight" in names:
                return lambda name, body=body, head=head: (body + name[len("model."):] if name.startswith("model.")
                                                           else head + name[len("lm_head."):])
    raise UnsupportedModelError("the checkpoint has no model.embed_tokens.weight (nor a multimodal checkpoint's "
                                "text embeddings): not a decoder checkpoint treegen can read")


def _is_nested(rp: dict) -> bool:
    return bool(rp) and all(isinstance(v, dict) or v is None for v in rp.values())


def _rope_parameters(config, layer_type: str | None = None) -> dict:
    """RoPE settings of one layer type as one flat dict (transformers 5 ``rope_parameters``, nested by
    layer type or not, or legacy ``rope_scaling`` / ``rope_theta`` / ``rope_local_base_freq``)."""
    rp = getattr(config, "rope_parameters", None)
    if rp is None:
        rp = getattr(config, "rope_scaling", None)
    rp = dict(rp or {})
    if _is_nested(rp):
        if layer_type is None or rp.get(layer_type) is None:
            raise UnsupportedModelError(
                f"per-layer-type RoPE parameters are not supported for model_type={config.model_type!r} "
                f"(got keys {sorted(rp)})"
            )
        rp = dict(rp[layer_type])
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None) is not None:
        rp = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}  # Gemma 3, transformers 4
    rp.setdefault("rope_type", rp.get("type", "default"))
    if "rope_theta" not in rp:
        rp["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    if "partial_rotary_factor" not in rp and getattr(config, "partial_rotary_factor", None) is not None:
        rp["partial_rotary_factor"] = config.partial_rotary_factor
    return rp


def _rope_init_functions() -> dict:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS


def layer_types_of(config) -> list[str]:
    """Each layer's attention type, ``full_attention`` or ``sliding_attention`` (which layers use
    ``config.sliding_window``, by the family's rule; see ``Family.window_layers``)."""
    family = family_for(getattr(config, "model_type", None))
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    declared = getattr(config, "layer_types", None)
    if declared is not None:
        declared = list(declared)
        unknown = sorted(set(declared) - set(_LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(f"layer types {unknown} are not supported (model_type={config.model_type!r}); "
                                        f"supported: {list(_LAYER_TYPES)}")
        if len(declared) != n:
            raise UnsupportedModelError(f"config.layer_types has {len(declared)} entries for {n} layers")
    if window is None or family.window_layers is None:
        return ["full_attention"] * n
    if family.window_layers == "all":
        return ["sliding_attention"] * n
    if declared is not None:
        return declared
    # no per-layer types in this config: a window that is set counts everywhere unless switched off
    used = bool(getattr(config, "use_sliding_window", True))
    return ["sliding_attention" if used else "full_attention"] * n


def _rope_layer_keys(config, family: Family) -> list[str | None]:
    """Per layer, the key of its RoPE table: its layer type where the family gives layer types their
    own RoPE (Gemma 3's local and global bases), else None (one table for all)."""
    n = int(config.num_hidden_layers)
    if not family.rope_per_layer_type:
        return [None] * n
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    declared = getattr(config, "layer_types", None)
    if declared is None or not (_is_nested(dict(rp)) or getattr(config, "rope_local_base_freq", None) is not None):
        return [None] * n
    return list(declared)


def check_supported(config) -> None:
    """Raise :class:`UnsupportedModelError` unless ``config`` (an HF config) is one we can run.

    Cheap: looks at the config only, so it can run before any weights are loaded.
    """
    family = family_for(getattr(config, "model_type", None))
    model_type = config.model_type
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"bidirectional attention (model_type={model_type!r}) is not supported: "
                                    f"treegen decodes causally")
    if getattr(config, "attention_chunk_size", None):
        raise UnsupportedModelError(f"chunked attention (model_type={model_type!r}) is not supported")
    layer_types_of(config)
    for key in sorted(set(_rope_layer_keys(config, family)), key=str):
        rope_inv_freq(config, key)


def effective_window(window, max_context: int) -> int | None:
    """A layer's sliding window as attention applies it: None for none, and for one at least as long as the
    longest context the model takes, which never masks a key (Phi-4-mini's 262,144 against its 131,072
    positions: planned without a window, its plans keep the library kernel)."""
    return int(window) if window is not None and int(window) < max_context else None


def max_context_of(config) -> int:
    """Longest sequence (in tokens) this model can run with plain causal attention.

    ``max_position_embeddings``, further limited, for ``longrope``, by the original context (beyond it
    HF switches frequency sets). Sliding windows do not limit it: tree attention applies them.
    ``dynamic`` NTK RoPE equals plain RoPE for sequences up to ``max_position_embeddings``.
    """
    limit = int(config.max_position_embeddings)
    family = family_for(config.model_type)
    for key in set(_rope_layer_keys(config, family)):
        rp = _rope_parameters(config, key)
        if rp["rope_type"] == "longrope" and rp.get("original_max_position_embeddings"):
            limit = min(limit, int(rp["original_max_position_embeddings"]))
    return limit

def _head_dim(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def rope_inv_freq(config, layer_type: str | None = None) -> tuple[Tensor, float]:
    """(inv_freq [rotary_dim // 2] fp32 on CPU, attention_scaling) exactly as transformers computes
    them for layers of ``layer_type`` (None: the model's one RoPE). ``rotary_dim`` is ``head_dim``
    unless the family rotates part of each head (Phi-3's ``partial_rotary_factor``)."""
    family = family_for(getattr(config, "model_type", None))
    rp = _rope_parameters(config, layer_type)
    head_dim = _head_dim(config)
    rope_type = rp["rope_type"]
    if rope_type == "default":
        dim = int(head_dim * rp.get("partial_rotary_factor", 1.0)) if family.partial_rotary else head_dim
        inv_freq = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    init = _rope_init_functions().get(rope_type)
    if init is None:
        raise UnsupportedModelError(
            f"unsupported RoPE type {rope_type!r} for model_type={config.model_type!r}; "
            f"supported: {['default', *sorted(_rope_init_functions())]}"
        )
    raw = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and _is_nested(dict(raw)):
        try:
            inv_freq, scaling = init(config, torch.device("cpu"), layer_type=layer_type)
        except TypeError:  # an init function without layer types: give it a config with this type's flat dict
            flat = copy.copy(config)
            flat.rope_parameters = rp
            inv_freq, scaling = init(flat, torch.device("cpu"))
    else:
        inv_freq, scaling = init(config, torch.device("cpu"))
    if inv_freq.numel() * 2 != head_dim and not family.partial_rotary:
        raise UnsupportedModelError(f"partial rotary embeddings are not supported for model_type={config.model_type!r}")
    return inv_freq.to(torch.float32), float(scaling)


__all__ = ["ModelNotFoundError", "UnsupportedModelError", "check_model_type", "check_supported", "checkpoint_names",
           "effective_window", "family_for", "layer_types_of", "max_context_of", "rope_inv_freq", "text_config_of"]
