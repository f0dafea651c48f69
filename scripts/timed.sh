#!/usr/bin/env bash
# `scripts/timed.sh NAME CMD...`: run CMD, then print how long phase NAME took (and append it to the run's
# summary, $LMQ_PHASES); `scripts/timed.sh --summary` prints every phase of the run so far and clears it.
set -uo pipefail
phases=${LMQ_PHASES:-.venv/.phase-times}
if [ "${1:-}" = "--summary" ]; then
  echo "== make test phases (seconds):"
  [ -f "$phases" ] && cat "$phases"
  rm -f "$phases"
  exit 0
fi
name=$1
shift
start=$(date +%s)
"$@"
status=$?
took=$(( $(date +%s) - start ))
mark=ok
[ $status -eq 0 ] || mark="FAILED (exit $status)"
printf '%6d  %s %s\n' "$took" "$name" "$mark" | tee -a "$phases"
exit $status
