"""Independent oracles the tests compare the engine with (fixtures are in conftest.py)."""

from __future__ import annotations

import torch


def hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    """transformers' own greedy generate(): the reference for strict greedy output. Give it a
    model the engine never patched (conftest's ``oracle``) unless the patched kernels are
    what is being checked against (int8 weights: the quantized model is the reference)."""
    dev = model.device  # the CPU, or the GPU for tests/test_cuda.py
    out = model.generate(torch.tensor([ids], device=dev),
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                         do_sample=False, max_new_tokens=max_new,
                         pad_token_id=model.generation_config.pad_token_id)
    return out[0, len(ids):].tolist()
