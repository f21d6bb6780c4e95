# Sourced by the scripts that start a long marscli job in the background (bench_qwen_task.sh,
# calibrate_qwen.sh, quality_qwen_humaneval.sh, quality_qwen_quant.sh), so that the wrapper
# lives in one place.
#
#   background_marscli LOG append|new ARGS...
#
# Runs ${PYTHON:-python} -m marscli ARGS under nohup, detached from the terminal, with stdout
# and stderr going to LOG (appended to, or replaced), then appends the line
# "wall seconds: S, exit code: C" (scripts/quality_table.py sums those lines). Prints the
# job's pid.
background_marscli() {
  local log=$1 mode=$2
  shift 2
  # shellcheck disable=SC2016  # expanded by the inner shell, not here
  local job='start=$(date +%s); "$0" -m marscli "$@"; rc=$?; echo "wall seconds: $(( $(date +%s) - start )), exit code: $rc"'
  if [ "$mode" = append ]; then
    nohup bash -c "$job" "${PYTHON:-python}" "$@" >> "$log" 2>&1 < /dev/null &
  else
    nohup bash -c "$job" "${PYTHON:-python}" "$@" > "$log" 2>&1 < /dev/null &
  fi
  echo "$!"
}
