"""`marscli train-head`: collect the target's answers (stage 1), train an EAGLE-3 head on them
(stage 2) and write it in the published layout (stage 3). See marscli.training."""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from marscli.config import GenerationOptions, Request, SamplingParams
from marscli.drafters.eagle3_head import default_feature_layers
from marscli.errors import InputError, UsageError
from marscli.io.console import UNIT_COUNT, Log, Progress
from marscli.io.records import read_requests
from marscli.jobs.results import ResultOptions
from marscli.jobs.setup import build_generator, generation_setup
from marscli.training.collect import (
    Answer,
    Answerer,
    CollectSettings,
    FeatureRecorder,
    collect,
    read_manifest,
    read_records,
)
from marscli.training.corpus import build_corpus, corpus_description
from marscli.training.train import TrainSettings, train_head

#: The PROMPTS word for the built-in corpus (marscli.training.corpus).
BUILTIN_CORPUS = "@stdlib"


@dataclass(frozen=True)
class TrainHeadConfig:
    prompts: tuple[str, ...]
    output: str
    target: str | None = None
    data: str | None = None  # default: OUTPUT + ".collect"
    collect_tokens: int = 100_000
    max_tokens: int = 256
    batch_size: int = 8
    draft: str = "ngram"  # a lossless drafter speeds up collection; strict greedy output is the target's
    draft_quant: str | None = None  # a draft model's weights ('int8', ...): speed only, as above
    dtype: str = "auto"
    device: str | None = None
    collect: CollectSettings = field(default_factory=lambda: CollectSettings(256))
    train: TrainSettings = field(default_factory=TrainSettings)
    collect_only: bool = False


def data_dir(cfg: TrainHeadConfig) -> Path:
    return Path(cfg.data) if cfg.data else Path(cfg.output.rstrip("/") + ".collect")


def read_prompts(sources: tuple[str, ...]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Prompt records from JSONL files and/or the built-in corpus -> (records, {source: sha256
    or description}); a bad line is an error naming its file and line."""
    if not sources:
        raise UsageError(f"give prompt files (JSONL) or {BUILTIN_CORPUS} (the built-in corpus)")
    records: list[dict[str, Any]] = []
    described: dict[str, str] = {}
    seen: dict[str, str] = {}
    for src in sources:
        if src == BUILTIN_CORPUS:
            recs = build_corpus()
            d = corpus_description()
            described[src] = f"python {d['python']}, {len(recs)} records"
        else:
            path = Path(src)
            try:
                data = path.read_bytes()
            except OSError as e:
                raise InputError(f"{src}: cannot read prompts: {e.strerror or e}") from None
            described[src] = hashlib.sha256(data).hexdigest()
            recs = []
            for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise InputError(f"{src}:{n}: not JSON: {e}") from None
                if not isinstance(rec, dict) or not ("prompt" in rec or "messages" in rec):
                    raise InputError(f"{src}:{n}: a prompt record needs 'prompt' or 'messages'")
                rec = dict(rec)
                rec["id"] = str(rec.get("id", rec.get("question_id", rec.get("task_id", f"{src}:{n}"))))
                recs.append(rec)
        for rec in recs:
            rid = rec["id"]
            if rid in seen:
                raise InputError(f"{src}: id {rid!r} is also in {seen[rid]}: ids must be unique across prompt sources")
            seen[rid] = src
        records += recs
    return records, described


def answerer(gen) -> Answerer:
    """Answers through a Generator (marscli.jobs.setup): the engine's batching and drafter,
    strict verification, its forward passes recorded (FeatureRecorder); per record (prompt ids
    as the engine encoded them, answer ids, recorded features or None)."""
    model = gen.target.model
    num_layers = int(model.config.num_hidden_layers)
    recorder = FeatureRecorder(gen.engine.drafters, default_feature_layers(num_layers), num_layers)
    gen.engine.use_drafters(recorder)

    def answer(records: list[dict[str, Any]], s: CollectSettings) -> list[Answer | None]:
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        items = list(read_requests(io.BytesIO(data)))
        sampling = SamplingParams(s.temperature, s.top_p, 0, s.max_tokens, s.seed)
        options = ResultOptions(timing=False, token_ids=True)
        got: dict[int, Answer | None] = {}
        try:
            for item, result, _ in gen.results(items, sampling, options):
                ok = isinstance(item, Request) and result.get("error") is None and result.get("token_ids")
                if not ok:
                    got[item.index] = None
                    continue
                ids = gen.engine.prompts.encode(item)
                out = list(result["token_ids"])
                got[item.index] = (ids, out, recorder.take(ids, list(ids) + out))
        finally:
            recorder.clear()
        return [got.get(i) for i in range(len(records))]

    return answer


def run_train_head(cfg: TrainHeadConfig, log: Log, argv: list[str] | None = None) -> int:
    out = Path(cfg.output)
    ddir = data_dir(cfg)
    prompts, described = read_prompts(cfg.prompts)
    log.info(f"{len(prompts)} prompts from {', '.join(cfg.prompts)}; collection in {ddir}")
    t0 = time.perf_counter()
    opts = GenerationOptions(target=cfg.target, draft=cfg.draft, verify="strict", batch_size=cfg.batch_size,
                             draft_quant=cfg.draft_quant, dtype=cfg.dtype, device=cfg.device or "auto",
                             auto_profile=False)
    gen = build_generator(generation_setup(opts), log.info)
    target = gen.target
    load_s = time.perf_counter() - t0
    with Progress(log, cfg.collect_tokens, label="collecting answer tokens", unit=UNIT_COUNT) as bar:
        manifest = collect(target, answerer(gen), prompts, ddir, tokens_wanted=cfg.collect_tokens,
                           settings=cfg.collect, prompt_files=described, chunk=2 * cfg.batch_size, log=log.info,
                           progress=lambda d, t: bar.update(min(d, t), t),
                           runner={"drafter": cfg.draft, "draft_quant": cfg.draft_quant, "batch_size": cfg.batch_size})
    held = sum(s["answer_tokens"] for s in manifest["shards"])
    if cfg.collect_only:
        log.info(f"collected {held} answer tokens in {ddir} (--collect-only: no training)")
        return 0
    records = list(read_records(ddir))
    layers = tuple(manifest["feature_layers"])
    extra = {
        "command": "marscli " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "target": {k: target.identity.get(k) for k in ("name", "source", "sha256", "dtype", "quantization")},
        "corpus": described,
        "collection": {"folder": str(ddir), "records": sum(s["records"] for s in manifest["shards"]),
                       "answer_tokens": held, "tokens": sum(s["tokens"] for s in manifest["shards"]),
                       "prompts_consumed": manifest["prompts_consumed"], "settings": manifest["settings"],
                       "seconds": {k: round(v, 1) for k, v in manifest["seconds"].items()},
                       "recorded": manifest.get("recorded"),
                       # per collecting invocation (collect's runner): a collection resumed
                       # with another drafter than this invocation's is recorded as it ran
                       "runs": manifest.get("runs", [])},
        "load_seconds": round(load_s, 1),
    }
    log.info(f"training on {len(records)} records ({held} answer tokens), settings {asdict(cfg.train)}")
    with Progress(log, None, label="training steps", unit=UNIT_COUNT) as bar:
        record = train_head(target.model, records, layers, out, cfg.train, extra_record=extra, log=log.info,
                            progress=lambda d, t: bar.update(d, t))
    best = record["epochs"][record["best_epoch"] - 1]
    log.info(f"wrote {out} (epoch {record['best_epoch']}"
             + (f", held-out acceptance length {best['heldout_acceptance_length']} at a chain of "
                f"{cfg.train.eval_k}" if "heldout_acceptance_length" in best else "")
             + f"); use it with --draft eagle3:{out}")
    print(json.dumps(record))
    return 0


def check_output(cfg: TrainHeadConfig) -> None:
    """Refuse an output folder that holds something other than a head before any work."""
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {out}: exists and is not a folder")
    if out.is_dir():
        alien = sorted(p.name for p in out.iterdir()
                       if p.name not in ("config.json", "model.safetensors", "pytorch_model.bin", "training.json"))
        if alien:
            raise UsageError(f"-o {out}: the folder holds {alien[0]!r}, not a head marscli wrote; "
                             "choose an empty or new folder")
    ddir = data_dir(cfg)
    if ddir.exists():
        read_manifest(ddir)  # a folder that is not a collection fails here, before loading


__all__ = ["BUILTIN_CORPUS", "TrainHeadConfig", "check_output", "data_dir", "read_prompts", "run_train_head"]
