#!/usr/bin/env bash
# The test suite, in timed phases (after scripts/setup.sh, and scripts/setup-vllm.sh for the vllm phase):
#
#   bash scripts/test.sh fast   the fast tier: tests/unit, pure logic, no process started (about 1 min on 2 cores)
#   bash scripts/test.sh        everything (CI): unit, then integration + slurm, then vllm_cpu
#   ESBATCH_STRESS=N bash scripts/test.sh ...   races, chaos and signal storms (pytest -m stress) N times, not once
#
# Each phase prints its slowest tests; the end prints each phase's wall time, exit status and share of the CI
# budget (35 min on 2 cores, set-up included: BUDGET below; the set-up's time when .ci/run started it), then names
# every unit case over 1 s and every other case over 60 s (reported, not failed: move or speed them up). The
# script exits non-zero if any phase failed (every phase runs regardless). pytest-xdist spreads each phase over
# workers: ESBATCH_TEST_WORKERS_UNIT / _MAIN / _VLLM set their numbers (docs/benchmarks.md, "Test suite time"),
# the longest scopes first (--no-loadscope-reorder: tests/conftest.py orders them by tests/durations.json).
# Every process a test starts uses one thread (tests/conftest.py: OMP_NUM_THREADS=1), and each vllm worker keeps
# to its own cores (tests/vllm_cpu/conftest.py; ESBATCH_TEST_PIN=0 turns that off): threads of two workers
# sharing a core wait on each other's time slices at every OpenMP barrier (5-7x slower, measured).
# Extra arguments go to every pytest call (-x, -k EXPR).
set -uo pipefail
cd "$(dirname "$0")/.."
tier=all
case "${1:-}" in
  fast | all) tier=$1; shift ;;
esac

# each phase's share of the 35-minute budget, in seconds (set-up: scripts/setup-all.sh, timed by .ci/run)
declare -A BUDGET=([set-up]=180 [unit]=90 [integration+slurm]=1200 [vllm]=630)
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
declare -a names=() secs=() codes=()
if [ -n "${ESBATCH_CI_START:-}" ]; then names+=(set-up) secs+=($(($(date +%s) - ESBATCH_CI_START))) codes+=(0); fi
phase() {  # phase NAME COMMAND...
  local name=$1 t0 rc
  shift
  echo "=== phase $name: $*" >&2
  t0=$(date +%s)
  "$@" --junit-xml="$reports/${#names[@]}-$name.xml"
  rc=$?
  names+=("$name") secs+=($(($(date +%s) - t0))) codes+=("$rc")
  echo "=== phase $name: exit $rc after ${secs[-1]} s" >&2
}

# esbatch's and the tests' bytecode, once for the hundreds of processes the phases start: where
# PYTHONDONTWRITEBYTECODE is set (CI's machines), none of them can write it, and each compiled what it imported again
.venv/bin/python -m compileall -q esbatch tests > /dev/null
phase unit .venv/bin/python -m pytest -q -p no:cacheprovider -n "${ESBATCH_TEST_WORKERS_UNIT:-2}" \
  --durations=10 tests/unit "$@"
if [ "$tier" = all ]; then
  # the SLURM tests share one cluster (its fixture starts and stops it): one xdist group, so one worker
  phase integration+slurm .venv/bin/python -m pytest -q -p no:cacheprovider \
    -n "${ESBATCH_TEST_WORKERS_MAIN:-3}" --dist loadgroup --no-loadscope-reorder --durations=30 \
    tests/slurm tests/integration "$@"
  phase vllm .venv-vllm/bin/python -m pytest -q -p no:cacheprovider -n "${ESBATCH_TEST_WORKERS_VLLM:-2}" \
    --dist loadgroup --no-loadscope-reorder --durations=30 tests/vllm_cpu "$@"
fi

status=0 total=0 budget=0
echo
echo "phase               seconds  exit  budget  share"
for i in "${!names[@]}"; do
  n=${names[$i]} s=${secs[$i]}
  printf '%-19s %7s  %4s  %6s  %4s%%\n' "$n" "$s" "${codes[$i]}" "${BUDGET[$n]}" $((100 * s / BUDGET[$n]))
  total=$((total + s)) budget=$((budget + BUDGET[$n]))
  [ "${codes[$i]}" = 0 ] || status=1
done
printf '%-19s %7s  %4s  %6s  %4s%%   (CI budget: 2100 s = 35 min, set-up included)\n' all "$total" "" "$budget" \
  $((100 * total / budget))
# the guard: the cases that eat the budget, by name (a unit case is pure logic: milliseconds, not seconds)
.venv/bin/python - "$reports" <<'PY'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

slow = []
for f in sorted(Path(sys.argv[1]).glob("*.xml")):
    limit = 1.0 if f.stem.endswith("-unit") else 60.0
    try:
        cases = ET.parse(f).getroot().iter("testcase")
    except (ET.ParseError, OSError):
        continue  # the phase did not get as far as writing its report (its exit status says why)
    for c in cases:
        t = float(c.get("time") or 0)  # setup + call + teardown
        if t > limit:
            slow.append((f.stem.split("-", 1)[1], limit, t, f"{c.get('classname', '')}::{c.get('name', '')}"))
print(f"\nslow cases (unit over 1 s, others over 60 s; reported, not failed): {len(slow)}")
for phase, limit, t, name in sorted(slow, key=lambda x: (x[0], -x[2])):
    print(f"  {phase:<18} {t:7.1f} s > {limit:g} s  {name}")
PY
exit "$status"
