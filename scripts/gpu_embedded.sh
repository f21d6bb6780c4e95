#!/usr/bin/env bash
# The CUDA paths on a GPU machine, in one short run (docs/gpu.md has the last run's figures):
# the embedded SmolLM2-135M with its shipped EAGLE-3 head, bfloat16, greedy and temperature 1,
# chains and trees; bitsandbytes 4-bit and 8-bit targets; batched throughput with n-gram;
# records/s of a short-output batch job against generate() (bench --throughput).
# Each step has its own time limit, so one that fails or hangs leaves the others' figures.
# The defaults fit one 10-minute device call: on the H200 lent on 2026-11-27 the engine ran
# ~15 tokens/s on this model (a 21 ms forward, launch-bound, plus the engine's per-step
# work), and bitsandbytes 8-bit ~5x slower.
#
#   scripts/gpu_embedded.sh OUTDIR PROMPTS_DIR
#
# PROMPTS_DIR holds humaneval8.jsonl (HumanEval 1-8) and mt32.jsonl (MT-Bench, 16 or more).
# Environment: PYTHON (python3), LIMIT (HumanEval records, 3), MAX_TOKENS (64),
# THETA (0.9299, the embedded model's profile), STEP_TIMEOUT (seconds per step, 150),
# DEVICE (cuda; cpu for a dry run of the arguments).
# Writes OUTDIR/NAME.json (bench reports), OUTDIR/NAME.log (stderr: the tables) and
# OUTDIR/summary.txt (one line per step: exit code and wall seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: $0 OUTDIR PROMPTS_DIR}
prompts=${2:?usage: $0 OUTDIR PROMPTS_DIR}
py=${PYTHON:-python3}
limit=${LIMIT:-3}
mt=${MAX_TOKENS:-64}
theta=${THETA:-0.9299}
mkdir -p "$out"
export COLUMNS=220 PYTHONUNBUFFERED=1

step() {  # step NAME TIMEOUT ARGS...: one marscli bench run
  local name=$1 limit_s=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit_s" "$py" -m marscli bench "$@" --report "$out/$name.json" > /dev/null 2> "$out/$name.log"
  rc=$?
  echo "$name rc=$rc wall_s=$(( $(date +%s) - start ))" | tee -a "$out/summary.txt"
}

dev=${DEVICE:-cuda}
he=("$prompts/humaneval8.jsonl" --limit "$limit" --max-tokens "$mt" --device "$dev" --seeds 0)
t=${STEP_TIMEOUT:-150}
step bf16-head-t0 "$t" "${he[@]}" --dtype bfloat16 --draft eagle3 \
  --methods "hf-generate,ar,strict,mars@$theta,strict-tree,mars-tree@$theta"
step bf16-head-t1 "$t" "${he[@]}" --dtype bfloat16 --draft eagle3 --temperature 1 \
  --methods "ar,strict,mars@$theta,strict-tree,mars-tree@$theta"
step nf4-head-t0 "$t" "${he[@]}" --quant 4bit --draft eagle3 --methods "hf-generate,ar,strict,mars@$theta"
step int8-head-t0 "$t" "${he[@]}" --quant int8 --draft eagle3 --methods "hf-generate,ar,strict,mars@$theta"
step bf16-ngram-batch "$t" "$prompts/mt32.jsonl" --limit 8 --max-tokens 32 --device "$dev" --dtype bfloat16 \
  --draft ngram --methods "ar,strict,mars@$theta" --batch-size 1,8
# Batch jobs (issue 53): short-output labelling records, records/s against generate() at the
# same batch size, batched prefill and the prefix cache included.
"$py" scripts/throughput_records.py labelling 1024 > "$out/labelling.jsonl"
step bf16-throughput "$t" "$out/labelling.jsonl" --throughput --batch-size 64,256 --device "$dev" \
  --dtype bfloat16 --draft none --methods hf-generate,ar --max-tokens 4
