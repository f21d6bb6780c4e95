"""EAGLE-3 head checkpoints on disk: reading, checking against a target, writing, and a random
head for tests and the GPU check. The format (keys, shapes, config.json fields) is described in
marscli.drafters.eagle3_head, with the module it loads into.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from marscli.drafters.eagle3_head import AUX_LAYERS_KEY, Eagle3Head, HeadConfig, default_feature_layers, expected_shapes
from marscli.errors import ModelLoadError
from marscli.io.results import usual_file_mode
from marscli.models.quant import output_rows
from marscli.models.sources import KIND_DIR, fingerprint_or_none, resolve_source

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
BIN_FILE = "pytorch_model.bin"
WEIGHT_FILES = (SAFETENSORS_FILE, BIN_FILE)
#: Accepted spellings of the decoder layer's prefix, the published one first.
LAYER_PREFIXES = ("midlayer.", "layers.0.")
#: Keys a checkpoint may carry that hold nothing the head needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
