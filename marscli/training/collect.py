"""Stage 1 of train-head: the target answers prompts, and what a head learns from is recorded.

The target generates through marscli's own engine (batched, plain decoding of the target or
any lossless drafter: strict greedy output is the target's greedy output whatever drafts it),
and the generating forward passes themselves are recorded (``FeatureRecorder`` wraps the
engine's drafter, as EAGLE-3 drafting taps the target): for every position the target ran on,
the hidden states entering the head's feature layers (EAGLE-3: 2, L//2, L-3) and its final
(normed) hidden state, from which training recomputes the target's logits on the draft
vocabulary (so no vocabulary-wide logits are stored), and the target's top-1 token after
every position (greedy answers: the next answer token; prompt positions and sampled answers:
the output layer over the recorded final state). The target thus runs once. The answer's
last token is never fed to the target: its row of ``features`` and ``final`` is zeros and its
``top1`` is -1 (training never reads them: the last position predicts nothing).

A record the engine's passes could not be matched to (none so far; the count is in the
manifest) is recorded with one teacher-forced pass over prompt + answer instead
(``record_sequence``), which also fills the last position. Earlier collections were all
recorded that way: on the embedded model at batch 16 that pass took 33% of the collection's
time (1,316 s of 3,973 s for 164,807 answer tokens).

On disk, DATA/ holds ``manifest.json`` and shards ``shard-NNNNN.safetensors`` of whole
records, each shard with

=================  ==============================  ================================================
key                shape, dtype                    what
=================  ==============================  ================================================
``tokens``         [N] int32                       every record's prompt + answer, concatenated
``offsets``        [R+1] int64                     record r is tokens[offsets[r]:offsets[r+1]]
``prompt_lens``    [R] int32                       its prompt's length (the answer follows)
``features``       [N, F] bfloat16                 hidden states entering the feature layers
``final``          [N, H] bfloat16                 the decoder's output (after the final norm)
``top1``           [N] int32                       the target's top-1 token after each position
                                                   (-1: not recorded, the last position)
=================  ==============================  ================================================

``manifest.json``: format version, the target's identity, feature layers, hidden size, the
generation settings and the prompt files' sha256 (a run with other settings is refused, not
mixed in), the number of prompts consumed so far (resume continues after them), per shard
its record and token counts, the seconds spent generating and recording (the teacher-forced
passes, and the output layer over prompt positions), and ``recorded``: how many records came
from the engine's own passes and how many from a teacher-forced pass. A run stops
once the recorded answer tokens reach the asked number; run it again with a larger number
to collect more.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from marscli.drafters.eagle3_head import FeatureTap, default_feature_layers
from marscli.errors import InputError
from marscli.io.results import usual_file_mode

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_PATTERN = "shard-{:05d}.safetensors"
STORE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class CollectSettings:
    """What decides the recorded data (a resumed run must match them)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed}


@dataclass
class Record:
    """One recorded sequence."""

    tokens: torch.Tensor  # [L] int
    prompt_len: int
    features: torch.Tensor  # [L, F]
    final: torch.Tensor  # [L, H]
    top1: torch.Tensor  # [L] int

    @property
    def answer_tokens(self) -> int:
        return int(self.tokens.numel()) - self.prompt_len


def read_manifest(data_dir: Path) -> dict[str, Any] | None:
    path = data_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read the collection's manifest: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise InputError(f"{path}: not a train-head collection manifest (format version {FORMAT_VERSION})")
    return doc


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


@torch.inference_mode()
def output_top1(model, final: torch.Tensor) -> torch.Tensor:
    """The target's top-1 token after each of `final`'s positions ([S, H] normed hidden
    states), through its output layer a slice at a time (vocabulary-wide logits): [S] int32."""
    lm = model.get_output_embeddings()
    out = torch.empty(final.shape[0], dtype=torch.int32)
    for s in range(0, final.shape[0], 256):
        h = final[s:s + 256].to(device=lm.weight.device, dtype=lm.weight.dtype)
        out[s:s + 256] = lm(h).argmax(-1).to(torch.int32).cpu()
    return out


@torch.inference_mode()
def record_sequence(model, tap: FeatureTap, ids: list[int], prompt_len: int) -> Record:
    """One teacher-forced decoder pass over ids -> the recorded Record."""
    dev = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    decoder = model.get_decoder()
    with tap.capture():
        final = decoder(input_ids=x).last_hidden_state[0]  # [L, H], normed
    feats = tap.features[0]
    top1 = output_top1(model, final)
    return Record(torch.tensor(ids, dtype=torch.int32), prompt_len, feats.to(STORE_DTYPE).cpu(),
                  final.to(STORE_DTYPE).cpu(), top1)


def record_from_features(model, ids: list[int], prompt_len: int, feats: torch.Tensor, *,
                         greedy: bool) -> Record:
    """A Record from what the engine's own passes captured: feats [len(ids) - 1, F + H], the
    feature layers' inputs then the final norm's output, for every position but the last
    (see the module's docstring). greedy: the answer is the target's greedy one, so the top-1
    after an answer position is the next token; the output layer gives the rest."""
    n = len(ids)
    H = int(model.config.hidden_size)
    assert feats.shape[0] == n - 1 and feats.shape[1] > H, (tuple(feats.shape), n, H)
    zero = feats.new_zeros(1, feats.shape[1])
    rows = torch.cat([feats.to(STORE_DTYPE).cpu(), zero.to(STORE_DTYPE).cpu()])
    final = rows[:, -H:].contiguous()
    top1 = torch.full((n,), -1, dtype=torch.int32)
    known = prompt_len - 1 if greedy else n - 1  # positions whose top-1 the output layer gives
    if greedy:
        top1[prompt_len - 1: n - 1] = torch.tensor(ids[prompt_len:], dtype=torch.int32)
    if known > 0:
        top1[:known] = output_top1(model, final[:known])
    return Record(torch.tensor(ids, dtype=torch.int32), prompt_len, rows[:, :-H].contiguous(), final, top1)


@dataclass
class _RecordedRow:
    """One engine row as FeatureRecorder sees it: its prompt, the feature rows the passes
    captured at its committed positions (in order), and its committed sequence so far."""

    prompt_ids: list[int]
    chunks: list[torch.Tensor] = field(default_factory=list)
    seq: list[int] | None = None


class FeatureRecorder:
    """A BatchedDrafter that drafts with `inner` and records, row by row, the target features
    the engine's passes computed at the row's committed positions: the inputs of `layers` and
    the final norm's output (FeatureTap's id ``num_layers``). Install it with
    ``Engine.use_drafters``; after a job, ``take`` hands each finished record's features over.
    An inner drafter that reads features itself (EAGLE-3) gets its own columns."""

    def __init__(self, inner, layers: tuple[int, ...], num_layers: int):
        self.inner = inner
        self.n_inner = len(inner.feature_layers)
        self.feature_layers = tuple(inner.feature_layers) + tuple(layers) + (num_layers,)
        self.tree = inner.tree
        self.rows: list[_RecordedRow] = []  # per active engine row
        self.finished: dict[tuple[int, ...], list[_RecordedRow]] = {}

    def __getattr__(self, name: str):  # the job corpus, hybrid curves...: the inner drafter's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _finish(self, row: _RecordedRow) -> None:
        if row.chunks:
            self.finished.setdefault(tuple(row.prompt_ids), []).append(row)

    def reset(self) -> None:
        for row in self.rows:
            self._finish(row)
        self.rows = []
        self.inner.reset()

    def add_row(self, prompt_ids, sampling) -> None:
        self.rows.append(_RecordedRow(list(prompt_ids)))
        self.inner.add_row(prompt_ids, sampling)

    def add_rows(self, prompts, samplings) -> None:
        self.rows.extend(_RecordedRow(list(p)) for p in prompts)
        self.inner.add_rows(prompts, samplings)

    def keep(self, rows: list[int]) -> None:
        kept = set(rows)
        for b, row in enumerate(self.rows):
            if b not in kept:
                self._finish(row)
        self.rows = [self.rows[b] for b in rows]
        self.inner.keep(rows)

    def offers(self, seqs, k_caps):
        return self.inner.offers(seqs, k_caps)

    def propose(self, seqs, ks, bonus=False):
        return self.inner.propose(seqs, ks, bonus)

    def propose_tree(self, row, seq, max_path):
        return self.inner.propose_tree(row, seq, max_path)

    def observe(self, row: int, features: torch.Tensor) -> None:
        width = features.shape[1] // len(self.feature_layers)
        if self.n_inner:
            self.inner.observe(row, features[:, : self.n_inner * width])
        self.rows[row].chunks.append(features[:, self.n_inner * width:].to(STORE_DTYPE).cpu())

    def accepted(self, row: int, proposed: int, accepted: int, seq: list[int]) -> None:
        self.rows[row].seq = seq
        self.inner.accepted(row, proposed, accepted, seq)

    def rewind(self, row: int, seq: list[int]) -> None:
        raise NotImplementedError("train-head records strict runs: they never rewind")

    def take(self, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor | None:
        """The recorded features of the finished record whose prompt is prompt_ids and whose
        committed tokens start with `tokens` (prompt + answer): [len(tokens) - 1, F + H], or
        None when no finished row matches (the caller records it another way)."""
        rows = self.finished.get(tuple(prompt_ids), [])
        for i, row in enumerate(rows):
            got = sum(int(c.shape[0]) for c in row.chunks)
            if got >= len(tokens) - 1 and (row.seq is None or list(row.seq[: len(tokens)]) == list(tokens)):
                rows.pop(i)
                return torch.cat(row.chunks)[: len(tokens) - 1]
        return None

    def clear(self) -> None:
        """Forget the finished rows not taken (records that failed, restarted rows)."""
        self.finished = {}


def write_shard(path: Path, records: list[Record]) -> dict[str, int]:
    from safetensors.torch import save_file

    lengths = [int(r.tokens.numel()) for r in records]
    offsets = torch.zeros(len(records) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    sd = {
        "tokens": torch.cat([r.tokens for r in records]).contiguous(),
        "offsets": offsets,
        "prompt_lens": torch.tensor([r.prompt_len for r in records], dtype=torch.int32),
        "features": torch.cat([r.features for r in records]).contiguous(),
        "final": torch.cat([r.final for r in records]).contiguous(),
        "top1": torch.cat([r.top1 for r in records]).contiguous(),
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(sd, str(tmp))
    os.chmod(tmp, usual_file_mode())
    os.replace(tmp, path)
    return {"records": len(records), "tokens": int(offsets[-1]),
            "answer_tokens": sum(r.answer_tokens for r in records)}


def read_records(data_dir: Path) -> Iterator[Record]:
    """Every recorded sequence of a collection, in order."""
    from safetensors.torch import load_file

    doc = read_manifest(data_dir)
    if doc is None:
        raise InputError(f"{data_dir}: no {MANIFEST}: not a train-head collection (run train-head to collect)")
    for shard in doc["shards"]:
        path = data_dir / shard["file"]
        try:
            sd = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - any unreadable shard is one message
            raise InputError(f"{path}: cannot read the shard: {e}") from None
        off = sd["offsets"].tolist()
        for r in range(len(off) - 1):
            a, b = off[r], off[r + 1]
            yield Record(sd["tokens"][a:b], int(sd["prompt_lens"][r]), sd["features"][a:b],
                         sd["final"][a:b], sd["top1"][a:b])


#: Answers a chunk of prompt records: per record (prompt ids, answer ids, the features the
#: engine's passes recorded or None) or None (the record failed: too long for the context, no
#: chat template, ...).
Answer = tuple[list[int], list[int], torch.Tensor | None]
Answerer = Callable[[list[dict[str, Any]], CollectSettings], list[Answer | None]]


def collect(target, answer: Answerer, prompts: list[dict[str, Any]], data_dir: Path, *, tokens_wanted: int,
            settings: CollectSettings, prompt_files: dict[str, str], chunk: int = 64,
            log: Callable[[str], None] = lambda _m: None,
            progress: Callable[[int, int], None] = lambda _done, _want: None,
            runner: dict[str, Any] | None = None) -> dict[str, Any]:
    """Answer `prompts` (JSONL record dicts) after the ones already consumed with `answer`
    (the target, through marscli's engine: marscli.jobs.train_head), record the answers of
    `target` (a LoadedModel) into data_dir until `tokens_wanted` answer tokens are held, and
    return the manifest. Resumable: the manifest is rewritten after every shard.

    runner: how this invocation answers (drafter, draft weights, batch size: speed only, the
    answers are the target's either way). Each invocation that answers prompts appends it to
    the manifest's ``runs`` with the prompts it consumed and the answer tokens it added, so a
    collection resumed with another drafter says which run collected what."""
    model = target.model
    layers = default_feature_layers(int(model.config.num_hidden_layers))
    data_dir.mkdir(parents=True, exist_ok=True)
    doc = read_manifest(data_dir)
    fresh = {"version": FORMAT_VERSION, "target": target.identity, "feature_layers": list(layers),
             "hidden_size": int(model.config.hidden_size), "settings": settings.to_dict(),
             "prompt_files": prompt_files}
    if doc is None:
        doc = {**fresh, "prompts_consumed": 0, "shards": [], "seconds": {"generate": 0.0, "record": 0.0},
               "recorded": {"engine": 0, "teacher_forced": 0}}
    else:
        for key in ("feature_layers", "hidden_size", "settings", "prompt_files"):
            if doc.get(key) != fresh[key]:
                raise InputError(f"{data_dir / MANIFEST}: collected with other {key} ({doc.get(key)!r}, now "
                                 f"{fresh[key]!r}); use another --data folder or the same settings")
        old_t, new_t = doc["target"], target.identity
        if (old_t.get("sha256"), old_t.get("name")) != (new_t.get("sha256"), new_t.get("name")):
            raise InputError(f"{data_dir / MANIFEST}: collected from target {old_t.get('name')!r}, not "
                             f"{new_t.get('name')!r}")
    doc.setdefault("recorded", {"engine": 0, "teacher_forced": sum(s["records"] for s in doc["shards"])})
    tap = FeatureTap(model, layers)
    greedy = settings.temperature == 0
    have = sum(s["answer_tokens"] for s in doc["shards"])
    progress(have, tokens_wanted)
    start = doc["prompts_consumed"]
    have_before, run = have, None
    if have >= tokens_wanted:
        log(f"collection holds {have} answer tokens (>= {tokens_wanted}): nothing to collect")
    elif start >= len(prompts):
        log(f"all {len(prompts)} prompts are consumed ({have} answer tokens held): give more prompts "
            "for more data")
    while have < tokens_wanted and start < len(prompts):
        batch = prompts[start:start + chunk]
        t0 = time.perf_counter()
        answers = answer(batch, settings)
        t1 = time.perf_counter()
        records = []
        for got in answers:
            if got is None or not got[1]:
                continue  # a record that cannot be prompted (too long, no template) adds nothing
            ids, out, feats = got
            seq = list(ids) + list(out)
            if feats is not None:
                records.append(record_from_features(model, seq, len(ids), feats, greedy=greedy))
                doc["recorded"]["engine"] += 1
            else:
                records.append(record_sequence(model, tap, seq, len(ids)))
                doc["recorded"]["teacher_forced"] += 1
        t2 = time.perf_counter()
        start += len(batch)
        if records:
            name = SHARD_PATTERN.format(len(doc["shards"]))
            info = write_shard(data_dir / name, records)
            doc["shards"].append({"file": name, **info})
            have += info["answer_tokens"]
        doc["prompts_consumed"] = start
        if run is None:
            run = {**(runner or {}), "prompts": [start - len(batch), start], "answer_tokens": 0}
            doc.setdefault("runs", []).append(run)
        run["prompts"][1] = start
        run["answer_tokens"] = have - have_before
        doc["seconds"]["generate"] += t1 - t0
        doc["seconds"]["record"] += t2 - t1
        _write_json(data_dir / MANIFEST, doc)
        progress(have, tokens_wanted)
        log(f"collected {have} answer tokens from {start} prompts (generate {t1 - t0:.1f} s, "
            f"record {t2 - t1:.1f} s)")
    return doc


__all__ = ["Answer", "Answerer", "CollectSettings", "FORMAT_VERSION", "FeatureRecorder", "Record", "collect",
           "read_manifest", "read_records", "record_from_features", "record_sequence", "write_shard"]
