#!/usr/bin/env bash
# One arm of the int8 quality table on the packaged Qwen2.5-Coder pair (issue 35, item 3):
# greedy decoding of the 1.5B target as float32 or as `--quant int8`, as a background
# `marscli generate --resume` job (run it again after an interruption: it appends the
# records still missing). Strict verification with the int8 0.5B draft model only makes it
# faster: strict greedy output is the target's own greedy decoding (tested), so the two arms
# differ by the target's weights alone. Pair them with
#
#   scripts/quality_table.py OUTDIR --task TASK --arms f32,int8 --baseline f32 [--prompts FILE]
#
#   scripts/quality_qwen_quant.sh TASK QUANT [OUTDIR]     TASK: humaneval | gsm8k; QUANT: f32 | int8
#
# Environment (all optional): LIMIT (default 40), MAX_TOKENS (default: humaneval 512,
# gsm8k 400), BATCH (default 16: quality only, and a record's text does not depend on it),
# PROMPTS_DIR (default ../shared/data/prompts), PYTHON (default python).
# Writes OUTDIR (default quality-int8/TASK; one folder per task, as the table's files are
# per folder) /QUANT.jsonl and appends to QUANT.log:
# stderr, then "wall seconds: S, exit code: C" per run.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/background_marscli.sh
source scripts/background_marscli.sh
task=${1:?usage: $0 humaneval|gsm8k f32|int8 [OUTDIR]}
quant=${2:?usage: $0 humaneval|gsm8k f32|int8 [OUTDIR]}
out=${3:-quality-int8/$task}
case "$task" in
  humaneval) default_max=512 ;;
  gsm8k) default_max=400 ;;
  *) echo "unknown task $task (humaneval, gsm8k)" >&2; exit 2 ;;
esac
case "$quant" in
  f32) q=() ;;
  int8) q=(--quant int8) ;;
  *) echo "unknown weights $quant (f32, int8)" >&2; exit 2 ;;
esac
prompts="${PROMPTS_DIR:-../shared/data/prompts}/$task.jsonl"
[ -f "$prompts" ] || { echo "prompt set $prompts not found" >&2; exit 2; }
mkdir -p "$out"
args=(generate "$prompts" -o "$out/$quant.jsonl" --resume --limit "${LIMIT:-40}"
      --target qwen2.5-coder-1.5b-instruct "${q[@]}" --draft qwen2.5-coder-0.5b-instruct --draft-quant int8
      --dtype float32 --device cpu --temperature 0 --verify strict
      --max-tokens "${MAX_TOKENS:-$default_max}" --batch-size "${BATCH:-16}")
background_marscli "$out/$quant.log" append "${args[@]}"
echo "started: ${PYTHON:-python} -m marscli ${args[*]}" >&2
echo "log: $out/$quant.log   results: $out/$quant.jsonl" >&2
