"""EAGLE-3 heads shipped with marscli: one folder per target, in the published layout
(config.json + model.safetensors) with the ``training.json`` that train-head wrote (how it was
trained, and for which target). ``--draft eagle3`` without a path uses the head shipped for
the target, matched by the target file's sha256 when both are known, else by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HEADS_DIR = Path(__file__).parent


def shipped_heads(root: Path = HEADS_DIR) -> list[tuple[Path, dict[str, Any]]]:
    """(folder, the target it was trained for) of every shipped head."""
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        rec = folder / "training.json"
        if not (folder / "config.json").is_file() or not rec.is_file():
            continue
        try:
            target = json.loads(rec.read_text()).get("target") or {}
        except (OSError, ValueError):
            continue
        found.append((folder, target))
    return found


def shipped_head_for(identity: dict[str, Any], root: Path = HEADS_DIR) -> Path | None:
    """The shipped head trained for a target of this identity, or None."""
    for folder, target in shipped_heads(root):
        a, b = target.get("sha256"), identity.get("sha256")
        if (a and b and a == b) or (not (a and b) and target.get("name") == identity.get("name")):
            return folder
    return None


__all__ = ["HEADS_DIR", "shipped_head_for", "shipped_heads"]
