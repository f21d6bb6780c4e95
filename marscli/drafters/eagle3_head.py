"""EAGLE-3 draft heads (Li et al., arXiv 2503.01840): checkpoint format, module, loading.

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
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from marscli.errors import ModelLoadError
from marscli.io.results import usual_file_mode
from marscli.models.fastpath import folded_gqa
from marscli.models.quant import output_rows
from marscli.models.sources import KIND_DIR, fingerprint_or_none, resolve_source

DRAFT_PREFIX = "eagle3:"
CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
BIN_FILE = "pytorch_model.bin"
WEIGHT_FILES = (SAFETENSORS_FILE, BIN_FILE)
#: vLLM's config key for the target layers that feed fc (input of those decoder layers).
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"
#: Accepted spellings of the decoder layer's prefix, the published one first.
LAYER_PREFIXES = ("midlayer.", "layers.0.")
#: Keys a checkpoint may carry that hold nothing the head needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


# --------------------------------------------------------------------------------------------
# Loading and saving


@dataclass
class LoadedHead:
    """An EAGLE-3 head ready to draft for its target (the draft side of a LoadedModel)."""

    head: Eagle3Head
    identity: dict[str, Any]
    device: torch.device

    @property
    def model(self) -> Eagle3Head:
        return self.head

    @property
    def name(self) -> str:
        return str(self.identity.get("name"))


def parse_draft_source(draft: str) -> str | None:
    """'eagle3:PATH' -> PATH; anything else -> None."""
    if draft.startswith(DRAFT_PREFIX):
        return draft[len(DRAFT_PREFIX):]
    return None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(path))
        sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one message
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise ModelLoadError(f"EAGLE-3 head {path}: cannot read weights: {first}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ModelLoadError(f"EAGLE-3 head {path}: not a state dict of tensors")
    return sd


def _target_width(model) -> int:
    return output_rows(model)


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def check_head(sd: dict[str, torch.Tensor], cfg: HeadConfig, target_model, where: str,
               config_where: str) -> tuple[tuple[int, ...], dict[str, torch.Tensor]]:
    """Check a head's weights against its config and its target; return (feature layers,
    the state dict under the published key names). Raises ModelLoadError naming the file
    and the key of the first problem."""
    # Accept the converters' "layers.0." spelling of "midlayer.".
    norm: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        for p in LAYER_PREFIXES[1:]:
            if k.startswith(p):
                k = LAYER_PREFIXES[0] + k[len(p):]
        norm[k] = v
    sd = norm

    t_cfg = target_model.config
    t_hidden = int(t_cfg.hidden_size)
    t_layers = int(t_cfg.num_hidden_layers)
    t_vocab = _target_width(target_model)
    layers = cfg.feature_layers or default_feature_layers(t_layers)
    bad = [i for i in layers if not 0 <= i < t_layers]
    if bad:
        raise ModelLoadError(f"{config_where}: {AUX_LAYERS_KEY} names layer {bad[0]} but the target "
                             f"has {t_layers} layers")

    if "fc.weight" not in sd:
        raise ModelLoadError(f"EAGLE-3 head {where}: missing key 'fc.weight'")
    fc_in = int(sd["fc.weight"].shape[-1])
    if cfg.target_hidden_size is not None and cfg.target_hidden_size != t_hidden:
        raise ModelLoadError(f"{config_where}: target_hidden_size is {cfg.target_hidden_size} but "
                             f"the target's hidden size is {t_hidden}: this head is for another target")
    shapes = expected_shapes(cfg, len(layers) * t_hidden)
    for key, shape in shapes.items():
        if key not in sd:
            raise ModelLoadError(f"EAGLE-3 head {where}: missing key {key!r}")
        got = tuple(sd[key].shape)
        if got != shape:
            if key == "fc.weight" and got[:1] == shape[:1]:
                raise ModelLoadError(
                    f"EAGLE-3 head {where}: 'fc.weight' takes {fc_in} target features but this "
                    f"target gives {len(layers)} layers x hidden size {t_hidden} = {shape[1]}: "
                    "the head was trained for another target (hidden size or layer count)")
            raise ModelLoadError(f"EAGLE-3 head {where}: {key!r} has shape {list(got)}, expected "
                                 f"{list(shape)} from {CONFIG_FILE}")
    if cfg.vocab_size != t_vocab:
        raise ModelLoadError(f"{config_where}: vocab_size is {cfg.vocab_size} but the target's "
                             f"logits have {t_vocab} entries: this head is for another vocabulary")

    if "embed_tokens.weight" in sd:
        got = tuple(sd["embed_tokens.weight"].shape)
        if got != (cfg.vocab_size, cfg.hidden_size):
            raise ModelLoadError(f"EAGLE-3 head {where}: 'embed_tokens.weight' has shape {list(got)}, "
                                 f"expected {[cfg.vocab_size, cfg.hidden_size]}")
    else:
        emb = target_model.get_input_embeddings().weight
        if emb.shape[1] != cfg.hidden_size:
            raise ModelLoadError(
                f"EAGLE-3 head {where}: no 'embed_tokens.weight' and the head's hidden size "
                f"{cfg.hidden_size} differs from the target's {emb.shape[1]}, so the target's "
                "embeddings cannot stand in")

    D, V = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" in sd:
        d2t = sd["d2t"]
        if tuple(d2t.shape) != (D,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise ModelLoadError(f"EAGLE-3 head {where}: 'd2t' must be [{D}] integers "
                                 f"(draft_vocab_size), got {d2t.dtype} {_shape(d2t)}")
        tgt = torch.arange(D) + d2t.long()
        if D and (int(tgt.min()) < 0 or int(tgt.max()) >= V):
            i = int(((tgt < 0) | (tgt >= V)).nonzero()[0])
            raise ModelLoadError(f"EAGLE-3 head {where}: 'd2t' maps draft token {i} to {int(tgt[i])}, "
                                 f"outside the target vocabulary (0..{V - 1})")
        if D > 1 and not bool((tgt[1:] > tgt[:-1]).all()):
            i = int((tgt[1:] <= tgt[:-1]).nonzero()[0]) + 1
            raise ModelLoadError(f"EAGLE-3 head {where}: 'd2t' is not increasing at draft token {i} "
                                 "(two draft tokens map to the same target token, or out of order)")
    elif D != V:
        raise ModelLoadError(f"EAGLE-3 head {where}: missing key 'd2t' (draft_vocab_size {D} "
                             f"differs from vocab_size {V}, so the draft-to-target map is needed)")
    else:
        tgt = torch.arange(D)
    if "t2d" in sd:
        t2d = sd["t2d"]
        if tuple(t2d.shape) != (V,):
            raise ModelLoadError(f"EAGLE-3 head {where}: 't2d' has shape {_shape(t2d)}, expected [{V}]")
        mask = t2d.bool()
        if int(mask.sum()) != D or not bool(mask[tgt].all()):
            raise ModelLoadError(f"EAGLE-3 head {where}: 't2d' does not mark exactly the {D} target "
                                 "tokens that 'd2t' maps to")

    known = set(shapes) | {"embed_tokens.weight", "d2t", "t2d"}
    extra = sorted(k for k in sd if k not in known and not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise ModelLoadError(f"EAGLE-3 head {where}: unexpected key {extra[0]!r}"
                             + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else "")
                             + "; not an EAGLE-3 head in the published format?")
    return tuple(layers), sd


def build_head(sd: dict[str, torch.Tensor], cfg: HeadConfig, target_model,
               layers: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """An Eagle3Head holding the (checked) state dict, on the target's device and dtype."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    own_embed = "embed_tokens.weight" in sd
    shared = None if own_embed else target_model.get_input_embeddings()
    n_features = len(layers) * int(target_model.config.hidden_size)
    with torch.device("meta"):  # no random init of weights that are overwritten at once
        head = Eagle3Head(cfg, n_features, layers, shared_embed=shared)
    head.to(dtype).to_empty(device=device)
    full = dict(sd)
    if "d2t" not in full:
        full["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "t2d" not in full:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + full["d2t"].long()] = True
        full["t2d"] = t2d
    full["d2t"] = full["d2t"].long()
    full["t2d"] = full["t2d"].bool()
    head.load_state_dict(full, strict=True)
    head.rotary = LlamaRotaryEmbedding(cfg.llama_config()).to(device)
    head.requires_grad_(False)
    return head.eval()


def resolve_head_folder(source: str) -> tuple[Path, str, str, str | None]:
    """A head source (folder or hub id from the local cache) -> (folder, name, kind, revision)."""

    if source.lower().endswith(".gguf"):
        raise ModelLoadError(f"EAGLE-3 head {source}: a .gguf file is not an EAGLE-3 head; pass the "
                             "head's folder (config.json + model.safetensors or pytorch_model.bin)")
    resolved = resolve_source(source, "EAGLE-3 head")
    if resolved.path.is_file():
        raise ModelLoadError(f"EAGLE-3 head {source} is a file; pass the head's folder")
    return resolved.path, resolved.name, resolved.kind if resolved.kind != KIND_DIR else "dir", resolved.revision


def load_head(source: str, target, *, log=None) -> LoadedHead:
    """Load an EAGLE-3 head for `target` (a LoadedModel); ModelLoadError on any mismatch."""
    folder, name, kind, revision = resolve_head_folder(source)
    emb = target.model.get_input_embeddings().weight
    head = read_head(folder, target.model, emb.dtype, emb.device)
    if log:
        log(f"EAGLE-3 head {name}: hidden {head.cfg.hidden_size}, draft vocabulary "
            f"{head.cfg.draft_vocab_size}/{head.cfg.vocab_size}, features from target layers "
            f"{list(head.feature_layers)}")
    identity = {
        "name": name, "source": source, "kind": kind, "sha256": None,
        "fingerprint": fingerprint_or_none(folder), "revision": revision,
        "dtype": str(emb.dtype).removeprefix("torch."), "quantization": None,
        "device": str(emb.device), "format": "eagle3",
    }
    return LoadedHead(head, identity, emb.device)


def read_head(folder: Path, target_model, dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """The head in a local folder, checked against target_model (an nn.Module) and built in
    dtype on device; ModelLoadError on any mismatch."""
    cfg_path = folder / CONFIG_FILE
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"EAGLE-3 head {cfg_path}: cannot read config: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"EAGLE-3 head {cfg_path}: not a JSON object")
    cfg = HeadConfig.from_dict(raw, f"EAGLE-3 head {cfg_path}")
    weights = next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)
    if weights is None:
        raise ModelLoadError(f"EAGLE-3 head {folder}: no {' or '.join(WEIGHT_FILES)}")
    sd = _read_weights(weights)
    layers, sd = check_head(sd, cfg, target_model, str(weights), f"EAGLE-3 head {cfg_path}")
    return build_head(sd, cfg, target_model, layers, dtype, device)


def save_head(head: Eagle3Head, folder: str | Path, *, fmt: str = "safetensors",
              extra_config: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write a head in the published format (config.json + model.safetensors or
    pytorch_model.bin). extra_config: keys to add to or drop from (value None) config.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(head.cfg.raw)
    cfg.update({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": head.cfg.hidden_size, "intermediate_size": head.cfg.intermediate_size,
        "num_attention_heads": head.cfg.num_heads, "num_key_value_heads": head.cfg.num_kv_heads,
        "head_dim": head.cfg.head_dim, "rms_norm_eps": head.cfg.rms_norm_eps,
        "hidden_act": head.cfg.hidden_act, "vocab_size": head.cfg.vocab_size,
        "draft_vocab_size": head.cfg.draft_vocab_size,
    })
    for k, v in (extra_config or {}).items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    sd = {k: (v.to(dtype) if dtype is not None and v.dtype.is_floating_point else v).detach().cpu().contiguous()
          for k, v in head.state_dict().items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(folder / SAFETENSORS_FILE))
        os.chmod(folder / SAFETENSORS_FILE, usual_file_mode())
    elif fmt == "bin":
        torch.save(sd, str(folder / BIN_FILE))
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return folder


def random_head(target_model, *, seed: int = 0, hidden_size: int | None = None,
                intermediate_size: int | None = None, num_heads: int | None = None,
                num_kv_heads: int | None = None, draft_vocab: list[int] | None = None,
                own_embedding: bool = False, feature_layers: tuple[int, ...] | None = None,
                std: float = 0.02) -> Eagle3Head:
    """A randomly initialised head shaped for `target_model` (for tests and for fitting).

    draft_vocab: the target ids of the reduced draft vocabulary (sorted); None: the full
    target vocabulary. feature_layers: None uses EAGLE-3's default rule.
    """
    t = target_model.config
    H = hidden_size or t.hidden_size
    V = _target_width(target_model)
    ids = sorted(draft_vocab) if draft_vocab is not None else list(range(V))
    raw = {"hidden_size": H, "intermediate_size": intermediate_size or t.intermediate_size,
           "num_attention_heads": num_heads or t.num_attention_heads,
           "num_key_value_heads": num_kv_heads or getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
           "rms_norm_eps": getattr(t, "rms_norm_eps", 1e-6), "hidden_act": "silu",
           "vocab_size": V, "draft_vocab_size": len(ids),
           "max_position_embeddings": getattr(t, "max_position_embeddings", 2048),
           "rope_theta": float(getattr(t, "rope_theta", None) or
                               (getattr(t, "rope_parameters", None) or {}).get("rope_theta", 10000.0))}
    if H != t.hidden_size:
        raw["target_hidden_size"] = t.hidden_size
    if feature_layers is not None:
        raw[AUX_LAYERS_KEY] = list(feature_layers)
    cfg = HeadConfig.from_dict(raw, "<random head>")
    layers = feature_layers or default_feature_layers(t.num_hidden_layers)
    gen = torch.Generator().manual_seed(seed)
    embed = None if own_embedding else target_model.get_input_embeddings()
    if embed is None and H != t.hidden_size:
        raise ValueError("a head narrower or wider than its target needs its own embedding")
    head = Eagle3Head(cfg, len(layers) * t.hidden_size, layers, shared_embed=embed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        d = torch.tensor(ids, dtype=torch.long)
        head.d2t.copy_(d - torch.arange(len(ids)))
        head.t2d.zero_()
        head.t2d[d] = True
    return head.to(target_model.get_input_embeddings().weight.dtype).eval()


__all__ = [
    "Eagle3Head", "FeatureTap", "HeadConfig", "LoadedHead", "check_head", "default_feature_layers",
    "load_head", "parse_draft_source", "random_head", "read_head", "save_head",
]
