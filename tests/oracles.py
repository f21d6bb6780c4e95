"""Independent oracles the tests compare the engine with (fixtures are in conftest.py)."""

from __future__ import annotations

import torch


def hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    """transformers' own greedy generate(): the reference for strict greedy output. Give it a
    model the engine never patched (conftest's ``oracle``) unless the patched kernels are
    what is being checked against (int8 weights: the quantized model is the reference)."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new,
                         pad_token_id=model.generation_config.pad_token_id)
    return out[0, len(ids):].tolist()
