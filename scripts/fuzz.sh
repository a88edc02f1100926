#!/usr/bin/env bash
# The long fuzz runs recorded in docs/FUZZING.md: every target (or those named
# as arguments: superblock, pool, request) on CXLKV_FUZZ_INPUTS inputs
# (default 10 000 000 each), built with the `fuzz` profile (optimised, with
# overflow checks and debug assertions). Logs, with the outcome histogram of
# each target, go to target/fuzz-logs/. A crash stops the run and saves the
# input under target/tmp/fuzz-crashes/ (see docs/FUZZING.md to replay it).
# `scripts/test.sh` runs the short smoke version through `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

inputs=${CXLKV_FUZZ_INPUTS:-10000000}
seed=${CXLKV_FUZZ_SEED:-12648430}
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(superblock nodes pool request)
fi
logs=target/fuzz-logs
mkdir -p "$logs"

cargo build --profile fuzz --locked --test fuzz
echo "== $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(rustc --version), $(nproc) cores"
for t in "${targets[@]}"; do
    echo "== fuzz $t: $inputs inputs, seed $seed"
    CXLKV_FUZZ_INPUTS=$inputs CXLKV_FUZZ_SEED=$seed CXLKV_FUZZ_PROGRESS_SECS=${CXLKV_FUZZ_PROGRESS_SECS:-60} \
        cargo test --profile fuzz --locked --test fuzz -- --exact "$t" --nocapture 2>&1 | tee "$logs/$t.log"
done
echo "== fuzz: ${targets[*]}: $inputs inputs each, 0 crashes"
