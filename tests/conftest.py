"""Shared fixtures: test isolation, tiny random models, and the real embedded model (once).

Heavy imports (torch, transformers, tokenizers) happen inside fixtures so collecting tests that
need none of them stays fast.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

# huggingface_hub and transformers read these once, at import: set them before any test imports
# either, so nothing in the test session can reach the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Draft lengths from a fixed cost curve, never a timing (marscli.engine.costs), here too: fixtures of
# module or session scope run before _isolate and must not measure (nor write the user's cache).
os.environ["MARSCLI_COSTS"] = "static"

TINY_HIDDEN = 64
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_INTERMEDIATE = 128
TINY_MAX_POSITIONS = 512
TINY_BPE_VOCAB = 320  # 256 byte symbols + 3 specials + ~60 merges

TINY_PAD, TINY_BOS, TINY_EOS = "<pad>", "<s>", "</s>"
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
TINY_CORPUS = (
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them in one pass",
    "a margin aware rule relaxes verification when the top two logits are close",
    "hello world, hello marscli; the cat sat on the mat.",
    "one two three four five six seven eight nine ten",
)


def make_tiny_tokenizer(
    corpus: Sequence[str] = TINY_CORPUS,
    vocab_size: int = TINY_BPE_VOCAB,
    *,
    pad: bool = True,
):
    """A byte-level BPE tokenizer trained in-process (no hub): any text round-trips.

    Special tokens come first: <pad>=0 (only if pad), <s>, </s>.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ([TINY_PAD] if pad else []) + [TINY_BOS, TINY_EOS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    kwargs: dict[str, Any] = {"bos_token": TINY_BOS, "eos_token": TINY_EOS}
    if pad:
        kwargs["pad_token"] = TINY_PAD
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def make_tiny_model_dir(
    path: Path,
    seed: int = 0,
    layers: int = 2,
    vocab_pad: int = 0,
    tokenizer=None,
    arch: str = "llama",
) -> Path:
    """Save a tiny random Llama (float32) with `tokenizer` to `path`; return `path`.

    vocab_pad adds embedding/lm_head rows beyond len(tokenizer), as padded checkpoints have.
    arch "qwen2" saves a Qwen2 of the same size instead (biases on q/k/v).
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[arch]

    tokenizer = tokenizer if tokenizer is not None else make_tiny_tokenizer()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config_class(
        vocab_size=len(tokenizer) + vocab_pad,
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    if arch != "llama":  # initialised to zero: give the q/k/v biases values a test can see
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(autouse=True)
def _isolate(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No network, no user caches or profiles, no colour: every test starts clean."""
    base = tmp_path_factory.mktemp("isolated")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("MARSCLI_CACHE", str(base / "cache"))
    monkeypatch.setenv("MARSCLI_PROFILE_DIR", str(base / "profiles"))
    monkeypatch.setenv("HF_HOME", str(base / "hf"))
    # Draft lengths from a fixed cost curve, never a timing: outputs and statistics in tests
    # do not depend on the machine's load (tests/engine/test_costs.py measures on purpose).
    monkeypatch.setenv("MARSCLI_COSTS", "static")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The tokenizer shared by tiny_model_dir and tiny_draft_dir (do not mutate)."""
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> Path:
    """A tiny random 2-layer Llama target saved with save_pretrained."""
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-target"), seed=0, layers=2, tokenizer=tiny_tokenizer
    )


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> Path:
    """A tiny random 1-layer Llama drafter with the target's tokenizer (different weights)."""
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-draft"), seed=1, layers=1, tokenizer=tiny_tokenizer
    )


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir) -> Path:
    """The directory ``target`` loads: tiny_model_dir, unless a module overrides it with a
    target of its own (a deeper one for EAGLE-3 heads, say)."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def target(target_dir):
    """The target (target_dir) loaded float32 on the CPU, once per module (an engine patches its
    CPU kernels: compare with ``oracle``, never with this model's own generate())."""
    from marscli.config import ModelConfig
    from marscli.models.loading import load_model

    return load_model(ModelConfig(str(target_dir), dtype="float32", device="cpu"))


@pytest.fixture
def runner():
    """Typer's CliRunner for marscli.cli.app: result.stdout and result.stderr apart."""
    from typer.testing import CliRunner

    return CliRunner()


@pytest.fixture(scope="module")
def draft(tiny_draft_dir):
    """The tiny draft model loaded float32 on the CPU, once per module."""
    from marscli.config import ModelConfig
    from marscli.models.loading import load_model

    return load_model(ModelConfig(str(tiny_draft_dir), dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def oracle(target_dir):
    """The target's weights loaded apart by transformers alone: the engine patches its model's
    CPU kernels (fastpath), and the oracle must not share those patches."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_factory():
    """make_tiny_model_dir(path, seed, layers, vocab_pad=0, tokenizer=None) -> path."""
    return make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_tokenizer_factory():
    """make_tiny_tokenizer(corpus=..., vocab_size=..., pad=True) -> PreTrainedTokenizerFast."""
    return make_tiny_tokenizer


@pytest.fixture
def calib_prompts(tmp_path: Path) -> Path:
    """Four repetitive prompt records (JSONL) to calibrate the tiny models on."""
    rows = [
        {"id": f"c{i}", "prompt": p, "max_tokens": 24}
        for i, p in enumerate([
            "one two three one two three one two three one two",
            "the cat sat on the mat. the cat sat on the mat. the cat",
            "hello world, hello world, hello world, hello",
            "a b c d a b c d a b c d a b",
        ])
    ]
    src = tmp_path / "calib.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


@pytest.fixture(scope="session")
def embedded_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MARSCLI_CACHE holding the converted embedded model, shared by the whole session."""
    return tmp_path_factory.mktemp("embedded-cache")


@pytest.fixture(scope="session")
def embedded_model(embedded_cache_dir: Path):
    """The real embedded SmolLM2-135M-Instruct, converted and loaded once per session."""
    from marscli.config import ModelConfig
    from marscli.models.loading import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MARSCLI_CACHE", str(embedded_cache_dir))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        return load_model(ModelConfig(source=None, device="cpu", dtype="float32"))


@pytest.fixture
def use_embedded_cache(monkeypatch: pytest.MonkeyPatch, embedded_cache_dir: Path) -> Path:
    """Point MARSCLI_CACHE at the session's converted embedded model (after _isolate)."""
    monkeypatch.setenv("MARSCLI_CACHE", str(embedded_cache_dir))
    return embedded_cache_dir


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one intra-op thread for a module (restored after it): modules of tiny models,
    whose small ops would wait on a second thread of a shared CPU, and in-process runs that
    must sum floats as a launched OMP_NUM_THREADS=1 process does. Use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
