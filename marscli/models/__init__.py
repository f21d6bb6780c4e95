"""Models and how they run: loading (hub id, local folder, .gguf, packaged models; dtype,
device, device_map, 4/8-bit; tokenizer checks), where weights come from, the packaged
models' catalogue, the KV caches and the CPU fast path. Callers import from the submodules.

- ``loading``: ``load_model`` -> ``LoadedModel``; vocabulary checks between target and draft.
- ``sources``: embedded model, split GGUF packages (sha256-checked), .gguf, folder, hub id.
- ``catalog``: the packaged models `marscli models` lists.
- ``kvcache``: every KV cache (growing layers, rollback, holes, tree compaction).
- ``fastpath``: CPU kernels (GQA attention; few-row linear layers, oneDNN packed weights).

KV caches and the fast path live here, below the drafters and the engine, because both run
model forwards with them (a draft model is a model).
"""
