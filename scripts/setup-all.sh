#!/usr/bin/env bash
# Both environments at once: scripts/setup.sh (.venv) and scripts/setup-vllm.sh (.venv-vllm) in parallel. Each
# install is mostly downloads and unpacking and keeps about one core busy, so on 2 cores the two together take
# about as long as the longer one (fresh clones: 169-219 s against 274 s one after the other, docs/benchmarks.md).
# Exits non-zero if either failed; their own output says which and why.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh &
main=$!
bash scripts/setup-vllm.sh &
vllm=$!
wait "$main"
main_rc=$?
wait "$vllm"
vllm_rc=$?
echo "setup-all: .venv exit ${main_rc}, .venv-vllm exit ${vllm_rc}, in ${SECONDS} s" >&2
[ "$main_rc" = 0 ] && [ "$vllm_rc" = 0 ]
