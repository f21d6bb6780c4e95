"""Stage 1 of train-head: the target answers prompts, and what a head learns from is recorded.

The target generates through marscli's own engine (batched, plain decoding of the target or
any lossless drafter: strict greedy output is the target's greedy output whatever drafts it).
Each finished answer is then recorded with one teacher-forced pass of the target's decoder
over prompt + answer: the hidden states entering the head's feature layers (EAGLE-3: 2, L//2,
L-3), the target's top-1 token after every position, and its final (normed) hidden state,
from which training recomputes the target's logits on the draft vocabulary (so no
vocabulary-wide logits are stored). The target thus runs twice; the recording pass is a
prefill, cheap on a GPU but compute-bound on a CPU: on the embedded model at batch 16 it took
42% of the generation's time (34.8 s against 81.9 s for 6,081 answer tokens). Recording
inside the engine's own forwards (as EAGLE-3 drafting already taps them) would save it; the
manifest keeps both times.

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
=================  ==============================  ================================================

``manifest.json``: format version, the target's identity, feature layers, hidden size, the
generation settings and the prompt files' sha256 (a run with other settings is refused, not
mixed in), the number of prompts consumed so far (resume continues after them), per shard
its record and token counts, and the seconds spent generating and recording. A run stops
once the recorded answer tokens reach the asked number; run it again with a larger number
to collect more.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from marscli.drafters.eagle3_head import FeatureTap, default_feature_layers, usual_file_mode
from marscli.errors import InputError

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
def record_sequence(model, tap: FeatureTap, ids: list[int], prompt_len: int) -> Record:
    """One teacher-forced decoder pass over ids -> the recorded Record."""
    dev = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    decoder = model.get_decoder()
    with tap.capture():
        final = decoder(input_ids=x).last_hidden_state[0]  # [L, H], normed
    feats = tap.features[0]
    lm = model.get_output_embeddings()
    top1 = torch.empty(len(ids), dtype=torch.int32)
    for s in range(0, len(ids), 256):  # the vocabulary-wide logits, a slice at a time
        top1[s:s + 256] = lm(final[s:s + 256].to(lm.weight.dtype)).argmax(-1).to(torch.int32).cpu()
    return Record(torch.tensor(ids, dtype=torch.int32), prompt_len, feats.to(STORE_DTYPE).cpu(),
                  final.to(STORE_DTYPE).cpu(), top1)


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
    usual_file_mode(tmp)
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


#: Answers a chunk of prompt records: per record (prompt ids, answer ids) or None (the record
#: failed: too long for the context, no chat template, ...).
Answerer = Callable[[list[dict[str, Any]], CollectSettings], list[tuple[list[int], list[int]] | None]]


def collect(target, answer: Answerer, prompts: list[dict[str, Any]], data_dir: Path, *, tokens_wanted: int,
            settings: CollectSettings, prompt_files: dict[str, str], chunk: int = 64,
            log: Callable[[str], None] = lambda _m: None,
            progress: Callable[[int, int], None] = lambda _done, _want: None) -> dict[str, Any]:
    """Answer `prompts` (JSONL record dicts) after the ones already consumed with `answer`
    (the target, through marscli's engine: marscli.jobs.train_head), record the answers of
    `target` (a LoadedModel) into data_dir until `tokens_wanted` answer tokens are held, and
    return the manifest. Resumable: the manifest is rewritten after every shard."""
    model = target.model
    layers = default_feature_layers(int(model.config.num_hidden_layers))
    data_dir.mkdir(parents=True, exist_ok=True)
    doc = read_manifest(data_dir)
    fresh = {"version": FORMAT_VERSION, "target": target.identity, "feature_layers": list(layers),
             "hidden_size": int(model.config.hidden_size), "settings": settings.to_dict(),
             "prompt_files": prompt_files}
    if doc is None:
        doc = {**fresh, "prompts_consumed": 0, "shards": [], "seconds": {"generate": 0.0, "record": 0.0}}
    else:
        for key in ("feature_layers", "hidden_size", "settings", "prompt_files"):
            if doc.get(key) != fresh[key]:
                raise InputError(f"{data_dir / MANIFEST}: collected with other {key} ({doc.get(key)!r}, now "
                                 f"{fresh[key]!r}); use another --data folder or the same settings")
        old_t, new_t = doc["target"], target.identity
        if (old_t.get("sha256"), old_t.get("name")) != (new_t.get("sha256"), new_t.get("name")):
            raise InputError(f"{data_dir / MANIFEST}: collected from target {old_t.get('name')!r}, not "
                             f"{new_t.get('name')!r}")
    tap = FeatureTap(model, layers)
    have = sum(s["answer_tokens"] for s in doc["shards"])
    progress(have, tokens_wanted)
    start = doc["prompts_consumed"]
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
            ids, out = got
            records.append(record_sequence(model, tap, list(ids) + list(out), len(ids)))
        t2 = time.perf_counter()
        start += len(batch)
        if records:
            name = SHARD_PATTERN.format(len(doc["shards"]))
            info = write_shard(data_dir / name, records)
            doc["shards"].append({"file": name, **info})
            have += info["answer_tokens"]
        doc["prompts_consumed"] = start
        doc["seconds"]["generate"] += t1 - t0
        doc["seconds"]["record"] += t2 - t1
        _write_json(data_dir / MANIFEST, doc)
        progress(have, tokens_wanted)
        log(f"collected {have} answer tokens from {start} prompts (generate {t1 - t0:.1f} s, "
            f"record {t2 - t1:.1f} s)")
    return doc


__all__ = ["CollectSettings", "FORMAT_VERSION", "Record", "collect", "read_manifest", "read_records",
           "record_sequence", "write_shard", "Answerer"]
