#!/usr/bin/env bash
# `stagefs bench` over plain local disk and over a loopback GlusterFS volume, each without and
# with compute per batch, all four methods (direct, stagefs with the hook's batch opens,
# stagefs-fuse, copy-first): the numbers of issues #17 and #28 (a table and a chart per run).
#
# Run by hand, as root, after `cargo build --release` (or with STAGEFS naming the binary; not
# in CI: it takes minutes, and timings on a shared machine are noisy, so read the ratios
# within one run):
#
#   bash tests/bench/bench_cmd.sh [OUT_DIR]     (default /tmp/stagefs-bench-cmd)
#
# FILES, EPOCHS, WORKERS and COMPUTE_MS override the defaults (2000 files of ~110 KB, 3
# epochs, 2 workers, 60 ms of compute per batch for the "with compute" runs). Needs
# glusterfs-server. The GlusterFS client caches nothing on the node (direct-io-mode=enable,
# quick-read off),
# as when the dataset is much larger than the node's memory; the bench drops the page cache
# before every epoch. Everything it creates is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT="${1:-/tmp/stagefs-bench-cmd}"
FILES="${FILES:-2000}"
EPOCHS="${EPOCHS:-3}"
WORKERS="${WORKERS:-2}"
COMPUTE_MS="${COMPUTE_MS:-60}"
STAGEFS="${STAGEFS:-$PWD/target/release/stagefs}"
GLUSTER="$PWD/tests/e2e/gluster.sh"
WORK="$(mktemp -d /var/tmp/stagefs-bench-cmd.XXXXXX)"
VOLUME=stagefsbenchcmd

[ -x "$STAGEFS" ] || { echo "build first: cargo build --release" >&2; exit 1; }
mkdir -p "$OUT"

cleanup() {
  "$GLUSTER" down "$VOLUME" "$WORK/bricks" "$WORK/gluster" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# make_dataset DIR FILES (tests/bench/dataset.sh)
# shellcheck source=tests/bench/dataset.sh
source tests/bench/dataset.sh

run() {
  local name="$1" source="$2" compute="$3"
  echo "=== $name: compute ${compute} ms per batch"
  "$STAGEFS" bench "$source" --cache "$WORK/cache" --epochs "$EPOCHS" --workers "$WORKERS" \
    --compute-ms "$compute" --methods direct,stagefs,stagefs-fuse,copy-first --json "$OUT/$name-compute$compute.json" | tee "$OUT/$name-compute$compute.txt"
}

mkdir -p "$WORK/cache" "$WORK/local"
make_dataset "$WORK/local" "$FILES"
run local "$WORK/local" 0
run local "$WORK/local" "$COMPUTE_MS"

GLUSTER_MOUNT_OPTIONS=direct-io-mode=enable "$GLUSTER" up "$VOLUME" "$WORK/bricks" "$WORK/gluster" >/dev/null
# quick-read would serve small files from the client's memory after the first read.
gluster --mode=script volume set "$VOLUME" performance.quick-read off >/dev/null
cp -r "$WORK/local/." "$WORK/gluster/"
run glusterfs "$WORK/gluster" 0
run glusterfs "$WORK/gluster" "$COMPUTE_MS"
echo "results in $OUT"
