#!/usr/bin/env bash
# Calibrate a MARS profile for the packaged Qwen2.5-Coder pair on prompts the benchmark does
# NOT evaluate: HumanEval records SKIP+1 .. SKIP+M and GSM8K records SKIP+1 .. SKIP+M (bench
# --limit N scores the first N, so use SKIP >= N). Background job; prints its pid.
#
#   scripts/calibrate_qwen.sh SKIP M [DRAFT]     DRAFT: qwen2.5-coder-0.5b-instruct (default) or ngram
#
# Writes profiles/qwen2.5-coder-1.5b-instruct.DRAFTER.float32.yaml (the shipped-profile folder;
# commit it to ship it) and calibrate-qwen-DRAFTER.log. Policy: --max-nll-increase 0.02 (the
# default). Wall time: 2*M records x ~200 tokens x ~0.4 s = about 1.5 hours for M=32 at batch
# size 1; BATCH_SIZE (default 1) decodes that many records together, which on this CPU roughly
# halves the wall time at 4 (the margins are the target's own, whatever the batch).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/background_marscli.sh
source scripts/background_marscli.sh
skip=${1:?usage: $0 SKIP M [DRAFT]}
m=${2:?usage: $0 SKIP M [DRAFT]}
draft=${3:-qwen2.5-coder-0.5b-instruct}
dir="${PROMPTS_DIR:-../shared/data/prompts}"
kind=$([ "$draft" = ngram ] && echo ngram || echo qwen2.5-coder-0.5b-instruct)
name="qwen2.5-coder-1.5b-instruct.$kind.float32"
calib=$(mktemp --suffix=.jsonl)
# ids are prefixed with the set's name: both sets number their records from 0
"${PYTHON:-python}" - "$dir" "$skip" "$m" > "$calib" <<'PY'
import json, sys
folder, skip, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for name in ("humaneval", "gsm8k"):
    with open(f"{folder}/{name}.jsonl", encoding="utf-8") as f:
        for line in list(f)[skip:skip + m]:
            record = json.loads(line)
            record["question_id"] = f"{name}-{record['question_id']}"
            print(json.dumps(record, ensure_ascii=False))
PY
log="calibrate-qwen-$kind.log"
background_marscli "$log" new calibrate "$calib" --target qwen2.5-coder-1.5b-instruct --draft "$draft" \
  --dtype float32 --device cpu --max-tokens "${MAX_TOKENS:-256}" --batch-size "${BATCH_SIZE:-1}" --name "$name" -o "profiles/$name.yaml"
echo "calibrating on $(wc -l < "$calib") records from $calib; log: $log; profile: profiles/$name.yaml" >&2
