#!/usr/bin/env bash
# One arm of the sampled HumanEval quality table on the packaged Qwen2.5-Coder pair (issue 34),
# as a background `marscli generate --resume` job: run it again after an interruption and it
# appends the records still missing (the settings must be the same; a sampled run's resume
# fingerprint includes the batch size).
#
#   scripts/quality_qwen_humaneval.sh ARM [OUTDIR]
#
# ARM: strict | mars | mars-code (MARS with --strict-in code) | ratio (needs RHO)
#
# Environment (all optional):
#   THETA        MARS's theta (default 0.8604, the pair's calibrated profile)
#   RHO          ratio's rho (fit it to MARS's relaxed share: scripts/fit_matched_knobs.py)
#   TEMPERATURE  (default 1)   TOP_P (default 1)   SEED (default 0: every record's stream starts
#                from it, the same in every arm, so paired differences come from the rule)
#   MAX_TOKENS   (default 1024)   BATCH (default 16)   LIMIT (default 164: all of HumanEval)
#   DRAFT        (default qwen2.5-coder-0.5b-instruct)   DRAFT_QUANT (default int8)
#   PROMPTS_DIR  (default ../shared/data/prompts)   PYTHON (default python)
#
# The defaults finish soonest on a 2-core CPU (HumanEval 1-16, 128 tokens, temperature 1,
# strict, 2026-11-26): the int8 0.5B draft model batched across rows 9.3 tokens/s at batch
# 16 and 8.7 at 8, against hybrid drafting (one draft model per row) ~6.0 at batch 1 and
# ~5 at 8. Speed at batch size 1 is bench's business, not this script's.
#
# Writes OUTDIR (default quality-qwen/) /ARM.jsonl (results; score them with
# scripts/quality_table.py) and appends to ARM.log: stderr, then a line
# "wall seconds: S, exit code: C" per run, which quality_table.py sums.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/background_marscli.sh
source scripts/background_marscli.sh
arm=${1:?usage: $0 strict|mars|mars-code|ratio [OUTDIR]}
out=${2:-quality-qwen}
theta=${THETA:-0.8604}
case "$arm" in
  strict) rule=(--verify strict) ;;
  mars) rule=(--verify mars --theta "$theta") ;;
  mars-code) rule=(--verify mars --theta "$theta" --strict-in code) ;;
  ratio) rule=(--verify ratio --rho "${RHO:?ratio needs RHO}") ;;
  *) echo "unknown arm $arm (strict, mars, mars-code, ratio)" >&2; exit 2 ;;
esac
prompts="${PROMPTS_DIR:-../shared/data/prompts}/humaneval.jsonl"
[ -f "$prompts" ] || { echo "prompt set $prompts not found" >&2; exit 2; }
mkdir -p "$out"
args=(generate "$prompts" -o "$out/$arm.jsonl" --resume --limit "${LIMIT:-164}"
      --target qwen2.5-coder-1.5b-instruct --draft "${DRAFT:-qwen2.5-coder-0.5b-instruct}"
      --draft-quant "${DRAFT_QUANT:-int8}" --dtype float32 --device cpu
      --temperature "${TEMPERATURE:-1}" --top-p "${TOP_P:-1}" --seed "${SEED:-0}"
      --max-tokens "${MAX_TOKENS:-1024}" --batch-size "${BATCH:-16}" "${rule[@]}")
background_marscli "$out/$arm.log" append "${args[@]}"
echo "started: ${PYTHON:-python} -m marscli ${args[*]}" >&2
echo "log: $out/$arm.log   results: $out/$arm.jsonl" >&2
