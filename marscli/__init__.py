"""marscli: offline speculative decoding with margin-aware verification (MARS).

`marscli.load(...)` returns an object whose `generate(records)` gives the result dicts that
`marscli generate` writes (see marscli.api). It is imported on first use, so `import marscli`
stays light (no torch).
"""

from __future__ import annotations

from typing import Any

from marscli._version import __version__

#: Public names served lazily from marscli.api.
_API = ("load", "LLM")


def __getattr__(name: str) -> Any:
    if name in _API:
        from marscli import api

        return getattr(api, name)
    raise AttributeError(f"module 'marscli' has no attribute {name!r}")


__all__ = ["__version__", *_API]
