"""marscli train-head (marscli.training): the training-time-test objective against a loss
computed the way drafting runs the head; the simulated acceptance length against what the
drafter measures; the whole command on a tiny 8-layer target (collect, resume, train, the
published layout, strict greedy with the trained head equal to plain decoding); the built-in
corpus; the shipped-head lookup.

The tiny target's output layer is scaled up so that its next-token distributions are peaked
like a trained model's (a random model's are nearly flat, and a head learns nothing from them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from marscli.config import DraftConfig, SamplingParams, VerifyConfig
from marscli.drafters.eagle3_files import load_head, random_head
from marscli.drafters.eagle3_head import FeatureTap
from marscli.engine import build_engine
from marscli.heads import shipped_head_for
from marscli.training.collect import CollectSettings, collect, read_records
from marscli.training.corpus import build_corpus, passages
from marscli.training.train import TrainSettings, make_batch, simulated_acceptance, train_head
from marscli.training.ttt import STEP_DECAY, chain_matches, pass_mask, ttt_loss, unrolled_logits, walk
from tests.oracles import hf_greedy

LAYERS = 8
SHARPEN = 12.0  # scale of the tiny target's lm_head: peaked next-token distributions
PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello marscli; the cat sat on the mat.",
    "one two three four five six seven eight nine ten",
    "a margin aware rule",
    "speculative decoding drafts tokens",
    "def add(a, b): return a + b",
    "print the sum of the numbers",
    "the head reads the target's hidden states",
]
MAX_NEW = 24


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_factory, tiny_tokenizer) -> Path:
    from transformers import LlamaForCausalLM

    path = tiny_factory(tmp_path_factory.mktemp("th-target"), seed=3, layers=LAYERS, tokenizer=tiny_tokenizer)
    model = LlamaForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    model.save_pretrained(str(path))
    return path


def plain_answer(target, prompt: str, max_new: int = MAX_NEW) -> tuple[list[int], list[int]]:
    ids = target.tokenizer(prompt).input_ids
    return ids, hf_greedy(target.model, ids, max_new)


def transformers_answerer(target):
    """Answers from transformers' generate() (an oracle independent of marscli's engine)."""
    def answer(records, s: CollectSettings):
        return [(*plain_answer(target, r["prompt"], s.max_tokens), None) for r in records]
    return answer


@pytest.fixture(scope="module")
def collection(target, tmp_path_factory):
    data = tmp_path_factory.mktemp("th-data")
    recs = [{"id": str(i), "prompt": p} for i, p in enumerate(PROMPTS)]
    collect(target, transformers_answerer(target), recs, data, tokens_wanted=10_000,
            settings=CollectSettings(MAX_NEW), prompt_files={"test": "x"}, chunk=3)
    return data


# --------------------------------------------------------------------------- the objective


def drafting_loss(head, rec, steps: int, in_draft: torch.Tensor, lm_rows: torch.Tensor):
    """The TTT loss of one sequence computed as the drafter runs the head: for every committed
    entry c, the committed cache 0..c from the target's features, then u more passes each on
    the previous output and the sequence's next token (the drafter's propose loop).
    Returns per pass (sum of KL over counted entries, count) and the logits {(c, u): [D]}."""
    toks = rec.tokens.long()
    feats = rec.features.float()
    L = toks.numel()
    sums = [[0.0, 0] for _ in range(steps)]
    logits = {}
    for c in range(L - 1):
        out, k, v = head(feats[None, :c + 1], toks[None, 1:c + 2], torch.arange(c + 1)[None],
                         target_features=True)
        past = (k, v)
        h = out[:, -1:]
        for u in range(steps):
            j = c + u  # the entry this pass plays; it predicts token j + 2
            if j > L - 2:
                break
            if u:
                h, k2, v2 = head(h, toks[None, j + 1: j + 2], torch.tensor([[j]]), past, target_features=False)
                past = (torch.cat([past[0], k2], 2), torch.cat([past[1], v2], 2))
            logits[(c, u)] = head.draft_logits(h[0, -1])
            pos = j + 1  # the target's distribution after this position
            counted = rec.prompt_len - 1 <= pos < L - 1 and bool(in_draft[int(rec.top1[pos])])
            if not counted:
                continue
            p = torch.softmax(rec.final[pos].float() @ lm_rows.T, -1)
            logq = torch.log_softmax(head.draft_logits(h[0, -1]), -1)
            sums[u][0] += float((p * (torch.log(p) - logq)).sum())
            sums[u][1] += 1
    return sums, logits


def test_ttt_loss_matches_the_drafting_computation(target, collection):
    recs = list(read_records(collection))[:3]  # different lengths: the batch is right-padded
    V = target.model.get_output_embeddings().weight.shape[0]
    vocab_ids = list(range(0, V, 2)) + [int(t) for r in recs for t in r.top1[:4]]
    vocab_ids = sorted(set(vocab_ids))
    # weights large enough that attention is far from uniform: seeing a wrong entry shows
    head = random_head(target.model, seed=5, draft_vocab=vocab_ids, std=0.3).float()
    ids_t = torch.tensor(vocab_ids)
    in_draft = torch.zeros(V, dtype=torch.bool)
    in_draft[ids_t] = True
    lm_rows = target.model.get_output_embeddings().weight[ids_t].detach().float()
    steps = 3
    with torch.no_grad():
        loss, stats = ttt_loss(head, make_batch(recs, ids_t, in_draft, lm_rows), steps)
        per, by_entry = zip(*[drafting_loss(head, r, steps, in_draft, lm_rows) for r in recs], strict=True)
        unrolled = unrolled_logits(head, recs[0].features.float()[None], recs[0].tokens.long()[None], steps)
    # every pass's logits, entry by entry, are the drafter's (pass u's row c: u drafts after entry c)
    for (c, u), want_logits in by_entry[0].items():
        torch.testing.assert_close(unrolled[u][0, c], want_logits, rtol=1e-4, atol=1e-4)
    assert len(by_entry[0]) > 2 * len(recs[0].tokens)
    want = 0.0
    for u in range(steps):
        kl, n = sum(p[u][0] for p in per), sum(p[u][1] for p in per)
        assert stats[u]["entries"] == n
        assert stats[u]["kl"] == pytest.approx(kl / n, rel=1e-4, abs=1e-6)
        want += STEP_DECAY ** u * kl / n
    assert float(loss) == pytest.approx(want, rel=1e-4)
    assert all(s["entries"] > 0 for s in stats) and stats[1]["kl"] != stats[0]["kl"]


def test_pass_mask_sees_the_committed_prefix_and_its_own_chain():
    m = pass_mask(5, 2, torch.device("cpu"))[0, 0]  # rows: entries 2..4; cols: 5 + 4 + 3
    assert m.shape == (3, 12)
    # entry 3 at pass 2: committed 0..1, pass-1 entry 2 (index 1 of pass 1), itself
    assert m[1].nonzero().flatten().tolist() == [0, 1, 5 + 1, 9 + 1]
    m = pass_mask(6, 3, torch.device("cpu"))[0, 0]  # entries 3..5; cols 6 + 5 + 4 + 3
    # entry 5 at pass 3: committed 0..2, pass-1 entry 3 (index 2), pass-2 entry 4 (index 2), itself
    assert m[2].nonzero().flatten().tolist() == [0, 1, 2, 6 + 2, 11 + 2, 15 + 2]


# --------------------------------------------------------------------------- acceptance


@pytest.fixture(scope="module")
def trained(target, collection, tmp_path_factory):
    out = tmp_path_factory.mktemp("th-head")
    recs = list(read_records(collection))
    settings = TrainSettings(epochs=12, draft_vocab=200, ttt_steps=3, lr=3e-3, tokens_per_batch=512,
                             holdout=0, eval_k=4, save_dtype="float32")
    from marscli.drafters.eagle3_head import default_feature_layers

    record = train_head(target.model, recs, default_feature_layers(LAYERS), out, settings)
    return out, record


def test_simulated_acceptance_equals_what_the_drafter_measures(target, collection, trained):
    out, record = trained
    head = load_head(str(out), target)
    recs = list(read_records(collection))
    sim = simulated_acceptance(head.head, recs, 4)
    assert sim.accepted_per_position[0] > 0, sim  # the head learned something: the check has teeth
    cfg = DraftConfig(kind="eagle3", model=str(out), num_draft_tokens=4, adaptive=False)
    eng = build_engine(target, head, VerifyConfig(), cfg)
    steps = emitted = 0
    acc = [0] * 4
    dra = [0] * 4
    for r in recs:
        ids = r.tokens[:r.prompt_len].tolist()
        res = eng.generate_ids(ids, SamplingParams(max_tokens=r.answer_tokens))
        assert res.token_ids == r.tokens[r.prompt_len:].tolist()  # strict greedy: the target's text
        steps += res.stats.steps
        emitted += res.stats.emitted
        acc = [a + b for a, b in zip(acc, res.stats.accepted_per_position, strict=True)]
        dra = [a + b for a, b in zip(dra, res.stats.drafted_per_position, strict=True)]
    assert (sim.steps, sim.emitted, sim.accepted_per_position, sim.drafted_per_position) == (steps, emitted, acc, dra)


@pytest.mark.parametrize("draft", ["ngram", "none", "eagle3"])
def test_engine_recording_equals_a_teacher_forced_pass(target_dir, target, trained, draft):
    """The collection records the engine's own forward passes (batched, cached, drafted by
    `draft`; an EAGLE-3 drafter reads its own columns of the same capture): every record
    equals one teacher-forced pass over prompt + answer, but for the last position, which the
    target never runs on."""
    from marscli.config import GenerationOptions
    from marscli.drafters.eagle3_head import default_feature_layers
    from marscli.jobs.setup import build_generator, generation_setup
    from marscli.jobs.train_head import answerer
    from marscli.training.collect import record_from_features, record_sequence

    spec = f"eagle3:{trained[0]}" if draft == "eagle3" else draft
    opts = GenerationOptions(target=str(target_dir), draft=spec, verify="strict", batch_size=3,
                             dtype="float32", device="cpu", auto_profile=False)
    gen = build_generator(generation_setup(opts))
    answers = answerer(gen)([{"id": str(i), "prompt": p} for i, p in enumerate(PROMPTS)], CollectSettings(MAX_NEW))
    tap = FeatureTap(target.model, default_feature_layers(LAYERS))
    for p, got in zip(PROMPTS, answers, strict=True):
        ids, out, feats = got
        assert (ids, out) == plain_answer(target, p)  # the target's greedy answer, whatever drafted
        assert feats is not None and feats.shape[0] == len(ids) + len(out) - 1
        rec = record_from_features(target.model, ids + out, len(ids), feats, greedy=True)
        ref = record_sequence(target.model, tap, ids + out, len(ids))
        assert rec.tokens.tolist() == ref.tokens.tolist() and rec.prompt_len == ref.prompt_len
        last = rec.tokens.numel() - 1
        torch.testing.assert_close(rec.features[:last].float(), ref.features[:last].float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(rec.final[:last].float(), ref.final[:last].float(), rtol=1e-2, atol=1e-2)
        assert rec.top1[:last].tolist() == ref.top1[:last].tolist()
        assert not rec.features[last].any() and not rec.final[last].any() and int(rec.top1[last]) == -1


def test_init_continues_from_a_written_head(target, collection, tmp_path):
    """--init: a second run starts where the first ended (its held-out acceptance before
    training is the first run's after it), over the first's draft vocabulary even when the
    data differs, and refuses a head of another vocabulary size."""
    from marscli.drafters.eagle3_head import default_feature_layers
    from marscli.errors import InputError

    recs = list(read_records(collection))
    layers = default_feature_layers(LAYERS)
    base = dict(epochs=2, draft_vocab=200, ttt_steps=2, lr=3e-3, tokens_per_batch=512, holdout=4, eval_k=4,
                save_dtype="float32")
    first = train_head(target.model, recs, layers, tmp_path / "a", TrainSettings(**base))
    best = first["epochs"][first["best_epoch"] - 1]["heldout_acceptance_length"]
    assert best > first["heldout_acceptance_length_before"]  # it learned: the check has teeth
    second = train_head(target.model, recs, layers, tmp_path / "b",
                        TrainSettings(**{**base, "epochs": 1, "init": str(tmp_path / "a")}))
    assert second["heldout_acceptance_length_before"] == best
    assert second["settings"]["init"] == str(tmp_path / "a")
    # fewer records (another most-frequent list): the first head's vocabulary is kept
    third = train_head(target.model, recs[:5], layers, tmp_path / "d",
                       TrainSettings(**{**base, "epochs": 1, "holdout": 0, "init": str(tmp_path / "a")}))
    assert third["draft_vocab"] == 200
    from marscli.training.train import draft_vocabulary

    vocab = int(target.model.get_output_embeddings().weight.shape[0])
    assert draft_vocabulary(recs[:5], 200, vocab) != draft_vocabulary(recs, 200, vocab)  # teeth
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(tmp_path / "d" / "model.safetensors"))["d2t"],
                       load_file(str(tmp_path / "a" / "model.safetensors"))["d2t"])
    with pytest.raises(InputError, match="another vocabulary size"):
        train_head(target.model, recs, layers, tmp_path / "c",
                   TrainSettings(**{**base, "draft_vocab": 150, "init": str(tmp_path / "a")}))


def test_walk_replays_steps_by_hand():
    # prompt of 3, 6 answer tokens, chain of 2; matches per entry c (entry c = position c+1)
    m = [9, 2, 1, 0, 2, 0, 0, 0]
    w = walk(m, 3, 9, 2)
    # n=3: c=1, cap 2, a=min(2,2)=2 -> n=6; c=4: cap 2, a=2 -> n=9: 2 steps, 6 tokens
    assert (w.steps, w.emitted, w.accepted_per_position, w.drafted_per_position) == (2, 6, [2, 2], [2, 2])
    w = walk([0] * 8, 3, 9, 2)  # nothing matches: one token per step, the last step drafts nothing
    assert (w.steps, w.emitted, w.drafted_per_position) == (6, 6, [5, 4])


def test_chain_matches_stops_at_the_first_miss(target, collection):
    recs = list(read_records(collection))[:1]
    head = random_head(target.model, seed=1).float()
    r = recs[0]
    m = chain_matches(head, r.features.float()[None], r.tokens.long()[None], 3)[0]
    assert m.shape == (r.tokens.numel() - 1,)
    assert int(m.max()) <= 3 and int(m.min()) >= 0


# --------------------------------------------------------------------------- the command


def _jsonl(path: Path, prompts) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    return path


def test_train_head_command_end_to_end(runner, target_dir, target, tmp_path):
    from marscli.cli import app

    src = _jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "head"
    base = ["train-head", str(src), "--target", str(target_dir), "-o", str(out), "--max-tokens", str(MAX_NEW),
            "--batch-size", "2", "--draft-vocab", "150", "--ttt-steps", "2", "--holdout", "4",
            "--tokens-per-batch", "256", "--save-dtype", "float32", "--dtype", "float32", "--device", "cpu"]
    r = runner.invoke(app, base + ["--collect-tokens", "40", "--collect-only"])
    assert r.exit_code == 0, r.stderr
    manifest = json.loads((tmp_path / "head.collect" / "manifest.json").read_text())
    first = manifest["prompts_consumed"]
    assert 0 < first < len(PROMPTS) and sum(s["answer_tokens"] for s in manifest["shards"]) >= 40
    assert not out.exists()
    # resumed with a larger budget and another drafter: only the prompts not yet consumed are
    # answered, then training
    r = runner.invoke(app, base + ["--collect-tokens", "100000", "--epochs", "2", "--draft", "none"])
    assert r.exit_code == 0, r.stderr
    manifest = json.loads((tmp_path / "head.collect" / "manifest.json").read_text())
    assert manifest["prompts_consumed"] == len(PROMPTS)
    recs = list(read_records(tmp_path / "head.collect"))
    assert len(recs) == len(PROMPTS) and [r.prompt_len for r in recs] == [
        len(target.tokenizer(p).input_ids) for p in PROMPTS]
    # what was collected through the engine is the target's greedy text, and features are the target's
    for p, rec in zip(PROMPTS, recs, strict=True):
        ids, ans = plain_answer(target, p)
        assert rec.tokens.tolist() == ids + ans
    # recorded in the engine's own passes (the last position, never run, is zeros)
    assert manifest["recorded"] == {"engine": len(PROMPTS), "teacher_forced": 0}
    tap = FeatureTap(target.model, load_head(str(out), target).head.feature_layers)
    with torch.no_grad(), tap.capture():
        target.model(recs[0].tokens.long()[None])
    torch.testing.assert_close(recs[0].features[:-1].float(), tap.features[0, :-1], rtol=1e-2, atol=1e-2)
    assert not recs[0].features[-1].any()
    # the training record, on stdout and in the folder
    record = json.loads(r.stdout.strip().splitlines()[-1])
    assert record == json.loads((out / "training.json").read_text())
    assert record["collection"]["recorded"] == manifest["recorded"]
    # each collecting invocation as it ran, not the training invocation's drafter for all
    runs = record["collection"]["runs"]
    assert runs == manifest["runs"] and [r["drafter"] for r in runs] == ["ngram", "none"]
    assert [r["prompts"] for r in runs] == [[0, first], [first, len(PROMPTS)]]
    assert sum(r["answer_tokens"] for r in runs) == sum(s["answer_tokens"] for s in manifest["shards"])
    assert all(r["batch_size"] == 2 and r["draft_quant"] is None for r in runs)
    assert len(record["epochs"]) == 2 and record["heldout_records"] == 2 and record["train_records"] == 6
    assert all("heldout_acceptance_length" in e for e in record["epochs"])
    # the published layout: no embedding (the target's is shared), the EAGLE-3 architecture
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 150
    assert "eagle_aux_hidden_state_layer_ids" not in cfg  # the default layers: no non-default flags
    from safetensors.torch import load_file

    sd = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in sd and sd["lm_head.weight"].shape[0] == 150
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' 0600
    # strict greedy with the trained head equals plain decoding, through generate
    gen = ["generate", str(src), "--target", str(target_dir), "--max-tokens", str(MAX_NEW), "--no-profile",
           "--dtype", "float32", "--device", "cpu"]
    plain = runner.invoke(app, gen + ["--draft", "none"])
    spec = runner.invoke(app, gen + ["--draft", f"eagle3:{out}", "--num-draft-tokens", "4"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.stderr
    a = [json.loads(x)["output"] for x in plain.stdout.splitlines()]
    b = [json.loads(x) for x in spec.stdout.splitlines()]
    assert [x["output"] for x in b] == a
    assert all(x["spec"]["drafter"] == "eagle3" for x in b)


def test_train_head_refuses_bad_input(runner, target_dir, tmp_path):
    from marscli.cli import app

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": \n')
    r = runner.invoke(app, ["train-head", str(bad), "--target", str(target_dir), "-o", str(tmp_path / "h")])
    assert r.exit_code == 2 and f"{bad}:2: not JSON" in r.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    r = runner.invoke(app, ["train-head", str(bad), "--target", str(target_dir), "-o", str(tmp_path / "full")])
    assert r.exit_code == 2 and "notes.txt" in r.stderr
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": "a", "prompt": "x"}\n')
    r = runner.invoke(app, ["train-head", str(good), "--target", str(target_dir), "-o", str(tmp_path / "q"),
                                 "--draft-quant", "int8"])
    assert r.exit_code == 2 and "--draft-quant applies to a draft model; the drafter is ngram" in r.stderr


def test_collection_refuses_other_settings(target, collection):
    recs = [{"id": str(i), "prompt": p} for i, p in enumerate(PROMPTS)]
    from marscli.errors import InputError

    with pytest.raises(InputError, match="collected with other settings"):
        collect(target, transformers_answerer(target), recs, collection, tokens_wanted=1,
                settings=CollectSettings(MAX_NEW + 1), prompt_files={"test": "x"})


# --------------------------------------------------------------------------- corpus and shipped heads


def test_builtin_corpus_is_deterministic_and_mixed(tmp_path):
    pkg = tmp_path / "lib" / "toy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""' + "A toy package for the corpus test. " * 8 + '"""\n')
    (pkg / "ops.py").write_text(
        'def scale(x, k=2):\n    """Multiply every item of x by k and return the new list."""\n'
        '    return [k * v for v in x]\n\n'
        'def _hidden(x):\n    """Private helpers are not prompts, whatever their docstring says."""\n    return x\n')
    (tmp_path / "lib" / "test").mkdir()
    (tmp_path / "lib" / "test" / "t.py").write_text('def test_x():\n    """A test case is no prompt at all."""\n')
    a = build_corpus(root=tmp_path / "lib")
    b = build_corpus(root=tmp_path / "lib")
    assert a == b
    ids = [r["id"] for r in a]
    assert len(ids) == len(set(ids))
    assert "code:toy.ops.scale" in ids and "module:toy" in ids
    assert not any("hidden" in i or "test_x" in i for i in ids)
    assert any(i.startswith("doc:") for i in ids)  # Python's documentation topics
    scale = next(r for r in a if r["id"] == "code:toy.ops.scale")["messages"][0]["content"]
    assert "scale" in scale
    assert build_corpus(2, root=tmp_path / "lib") == a[:2]


def test_passages_are_paragraph_aligned():
    text = "\n\n".join(f"para {i} " + "word " * 60 for i in range(10))
    got = list(passages(text))
    assert got and all(400 <= len(p) <= 1500 for p in got)
    assert all(p.startswith("para ") for p in got)


def test_shipped_head_lookup(tmp_path):
    h = tmp_path / "smol"
    h.mkdir()
    (h / "config.json").write_text("{}")
    (h / "training.json").write_text(json.dumps({"target": {"name": "M", "sha256": "abc"}}))
    assert shipped_head_for({"name": "M", "sha256": "abc"}, tmp_path) == h
    assert shipped_head_for({"name": "M", "sha256": "other"}, tmp_path) is None  # other weights
    assert shipped_head_for({"name": "M", "sha256": None}, tmp_path) == h
    assert shipped_head_for({"name": "N"}, tmp_path) is None
