"""Decoder families as data: one row of switches per ``model_type``, read by the one forward pass.

A row says how a family's decoder layer differs from Llama's — where its norms sit, how they scale,
whether q and k are normalised, how embeddings and attention are scaled, which activation gates the
MLP, how its checkpoint stores the projections, where RoPE and sliding windows apply — and nothing
else: model dimensions always come from the checkpoint's config. ``treegen/runtime/model.py`` (and
``model_config.py``, for what the config implies) reads the row; adding a family that only recombines
these switches is adding a row.

Norm slots of a layer (``NormSlots``), by the checkpoint's module names:

    x = pre_attn(h)      ; y = attention(x) ; y = post_attn(y)  ; h = h + y
    x = pre_mlp(h)       ; y = mlp(x)       ; y = post_mlp(y)   ; h = h + y

A slot that is ``None`` is the identity (OLMo 2 has no pre-norms; Llama no post-norms).

RMSNorm variants (``NormStyle``), x normalised in fp32 as ``x * rsqrt(mean(x²) + eps)``:

    llama:  w * x.to(dtype)                 (LlamaRMSNorm; the fused CUDA kernel computes this one)
    olmo:   (w * x).to(dtype)               (scale in fp32, then round)
    gemma:  (x * (1 + w.float())).to(dtype) (weights stored as offsets from 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

NormStyle = Literal["llama", "olmo", "gemma"]


@dataclass(frozen=True)
class NormSlots:
    """Checkpoint module names (under ``model.layers.{i}.``) of a layer's four norm slots; None = absent."""

    pre_attn: str | None = "input_layernorm"
    post_attn: str | None = None
    pre_mlp: str | None = "post_attention_layernorm"
    post_mlp: str | None = None


LLAMA_NORMS = NormSlots()
SANDWICH_NORMS = NormSlots("input_layernorm", "post_attention_layernorm",
                           "pre_feedforward_layernorm", "post_feedforward_layernorm")
POST_NORMS = NormSlots(None, "post_attention_layernorm", None, "post_feedforward_layernorm")


@dataclass(frozen=True)
class Family:
    """Per-family switches (see the module doc). Defaults are Llama's."""

    name: str
    norms: NormSlots = LLAMA_NORMS
    norm_style: NormStyle = "llama"
    # q/k RMSNorm before RoPE: "head" (one [head_dim] weight shared by all heads: Qwen3, Gemma 3),
    # "proj" (over the whole projection, [num_heads * head_dim]: OLMo 2), or None
    qk_norm: Literal["head", "proj"] | None = None
    embed_scale: bool = False  # embeddings times sqrt(hidden), the scale rounded to the model dtype (Gemma)
    act_attrs: tuple[str, ...] = ("hidden_act",)  # config attributes naming the MLP gate's activation, in order
    # checkpoint layout: fused module names, or None when q/k/v (gate/up) are stored apart
    qkv_module: str | None = None  # e.g. "qkv_proj" = [q | k | v] along the output axis (Phi-3)
    gate_up_module: str | None = None  # e.g. "gate_up_proj" = [gate | up] (Phi-3)
    qkv_bias: Literal["config", "always"] = "config"  # qwen2: q/k/v always biased, o never
    attn_scale: Literal["head_dim", "query_pre_attn_scalar"] = "head_dim"  # softmax scale = that ** -0.5
    partial_rotary: bool = False  # HF rotates only the first partial_rotary_factor of head_dim (Phi-3)
    rope_fp32: bool = False  # HF applies RoPE in fp32 with fp32 cos/sin, rounding once (OLMo 2)
    rope_per_layer_type: bool = False  # rope_parameters may be nested by layer type (Gemma 3, OLMo 3)
    # which layers use config.sliding_window: "all" (every layer when it is set: Mistral, Phi-3),
    # "layer_types" (layers typed "sliding_attention"), or None (no windows in this family)
    window_layers: Literal["all", "layer_types"] | None = "layer_types"
    final_softcap: bool = False  # config.final_logit_softcapping applies to the logits (Gemma 2)
    attn_softcap: bool = False  # config.attn_logit_softcapping caps the attention scores (Gemma 2)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", window_layers=None),
    Family("mistral", window_layers="all"),
    Family("qwen2", qkv_bias="always"),
    Family("qwen3", qk_norm="head"),
    Family("phi3", qkv_module="qkv_proj", gate_up_module="gate_up_proj", partial_rotary=True, window_layers="all"),
    Family("olmo2", norms=POST_NORMS, norm_style="olmo", qk_norm="proj", rope_fp32=True, window_layers=None),
    Family("olmo3", norms=POST_NORMS, norm_style="olmo", qk_norm="proj", rope_fp32=True, rope_per_layer_type=True),
    Family("gemma", norm_style="gemma", embed_scale=True, act_attrs=("hidden_activation", "hidden_act"),
           window_layers=None),
    Family("gemma2", norms=SANDWICH_NORMS, norm_style="gemma", embed_scale=True,
           act_attrs=("hidden_activation", "hidden_act"), attn_scale="query_pre_attn_scalar",
           final_softcap=True, attn_softcap=True),
    Family("gemma3_text", norms=SANDWICH_NORMS, norm_style="gemma", qk_norm="head", embed_scale=True,
           act_attrs=("hidden_activation", "hidden_act"), attn_scale="query_pre_attn_scalar",
           rope_per_layer_type=True, final_softcap=True, attn_softcap=True),
)}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


@dataclass(frozen=True)
class TextOnly:
    """A multimodal checkpoint whose language model is a family above: treegen reads that part only
    (text in, text out; images are not supported). ``config_attr``: the text config inside the
    checkpoint's config; ``prefixes``: where the text model's ``model.*`` and ``lm_head.*`` tensors
    sit in the checkpoint, in the order tried (as saved on the hub, then transformers 5's own names)."""

    config_attr: str
    prefixes: tuple[tuple[str, str], ...]


TEXT_ONLY: dict[str, TextOnly] = {
    "gemma3": TextOnly("text_config", (("language_model.model.", "language_model.lm_head."),
                                       ("model.language_model.", "lm_head."))),
}


__all__ = ["FAMILIES", "Family", "NormSlots", "NormStyle", "SUPPORTED_MODEL_TYPES", "TEXT_ONLY", "TextOnly"]
