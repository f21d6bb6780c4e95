"""Tests of marscli.tree: the draft tree, the tree forward and cache compaction on tiny random
models."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, settings

from marscli.tree import (
    ROOT,
    DraftTree,
    check_tree_support,
    compact_cache,
    tree_forward,
    tree_inputs,
)

V = 10
NINF = -math.inf
INF = math.inf

HYP = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors only: with a second intra-op thread on a shared CPU, each small op can wait
    milliseconds for it to be scheduled."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def L(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


def row(spec: dict[int, float], fill: float = -10.0) -> list[float]:
    """One row of V logits: `fill` everywhere except the token ids given in spec."""
    out = [fill] * V
    for tok, z in spec.items():
        out[tok] = z
    return out


def argmax_row(tok: int) -> list[float]:
    return row({tok: 5.0})


def close_call(t1: int, t2: int, ratio: float = 0.9) -> list[float]:
    """A row whose top-1 is t1 (logit 4) and top-2 t2 (logit 4 * ratio): logit ratio `ratio`."""
    return row({t1: 4.0, t2: 4.0 * ratio}, fill=-2.0)


def lg(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def tree_of(tokens: list[int], parents: list[int]) -> DraftTree:
    return DraftTree(L(tokens), L(parents))


# ---------------------------------------- the tree

#        root
#      /  |  \
#     0   1   2          (tokens 11 12 13)
#    / \   \
#   3   4   5            (21 22 23)
#  / \       \
# 6   7       8          (31 32 33)
#     |
#     9                  (41)
SAMPLE = tree_of([11, 12, 13, 21, 22, 23, 31, 32, 33, 41], [-1, -1, -1, 0, 0, 1, 3, 3, 5, 7])


def test_tree_structure():
    t = SAMPLE
    assert len(t) == 10
    assert t.depth().tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert t.children(ROOT) == [0, 1, 2]
    assert t.children(0) == [3, 4] and t.children(3) == [6, 7] and t.children(9) == []
    assert t.leaves() == [2, 4, 6, 8, 9]
    assert t.path_to(9) == [0, 3, 7, 9] and t.path_to(8) == [1, 5, 8] and t.path_to(2) == [2]
    assert t.child_lists()[0] == [0, 1, 2] and t.child_lists()[4] == [6, 7]
    anc = t.ancestor_mask()
    assert anc.shape == (11, 11)
    # row of node 9 (index 10) sees the root and nodes 0, 3, 7, 9
    assert anc[10].nonzero().flatten().tolist() == [0, 1, 4, 8, 10]
    assert anc[0].nonzero().flatten().tolist() == [0]


def test_chain_and_empty_tree():
    c = DraftTree.chain([5, 6, 7])
    assert c.parents.tolist() == [ROOT, 0, 1] and c.tokens.tolist() == [5, 6, 7]
    assert c.depth().tolist() == [1, 2, 3] and c.leaves() == [2] and c.path_to(2) == [0, 1, 2]
    e = DraftTree.chain([])
    assert len(e) == 0 and e.leaves() == [] and e.depth().shape == (0,)
    assert e.children(ROOT) == [] and e.ancestor_mask().tolist() == [[True]]


def test_tree_rejects_bad_parents_and_shapes():
    with pytest.raises(ValueError, match="node 1 has parent 1"):
        tree_of([1, 2], [-1, 1])
    with pytest.raises(ValueError, match="node 0 has parent -2"):
        tree_of([1], [-2])
    with pytest.raises(ValueError, match="node 1 has parent 3"):
        tree_of([1, 2], [-1, 3])
    with pytest.raises(AssertionError, match="parents"):
        DraftTree(L([1, 2]), L([-1]))
    with pytest.raises(AssertionError, match=r"tokens must be \[N\]"):
        DraftTree(L([[1, 2]]), L([[-1, 0]]))


def test_tree_inputs_by_hand():
    t = tree_of([7, 8, 9], [-1, -1, 0])  # root -> {0: 7 -> {2: 9}, 1: 8}
    ids, pos, mask = tree_inputs(t, root_token=4, past_len=2, dtype=torch.float32, device="cpu")
    assert ids.tolist() == [[4, 7, 8, 9]]
    assert pos.tolist() == [[2, 3, 3, 4]]
    assert mask.shape == (1, 1, 4, 6) and mask.dtype == torch.float32
    big = torch.finfo(torch.float32).min
    visible = [
        [1, 1, 1, 0, 0, 0],  # root: past + itself
        [1, 1, 1, 1, 0, 0],  # node 0: + root
        [1, 1, 1, 0, 1, 0],  # node 1: not its sibling
        [1, 1, 1, 1, 0, 1],  # node 2: root, node 0, itself
    ]
    want = torch.tensor([[0.0 if v else big for v in r] for r in visible])
    assert torch.equal(mask[0, 0], want)
    # additive in the requested dtype (bf16 model: bf16 mask with bf16's own minimum)
    _, _, m16 = tree_inputs(t, 4, 0, torch.bfloat16, "cpu")
    assert m16.dtype == torch.bfloat16 and m16.shape == (1, 1, 4, 4)
    assert float(m16.min()) == torch.finfo(torch.bfloat16).min
    with pytest.raises(AssertionError, match="float dtype"):
        tree_inputs(t, 4, 0, torch.bool, "cpu")


# ---------------------------------------- tiny models

MODEL_VOCAB = 64
MODEL_KW = {
    "vocab_size": MODEL_VOCAB, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
_MODELS: dict = {}


def tiny(family: str = "llama", impl: str = "sdpa"):
    """A tiny random float32 model, built once per (family, attention implementation)."""
    key = (family, impl)
    if key not in _MODELS:
        import transformers as tf

        config_cls, model_cls, extra = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
            "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 16}),
            "mistral-sliding": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 4}),
            "qwen2-sliding": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                              {"use_sliding_window": True, "sliding_window": 4,
                               "max_window_layers": 1}),
        }[family]
        torch.manual_seed(0)
        config = config_cls(**MODEL_KW, **extra, attn_implementation=impl)
        _MODELS[key] = model_cls(config).to(torch.float32).eval()
    return _MODELS[key]


def plain_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of a plain forward over ids, no cache."""
    with torch.no_grad():
        return model(input_ids=L([ids])).logits[0].float()


def prefilled(model, past: list[int]):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if past:
        with torch.no_grad():
            model(input_ids=L([past]), past_key_values=cache, use_cache=True)
    return cache


PAST = [3, 14, 15, 9, 26, 5, 35]
ROOT_TOKEN = 8
MODEL_TREE = tree_of([11, 12, 13, 21, 22, 23, 31, 32, 33, 41], SAMPLE.parents.tolist())


@pytest.mark.parametrize(
    ("family", "impl"),
    [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("gemma", "eager")],
)
def test_tree_forward_equals_each_root_path_as_a_sequence(family, impl):
    model = tiny(family, impl)
    t = MODEL_TREE
    cache = prefilled(model, PAST)
    with torch.no_grad():
        logits, hidden = tree_forward(model, cache, t, ROOT_TOKEN, len(PAST),
                                      output_hidden_states=True)
    assert logits.shape == (len(t) + 1, MODEL_VOCAB) and logits.dtype == torch.float32
    assert cache.get_seq_length() == len(PAST) + 1 + len(t)
    base = PAST + [ROOT_TOKEN]
    assert torch.allclose(logits[0], plain_logits(model, base)[-1], atol=1e-4)
    for i in range(len(t)):
        seq = base + [int(t.tokens[j]) for j in t.path_to(i)]
        assert torch.allclose(logits[i + 1], plain_logits(model, seq)[-1], atol=1e-4), i
    # hidden states: embeddings + one per layer, [1, N+1, H]; the last matches a plain forward
    assert len(hidden) == model.config.num_hidden_layers + 1
    assert hidden[-1].shape == (1, len(t) + 1, model.config.hidden_size)
    seq = base + [int(t.tokens[j]) for j in t.path_to(9)]
    with torch.no_grad():
        ref = model(input_ids=L([seq]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert torch.allclose(hidden[-1][0, 10], ref, atol=1e-4)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_chain_tree_equals_a_normal_forward(impl):
    model = tiny("llama", impl)
    chain = [17, 4, 40, 2]
    cache_a, cache_b = prefilled(model, PAST), prefilled(model, PAST)
    with torch.no_grad():
        tree_logits, none = tree_forward(model, cache_a, DraftTree.chain(chain), ROOT_TOKEN,
                                         len(PAST))
        normal = model(input_ids=L([[ROOT_TOKEN] + chain]), past_key_values=cache_b,
                       use_cache=True).logits[0]
    assert none is None
    assert torch.allclose(tree_logits, normal, atol=1e-4)
    for la, lb in zip(cache_a.layers, cache_b.layers):
        assert torch.allclose(la.keys, lb.keys, atol=1e-5)
        assert torch.allclose(la.values, lb.values, atol=1e-5)


def test_empty_tree_and_empty_past():
    model = tiny()
    cache = prefilled(model, [])
    with torch.no_grad():
        logits, _ = tree_forward(model, cache, DraftTree.chain([]), ROOT_TOKEN, 0)
    assert logits.shape == (1, MODEL_VOCAB)
    assert torch.allclose(logits[0], plain_logits(model, [ROOT_TOKEN])[-1], atol=1e-4)


@pytest.mark.parametrize("path", [[1, 5, 8], [0, 3, 7, 9], [0, 4], [2], []])
def test_compact_cache_then_decode_equals_fresh_forward(path):
    model = tiny()
    t = MODEL_TREE
    cache = prefilled(model, PAST)
    with torch.no_grad():
        tree_forward(model, cache, t, ROOT_TOKEN, len(PAST))
    compact_cache(cache, len(PAST), path)
    kept = len(PAST) + 1 + len(path)
    for layer in cache.layers:
        assert layer.keys.shape[-2] == kept and layer.values.shape[-2] == kept
    assert cache.get_seq_length() == kept
    accepted = PAST + [ROOT_TOKEN] + [int(t.tokens[i]) for i in path]
    nxt = 50
    with torch.no_grad():
        step = model(input_ids=L([[nxt]]), past_key_values=cache, use_cache=True).logits[0, -1]
    assert torch.allclose(step, plain_logits(model, accepted + [nxt])[-1], atol=1e-4)
    # and the next step's tree sees the compacted past as a plain prefix
    t2 = tree_of([6, 7, 60], [-1, -1, 0])
    with torch.no_grad():
        logits, _ = tree_forward(model, cache, t2, 44, kept + 1)
    for i in range(len(t2)):
        seq = accepted + [nxt, 44] + [int(t2.tokens[j]) for j in t2.path_to(i)]
        assert torch.allclose(logits[i + 1], plain_logits(model, seq)[-1], atol=1e-4)


def test_compact_cache_on_an_inference_mode_cache():
    # the engine fills its cache under torch.inference_mode(); compaction writes in place
    model = tiny()
    with torch.inference_mode():
        cache = prefilled(model, PAST)
        tree_forward(model, cache, MODEL_TREE, ROOT_TOKEN, len(PAST))
    compact_cache(cache, len(PAST), [1, 5])
    with torch.inference_mode():
        step = model(input_ids=L([[50]]), past_key_values=cache, use_cache=True).logits[0, -1]
    seq = PAST + [ROOT_TOKEN, 12, 23, 50]
    assert torch.allclose(step, plain_logits(model, seq)[-1], atol=1e-4)


def test_compact_cache_rejects_bad_paths():
    model = tiny()
    cache = prefilled(model, PAST)
    with torch.no_grad():
        tree_forward(model, cache, MODEL_TREE, ROOT_TOKEN, len(PAST))
    with pytest.raises(AssertionError, match="not increasing"):
        compact_cache(cache, len(PAST), [5, 1])
    with pytest.raises(AssertionError, match="cannot hold path"):
        compact_cache(cache, len(PAST), [0, 10])


def test_tree_forward_checks_the_cache_length():
    model = tiny()
    cache = prefilled(model, PAST)
    with pytest.raises(AssertionError, match="cache holds 7 positions"):
        tree_forward(model, cache, MODEL_TREE, ROOT_TOKEN, len(PAST) - 1)


@pytest.mark.parametrize("family", ["mistral-sliding", "qwen2-sliding"])
def test_sliding_window_models_are_refused(family):
    model = tiny(family)
    cache = prefilled(model, PAST[:2])
    with pytest.raises(ValueError, match="not supported for models with sliding-window"):
        tree_forward(model, cache, MODEL_TREE, ROOT_TOKEN, 2)
    with pytest.raises(ValueError, match="not supported for models with sliding-window"):
        check_tree_support(model)
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer"):
        compact_cache(cache, 1, [])
    # a cache built without the config still does not fool the check
    from transformers import DynamicCache

    with pytest.raises(ValueError, match="sliding-window"):
        tree_forward(model, DynamicCache(), MODEL_TREE, ROOT_TOKEN, 0)


def test_unsupported_attention_implementation_is_refused():
    model = tiny()
    saved = model.config._attn_implementation
    try:
        model.config._attn_implementation = "flash_attention_2"
        with pytest.raises(ValueError, match="attn_implementation"):
            check_tree_support(model)
    finally:
        model.config._attn_implementation = saved
    check_tree_support(model)
