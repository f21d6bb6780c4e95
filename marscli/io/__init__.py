"""JSONL in and out. Callers import from the submodules; nothing is re-exported here.

- `marscli.io.records`: input parsing. JSONL lines -> validated `Request`s or `RecordError`s
  (prompt, chat messages, OpenAI batch lines, prompt-set records).
- `marscli.io.input_index`: the streamed input of a run: the index of a generate run
  (`index_input`, `InputIndex`, `RecordRef`), whole-input reading with a digest
  (`read_input`), duplicate ids.
- `marscli.io.results`: output. Results in input order (`ResultWriter`, `PartWriter`), atomic
  file replacement, reading an output back (`scan_output`), part files of data-parallel runs
  and their merge (`merge_results`).
- `marscli.io.resume`: resumable runs. The sidecar holding a run's fingerprint, fingerprint
  comparison, and `RunOutput`: where a run's results go, fresh or resumed.
- `marscli.io.openai_format`: result lines as OpenAI Batch API output lines.
- `marscli.io.console`: stderr narration (`Log`) and progress (`Progress`): stdout is data only.
- `marscli.io.distributed`: launchers (accelerate, torchrun), the process group of a
  data-parallel run, its shards, steps and progress exchanged between processes.
"""
