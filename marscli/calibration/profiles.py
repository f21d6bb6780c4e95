"""Calibration profiles: one YAML file per (target, drafter, rule) holding a calibrated knob
(MARS's theta, or another rule's: ``verification.rule``; mars when absent).

A profile says which weights it was measured on (target identity: sha256 of a GGUF file or a
fingerprint of a model folder, dtype, quantization, device type), with which drafter, which
margin statistic and theta were chosen, by which policy, and the evidence (summary figures,
histogram, trade-off curve, calibration data). `marscli calibrate` writes them;
`marscli generate` picks one up when its target identity matches the loaded target.

Profiles are untrusted input: the loader refuses YAML aliases and duplicate keys, checks
every key against the schema (profile_schema.py; unknown keys are errors), and names the file and the key
path of the first problem. Errors are ProfileError (exit code 2).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from marscli.calibration.profile_schema import (
    MAIN_KNOB,
    RULE_KNOB_KEYS,
    ProfileError,
    validate_profile,
)
from marscli.config import SPANS_OFF, GuardConfig, SpanConfig
from marscli.drafters.kinds import DRAFTERS, EAGLE3, MODEL
from marscli.io.results import atomic_write_text
from marscli.verification.guard import DEFAULT_LOOP_REWIND, DEFAULT_STRICT_FIRST
from marscli.verification.registry import (
    LOGIT_RATIO,
    MARS,
    Rule,
)

PROFILE_SUFFIXES = (".yaml", ".yml")
#: Profiles are small; a bigger file is refused before parsing (untrusted input).
MAX_PROFILE_BYTES = 8 * 1024 * 1024
PROFILE_DIR_ENV = "MARSCLI_PROFILE_DIR"


# --------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases (no billion laughs) and duplicate keys."""

    def compose_node(self, parent, index):  # noqa: D401 - PyYAML hook
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, "YAML aliases are not allowed in profiles", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a plain value", key_node.start_mark) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key].line + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """Block-style mappings, flow-style lists of scalars (histogram counts on one line)."""


def _represent_list(dumper: yaml.SafeDumper, data: list):
    flow = all(not isinstance(x, (dict, list)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def dump_profile(data: dict) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)


# --------------------------------------------------------------------------- Profile


@dataclass(frozen=True)
class Profile:
    """A validated profile and where it came from."""

    data: dict[str, Any]
    path: Path | None
    sha256: str  # of the file's bytes

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def rule_name(self) -> str:
        """The profile's rule: mars in profiles from before issue 14."""
        return self.data["verification"].get("rule", MARS)

    @property
    def rule(self):
        """The calibrated Rule with the profile's knobs (the loop guard is apart:
        ``guard``)."""

        v = self.data["verification"]
        return Rule(self.rule_name, **{k: v[k] for k in RULE_KNOB_KEYS[self.rule_name]})

    @property
    def theta(self) -> float:
        """MARS's theta; a profile of another rule has none (use ``rule``)."""
        if self.rule_name != MARS:
            raise ProfileError(f"{self.describe()}: calibrated for the {self.rule_name} rule, "
                               f"not mars: it has no theta ({self.rule.label()})")
        return self.data["verification"]["theta"]

    @property
    def margin(self) -> str:
        """MARS's margin statistic (logit-ratio for a profile of another rule: unused)."""
        return self.data["verification"].get("margin", LOGIT_RATIO)

    @property
    def knob(self) -> tuple[str, float]:
        """(name, value) of the rule's main knob, as calibrated."""
        name = MAIN_KNOB[self.rule_name]
        return name, self.data["verification"][name]

    @property
    def guard(self):
        """The loop guard the profile was calibrated with (a GuardConfig), or None for a
        profile from before the guard."""

        g = self.data["verification"].get("guard")
        if g is None:
            return None
        try:
            return GuardConfig(g["repeat_ngram"], g["repeat_window"], g["max_relaxed_share"],
                               g.get("strict_first", DEFAULT_STRICT_FIRST), g.get("strict_stops", True),
                               g.get("loop_rewind", DEFAULT_LOOP_REWIND))
        except ValueError as e:
            raise ProfileError(f"{self.describe()}: verification.guard: {e}") from None

    @property
    def spans(self) -> SpanConfig:
        """The strict spans the profile was calibrated with (SPANS_OFF: none, as in every
        profile from before them): generate's default when its command line names none."""
        s = self.data["verification"].get("spans")
        if not s or (not s["strict_in"] and s.get("strict_regex") is None):
            return SPANS_OFF
        return SpanConfig(tuple(s["strict_in"]), s.get("strict_regex"))

    @property
    def target_source(self) -> str | None:
        """What --target the profile implies: None for the embedded default."""
        t = self.data["target"]
        return None if t["kind"] == "embedded" else t["source"]

    @property
    def short_hash(self) -> str:
        return self.sha256[:12]

    def describe(self) -> str:
        where = f" ({self.path})" if self.path is not None else ""
        return f"{self.name}{where}"

    @property
    def speed(self) -> dict[str, Any] | None:
        """The predicted speed section (None in profiles made before it)."""
        return self.data.get("speed")

    def reference(self) -> dict[str, str]:
        """What each result line records about the profile it ran with."""
        return {"name": self.name, "sha256": self.sha256}


def parse_profile(text: bytes | str, source: str, path: Path | None = None) -> Profile:
    """Parse and validate profile text; raise ProfileError naming ``source`` on any problem."""
    raw_bytes = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if len(raw_bytes) > MAX_PROFILE_BYTES:
        raise ProfileError(f"{source}: file too large for a profile ({len(raw_bytes)} bytes)")
    try:
        decoded = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProfileError(f"{source}: not valid UTF-8 (byte {e.start})") from None
    try:
        raw = yaml.load(decoded, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = e.problem or e.context or "invalid YAML"
        raise ProfileError(f"{source}: {where}{problem}") from None
    except (yaml.YAMLError, RecursionError, ValueError, OverflowError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ProfileError(f"{source}: invalid YAML: {msg}") from None
    data = validate_profile(raw, source)
    return Profile(data, path, hashlib.sha256(raw_bytes).hexdigest())


def load_profile(path: str | os.PathLike) -> Profile:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_PROFILE_BYTES + 1)
    except OSError as e:
        raise ProfileError(f"{p}: cannot read profile: {e.strerror or e}") from None
    return parse_profile(raw, str(p), p)


def save_profile(data: dict[str, Any], path: str | os.PathLike) -> Profile:
    """Validate ``data`` and write it atomically (temp file in the same folder, then rename)."""

    text = dump_profile(data)
    prof = parse_profile(text, str(path), Path(path))  # what we write must read back
    atomic_write_text(Path(path), text)
    return prof


# --------------------------------------------------------------------------- where profiles live


def user_profile_dir() -> Path:
    """$MARSCLI_PROFILE_DIR, else ~/.config/marscli/profiles (the platform's config dir)."""
    env = os.environ.get(PROFILE_DIR_ENV)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_config_dir("marscli")) / "profiles"


def packaged_profile_dir() -> Path | None:
    """The profiles shipped with marscli: the checkout's profiles/ or the wheel's copy."""
    package = Path(__file__).resolve().parents[1]  # marscli/
    for cand in (package / "_profiles", package.parent / "profiles"):
        if cand.is_dir():
            return cand
    return None


def profile_dirs() -> list[Path]:
    """Search order: the user's profiles first, then the packaged ones."""
    dirs = [user_profile_dir()]
    packaged = packaged_profile_dir()
    if packaged is not None:
        dirs.append(packaged)
    return dirs


def iter_profile_files(dirs: list[Path] | None = None) -> Iterator[Path]:
    for d in dirs if dirs is not None else profile_dirs():
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if p.suffix in PROFILE_SUFFIXES and p.is_file():
                yield p


def resolve_profile(name_or_path: str) -> Profile:
    """A profile by file path, by file stem or by its ``name`` in the profile dirs."""
    p = Path(name_or_path)
    if p.suffix in PROFILE_SUFFIXES or os.sep in name_or_path or p.exists():
        if not p.exists():
            raise ProfileError(f"{p}: no such profile file")
        return load_profile(p)
    files = list(iter_profile_files())
    for f in files:
        if f.stem == name_or_path:
            return load_profile(f)
    for f in files:
        try:
            prof = load_profile(f)
        except ProfileError:
            continue
        if prof.name == name_or_path:
            return prof
    where = ", ".join(str(d) for d in profile_dirs())
    known = sorted({f.stem for f in files})
    listing = f"; known: {', '.join(known)}" if known else ""
    raise ProfileError(f"no profile named {name_or_path!r} in {where}{listing}")


# --------------------------------------------------------------------------- matching


def identity_for_profile(identity: dict[str, Any]) -> dict[str, Any]:
    """A LoadedModel identity in the profile's target/drafter-model shape."""
    device = str(identity.get("device") or "cpu")
    source = identity.get("source")
    if identity.get("kind") == "embedded" and source:
        source = Path(source).name  # the packaged file; its folder is machine-specific
    return {
        "name": str(identity.get("name")),
        "source": source,
        "kind": str(identity.get("kind")),
        "sha256": identity.get("sha256"),
        "fingerprint": identity.get("fingerprint"),
        "revision": identity.get("revision"),
        "dtype": str(identity.get("dtype")),
        "quantization": identity.get("quantization"),
        "device_type": device.split(":")[0],
    }


def same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Do two identities name the same weights? By sha256, else by folder fingerprint, else
    by hub revision."""
    for key in ("sha256", "fingerprint", "revision"):
        if a.get(key) and b.get(key):
            return a[key] == b[key]
    return False


def drafter_description(kind: str, draft_identity: dict[str, Any] | None, hybrid: bool = False) -> dict[str, Any]:
    return {"kind": kind, "model": identity_for_profile(draft_identity) if draft_identity else None,
            **({"hybrid": True} if hybrid else {})}


def match_problems(profile: Profile, target_identity: dict[str, Any],
                   drafter: dict[str, Any]) -> list[str] | None:
    """None when the profile is for other weights or another drafter; otherwise the list of
    settings that differ (dtype, quantization, device type): [] is a full match."""
    want = identity_for_profile(target_identity)
    prof_target = profile.data["target"]
    if not same_weights(prof_target, want):
        return None
    prof_drafter = profile.data["drafter"]
    if prof_drafter["kind"] != drafter["kind"] or bool(prof_drafter.get("hybrid")) != bool(drafter.get("hybrid")):
        return None
    if DRAFTERS[drafter["kind"]].model:  # a draft model or head: the same weights
        if prof_drafter["model"] is None or drafter["model"] is None:
            return None
        if not same_weights(prof_drafter["model"], drafter["model"]):
            return None
    problems = []
    for key in ("dtype", "quantization", "device_type"):
        if prof_target.get(key) != want.get(key):
            problems.append(f"{key} {prof_target.get(key) or 'none'} (loaded: {want.get(key) or 'none'})")
    return problems


def find_matching_profile(target_identity: dict[str, Any], drafter: dict[str, Any],
                          note: Callable[[str], None] | None = None,
                          rule: str | None = None) -> Profile | None:
    """The profile for this target and drafter: user dir first, then packaged; newest first
    within a dir. Profiles for the same weights calibrated under another dtype, quantization
    or device type are not used, and ``note`` says why. ``rule``: only profiles of that rule
    (None: of any rule, the newest)."""
    note = note or (lambda _msg: None)
    for d in profile_dirs():
        candidates = []
        for f in iter_profile_files([d]):
            try:
                prof = load_profile(f)
            except ProfileError as e:
                note(f"skipping profile {e}")
                continue
            problems = match_problems(prof, target_identity, drafter)
            if problems is None or (rule is not None and prof.rule_name != rule):
                continue
            if problems:
                note(f"profile {prof.describe()} is for these weights but was calibrated with "
                     f"{'; '.join(problems)}: not used")
                continue
            candidates.append(prof)
        if candidates:
            return max(candidates, key=lambda p: str(p.data["created_at"]))
    return None


def default_profile_name(target_name: str, drafter_kind: str, draft_name: str | None,
                         dtype: str, quantization: str | None, rule: str = MARS) -> str:
    """A file-name-safe profile name, e.g. smollm2-135m-instruct.ngram.float32; a rule other
    than mars is appended (smollm2-135m-instruct.ngram.float32.ratio), so that profiles of
    several rules for one target and drafter live side by side."""
    drafter = drafter_kind
    if drafter_kind == MODEL and draft_name:
        drafter = draft_name
    elif drafter_kind == EAGLE3 and draft_name:
        drafter = f"eagle3-{draft_name}"
    parts = [target_name, drafter, dtype]
    if quantization:
        parts.append(quantization)
    if rule != MARS:
        parts.append(rule)
    slug = ".".join(re.sub(r"[^a-z0-9]+", "-", str(x).lower()).strip("-") for x in parts)
    return slug or "profile"
