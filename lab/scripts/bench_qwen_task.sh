#!/usr/bin/env bash
# bench --task on the packaged Qwen2.5-Coder pair, as a background job writing its report.
#
#   scripts/bench_qwen_task.sh TASK N [OUTDIR]      TASK: humaneval, gsm8k or sum; N: first N records
#
# Environment (all optional):
#   METHODS     bench methods (default ar,strict,mars: ar gives the speed-up over plain decoding
#               and is checked token for token against strict)
#   THETAS      MARS thresholds, comma-separated (default 0.9)
#   PROFILE     a calibrated profile (name or YAML path): its theta joins THETAS (mars@profile-theta)
#   DRAFT       drafter (default qwen2.5-coder-0.5b-instruct; "ngram" for prompt lookup)
#   MAX_TOKENS  (default: humaneval 384, gsm8k 320, sum 128)
#   PROMPTS_DIR (default ../shared/data/prompts, relative to the repository root)
#   PYTHON      (default python)
#   EXTRA_ARGS  further bench options, split on spaces (e.g. "--draft-quant int8")
#   SKIP        leave out the first SKIP records, i.e. measure records SKIP+1 .. SKIP+N (default 0),
#               so that a long table can be measured in chunks, one per session, and merged with
#               scripts/merge_bench_reports.py; the report is then bench-TASK-SKIP+N.json
#
# Prints the background job's pid. OUTDIR (default bench-qwen/) gets
#   bench-TASK-N.json  the report (its "task" section: per-method score, CI, paired diff, flips, recovery)
#   bench-TASK-N.log   stderr: progress, the tables, and a last line "wall seconds: S, exit code: C"
#
# Wall time, from the issue's ~0.5 s per target token (float32, 2-core CPU) and a draft
# model costing about a third of the target per token (so speculative decoding with it is
# only ~1.2-1.5x faster than plain decoding on this CPU): per method about
# N x (mean answer length) x 0.5 s for ar and ~0.35-0.4 s per token for strict and each mars
# theta. HumanEval chat answers run ~200-300 tokens, GSM8K ~150-250: with METHODS=ar,strict,mars
# and two thetas, N=40 takes about 4-5 hours per task, N=20 about 2-2.5 hours. Loading the
# pair takes ~1-2 minutes (the first run also assembles and converts it: ~3 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/background_marscli.sh
source scripts/background_marscli.sh
task=${1:?usage: $0 humaneval|gsm8k|sum N [OUTDIR]}
n=${2:?usage: $0 humaneval|gsm8k|sum N [OUTDIR]}
out=${3:-bench-qwen}
case "$task" in
  humaneval) default_max=384 ;;
  gsm8k) default_max=320 ;;
  sum) default_max=128 ;;
  *) echo "unknown task $task (humaneval, gsm8k, sum)" >&2; exit 2 ;;
esac
prompts="${PROMPTS_DIR:-../shared/data/prompts}/$task.jsonl"
[ -f "$prompts" ] || { echo "prompt set $prompts not found" >&2; exit 2; }
mkdir -p "$out"
skip=${SKIP:-0}
tag=$([ "$skip" = 0 ] && echo "$n" || echo "$skip+$n")
report="$out/bench-$task-$tag.json"
log="$out/bench-$task-$tag.log"
if [ "$skip" != 0 ]; then
  # records keep their question_id, which is what the task scorer matches on
  slice="$out/prompts-$task-$tag.jsonl"
  sed -n "$((skip + 1)),$((skip + n))p" "$prompts" > "$slice"
  prompts="$slice"
fi
args=(bench "$prompts" --limit "$n" --task "$task"
      --target qwen2.5-coder-1.5b-instruct --draft "${DRAFT:-qwen2.5-coder-0.5b-instruct}"
      --methods "${METHODS:-ar,strict,mars}" --theta "${THETAS:-0.9}"
      --max-tokens "${MAX_TOKENS:-$default_max}" --dtype float32 --device cpu --report "$report")
if [ -n "${PROFILE:-}" ]; then args+=(--profile "$PROFILE"); fi
# shellcheck disable=SC2206  # word splitting is the point: a list of options
if [ -n "${EXTRA_ARGS:-}" ]; then args+=(${EXTRA_ARGS}); fi
background_marscli "$log" new "${args[@]}"
echo "started: ${PYTHON:-python} -m marscli ${args[*]}" >&2
echo "log: $log   report: $report" >&2
