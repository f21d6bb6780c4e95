"""int8 decoder layers in TorchScript (marscli.models.int8_decoder): the same bits as
transformers' own layers, for Llama and Qwen2, at every shape the engine forwards (a padded
batch's prefill, one new token, several), and the layers it does not mirror left alone."""

from __future__ import annotations

import pytest
import torch

from marscli.config import DraftConfig, ModelConfig, SamplingParams, VerifyConfig
from marscli.engine import build_engine
from marscli.models import int8_decoder, quant
from marscli.models.int8_decoder import install_int8_decoder, uninstall_int8_decoder
from marscli.models.kvcache import cache_kw, new_cache
from marscli.models.loading import load_model
from tests.conftest import make_tiny_model_dir
from tests.oracles import hf_greedy

pytestmark = pytest.mark.skipif(not quant.int8_available(), reason="this torch build has no fbgemm")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm8(request, tmp_path_factory, tiny_tokenizer):
    path = make_tiny_model_dir(tmp_path_factory.mktemp(f"tiny-{request.param}"), seed=3, layers=3,
                               tokenizer=tiny_tokenizer, arch=request.param)
    return load_model(ModelConfig(str(path), dtype="float32", device="cpu", quant="int8"))


def _steps(model) -> list[torch.Tensor]:
    """Logits of a padded 2-row prefill, then 1 new token a row, then 4: the engine's shapes."""
    ids = torch.tensor([[0, 0, 5, 9, 14, 3, 22], [7, 11, 4, 18, 2, 6, 30]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    cache = new_cache(model)
    out = []
    with torch.inference_mode():
        for new in (ids, torch.tensor([[12], [40]]), torch.tensor([[8, 3, 3, 27], [1, 19, 5, 9]])):
            if new is not ids:
                mask = torch.cat([mask, torch.ones_like(new)], dim=1)
            pos = (mask.cumsum(-1) - 1).clamp_min(0)[:, -new.shape[1]:]
            out.append(model(input_ids=new, attention_mask=mask, position_ids=pos, **cache_kw(model, cache),
                             use_cache=True).logits)
    return out


def test_every_layer_is_patched_and_scripted(lm8):
    layers = lm8.model.config.num_hidden_layers
    assert uninstall_int8_decoder(lm8.model) == layers
    try:
        assert install_int8_decoder(lm8.model) == layers
        assert install_int8_decoder(lm8.model) == 0  # once only
    finally:
        install_int8_decoder(lm8.model)
    # This torch scripts them: the speed is real, not the plain-Python fallback.
    assert all(isinstance(f, torch.jit.ScriptFunction) for f in int8_decoder._scripted())
    assert isinstance(quant.scripted_int8_product(), torch.jit.ScriptFunction)


def test_the_same_logits_as_transformers_layers(lm8):
    patched = _steps(lm8.model)
    uninstall_int8_decoder(lm8.model)
    try:
        plain = _steps(lm8.model)
    finally:
        install_int8_decoder(lm8.model)
    for a, b in zip(patched, plain):
        assert torch.equal(a, b)
    assert not torch.equal(patched[1], patched[2][:, :1])  # the steps differ: the check can fail


def test_strict_speculation_on_the_patched_model_is_its_plain_decoding(lm8):
    tok = lm8.tokenizer
    cfg = DraftConfig(kind="ngram", num_draft_tokens=4, adaptive=False)
    spec = build_engine(lm8, None, VerifyConfig(), cfg)
    for text in ["one two three four five six seven eight nine ten one two three", "hello world, hello"]:
        ids = tok(text).input_ids
        got = spec.generate_ids(ids, SamplingParams(max_tokens=40)).token_ids
        assert got == hf_greedy(lm8.model, ids, 40)
        uninstall_int8_decoder(lm8.model)
        try:
            assert got == hf_greedy(lm8.model, ids, 40)  # transformers' layers, same tokens
        finally:
            install_int8_decoder(lm8.model)


def test_layers_it_does_not_mirror_keep_their_forward(tiny_model_dir):
    plain = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu"))
    assert install_int8_decoder(plain.model) == 0  # float weights: not this module's
    lm = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu", quant="int8"))
    model = lm.model
    uninstall_int8_decoder(model)
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    assert install_int8_decoder(model) == model.config.num_hidden_layers - 1
    assert "forward" not in vars(model.model.layers[0])
