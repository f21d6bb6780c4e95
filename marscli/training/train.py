"""Stage 2 of train-head: fit an EAGLE-3 head to a recorded collection; stage 3: write it.

The head (marscli.drafters.eagle3_head.Eagle3Head) is shaped like one decoder layer of its
target (hidden size, heads, MLP width), reads the target's frozen input embeddings (so the
checkpoint carries none and vLLM and SGLang share the target's), and drafts over a reduced
vocabulary: the D most frequent tokens of the collected answers (ties: the lower id), with
EAGLE-3's ``d2t``/``t2d`` maps. Its ``lm_head`` starts from the target's output rows of
those tokens and its final norm from the target's; ``fc`` and the decoder layer start at
random (std 0.02, norms 1). The objective is marscli.training.ttt's (forward KL, training-time
test unrolled ``ttt_steps`` passes). AdamW, linear warm-up then cosine decay, gradient
clipping at 0.5; batches are whole records, packed up to a token budget, in an order that
depends only on the seed.

Held out: every ``holdout``-th record (by its position in the collection) is never trained
on; after each epoch the head's simulated acceptance length on them is measured
(marscli.training.ttt.walk: strict greedy with a fixed chain of ``eval_k`` drafts, the
figure the drafter reports when the recorded answers are the target's greedy text). The
head of the best epoch is the one written.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from marscli.drafters.eagle3_files import random_head, read_head, save_head
from marscli.drafters.eagle3_head import AUX_LAYERS_KEY, Eagle3Head, default_feature_layers
from marscli.errors import InputError, ModelLoadError
from marscli.training.collect import Record
from marscli.training.ttt import Batch, WalkStats, chain_matches, empty_walk, ttt_loss, walk

TRAINING_RECORD = "training.json"


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 4
    draft_vocab: int = 8192
    ttt_steps: int = 4
    lr: float = 5e-4
    tokens_per_batch: int = 4096
    warmup: float = 0.05  # share of the steps
    weight_decay: float = 0.0
    clip: float = 0.5
    holdout: int = 20  # every holdout-th record is held out (0: none)
    eval_k: int = 4
    seed: int = 0
    save_dtype: str = "bfloat16"
    init: str | None = None  # a head folder to start from (same target, layers and draft vocabulary)


def draft_vocabulary(records: list[Record], size: int, vocab: int) -> list[int]:
    """The `size` most frequent answer tokens (ties: lower id first), filled up with the
    lowest unused ids when the answers hold fewer distinct tokens; sorted."""
    if not 0 < size <= vocab:
        raise InputError(f"--draft-vocab must be in 1..{vocab} (the target's vocabulary), got {size}")
    counts: Counter[int] = Counter()
    for r in records:
        counts.update(r.tokens[r.prompt_len:].tolist())
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    if len(chosen) < size:
        have = set(chosen)
        chosen += [t for t in range(vocab) if t not in have][: size - len(chosen)]
    return sorted(chosen)


def init_head(target_model, vocab_ids: list[int], layers: tuple[int, ...], seed: int) -> Eagle3Head:
    """A head for target_model over vocab_ids: random fc and decoder layer, lm_head and final
    norm from the target, embeddings shared with the target (frozen)."""
    head = random_head(target_model, seed=seed, draft_vocab=vocab_ids, feature_layers=tuple(layers))
    head.cfg.raw.pop(AUX_LAYERS_KEY, None)  # written below only when not EAGLE-3's default
    if tuple(layers) != default_feature_layers(int(target_model.config.num_hidden_layers)):
        head.cfg.raw[AUX_LAYERS_KEY] = list(layers)
    with torch.no_grad():
        w = target_model.get_output_embeddings().weight
        head.lm_head.weight.copy_(w[torch.tensor(vocab_ids)].to(head.lm_head.weight.dtype))
        norm = getattr(target_model.get_decoder(), "norm", None)
        w_norm = getattr(norm, "weight", None)
        if w_norm is not None and w_norm.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight.to(head.norm.weight.dtype))
    return head.float()


def make_batch(records: list[Record], vocab_ids: torch.Tensor, in_draft: torch.Tensor,
               lm_rows: torch.Tensor) -> Batch:
    """Records -> a right-padded Batch; p is the target's softmax over the draft vocabulary,
    recomputed from the recorded final hidden states (lm_rows: [D, H] the target's output
    rows of the draft tokens)."""
    L = max(int(r.tokens.numel()) for r in records)
    B = len(records)
    F = records[0].features.shape[1]
    feats = torch.zeros(B, L, F)
    toks = torch.zeros(B, L, dtype=torch.long)
    final = torch.zeros(B, L, lm_rows.shape[1])
    top_in = torch.zeros(B, L, dtype=torch.bool)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, r in enumerate(records):
        n = int(r.tokens.numel())
        feats[b, :n] = r.features.float()
        toks[b, :n] = r.tokens.long()
        final[b, :n] = r.final.float()
        top_in[b, :n] = in_draft[r.top1.long()]
        # the distribution after position i predicts token i+1: count it for the answer's tokens
        mask[b, max(r.prompt_len - 1, 0): n - 1] = True
    p = torch.softmax(final @ lm_rows.T.float(), -1)  # [B, L, D]
    return Batch(feats, toks, p, top_in, mask)


def batches(records: list[Record], tokens_per_batch: int, rng: random.Random) -> list[list[Record]]:
    """Whole records packed into batches of at most tokens_per_batch padded tokens (a longer
    record is a batch of its own), records in a seeded random order, sorted by length within
    windows so that padding stays small."""
    order = list(range(len(records)))
    rng.shuffle(order)
    window = 64
    out: list[list[Record]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: int(records[i].tokens.numel()))
        cur: list[int] = []
        for i in chunk:
            n = int(records[i].tokens.numel())
            longest = max([n] + [int(records[j].tokens.numel()) for j in cur])
            if cur and longest * (len(cur) + 1) > tokens_per_batch:
                out.append([records[j] for j in cur])
                cur = []
            cur.append(i)
        if cur:
            out.append([records[j] for j in cur])
    rng.shuffle(out)
    return out


@torch.no_grad()
def simulated_acceptance(head: Eagle3Head, records: list[Record], k: int) -> WalkStats:
    """Strict greedy acceptance with a fixed chain of k, replayed on each record (see ttt.walk)."""
    total = empty_walk(k)
    head.eval()
    for r in records:
        if r.prompt_len < 2 or r.answer_tokens < 1:
            continue
        m = chain_matches(head, r.features.float()[None], r.tokens.long()[None], k)[0].tolist()
        total = total.add(walk(m, r.prompt_len, int(r.tokens.numel()), k))
    return total


def read_init(folder: Path, target_model, layers: tuple[int, ...], draft_vocab: int) -> Eagle3Head:
    """The head --init starts from: the same target and feature layers, a draft vocabulary of
    the asked size (training keeps its vocabulary, whatever the collection now holds), else
    InputError."""
    try:
        old = read_head(folder, target_model, torch.float32, torch.device("cpu"))
    except ModelLoadError as e:
        raise InputError(f"--init {folder}: {e}") from None
    if tuple(old.feature_layers) != tuple(layers):
        raise InputError(f"--init {folder}: reads target layers {list(old.feature_layers)}, not {list(layers)}")
    if old.cfg.draft_vocab_size != draft_vocab:
        raise InputError(f"--init {folder}: drafts over another vocabulary size ({old.cfg.draft_vocab_size} "
                         f"tokens, not --draft-vocab {draft_vocab})")
    return old


def train_head(target_model, records: list[Record], layers: tuple[int, ...], out_dir: Path,
               settings: TrainSettings, *, extra_record: dict[str, Any] | None = None,
               log: Callable[[str], None] = lambda _m: None,
               progress: Callable[[int, int], None] = lambda _d, _t: None) -> dict[str, Any]:
    """Train on `records`, write the best epoch's head to out_dir in the published layout and
    its training record (``training.json``); return that record."""
    if not records:
        raise InputError("no recorded sequences to train on")
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    vocab = int(target_model.get_output_embeddings().weight.shape[0])
    k = settings.holdout
    held = [r for i, r in enumerate(records) if k and i % k == k - 1]
    train = [r for i, r in enumerate(records) if not (k and i % k == k - 1)]
    if not train:
        raise InputError("every record is held out: collect more, or lower --holdout")
    start = None
    if settings.init:
        start = read_init(Path(settings.init), target_model, tuple(layers), min(settings.draft_vocab, vocab))
        vocab_ids = start.to_target(torch.arange(start.cfg.draft_vocab_size)).tolist()
    else:
        vocab_ids = draft_vocabulary(train, min(settings.draft_vocab, vocab), vocab)
    ids_t = torch.tensor(vocab_ids)
    in_draft = torch.zeros(vocab, dtype=torch.bool)
    in_draft[ids_t] = True
    lm_rows = target_model.get_output_embeddings().weight[ids_t].detach().float()
    head = init_head(target_model, vocab_ids, layers, settings.seed)
    if start is not None:
        with torch.no_grad():
            head.load_state_dict(start.state_dict(), strict=True)
        log(f"starting from the head in {settings.init} (and its draft vocabulary)")
    params = [p for p in head.parameters() if p.requires_grad]
    head.train().requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    plan = [batches(train, settings.tokens_per_batch, rng) for _ in range(settings.epochs)]
    total_steps = sum(len(p) for p in plan)
    warm = max(1, int(settings.warmup * total_steps))

    def lr_at(step: int) -> float:
        if step < warm:
            return settings.lr * (step + 1) / warm
        frac = (step - warm) / max(1, total_steps - warm)
        return settings.lr * 0.5 * (1 + math.cos(math.pi * frac))

    epochs: list[dict[str, Any]] = []
    best: tuple[float, dict[str, torch.Tensor]] | None = None
    step = 0
    t_start = time.perf_counter()
    base_eval = simulated_acceptance(head, held, settings.eval_k) if held else None
    if base_eval is not None:
        log(f"held out {len(held)} records; before training: simulated acceptance length "
            f"{base_eval.acceptance_length:.3f} at a chain of {settings.eval_k}")
    for e, plan_e in enumerate(plan):
        t0 = time.perf_counter()
        head.train()
        sums = {"loss": 0.0, "tokens": 0}
        pass_top1 = [0.0] * settings.ttt_steps
        pass_n = [0] * settings.ttt_steps
        for group in plan_e:
            batch = make_batch(group, ids_t, in_draft, lm_rows)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, stats = ttt_loss(head, batch, settings.ttt_steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, settings.clip)
            opt.step()
            step += 1
            n = int(batch.loss_mask.sum())
            sums["loss"] += float(loss.detach()) * n
            sums["tokens"] += n
            for s in stats:
                pass_top1[s["pass"]] += s["top1"] * s["entries"]
                pass_n[s["pass"]] += s["entries"]
            progress(step, total_steps)
        train_s = time.perf_counter() - t0
        row: dict[str, Any] = {
            "epoch": e + 1, "train_loss": round(sums["loss"] / max(1, sums["tokens"]), 4),
            "train_top1_per_pass": [round(a / n, 4) if n else None
                                    for a, n in zip(pass_top1, pass_n, strict=True)],
            "train_seconds": round(train_s, 1),
        }
        score = -row["train_loss"]
        if held:
            t1 = time.perf_counter()
            ev = simulated_acceptance(head, held, settings.eval_k)
            row.update({"heldout_acceptance_length": round(ev.acceptance_length, 4),
                        "heldout_accepted_per_position": ev.accepted_per_position,
                        "heldout_drafted_per_position": ev.drafted_per_position,
                        "eval_seconds": round(time.perf_counter() - t1, 1)})
            score = ev.acceptance_length
        epochs.append(row)
        log(f"epoch {e + 1}/{settings.epochs}: loss {row['train_loss']}, top-1 per pass "
            f"{row['train_top1_per_pass']}"
            + (f", held-out acceptance length {row['heldout_acceptance_length']}" if held else "")
            + f" ({train_s:.0f} s)")
        if best is None or score > best[0]:
            best = (score, {k: v.detach().clone() for k, v in head.state_dict().items()})
    assert best is not None
    head.load_state_dict(best[1])
    head.eval().requires_grad_(False)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[settings.save_dtype]
    out_dir.mkdir(parents=True, exist_ok=True)
    save_head(head, out_dir, dtype=dtype, extra_config={"torch_dtype": settings.save_dtype})
    best_epoch = max(range(len(epochs)), key=lambda i: epochs[i].get("heldout_acceptance_length",
                                                                     -epochs[i]["train_loss"])) + 1
    record = {
        "settings": asdict(settings), "feature_layers": list(layers), "draft_vocab": len(vocab_ids),
        "train_records": len(train), "heldout_records": len(held),
        "train_answer_tokens": sum(r.answer_tokens for r in train),
        "heldout_answer_tokens": sum(r.answer_tokens for r in held),
        "heldout_acceptance_length_before": round(base_eval.acceptance_length, 4) if base_eval else None,
        "epochs": epochs, "best_epoch": best_epoch, "seconds": round(time.perf_counter() - t_start, 1),
        **(extra_record or {}),
    }
    tmp = out_dir / (TRAINING_RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out_dir / TRAINING_RECORD)
    return record


__all__ = ["TRAINING_RECORD", "TrainSettings", "batches", "draft_vocabulary", "init_head", "make_batch",
           "simulated_acceptance", "train_head"]
