"""int8 weights on the CPU (marscli.models.quant, `--quant int8`, `--draft-quant int8`).

Exactness is relative to the model as loaded: strict speculative output of an int8 target
equals plain greedy decoding of the same int8 model, in the engine and in transformers'
generate() on the same quantized model object. The kernel itself is checked against exact
integer arithmetic, and a row's output against the same row computed alone.
"""

from __future__ import annotations

import copy
import gc
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from marscli.config import DraftConfig, ModelConfig, SamplingParams, VerifyConfig
from marscli.engine import build_engine
from marscli.errors import ModelLoadError
from marscli.models import quant
from marscli.models.loading import load_model
from marscli.models.quant import CPU_INT8, Int8Linear, Int8Slice, quantize_int8, weight_bytes
from tests.engines import make_engine
from tests.oracles import hf_greedy

pytestmark = pytest.mark.skipif(not quant.int8_available(), reason="this torch build has no fbgemm")

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello marscli; the cat sat on the mat. hello world, hello",
    "one two three four five six seven eight nine ten one two three",
    "speculative decoding drafts tokens and the target verifies them in one pass. speculative",
]


def _linear(i: int, o: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(i, o, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(3.0)
    return lin


def _rows(n: int, width: int, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(n, width)
    x[1] *= 300.0  # a row with large values beside small ones
    x[2, 5] = 1000.0  # an outlier channel
    x[3] = 0.0  # an all-zero row
    return x


# --- the kernel ---------------------------------------------------------------------------


def test_a_row_is_the_same_bits_alone_and_among_any_rows():
    q = Int8Linear(_linear(96, 200))
    x = _rows(40, 96)
    full = q(x)
    for i in range(len(x)):
        assert torch.equal(q(x[i:i + 1])[0], full[i])
    for lo, hi in ((0, 9), (7, 16), (31, 40)):
        assert torch.equal(q(x[lo:hi]), full[lo:hi])
    assert torch.equal(q(x.reshape(4, 10, 96)).reshape(40, 200), full)
    assert torch.equal(full[3], q.bias)  # a zero row gives the bias


def test_the_product_is_close_to_float():
    lin = _linear(256, 300)
    x = torch.randn(16, 256)
    ref = lin(x)
    err = (Int8Linear(lin)(x) - ref).norm() / ref.norm()
    assert err < 0.01  # int8 weights per channel; the two-level input adds ~1e-4
    assert err > 1e-5  # and it is quantized: not the float product


def test_the_7_bit_grid_does_not_saturate():
    """fbgemm on CPUs without VNNI adds pairs of uint8 x int8 products in int16: an 8-bit grid
    overflows there. The grid used gives exact integer arithmetic (dequantized, in float64)."""
    torch.manual_seed(0)
    w = torch.sign(torch.randn(64, 512)) * 0.02  # every weight at full scale: worst case
    x = torch.randn(4, 512).abs()
    x = x / x.abs().amax(1, keepdim=True)
    scale = w.abs().amax(1) / 127
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(64, dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qw, None)
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, quant.X_SCALE, quant.X_ZERO, packed)
    qx = torch.clamp(torch.round(x.double() / quant.X_SCALE) + quant.X_ZERO, 0, 255)
    exact = ((qx - quant.X_ZERO) * quant.X_SCALE) @ qw.dequantize().double().T
    assert float((y.double() - exact).abs().max() / exact.abs().max()) < 1e-5


def test_fused_siblings_equal_separate_layers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    fused, apart = copy.deepcopy(base), copy.deepcopy(base)
    n = quantize_int8(fused)
    assert n == quantize_int8(apart, fuse=False)
    assert not any(type(m) is nn.Linear for m in fused.modules())
    assert sum(isinstance(m, Int8Slice) for m in fused.modules()) == 5 * base.config.num_hidden_layers
    ids = torch.tensor([[3, 9, 4, 17, 5, 22, 8]])
    with torch.no_grad():
        a, b = fused(ids).logits, apart(ids).logits
    assert torch.equal(a, b)
    assert weight_bytes(fused) == weight_bytes(apart) < weight_bytes(base) / 2


# --- the model, in the engine and in transformers -------------------------------------------


@pytest.fixture(scope="module")
def target8(tiny_model_dir):
    return load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu", quant="int8"))


@pytest.fixture(scope="module")
def draft8(tiny_draft_dir):
    return load_model(ModelConfig(str(tiny_draft_dir), dtype="float32", device="cpu", quant="int8"))


def test_the_identity_names_the_quantization(target8, tiny_model_dir):
    assert target8.identity["quantization"] == CPU_INT8
    assert target8.identity["dtype"] == "float32"
    assert isinstance(target8.model.get_output_embeddings(), Int8Linear)  # the lm_head too
    plain = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu"))
    assert plain.identity["quantization"] is None


def test_profiles_and_the_cost_cache_tell_int8_from_float(target8, tiny_model_dir):
    from marscli.calibration.profiles import identity_for_profile
    from marscli.engine.costs import cost_key, key_hash

    plain = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu"))
    assert identity_for_profile(target8.identity)["quantization"] == CPU_INT8
    assert identity_for_profile(plain.identity)["quantization"] is None
    k8, k32 = cost_key(target8, (1,), "model", target8.identity), cost_key(plain, (1,), "model", plain.identity)
    assert k8["target"]["quantization"] == k8["draft"]["quantization"] == CPU_INT8
    assert key_hash(k8) != key_hash(k32)


def _mappings_of(files: list[str]) -> int:
    gc.collect()
    with open("/proc/self/maps") as f:
        return sum(line.rstrip().endswith(tuple(files)) for line in f)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_an_int8_model_keeps_no_view_of_its_float_file(tiny_model_dir):
    # A view keeps the file mapped, and every page quantization read through it resident.
    files = [str(p) for p in Path(tiny_model_dir).glob("*.safetensors")]
    assert files
    base = _mappings_of(files)
    plain = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu"))
    assert _mappings_of(files) > base  # float32 weights are views of the file: the check sees them
    lm = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu", quant="int8"))
    del plain
    assert _mappings_of(files) == base
    # The copies are the same numbers: the model quantized in place of a float one computes the same.
    again = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu")).model
    quantize_int8(again)
    quant.install_f64_attention(again)
    ids = torch.tensor([[5, 17, 3, 99, 42, 7]])
    with torch.inference_mode():
        assert torch.equal(lm.model(ids).logits, again(ids).logits)


@pytest.mark.parametrize("kind", ["none", "ngram", "model", "self"])
def test_strict_speculation_on_an_int8_target_is_its_plain_decoding(target8, draft8, kind):
    engine = make_engine(target8, "model" if kind == "self" else kind, {"model": draft8, "self": target8}.get(kind))
    plain = make_engine(target8, "none")
    drafted = 0
    for text in PROMPTS:
        ids = target8.tokenizer(text).input_ids
        res = engine.generate_ids(ids, SamplingParams(max_tokens=40))
        assert res.token_ids == plain.generate_ids(ids, SamplingParams(max_tokens=40)).token_ids, text
        assert res.token_ids == hf_greedy(target8.model, ids, 40), text
        drafted += res.stats.drafted
    assert kind == "none" or drafted > 0


def test_a_batch_of_int8_rows_equals_each_row_alone(target8, draft8):
    engine = build_engine(target8, draft8, VerifyConfig(), DraftConfig(kind="model", model="x", num_draft_tokens=4),
                          batch_size=4)
    alone = make_engine(target8, "none")
    prompts = [target8.tokenizer(t).input_ids for t in PROMPTS]
    got = dict(engine.run(range(len(prompts)), lambda i: (prompts[i], SamplingParams(max_tokens=32))))
    assert sorted(got) == list(range(len(prompts)))
    for i, ids in enumerate(prompts):
        assert got[i].token_ids == alone.generate_ids(ids, SamplingParams(max_tokens=32)).token_ids, i


def test_the_embedded_model_int8_strict_is_its_plain_decoding(use_embedded_cache):
    lm = load_model(ModelConfig(source=None, device="cpu", dtype="float32", quant="int8"))
    model = lm.model
    assert lm.identity["quantization"] == CPU_INT8
    ngram, plain = make_engine(lm, "ngram", k=6), make_engine(lm, "none")
    prompts = ["Write a Python function that returns the n-th Fibonacci number.",
               "List three facts about the planet Mars, then repeat the list."]
    for text in prompts:
        ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = ids if isinstance(ids, list) else list(ids["input_ids"])
        a = ngram.generate_ids(ids, SamplingParams(max_tokens=64))
        assert a.token_ids == plain.generate_ids(ids, SamplingParams(max_tokens=64)).token_ids
        assert a.token_ids == hf_greedy(model, ids, 64)


# --- options and errors ---------------------------------------------------------------------


def test_int8_needs_float32_activations_and_no_device_map(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="--quant int8 on CPU keeps activations in float32"):
        load_model(ModelConfig(str(tiny_model_dir), dtype="bfloat16", device="cpu", quant="int8"))
    with pytest.raises(ModelLoadError, match="--quant int8 on CPU loads the whole model"):
        load_model(ModelConfig(str(tiny_model_dir), device="cpu", device_map="auto", quant="int8"))
    with pytest.raises(ModelLoadError, match="--quant 3bit: expected none, int8, 4bit"):
        load_model(ModelConfig(str(tiny_model_dir), device="cpu", quant="3bit"))


def test_int8_on_cuda_without_bitsandbytes_is_a_clear_error(monkeypatch, tiny_model_dir):
    import importlib.util

    from marscli.models import loading

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    monkeypatch.setattr(loading, "_resolve_device", lambda cfg: torch.device("cuda"))
    monkeypatch.setattr(loading, "_resolve_dtype", lambda cfg, device, log: torch.bfloat16)
    with pytest.raises(ModelLoadError, match="--quant int8 needs bitsandbytes, which is not installed"):
        load_model(ModelConfig(str(tiny_model_dir), quant="int8"))
    with pytest.raises(ModelLoadError, match="--draft-quant 4bit needs bitsandbytes"):
        load_model(ModelConfig(str(tiny_model_dir), quant="4bit"), role="draft")


def test_quantization_reaches_spec_fingerprint_and_profile(runner, tiny_model_dir, tiny_draft_dir, tmp_path):
    from marscli.cli import app

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "the cat sat on the mat"}) + "\n")
    out = tmp_path / "out.jsonl"
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--draft", str(tiny_draft_dir),
                            "--quant", "int8", "--draft-quant", "int8", "--verify", "strict", "--max-tokens", "8",
                            "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    rec = json.loads(out.read_text())
    assert rec["spec"]["quantization"] == {"target": CPU_INT8, "draft": CPU_INT8}
    # resuming the same output without --quant is a different run
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--draft", str(tiny_draft_dir),
                            "--verify", "strict", "--max-tokens", "8", "-o", str(out), "--resume"])
    assert r.exit_code != 0 and "quantization" in r.stderr
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--draft-quant", "int8"])
    assert r.exit_code != 0 and "--draft-quant applies to a draft model" in r.stderr


def test_the_embedded_model_drafts_for_itself_with_int8_weights(runner, use_embedded_cache, tmp_path):
    """--draft self --draft-quant int8: the float32 target with an int8 copy of itself as its
    draft model. Strict output is the float32 target's plain decoding; the spec says which
    copy was quantized."""
    from marscli.cli import app

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(
        ["Write a Python function that checks whether a number is prime.",
         "Name the planets of the solar system in order."])))
    outs = {}
    for name, extra in (("plain", ["--draft", "none"]),
                        ("self", ["--draft", "self", "--draft-quant", "int8", "--verify", "strict",
                                  "--num-draft-tokens", "4", "--fixed-k"])):
        out = tmp_path / f"{name}.jsonl"
        r = runner.invoke(app, ["generate", str(src), "--max-tokens", "48", "--device", "cpu",
                                "--dtype", "float32", "-o", str(out), *extra])
        assert r.exit_code == 0, r.stderr
        outs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    for plain, mine in zip(outs["plain"], outs["self"]):
        assert mine["output"] == plain["output"]
        assert mine["spec"]["drafter"] == "model"
        assert mine["spec"]["quantization"] == {"target": None, "draft": CPU_INT8}
        assert mine["spec"]["accepted"] > 0.8 * mine["spec"]["drafted"] > 0  # an int8 copy agrees


def test_draft_self_needs_a_different_quantization(runner, tiny_model_dir, tmp_path):
    from marscli.cli import app

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "the cat"}) + "\n")
    base = ["generate", str(src), "--target", str(tiny_model_dir), "--draft", "self"]
    r = runner.invoke(app, base)
    assert r.exit_code != 0 and "--draft self needs --draft-quant" in r.stderr
    r = runner.invoke(app, [*base, "--quant", "int8", "--draft-quant", "int8"])
    assert r.exit_code != 0 and "drafts with the target itself" in r.stderr
