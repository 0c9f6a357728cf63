#!/usr/bin/env bash
# Four "nodes" on this host over one loopback GlusterFS volume (world 4, a rank each, each
# cache twice its share), three epochs read together (a barrier per epoch, as DDP steps), once
# without peers and once with them: per epoch, the seconds and what the nodes read from the
# file system and from each other. The numbers of issue #30's goals ("≤ 5% from SOURCE in
# epochs 1-2", "epoch times with peers no slower than without").
#
# Run by hand, as root, after `cargo build --release` (not in CI: timings on a shared 2-core
# machine are noisy; read the ratios within one run):
#
#   bash tests/bench/peers_bench.sh
#
# FILES (default 2000, ~110 KB each) and EPOCHS (3) override the defaults. Needs
# glusterfs-server. The GlusterFS client caches nothing (direct-io-mode=enable, quick-read
# off) and the page cache is dropped before each epoch. Everything it creates is removed.
set -euo pipefail
cd "$(dirname "$0")/../.."

FILES="${FILES:-2000}"
EPOCHS="${EPOCHS:-3}"
NODES=4
STAGEFS="${STAGEFS:-$PWD/target/release/stagefs}"
GLUSTER="$PWD/tests/e2e/gluster.sh"
WORK="$(mktemp -d /var/tmp/stagefs-peers-bench.XXXXXX)"
VOLUME=stagefspeersbench
BASE_PORT=17400

[ -x "$STAGEFS" ] || { echo "build first: cargo build --release" >&2; exit 1; }

unmount_all() {
  for i in $(seq 0 $((NODES - 1))); do
    "$STAGEFS" unmount "$WORK/m$i" >/dev/null 2>&1 || true
  done
}
cleanup() {
  unmount_all
  "$GLUSTER" down "$VOLUME" "$WORK/bricks" "$WORK/gluster" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# The dataset: FILES files of ~110 KB in 20 classes (tests/bench/dataset.sh).
# shellcheck source=tests/bench/dataset.sh
source tests/bench/dataset.sh
GLUSTER_MOUNT_OPTIONS=direct-io-mode=enable "$GLUSTER" up "$VOLUME" "$WORK/bricks" "$WORK/gluster" >/dev/null
gluster --mode=script volume set "$VOLUME" performance.quick-read off >/dev/null
make_dataset "$WORK/gluster" "$FILES"
total=$(du -sb --apparent-size "$WORK/gluster" | cut -f1)
cache=$((2 * total / NODES))
head -c 32 /dev/urandom | base64 >"$WORK/secret"
chmod 600 "$WORK/secret"
flags=(--sampler torch-distributed --seed 0 --world-size "$NODES")
peers=$(for i in $(seq 0 $((NODES - 1))); do printf '127.0.0.1:%s,' $((BASE_PORT + i)); done)

# Sums KEY over the nodes' statistics.
summed() {
  local sum=0 i
  for i in $(seq 0 $((NODES - 1))); do
    sum=$((sum + $("$STAGEFS" stats --json "$WORK/m$i" |
      /usr/bin/python3 -c "import json, sys; print(json.load(sys.stdin)['$1'])")))
  done
  echo "$sum"
}

# Mounts the four nodes (with peers if $1 is "peers"), reads EPOCHS epochs, prints a line each.
run() {
  local name=$1 i
  for i in $(seq 0 $((NODES - 1))); do
    mkdir -p "$WORK/m$i"
    rm -rf "$WORK/c$i"
    local own=()
    [ "$name" != peers ] || own=(--node "$i" --peers "${peers%,}" --peer-secret-file "$WORK/secret")
    "$STAGEFS" mount "$WORK/gluster" "$WORK/m$i" --cache "$WORK/c$i" --cache-size "$cache" \
      "${flags[@]}" --rank "$i" "${own[@]}" &
  done
  wait
  local source_before=0 peer_before=0 misses_before=0 epoch
  for epoch in $(seq 0 $((EPOCHS - 1))); do
    sync
    echo 3 >/proc/sys/vm/drop_caches
    local started
    started=$(date +%s.%N)
    for i in $(seq 0 $((NODES - 1))); do
      "$STAGEFS" order --source "$WORK/gluster" "${flags[@]}" --rank "$i" --epoch "$epoch" --paths |
        (cd "$WORK/m$i" && xargs -d '\n' cat >/dev/null) &
    done
    wait
    local seconds source peer misses
    seconds=$(echo "$(date +%s.%N) - $started" | bc)
    source=$(summed source_bytes)
    peer=$(summed peer_bytes)
    misses=$(summed misses)
    printf '%-6s epoch %s: %6.2f s  from SOURCE %7.1f MB (%5.1f%% of the dataset)  from peers %7.1f MB  misses %5d\n' \
      "$name" "$epoch" "$seconds" "$(echo "($source - $source_before) / 1000000" | bc -l)" \
      "$(echo "100 * ($source - $source_before) / $total" | bc -l)" \
      "$(echo "($peer - $peer_before) / 1000000" | bc -l)" "$((misses - misses_before))"
    source_before=$source peer_before=$peer misses_before=$misses
  done
  unmount_all
}

echo "$NODES nodes, $FILES files, $((total / 1000000)) MB on GlusterFS, caches of $((cache / 1000000)) MB"
run alone
run peers
