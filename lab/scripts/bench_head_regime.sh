#!/usr/bin/env bash
# MARS in the paper's regime, in miniature (issue 33): on the embedded SmolLM2-135M-Instruct,
# the shipped EAGLE-3 head against the n-gram drafter, greedy and temperature 1, chain and
# tree, strict, MARS and the ratio rule, both relaxed rules fitted to the same relaxed share.
#
#   scripts/bench_head_regime.sh OUTDIR [PROMPTS]
#
# PROMPTS (default ../shared/data/prompts/sum.jsonl, CNN/DailyMail articles; TASK=sum scores
# ROUGE-L) are measured on their first LIMIT records. MARS runs at THETA (default the embedded
# model's profile theta, 0.9299) with both drafters: how much it relaxes, and what that buys,
# is the drafter's doing. The ratio rule is fitted to the share MARS relaxes, per drafter and
# temperature, on the records after the measured ones (scripts/fit_matched_knobs.py, CALIB
# calibration records, decoded at the bench's temperature and seed). One bench run per drafter
# and temperature, each with its own ar (the x ar column) and strict (the paired baseline):
#   OUTDIR/{eagle3,ngram}-t{0,1}.json        bench reports (speed, tau, task section)
#   OUTDIR/{eagle3,ngram}-t{0,1}.log         stderr (tables), last line "wall seconds: S, exit code: C"
#   OUTDIR/{eagle3,ngram}-t{0,1}.knobs.json  the ratio fit
#
# Environment (all optional): LIMIT (20), CALIB (calibration records, 20), THETA (0.9299),
# MAX_TOKENS (128), TASK (sum; 'none' for prompts without references, e.g. held-out @stdlib
# records: speed, tau and relaxed share only),
# HEAD (eagle3: the head shipped for the target), TEMPS ("0 1"), PYTHON (python), NO_FIT
# (set: no ratio rule, no fit: ar, strict and MARS only, plus the trees),
# EXTRA_ARGS (further bench options, split on spaces).
# Run it with nothing else on the machine: it measures speed.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: $0 OUTDIR [PROMPTS]}
prompts=${2:-../shared/data/prompts/sum.jsonl}
limit=${LIMIT:-20}
theta=${THETA:-0.9299}
max_tokens=${MAX_TOKENS:-128}
task=()
[ "${TASK:-sum}" = none ] || task=(--task "${TASK:-sum}")
head=${HEAD:-eagle3}
py=${PYTHON:-python}
read -r -a extra <<< "${EXTRA_ARGS:-}"
mkdir -p "$out"
for t in ${TEMPS:-0 1}; do
  for drafter in "$head" ngram; do
    name=$([ "$drafter" = ngram ] && echo ngram || echo eagle3)
    log="$out/$name-t$t.log"
    start=$(date +%s)
    set +e
    fitted=mars@$theta rc=0
    if [ -z "${NO_FIT:-}" ]; then
      fitted=$("$py" scripts/fit_matched_knobs.py --calibrate-on "$prompts" --input "$prompts" \
        --limit "$limit" --reference "mars@$theta" --rules ratio --draft "$drafter" --calibration-records "${CALIB:-20}" \
        --max-tokens "$max_tokens" --temperature "$t" --out "$out/$name-t$t.knobs.json" 2> "$log")
      rc=$?
    fi
    if [ $rc -eq 0 ]; then
      methods=ar,strict,$fitted
      [ "$name" = eagle3 ] && methods=$methods,strict-tree,mars-tree@$theta
      "$py" -m marscli bench "$prompts" --limit "$limit" "${task[@]}" --draft "$drafter" \
        --methods "$methods" --temperature "$t" --seeds 0 --max-tokens "$max_tokens" \
        --dtype float32 --device cpu --report "$out/$name-t$t.json" "${extra[@]}" 2>> "$log" > /dev/null
      rc=$?
    fi
    set -e
    echo "wall seconds: $(( $(date +%s) - start )), exit code: $rc" >> "$log"
    echo "$name t=$t: $(tail -n 1 "$log")" >&2
  done
done
