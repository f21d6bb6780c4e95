"""--draft-context N (issue 32, long prompts): a draft model reads only the prompt's last N
tokens, so its prefill of a long prompt costs N tokens. Strict output stays the target's; the
draft model really reads less; batched drafting drafts what one drafter per row does."""

from __future__ import annotations

import json

import pytest
import torch

from marscli.config import DraftConfig, SamplingParams, VerifyConfig
from marscli.drafters.model import BatchedModelDrafter, ModelDrafter, prompt_offset
from marscli.engine import build_engine

LONG = ("the committee met on tuesday to discuss the budget for the coming year and the plans "
        "for the new library. the chair said that the budget would be tight. " * 3)
PROMPTS = [LONG + "in short,", "hello world, hello", LONG[:200] + " so"]


def test_prompt_offset():
    assert prompt_offset(100, None) == 0
    assert prompt_offset(100, 10) == 89  # the window and the last token, which every draft feeds
    assert prompt_offset(11, 10) == 0 and prompt_offset(5, 10) == 0


def test_the_draft_model_reads_only_its_window(target, draft):
    vocab = target.model.get_output_embeddings().weight.shape[0]
    ids = target.tokenizer(PROMPTS[0]).input_ids
    assert len(ids) > 40
    windowed = ModelDrafter(draft.model, 4, vocab_size=vocab, context=16)
    windowed.start(ids, SamplingParams())
    got = windowed.propose(ids, 4).tokens
    assert windowed.cached == ids[-17:] + got[:3]  # 16 prompt tokens, the last one, 3 drafts fed
    # the same as a drafter given only the window as its prompt
    alone = ModelDrafter(draft.model, 4, vocab_size=vocab)
    alone.start(ids[-17:], SamplingParams())
    assert alone.propose(ids[-17:], 4).tokens == got
    # and the next step reads on from there
    seq = ids + got[:2] + [5]
    assert windowed.propose(seq, 3).tokens == alone.propose(ids[-17:] + got[:2] + [5], 3).tokens


@pytest.mark.parametrize("batch_size", [1, 3])
def test_strict_output_is_the_targets_with_a_prompt_window(target, draft, batch_size):
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=4, context=12)
    engine = build_engine(target, draft, VerifyConfig(), cfg, batch_size=batch_size)
    if batch_size > 1:
        assert isinstance(engine.drafters, BatchedModelDrafter) and engine.drafters.context == 12
    plain = build_engine(target, None, VerifyConfig(), DraftConfig(kind="none"))
    prompts = [target.tokenizer(t).input_ids for t in PROMPTS]
    got = dict(engine.run(range(len(prompts)), lambda i: (prompts[i], SamplingParams(max_tokens=24))))
    for i, ids in enumerate(prompts):
        assert got[i].token_ids == plain.generate_ids(ids, SamplingParams(max_tokens=24)).token_ids, i


def test_batched_windowed_drafts_are_each_rows_own(target, draft):
    """BatchedModelDrafter with a window drafts, row by row, what a ModelDrafter with the same
    window drafts alone (greedy: the same argmax, up to the batched pass's float order)."""
    vocab = target.model.get_output_embeddings().weight.shape[0]
    prompts = [target.tokenizer(t).input_ids for t in PROMPTS]
    batched = BatchedModelDrafter(draft.model, 4, vocab_size=vocab, context=12)
    for ids in prompts:
        batched.add_row(ids, SamplingParams())
    with torch.inference_mode():
        props = batched.propose(prompts, [4, 4, 4])
    for ids, prop in zip(prompts, props):
        one = ModelDrafter(draft.model, 4, vocab_size=vocab, context=12)
        one.start(ids, SamplingParams())
        assert prop.tokens == one.propose(ids, 4).tokens
    assert [len(h.cached) for h in batched.rows] == [min(len(p), 13) + 3 for p in prompts]


def test_draft_context_on_the_command_line(runner, tiny_model_dir, tiny_draft_dir, tmp_path):
    from marscli.cli import app

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": PROMPTS[0]}) + "\n")
    out = tmp_path / "out.jsonl"
    base = ["generate", str(src), "--target", str(tiny_model_dir), "--max-tokens", "12", "--verify", "strict"]
    r = runner.invoke(app, [*base, "--draft", str(tiny_draft_dir), "--draft-context", "16", "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    assert "the prompt's last 16 tokens" in r.stderr
    rec = json.loads(out.read_text())
    assert rec["spec"]["draft_context"] == 16
    # another window is another run for --resume
    r = runner.invoke(app, [*base, "--draft", str(tiny_draft_dir), "--draft-context", "32", "-o", str(out),
                            "--resume"])
    assert r.exit_code != 0 and "drafter" in r.stderr, r.stderr
    r = runner.invoke(app, [*base, "--draft", "ngram", "--draft-context", "16"])
    assert r.exit_code == 2 and "--draft-context limits what a draft model reads" in r.stderr, r.stderr
