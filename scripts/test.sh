#!/usr/bin/env bash
# The test suite, in timed phases (after scripts/setup.sh, and scripts/setup-vllm.sh for the vllm phase):
#
#   bash scripts/test.sh fast   the fast tier: tests/unit, pure logic, no process started (about 1 min on 2 cores)
#   bash scripts/test.sh        everything (CI): unit, then integration + slurm, then vllm_cpu
#
# Each phase prints its slowest tests; the end prints each phase's wall time and exit status, and the script
# exits non-zero if any phase failed (every phase runs regardless). pytest-xdist spreads each phase over
# workers: ESBATCH_TEST_WORKERS_UNIT / _MAIN / _VLLM set their numbers (docs/benchmarks.md, "Test suite time":
# what the defaults gave; they were not tuned side by side). Extra arguments go to every pytest call (-x, -k EXPR).
set -uo pipefail
cd "$(dirname "$0")/.."
tier=all
case "${1:-}" in
  fast | all) tier=$1; shift ;;
esac

declare -a names=() secs=() codes=()
phase() {  # phase NAME COMMAND...
  local name=$1 t0 rc
  shift
  echo "=== phase $name: $*" >&2
  t0=$(date +%s)
  "$@"
  rc=$?
  names+=("$name") secs+=($(($(date +%s) - t0))) codes+=("$rc")
  echo "=== phase $name: exit $rc after ${secs[-1]} s" >&2
}

phase unit .venv/bin/python -m pytest -q -p no:cacheprovider -n "${ESBATCH_TEST_WORKERS_UNIT:-2}" \
  --durations=10 tests/unit "$@"
if [ "$tier" = all ]; then
  # the SLURM tests share one cluster (its fixture starts and stops it): one xdist group, so one worker
  phase integration+slurm .venv/bin/python -m pytest -q -p no:cacheprovider \
    -n "${ESBATCH_TEST_WORKERS_MAIN:-3}" --dist loadgroup --durations=30 tests/slurm tests/integration "$@"
  phase vllm .venv-vllm/bin/python -m pytest -q -p no:cacheprovider -n "${ESBATCH_TEST_WORKERS_VLLM:-2}" \
    --dist loadgroup --durations=30 tests/vllm_cpu "$@"
fi

status=0
echo
echo "phase               seconds  exit"
for i in "${!names[@]}"; do
  printf '%-19s %7s  %s\n' "${names[$i]}" "${secs[$i]}" "${codes[$i]}"
  [ "${codes[$i]}" = 0 ] || status=1
done
exit "$status"
