"""Our own decoder forward pass for the decoder families of ``treegen/runtime/families.py``
(Llama, Mistral, Qwen 2/3, Phi-3/4, OLMo 2/3, Gemma 1/2/3).

The model owns the weights and the maths of one decoder step; it owns nothing
about the KV cache.  Every layer hands the new tokens' (RoPE'd) queries, keys
and values to a caller-supplied ``attend`` callback, which stores keys/values
wherever it likes and returns the attention output.  Tokens of many sequences
are packed in one flat ``[T]`` dimension; the only Python loop is over layers.

One forward serves every family: it reads the family's row of switches (norm slots and style,
q/k norm, embedding scale, activation, attention scale, partial rotary, RoPE per layer type,
final-logit soft-cap) rather than branching on ``model_type``.

Numerics follow transformers' own modules for each family (RMSNorm in fp32 with the family's
rounding, RoPE cos/sin computed in fp32 then cast to the model dtype — kept in fp32 where the family
does —, logits from the lm_head in the model dtype then cast to fp32), so fp32 logits match HF to ~1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from treegen.kernels.fused_ops import (add_rms_norm, fused_ops_available, rms_norm_reference, rope_,
                                       rope_reference, silu_mul)

from .families import Family
from .model_config import (UnsupportedModelError, _head_dim, _rope_layer_keys, check_supported, checkpoint_names,
                           effective_window, family_for, layer_types_of, max_context_of, rope_inv_freq, text_config_of)
from .shard import Part, Shard, check_tensor_parallel, part_shape, take
from .vocab_split import VocabSplit

if TYPE_CHECKING:
    from .distributed import PartialSum

rms_norm = rms_norm_reference

# attend(layer_idx, q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim],
#        v [T, num_kv_heads, head_dim]) -> [T, num_heads, head_dim]
AttendFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]

# get(name, shape, optional, part) -> the checkpoint tensor ``name`` on the target device and dtype, or
# None when it is absent and ``optional``; ``shape`` is what the config implies for the whole tensor (None
# entries: any size); ``part`` (None: all of it) the slices a tensor-parallel rank reads (see shard.py)
WeightGetter = Callable[[str, tuple, bool, "Part | None"], "Tensor | None"]

@dataclass(eq=False)
class _Layer:
    """Weights of one decoder layer (plain tensors; biases and absent norms are None).

    q/k/v and gate/up are held fused (``qkv_w``, ``gate_up_w``: one matrix product each per step);
    ``q_w``, ``k_w``, ... are views into them. Norm weights are what the family's norm multiplies by:
    the checkpoint's weight (``llama`` style, model dtype) or, for ``olmo`` / ``gemma`` styles, the
    fp32 scale (``w`` / ``1 + w``) that HF computes on every call.
    """

    qkv_w: Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_b: Tensor | None
    o_w: Tensor  # [hidden, num_heads * head_dim]
    o_b: Tensor | None
    gate_up_w: Tensor  # [2 * intermediate, hidden]
    gate_up_b: Tensor | None
    down_w: Tensor  # [hidden, intermediate]
    down_b: Tensor | None
    qkv_sizes: tuple[int, int, int]  # rows of q, k, v in qkv_w
    attn_norm: Tensor | None = None  # [hidden], before attention
    attn_post_norm: Tensor | None = None  # [hidden], on attention's output
    mlp_norm: Tensor | None = None  # [hidden], before the MLP
    mlp_post_norm: Tensor | None = None  # [hidden], on the MLP's output
    q_norm: Tensor | None = None  # [head_dim] ("head" q/k norm) or [num_heads * head_dim] ("proj")
    k_norm: Tensor | None = None  # [head_dim] or [num_kv_heads * head_dim]

    def __post_init__(self) -> None:
        self.q_w, self.k_w, self.v_w = self.qkv_w.split(self.qkv_sizes)
        self.q_b, self.k_b, self.v_b = (None, None, None) if self.qkv_b is None else self.qkv_b.split(self.qkv_sizes)
        inter = self.gate_up_w.shape[0] // 2
        self.gate_w, self.up_w = self.gate_up_w.split(inter)
        self.gate_b, self.up_b = (None, None) if self.gate_up_b is None else self.gate_up_b.split(inter)
        self.qk_norm = None  # [num_heads + num_kv_heads, head_dim]: per-head norms of q and k as one weight
        if self.q_norm is not None and self.q_norm.shape[0] < self.qkv_sizes[0]:  # per head, not per projection
            hd = self.q_norm.shape[0]
            self.qk_norm = torch.cat([self.q_norm.expand(self.qkv_sizes[0] // hd, hd),
                                      self.k_norm.expand(self.qkv_sizes[1] // hd, hd)])


def _cat(parts: list[Tensor | None], sizes: list[int]) -> Tensor | None:
    """Concatenate along the output axis; None when every part is None, zeros where one is missing."""
    if all(p is None for p in parts):
        return None
    ref = next(p for p in parts if p is not None)
    return torch.cat([p if p is not None else ref.new_zeros(n) for p, n in zip(parts, sizes)])


class _Dims(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    inter: int
    layers: int


def _dims(config) -> _Dims:
    heads = int(config.num_attention_heads)
    return _Dims(heads, int(getattr(config, "num_key_value_heads", None) or heads), _head_dim(config),
                 int(config.hidden_size), int(config.intermediate_size), int(config.num_hidden_layers))


def _build(config, family: Family, get: WeightGetter, *, tied: bool, shard: Shard = Shard(),
           vocab_parallel: bool = False):
    """(embed, layers, final norm, lm_head) from checkpoint tensors named as HF's ``*ForCausalLM``
    names them (``model.layers.{i}.self_attn.q_proj.weight``, ...), read through ``get``; of a
    tensor-parallel ``shard``, only its slices (see :mod:`treegen.runtime.shard`); with
    ``vocab_parallel``, ``lm_head`` holds only the shard's vocabulary rows (a tied model's: a view of
    the embedding's, which every rank keeps whole).

    q/k/v and gate/up are fused here (one copy while the layer is built) unless the checkpoint
    already stores them fused (Phi-3's ``qkv_proj`` / ``gate_up_proj``: views, no copy)."""
    d = _dims(config)
    hd = d.head_dim
    q_rows, kv_rows = d.heads * hd, d.kv_heads * hd
    q_heads, kv_heads = shard.heads(d.heads, d.kv_heads)
    q_part = (q_heads.start * hd, q_heads.stop * hd)  # this rank's rows of q, of k (or v)
    kv_part = (kv_heads.start * hd, kv_heads.stop * hd)
    sizes = (len(q_heads) * hd, len(kv_heads) * hd, len(kv_heads) * hd)  # the rank's rows of q, k, v
    i0, i1 = shard.channels(d.inter)
    whole = shard.size == 1
    rows = {"q_proj": None if whole else (0, [q_part]), "k_proj": None if whole else (0, [kv_part]),
            "v_proj": None if whole else (0, [kv_part]), "gate_proj": None if whole else (0, [(i0, i1)]),
            "up_proj": None if whole else (0, [(i0, i1)])}
    fused_qkv = None if whole else (0, [q_part, (q_rows + kv_part[0], q_rows + kv_part[1]),
                                        (q_rows + kv_rows + kv_part[0], q_rows + kv_rows + kv_part[1])])
    fused_gate_up = None if whole else (0, [(i0, i1), (d.inter + i0, d.inter + i1)])
    o_cols = None if whole else (1, [q_part])
    down_cols = None if whole else (1, [(i0, i1)])
    scale_in_fp32 = family.norm_style != "llama"

    def norm(name: str | None, n: int) -> Tensor | None:
        if name is None:
            return None
        w = get(name, (n,), False, None)
        if not scale_in_fp32:
            return w
        return w.float() + 1.0 if family.norm_style == "gemma" else w.float()

    def lin(name: str, out: int, inp: int, part: Part | None = None) -> tuple[Tensor, Tensor | None]:
        """Weight and bias; column slices (row-parallel) keep the bias on rank 0 only: the all-reduce adds it once."""
        weight = get(f"{name}.weight", (out, inp), False, part)
        bias = get(f"{name}.bias", (out,), True, part if part is not None and part[0] == 0 else None)
        return weight, None if part is not None and part[0] == 1 and shard.rank != 0 else bias

    layers = []
    for i in range(d.layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        if family.qkv_module:
            qkv_w, qkv_b = lin(a + family.qkv_module, q_rows + 2 * kv_rows, d.hidden, fused_qkv)
        else:
            parts = [lin(a + n, full, d.hidden, rows[n])
                     for n, full in zip(("q_proj", "k_proj", "v_proj"), (q_rows, kv_rows, kv_rows))]
            qkv_w, qkv_b = torch.cat([w for w, _ in parts]), _cat([b for _, b in parts], list(sizes))
            del parts
        if family.gate_up_module:
            gate_up_w, gate_up_b = lin(m + family.gate_up_module, 2 * d.inter, d.hidden, fused_gate_up)
        else:
            parts = [lin(m + n, d.inter, d.hidden, rows[n]) for n in ("gate_proj", "up_proj")]
            gate_up_w, gate_up_b = torch.cat([w for w, _ in parts]), _cat([b for _, b in parts], [i1 - i0] * 2)
            del parts
        qn = {"head": (d.head_dim, d.head_dim), "proj": (q_rows, kv_rows), None: (None, None)}[family.qk_norm]
        layers.append(_Layer(
            qkv_w, qkv_b, *lin(a + "o_proj", d.hidden, q_rows, o_cols), gate_up_w, gate_up_b,
            *lin(m + "down_proj", d.hidden, d.inter, down_cols), sizes,
            attn_norm=norm(family.norms.pre_attn and p + family.norms.pre_attn + ".weight", d.hidden),
            attn_post_norm=norm(family.norms.post_attn and p + family.norms.post_attn + ".weight", d.hidden),
            mlp_norm=norm(family.norms.pre_mlp and p + family.norms.pre_mlp + ".weight", d.hidden),
            mlp_post_norm=norm(family.norms.post_mlp and p + family.norms.post_mlp + ".weight", d.hidden),
            q_norm=norm(family.qk_norm and a + "q_norm.weight", qn[0]),
            k_norm=norm(family.qk_norm and a + "k_norm.weight", qn[1]),
        ))
    embed = get("model.embed_tokens.weight", (None, d.hidden), False, None)
    if vocab_parallel and shard.size > 1:
        vocab = int(embed.shape[0]) if tied else int(config.vocab_size)
        start, stop = shard.vocab(vocab)
        lm_head = embed[start:stop] if tied else get("lm_head.weight", (vocab, d.hidden), False, (0, [(start, stop)]))
    else:
        lm_head = embed if tied else get("lm_head.weight", (None, d.hidden), False, None)
    if get("lm_head.bias", (None,), True, None) is not None:
        raise UnsupportedModelError("lm_head with a bias is not supported")
    return embed, layers, norm("model.norm.weight", d.hidden), lm_head


def eos_ids_of(*sources) -> set[int]:
    """The union of ``eos_token_id`` (an int or a list) over configs / generation configs (None skipped)."""
    eos: set[int] = set()
    for src in sources:
        ids = getattr(src, "eos_token_id", None) if src is not None else None
        if ids is not None:
            eos.update([ids] if isinstance(ids, int) else ids)
    return eos


class FusedOps(NamedTuple):
    """Which element-wise steps run as fused CUDA kernels (``treegen/kernels/fused_ops.py``)."""

    norm: bool  # residual add + RMSNorm (llama-style norms only)
    rope: bool  # RoPE of q and k, writing the keys/values into the KV cache (full rotary only)
    act: bool  # silu(gate) * up


# --------------------------------------------------------------------------- the model


class LlamaFamilyModel:
    """Decoder-only model of any family in ``treegen.runtime.families`` with a cache-agnostic,
    packed-token forward.

    Attributes: ``config`` (HF config), ``family`` (its row of switches), ``num_layers``,
    ``num_heads``, ``num_kv_heads``, ``head_dim``, ``hidden_size``, ``vocab_size``, ``dtype``,
    ``device``, ``eos_token_ids`` (set[int]), ``max_context`` (int, see :func:`max_context_of`),
    ``attn_scale`` (softmax scale that ``attend`` must use: ``head_dim ** -0.5``, or
    ``query_pre_attn_scalar ** -0.5`` for Gemma 2/3), ``fused`` (fused CUDA kernels on or off) and
    ``fused_ops`` (which steps actually use them for this family); ``implementation`` names the path
    (``"fast"``; the generic path is :class:`treegen.runtime.generic.GenericModel`).

    Tensor parallel: ``tp`` (a :class:`~treegen.runtime.distributed.TensorParallel`, None: the whole
    model) names this rank's :class:`~treegen.runtime.shard.Shard` and all-reduces the row-parallel
    outputs; ``num_heads`` / ``num_kv_heads`` are then **this rank's** heads (so its KV store holds
    only its KV heads) and the layers hold only its slices. With ``tp.vocab_parallel`` the LM head
    holds only this rank's vocabulary rows: ``vocab_split`` (a
    :class:`~treegen.runtime.vocab_split.VocabSplit`, else None) names them, ``vocab_size`` stays the
    whole vocabulary's, and :meth:`forward` gathers the whole logits unless asked for this rank's slice.
    """

    implementation = "fast"

    def __init__(self, config, embed: Tensor, layers: list[_Layer], norm: Tensor,
                 lm_head: Tensor, eos_token_ids: set[int], tp=None, vocab_size: int | None = None):
        """``vocab_size``: the whole vocabulary when ``tp.vocab_parallel`` (``lm_head`` then holds this
        rank's rows of it, see :meth:`~treegen.runtime.shard.Shard.vocab`); else ``lm_head``'s rows."""
        check_supported(config)
        self.tp = tp
        self.shard = tp.shard if tp is not None else Shard()
        check_tensor_parallel(config, self.shard.size)
        split = tp is not None and tp.vocab_parallel and self.shard.size > 1
        if split and vocab_size is None:
            raise ValueError("a head split by vocabulary needs the whole vocabulary's size (vocab_size)")
        self.vocab_split = VocabSplit(tp, int(vocab_size)) if split else None
        if split and lm_head.shape[0] != self.vocab_split.width:
            raise ValueError(f"lm_head holds {lm_head.shape[0]} rows, this rank's vocabulary slice is {self.vocab_split}")
        self.config = config
        self.family = family = family_for(config.model_type)
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm  # [hidden] (the family's norm scale, see _Layer)
        self.lm_head = lm_head  # [vocab, hidden] (may be the same tensor as embed)
        self.eos_token_ids = set(eos_token_ids)

        self.num_layers = len(layers)
        heads = int(config.num_attention_heads)
        q_heads, kv_heads = self.shard.heads(heads, int(getattr(config, "num_key_value_heads", None) or heads))
        self.num_heads, self.num_kv_heads = len(q_heads), len(kv_heads)  # this rank's
        self.head_dim = _head_dim(config)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = self.vocab_split.size if split else int(lm_head.shape[0])
        self.dtype = embed.dtype
        self.device = embed.device
        self.eps = float(config.rms_norm_eps)
        scale_base = config.query_pre_attn_scalar if family.attn_scale == "query_pre_attn_scalar" else self.head_dim
        self.attn_scale = float(scale_base) ** -0.5
        self.max_context = max_context_of(config)
        self.layer_types = layer_types_of(config)
        # what ``attend`` must apply per layer: the sliding window of "sliding_attention" layers (keys at
        # key_pos > query_pos - window) and the attention logit soft cap (Gemma 2), see tree_attention
        window = effective_window(getattr(config, "sliding_window", None), self.max_context)
        self.layer_window = [window if t == "sliding_attention" else None for t in self.layer_types]
        cap = getattr(config, "attn_logit_softcapping", None) if family.attn_softcap else None
        self.attn_softcap = None if cap is None else float(cap)
        # embeddings times sqrt(hidden), the factor rounded to the model dtype as HF does
        self.embed_scale = (torch.tensor(self.hidden_size**0.5, dtype=self.dtype, device=self.device)
                            if family.embed_scale else None)
        self.final_softcap = getattr(config, "final_logit_softcapping", None) if family.final_softcap else None

        from transformers.activations import ACT2FN

        self.act_name = next((getattr(config, a) for a in family.act_attrs if getattr(config, a, None)), None)
        if self.act_name not in ACT2FN:
            raise UnsupportedModelError(f"unsupported activation {self.act_name!r} (model_type={config.model_type!r})")
        self.act = ACT2FN[self.act_name]
        self.intermediate_size = int(layers[0].gate_w.shape[0]) if layers else 0
        # RoPE: one table per key (a layer type where the family gives them different bases, else None)
        self.rope_keys = _rope_layer_keys(config, family)
        self.inv_freq: dict[str | None, Tensor] = {}  # key -> [rotary_dim // 2] fp32
        self.rope_scaling: dict[str | None, float] = {}
        for key in sorted(set(self.rope_keys), key=str):
            inv_freq, self.rope_scaling[key] = rope_inv_freq(config, key)
            self.inv_freq[key] = inv_freq.to(self.device)
        self.rotary_dim = 2 * next(iter(self.inv_freq.values())).numel()
        if any(2 * f.numel() != self.rotary_dim for f in self.inv_freq.values()):
            raise UnsupportedModelError("layer types with different rotary dimensions are not supported")
        # on CUDA the element-wise steps run as fused Triton kernels where the family's maths is theirs
        self.fused = fused_ops_available(self.device)

    @property
    def fused_ops(self) -> FusedOps:
        """Which steps run fused now (all False unless ``self.fused``): the kernels compute Llama-style
        RMSNorm, RoPE (whole or partial heads) and SiLU gating; other variants run as PyTorch ops."""
        on = bool(self.fused)
        return FusedOps(norm=on and self.family.norm_style == "llama",
                        rope=on,
                        act=on and self.act_name == "silu")

    @classmethod
    def from_weights(cls, config, get: WeightGetter, *, tied: bool, eos_token_ids: set[int] = frozenset(),
                     tp=None) -> "LlamaFamilyModel":
        """Build from checkpoint tensors read by ``get(name, shape, optional, part)`` (HF names; see
        ``_build``); with ``tp``, only this rank's slices are asked for."""
        check_supported(config)
        shard = tp.shard if tp is not None else Shard()
        check_tensor_parallel(config, shard.size)
        family = family_for(config.model_type)
        split = tp is not None and tp.vocab_parallel and shard.size > 1
        embed, layers, norm, lm_head = _build(config, family, get, tied=tied, shard=shard, vocab_parallel=split)
        vocab = (int(embed.shape[0]) if tied else int(config.vocab_size)) if split else None
        return cls(config, embed, layers, norm, lm_head, set(eos_token_ids) | eos_ids_of(config), tp=tp,
                   vocab_size=vocab)

    @classmethod
    def from_hf(cls, hf_model, *, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None, tp=None) -> "LlamaFamilyModel":
        """Wrap the weights of an HF ``*ForCausalLM`` of a supported family.

        Tensors are shared with ``hf_model`` when device and dtype already match
        (no copy; q/k/v and gate/up are fused, which copies those unless the checkpoint
        stores them fused); drop ``hf_model`` afterwards to free its module wrappers.
        """
        config = text_config_of(hf_model.config)
        check_supported(config)
        state = hf_model.state_dict()
        stored = checkpoint_names(state)

        def get(name: str, shape: tuple, optional: bool, part: Part | None) -> Tensor | None:
            t = state.get(stored(name))
            if t is None:
                if optional:
                    return None
                raise UnsupportedModelError(f"the {config.model_type} model has no weight {name!r}")
            return take(checked_weight(name, t, shape).detach(), part).to(device=device, dtype=dtype)

        in_w = hf_model.get_input_embeddings().weight
        out = hf_model.get_output_embeddings()
        tied = out.weight is in_w or out.weight.data_ptr() == in_w.data_ptr()
        if getattr(out, "bias", None) is not None:
            raise UnsupportedModelError("lm_head with a bias is not supported")
        eos = eos_ids_of(hf_model.config, config, getattr(hf_model, "generation_config", None))
        return cls.from_weights(config, get, tied=tied, eos_token_ids=eos, tp=tp)

    @classmethod
    def random(cls, config, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
               seed: int = 0, std: float = 0.02, tp=None) -> "LlamaFamilyModel":
        """Random weights of a config's real shapes, made directly on ``device`` (benchmarks: speed
        does not depend on the weights). Norms are the identity scale; biases exist where the config asks.
        Each tensor is drawn whole and then sliced, so a tensor-parallel rank (``tp``) holds exactly
        its part of the weights the whole model gets from the same seed."""
        check_supported(config)
        family = family_for(config.model_type)
        gen = torch.Generator(device=device).manual_seed(seed)
        attn_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attn_bias or family.qkv_bias == "always"
        mlp_bias = bool(getattr(config, "mlp_bias", False))

        def get(name: str, shape: tuple, optional: bool, part: Part | None) -> Tensor | None:
            if name.endswith(".bias"):
                on = (qkv_bias and ("_proj.bias" in name and ".self_attn." in name and "o_proj" not in name)) or \
                     (attn_bias and "o_proj" in name) or (mlp_bias and ".mlp." in name)
                if not on:
                    return None
            if name.endswith("norm.weight"):
                raw = 0.0 if family.norm_style == "gemma" else 1.0
                return torch.full(part_shape(shape, part), raw, device=device, dtype=dtype)
            shape = tuple(config.vocab_size if s is None else s for s in shape)
            return take(torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std, part).to(dtype)

        tied = bool(getattr(config, "tie_word_embeddings", False))
        return cls.from_weights(config, get, tied=tied, tp=tp)

    # ------------------------------------------------------------------ forward

    def rope_cos_sin(self, positions: Tensor, key: str | None = None) -> tuple[Tensor, Tensor]:
        """positions [T] int64 -> (cos, sin) each [T, 1, rotary_dim] (HF maths) for the RoPE table
        ``key``: in the model dtype, or fp32 where the family applies RoPE in fp32 (OLMo 2)."""
        freqs = positions[:, None].float() * self.inv_freq[key][None, :]  # [T, rotary_dim // 2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.rope_scaling[key]
        sin = emb.sin() * self.rope_scaling[key]
        dtype = torch.float32 if self.family.rope_fp32 else self.dtype
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, attend: AttendFn,
                logits_rows: Tensor | None = None, gather: bool = True, fp32_logits: bool = True) -> Tensor:
        """Run all layers over packed tokens and return fp32 logits.

        input_ids [T] int64: flat tokens of many sequences.
        positions [T] int64: absolute position of each token within its own sequence.
        attend(layer_idx, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]:
            q/k are after RoPE; k/v are only the new tokens' keys/values -- the caller
            caches them and computes attention (softmax scale ``self.attn_scale``).
            If ``attend.cache(layer_idx)`` exists and returns ``(k_cache, v_cache, slots)``, the
            fused CUDA path writes the keys/values there itself and calls ``attend(i, q, None, None)``.
        logits_rows [R] int64 (optional): rows of T whose logits are wanted (default: all).
        gather: with a head split by vocabulary (``vocab_split``), all-gather the whole logits (every rank
        must call alike); False: this rank's slice ``[R, vocab_split.width]`` (the sampler's input,
        :func:`~treegen.runtime.sampler.pick`). Without a split: ignored.
        fp32_logits: False returns them in the model's dtype, as the LM head computed them (the decode
        step's sampler converts them as it reads: the same values without an fp32 copy of ``[R, vocab]``,
        100 us a step at the Llama-3-8B shape and 256 rows, 427 at 1,024 on an H100).
        Returns [R, vocab] float32 (or the model's dtype).
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [T]; got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        n_tok, nh, nkv, hd = input_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        fused, inter = self.fused_ops, self.intermediate_size
        cache = getattr(attend, "cache", None)
        tables = {key: self.rope_cos_sin(positions, key) for key in self.inv_freq}  # each ([T, 1, R], [T, 1, R])
        flat_tables = {key: (cos[:, 0], sin[:, 0]) for key, (cos, sin) in tables.items()}  # [T, R]: the fused kernel's
        h = F.embedding(input_ids, self.embed)  # [T, hidden]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        y = None  # the output of the previous sub-layer, not yet added to the residual stream h
        for i, L in enumerate(self.layers):
            h, x = self._add_norm(h, y, L.attn_norm, fused.norm)
            qkv = F.linear(x, L.qkv_w, L.qkv_b).view(n_tok, nh + 2 * nkv, hd)
            if L.q_norm is not None:
                self._qk_norm_(qkv, L)
            cos, sin = tables[self.rope_keys[i]]
            if fused.rope and cache is not None:  # RoPE and the KV cache write in one kernel
                rope_(qkv, *flat_tables[self.rope_keys[i]], nh, nkv, store=cache(i))
                o = attend(i, qkv[:, :nh], None, None)
            else:
                if fused.rope:
                    rope_(qkv, *flat_tables[self.rope_keys[i]], nh, nkv)
                    q, k = qkv[:, :nh], qkv[:, nh : nh + nkv]
                else:
                    q, k = self._rope(qkv[:, :nh], cos, sin), self._rope(qkv[:, nh : nh + nkv], cos, sin)
                o = attend(i, q, k, qkv[:, nh + nkv :])  # [T, H, D]
            # (under tensor parallel the sum may be left to the add + norm that reads it next: see _row_parallel)
            y = self._row_parallel(o.reshape(n_tok, nh * hd), L.o_w, L.o_b,
                                   fused.norm and L.attn_post_norm is None and L.mlp_norm is not None)
            if L.attn_post_norm is not None:
                y = self._norm(y, L.attn_post_norm)
            h, x = self._add_norm(h, y, L.mlp_norm, fused.norm)
            gate_up = F.linear(x, L.gate_up_w, L.gate_up_b)
            gated = silu_mul(gate_up) if fused.act else self.act(gate_up[:, :inter]) * gate_up[:, inter:]
            read_by_norm = i + 1 < len(self.layers) and self.layers[i + 1].attn_norm is not None  # (the next layer's)
            y = self._row_parallel(gated, L.down_w, L.down_b, fused.norm and L.mlp_post_norm is None and read_by_norm)
            if L.mlp_post_norm is not None:
                y = self._norm(y, L.mlp_post_norm)
        if y is not None:
            h = h + y
        if logits_rows is not None:
            h = h.index_select(0, logits_rows)  # [R, hidden]
        logits = F.linear(self._norm(h, self.norm), self.lm_head)  # [R, vocab], model dtype
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if gather and self.vocab_split is not None:
            logits = self.vocab_split.gather(logits)  # (in the model dtype: half the bytes of fp32, same values)
        return logits.float() if fp32_logits else logits

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """The family's RMSNorm over the last axis of ``x`` (``weight`` broadcasts; see _Layer)."""
        if self.family.norm_style == "llama":
            return rms_norm(x, weight, self.eps)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * weight).to(x.dtype)

    def _row_parallel(self, x: Tensor, weight: Tensor, bias: Tensor | None, fused_add_norm: bool = False):
        """o and down: under tensor parallel each rank's slice gives a partial sum, summed over the group
        (possibly in the group's peer buffer: read it before the next all-reduce, as ``forward`` does).
        ``fused_add_norm``: the reader is the fused residual add + RMSNorm (:meth:`_add_norm`), which may take
        the sum in its kernel: then a ``PartialSum`` may come back (``TensorParallel.row_parallel``)."""
        if self.tp is None:
            return F.linear(x, weight, bias)
        if fused_add_norm:
            return self.tp.row_parallel(x, weight, bias)
        return self.tp.linear_all_reduce(x, weight, bias)

    def _add_norm(self, h: Tensor, y: Tensor | PartialSum | None, weight: Tensor | None,
                  fused: bool) -> tuple[Tensor, Tensor]:
        """The residual add ``h + y`` (nothing when ``y`` is None) and its norm (the identity when
        ``weight`` is None: a family without that pre-norm): (h, normed). ``y`` may be a tensor-parallel
        ``PartialSum`` (only where ``fused`` and ``weight``: :meth:`_row_parallel`'s ``fused_add_norm``),
        summed in the same kernel as the add and the norm."""
        if not (y is None or isinstance(y, Tensor)):  # the all-reduce, the add and the norm in one kernel
            return h, y.add_rms_norm_(h, weight, self.eps)
        if fused and weight is not None:  # one kernel; adds into h in place
            return h, add_rms_norm(h, y, weight, self.eps)
        h = h if y is None else h + y
        return h, (h if weight is None else self._norm(h, weight))

    def _qk_norm_(self, qkv: Tensor, L: _Layer) -> None:
        """Normalise the query and key heads of ``qkv [T, H + 2 Hkv, D]`` in place: per head with one
        weight for both (``L.qk_norm``), or each over its whole projection (OLMo 2)."""
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if L.qk_norm is not None:  # per head: q and k heads in one call
            qkv[:, : nh + nkv] = self._norm(qkv[:, : nh + nkv], L.qk_norm)
        else:
            flat = qkv.view(qkv.shape[0], -1)
            flat[:, : nh * hd] = self._norm(flat[:, : nh * hd], L.q_norm)
            flat[:, nh * hd : (nh + nkv) * hd] = self._norm(flat[:, nh * hd : (nh + nkv) * hd], L.k_norm)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """HF's RoPE of x [T, heads, D] with cos/sin [T, 1, R]: the first R dims rotate, the rest pass."""
        r = cos.shape[-1]
        out = rope_reference(x if r == x.shape[-1] else x[..., :r], cos, sin)
        if r != x.shape[-1]:
            out = torch.cat([out.to(x.dtype), x[..., r:]], dim=-1)
        return out.to(x.dtype)

    __call__ = forward

    def __repr__(self) -> str:
        fused = [name for name, on in self.fused_ops._asdict().items() if on]
        split = f", tensor_parallel={self.shard.rank}/{self.shard.size}" if self.shard.size > 1 else ""
        if self.vocab_split is not None:
            split += f", lm_head tokens [{self.vocab_split.start}, {self.vocab_split.stop})"
        return (f"LlamaFamilyModel({self.config.model_type}{split}, layers={self.num_layers}, "
                f"heads={self.num_heads}/{self.num_kv_heads}x{self.head_dim}, hidden={self.hidden_size}, "
                f"vocab={self.vocab_size}, dtype={self.dtype}, device={self.device}, "
                f"max_context={self.max_context}, fused={'+'.join(fused) or 'none'})")


def checked_weight(name: str, t: Tensor, shape: tuple) -> Tensor:
    """``t`` if its shape matches ``shape`` (None entries: any size), else a clear error."""
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise UnsupportedModelError(f"weight {name!r} has shape {tuple(t.shape)}, the config implies {want}")
    return t


__all__ = ["AttendFn", "FusedOps", "LlamaFamilyModel", "checked_weight", "eos_ids_of", "rms_norm"]
