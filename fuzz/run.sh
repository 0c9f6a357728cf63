#!/usr/bin/env bash
# Runs each fuzz target (all of them, or those named) for SECONDS and prints one line per
# target: executions, libFuzzer's coverage (cov: edges, ft: features), corpus size, and the
# crash file if one was found. Exits 1 if any target found a crash.
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and works on a stable toolchain:
# RUSTC_BOOTSTRAP=1 lets stable rustc accept the -Z flags cargo-fuzz passes (sanitizer,
# coverage instrumentation). Usage: fuzz/run.sh SECONDS [TARGET...]
set -euo pipefail

secs=${1:?usage: fuzz/run.sh SECONDS [TARGET...]}
shift
cd "$(dirname "$0")"
export RUSTC_BOOTSTRAP=1
# The targets build their test trees in TMPDIR: a scratch directory removed at the end,
# even when a crash skipped the targets' own clean-up.
scratch=$(mktemp -d)
export TMPDIR=$scratch
trap 'rm -rf "$scratch"' EXIT

if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo fuzz list)
fi

# Build everything first so build time is not counted as fuzzing time.
cargo fuzz build

logs=target/run-logs
mkdir -p "$logs"
status=0
printf '%-15s %6s %12s %8s %8s %7s  %s\n' target seconds execs cov ft corpus result
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  seeds=()
  [ -d "seeds/$t" ] && seeds=("seeds/$t")
  log="$logs/$t.log"
  start=$(date +%s)
  # No leak detection: a leak is no memory error in Rust, and LeakSanitizer reports the
  # catalog scan's worker thread (spawned every run) while it is still exiting.
  if cargo fuzz run "$t" "corpus/$t" "${seeds[@]}" -- \
      -max_total_time="$secs" -print_final_stats=1 -rss_limit_mb=4096 \
      -detect_leaks=0 >"$log" 2>&1; then
    result=ok
  else
    result="CRASH: $(sed -n 's/.*Test unit written to //p' "$log" | tail -n 1)"
    status=1
  fi
  elapsed=$(( $(date +%s) - start ))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corpus=$(find "corpus/$t" -type f | wc -l)
  printf '%-15s %6s %12s %8s %8s %7s  %s\n' "$t" "$elapsed" "${execs:-?}" "${cov:-?}" "${ft:-?}" "$corpus" "$result"
done
exit "$status"
