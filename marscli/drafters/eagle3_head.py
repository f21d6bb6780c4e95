"""EAGLE-3 draft heads (Li et al., arXiv 2503.01840): checkpoint format and module (reading,
checking and writing a checkpoint: marscli.drafters.eagle3_files).

An EAGLE-3 head is one decoder layer that drafts from the target's own hidden states. At
committed position j it reads two things:

- the target's features at j: the hidden states *entering* three target decoder layers
  (low, middle, high), concatenated, ``[3 * H_target]``, projected by ``fc`` to ``[H]``;
- the embedding of token j+1 (the token the target chose after position j).

Its output at j predicts token j+2. Drafting further, the head feeds its own output hidden
state (skipping ``fc``) with the embedding of the token it just drafted. Head position j is
committed position j (the head's sequence starts one token later than the target's).

Published checkpoint format (SafeAILab/EAGLE ``eagle/model/cnets.py``; what vLLM and SGLang
load too), a folder with ``config.json`` and ``model.safetensors`` or ``pytorch_model.bin``:

====================================================  ==============================
key                                                   shape
====================================================  ==============================
``fc.weight``                                         [H, n_layers * H_target]
``midlayer.input_layernorm.weight``                   [H]  (norms the token embedding)
``midlayer.hidden_norm.weight``                       [H]  (norms the fused features)
``midlayer.self_attn.{q,k,v}_proj.weight``            [heads|kv_heads * head_dim, 2H]
``midlayer.self_attn.o_proj.weight``                  [H, heads * head_dim]
``midlayer.post_attention_layernorm.weight``          [H]
``midlayer.mlp.{gate,up}_proj.weight``                [I, H]
``midlayer.mlp.down_proj.weight``                     [H, I]
``norm.weight``                                       [H]
``lm_head.weight``                                    [draft_vocab_size, H]
``d2t``                                               [draft_vocab_size] int64 offsets
``t2d``                                               [vocab_size] bool
``embed_tokens.weight`` (optional)                    [vocab_size, H]
====================================================  ==============================

q/k/v read ``input_layernorm(embedding) ‖ hidden_norm(features)`` (2H); the residual of the
attention block is the un-normed projected features. Draft token i of the reduced vocabulary
is target token ``i + d2t[i]``; ``t2d[t]`` says whether target token t is in the draft
vocabulary. Without ``embed_tokens.weight`` the head uses the target's input embeddings
(so H must equal the target's hidden size). ``d2t``/``t2d`` may be missing when
``draft_vocab_size == vocab_size`` (identity map). ``layers.0.`` is accepted for
``midlayer.`` (the naming some converters use).

config.json: Llama fields (``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``hidden_act``, ``vocab_size``,
``rope_theta``, ``rope_scaling``, ``max_position_embeddings``) plus ``draft_vocab_size`` and,
when the head is narrower or wider than its target, ``target_hidden_size``. Which target layers
feed ``fc``: EAGLE-3 takes the hidden states entering layers 2, L//2 and L-3 of an L-layer
target (in layer order, each once); a config may name others with
``eagle_aux_hidden_state_layer_ids`` (top level or under ``eagle_config``, vLLM's key).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from marscli.errors import ModelLoadError
from marscli.models.fastpath import folded_gqa

#: vLLM's config key for the target layers that feed fc (input of those decoder layers).
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states EAGLE-3 fuses: 2, L//2 and L-3, in layer
    order, each once (the published training code's rule; a shallow target gets fewer)."""
    picks = {2, num_layers // 2, num_layers - 3}
    return tuple(i for i in range(num_layers) if i in picks)


# --------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class HeadConfig:
    """The fields of an EAGLE-3 config.json that shape the head."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int | None
    feature_layers: tuple[int, ...] | None  # None: default_feature_layers(target layers)
    raw: dict[str, Any]  # the whole config.json (rope settings and the rest)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> HeadConfig:
        def need(key: str) -> int:
            if key not in d:
                raise ModelLoadError(f"{where}: missing {key!r} (not an EAGLE-3 head config?)")
            v = d[key]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ModelLoadError(f"{where}: {key!r} must be a positive integer, got {v!r}")
            return v

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        inter = need("intermediate_size")
        vocab = need("vocab_size")
        draft_vocab = d.get("draft_vocab_size", vocab)
        if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= vocab:
            raise ModelLoadError(f"{where}: 'draft_vocab_size' must be an integer in 1..vocab_size "
                                 f"({vocab}), got {draft_vocab!r}")
        kv = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or hidden // heads
        if heads % kv:
            raise ModelLoadError(f"{where}: num_attention_heads ({heads}) is not a multiple of "
                                 f"num_key_value_heads ({kv})")
        layers = d.get(AUX_LAYERS_KEY)
        if layers is None and isinstance(d.get("eagle_config"), dict):
            layers = d["eagle_config"].get(AUX_LAYERS_KEY)
        if layers is not None:
            if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
                raise ModelLoadError(f"{where}: {AUX_LAYERS_KEY!r} must be a list of layer indices, got {layers!r}")
            layers = tuple(layers)
        act = d.get("hidden_act", "silu")
        return cls(
            hidden_size=hidden, intermediate_size=inter, num_heads=heads, num_kv_heads=kv,
            head_dim=head_dim, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), hidden_act=act,
            vocab_size=vocab, draft_vocab_size=draft_vocab,
            target_hidden_size=d.get("target_hidden_size"), feature_layers=layers, raw=dict(d),
        )

    def llama_config(self):
        """A LlamaConfig carrying the rope, norm and MLP settings (for transformers' pieces)."""
        from transformers import LlamaConfig

        keep = {k: v for k, v in self.raw.items()
                if k in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                         "partial_rotary_factor")}
        return LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, hidden_act=self.hidden_act,
            vocab_size=self.vocab_size, num_hidden_layers=1, **keep,
        )


def expected_shapes(cfg: HeadConfig, n_features: int) -> dict[str, tuple[int, ...]]:
    """Required checkpoint keys and their shapes (n_features: the fc input width)."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    m = "midlayer."
    return {
        "fc.weight": (H, n_features),
        m + "input_layernorm.weight": (H,),
        m + "hidden_norm.weight": (H,),
        m + "self_attn.q_proj.weight": (q, 2 * H),
        m + "self_attn.k_proj.weight": (kv, 2 * H),
        m + "self_attn.v_proj.weight": (kv, 2 * H),
        m + "self_attn.o_proj.weight": (H, q),
        m + "post_attention_layernorm.weight": (H,),
        m + "mlp.gate_proj.weight": (inter, H),
        m + "mlp.up_proj.weight": (inter, H),
        m + "mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
    }


# --------------------------------------------------------------------------------------------
# The module


class _Attention(nn.Module):
    """Self-attention over [embedding ‖ features] (2H in) with its own small KV cache."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        H = cfg.hidden_size
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * H, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None, into=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, 2H]; past: keys, values [B, kv_heads, T, hd]; mask [B|1, 1, S, T+S] bool
        (True: attend) or None (every new entry sees everything cached and every earlier new
        entry: plain causal). into: (keys, values [B, kv, L, hd], at [B, S]): instead of past,
        row b's new entries are written at positions at[b] of these buffers (the slot cache of
        marscli.drafters.eagle3_slots) and attention reads all L of them through `mask`
        [B, 1, S, L]. Shared key/value heads are read in place (the query groups folded into
        the query axis: marscli.models.fastpath.folded_gqa), never copied per query head.
        Returns (out [B, S, H], k [B, kv, S, hd], v [B, kv, S, hd])."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if into is not None:
            keys, values, at = into
            index = at[:, None, :, None].expand(B, self.nkv, S, self.hd)
            keys.scatter_(2, index, k)
            values.scatter_(2, index, v)
        else:
            keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        T = keys.shape[2] - S
        if mask is None and S > 1:
            causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
            mask = torch.cat([torch.ones(S, T, dtype=torch.bool, device=x.device), causal], 1)[None, None]
        if mask is not None and mask.shape[0] != B:
            mask = mask.expand(B, *mask.shape[1:])
        att = folded_gqa(q, keys, values, mask, None)  # [B, S, nh, hd]
        out = self.o_proj(att.reshape(B, S, self.nh * self.hd))
        return out, k, v


class _MidLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        H = cfg.hidden_size
        self.input_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.llama_config())


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head; its parameter and buffer names are the checkpoint's keys.

    shared_embed: the target's input embedding, used when the checkpoint has no
    ``embed_tokens.weight``. It is held outside the module tree, so it is neither in the
    head's state dict nor touched by the head's .to()/.to_empty().
    """

    def __init__(self, cfg: HeadConfig, n_features: int, feature_layers: tuple[int, ...],
                 shared_embed: nn.Embedding | None = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        self.cfg = cfg
        self.feature_layers = tuple(feature_layers)
        H = cfg.hidden_size
        self.fc = nn.Linear(n_features, H, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        if shared_embed is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        object.__setattr__(self, "_shared_embed", shared_embed)
        self.rotary = LlamaRotaryEmbedding(cfg.llama_config())

    @property
    def own_embedding(self) -> bool:
        return self._shared_embed is None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self._shared_embed is None else self._shared_embed
        return table(tokens.to(table.weight.device)).to(self.dtype)

    @property
    def n_features(self) -> int:
        return self.fc.in_features

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None, *, target_features: bool, into=None):
        """One pass of the head.

        hidden: [B, S, n_features] target features (target_features=True: projected by fc)
        or [B, S, H] the head's own earlier outputs (target_features=False); tokens [B, S]
        target token ids (the token after each position);
        positions [B, S] head positions; past / mask / into: see _Attention.forward.
        Returns (out [B, S, H] pre-norm output hidden states, k, v [B, kv, S, hd]).
        """
        assert hidden.dim() == 3 and tokens.shape == hidden.shape[:2] == positions.shape, (
            tuple(hidden.shape), tuple(tokens.shape), tuple(positions.shape))
        hidden = hidden.to(self.dtype)
        if target_features:
            assert hidden.shape[-1] == self.n_features, (tuple(hidden.shape), self.n_features)
            hidden = self.fc(hidden)
        emb = self.embed(tokens)
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        cos, sin = self.rotary(hidden, positions)
        att, k, v = layer.self_attn(x, cos, sin, past, mask, into)
        h = hidden + att
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, k, v

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., H] output hidden -> [..., draft_vocab] logits (float32)."""
        return self.lm_head(self.norm(out)).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target token ids (i + d2t[i])."""
        return draft_ids + self.d2t[draft_ids]

    def target_probs(self, q_draft: torch.Tensor, vocab: int) -> torch.Tensor:
        """[..., draft_vocab] distribution -> [..., vocab] over target ids (0 outside the
        draft vocabulary)."""
        out = q_draft.new_zeros(q_draft.shape[:-1] + (vocab,))
        idx = self.to_target(torch.arange(q_draft.shape[-1], device=q_draft.device))
        out[..., idx] = q_draft
        return out


# --------------------------------------------------------------------------------------------
# Target features


def decoder_layers(model) -> nn.ModuleList:
    """The decoder layers of a causal LM (Llama-style model.model.layers and the like)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ModelLoadError(f"cannot find the decoder layers of {type(model).__name__}: "
                             "EAGLE-3 heads need a Llama-style target (model.layers)")
    return layers


class FeatureTap:
    """Captures the hidden states entering chosen decoder layers during the target's own
    forward passes (forward pre-hooks, registered only for the duration of a capture), so the
    verification pass yields the head's features: no second target pass.

    Layer id ``len(layers)`` (one past the last layer) stands for the decoder's output after
    its final norm, the hidden state the output layer reads (train-head records it)."""

    def __init__(self, model, layer_ids: tuple[int, ...]):
        self.layers = decoder_layers(model)
        self.layer_ids = tuple(layer_ids)
        self.norm = None
        if len(self.layers) in self.layer_ids:
            inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
            self.norm = getattr(inner, "norm", None)
            if self.norm is None:
                raise ModelLoadError(f"cannot find the final norm of {type(model).__name__} (model.norm)")
        self.features: torch.Tensor | None = None  # [B, S, len(layer_ids) * H], last capture

    @contextlib.contextmanager
    def capture(self) -> Iterator[FeatureTap]:
        got: dict[int, torch.Tensor] = {}
        final = len(self.layers)

        def hook_for(i: int):
            def hook(_module, args, kwargs):
                got[i] = args[0] if args else kwargs["hidden_states"]
            return hook

        def norm_hook(_module, _args, output):
            got[final] = output

        handles = [self.layers[i].register_forward_pre_hook(hook_for(i), with_kwargs=True)
                   for i in sorted(set(self.layer_ids)) if i != final]
        if self.norm is not None:
            handles.append(self.norm.register_forward_hook(norm_hook))
        self.features = None
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
        if len(got) == len(set(self.layer_ids)):
            dev = got[self.layer_ids[-1]].device  # layers may sit on several GPUs (device_map)
            self.features = torch.cat([got[i].to(dev) for i in self.layer_ids], dim=-1)


__all__ = ["AUX_LAYERS_KEY", "Eagle3Head", "FeatureTap", "HeadConfig", "decoder_layers", "default_feature_layers",
           "expected_shapes"]
