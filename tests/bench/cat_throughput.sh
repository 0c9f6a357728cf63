#!/usr/bin/env bash
# Sequential read throughput of one big file, `cat FILE > /dev/null`, directly from local
# disk and through stagefs: cold (first open: read through from SOURCE while it is staged),
# then warm (served from the cache) with FUSE passthrough and with --no-passthrough. With the
# default options the file is a predicted sample, so its staging starts at mount time, before
# the cold read opens it. The page cache is dropped before every measurement, so each one
# reads from disk. What it answers: how much a stagefs mount costs a reader compared with the
# local disk it stages to.
#
# Not run in CI. Needs root (drop_caches; passthrough is root-only) and a release build.
# Usage: tests/bench/cat_throughput.sh [SIZE_MB [REPEATS]]   (default 1024 MB, 3 repeats)
#   STAGEFS=path/to/stagefs  binary (default: target/release/stagefs)
#   TMPDIR=dir               where SOURCE and the cache go; must be on local disk (default /var/tmp)
set -euo pipefail

size_mb=${1:-1024}
repeats=${2:-3}
repo=$(cd "$(dirname "$0")/../.." && pwd)
bin=${STAGEFS:-$repo/target/release/stagefs}
[ -x "$bin" ] || { echo "no $bin: run cargo build --release" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "run as root (drop_caches, passthrough)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/var/tmp}/stagefs-cat.XXXXXX")
mnt=$work/mnt
cache=$work/cache
cleanup() {
  if mountpoint -q "$mnt"; then "$bin" unmount "$mnt" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# Default options need an ImageFolder: one class folder, the file a sample in it.
file=class0/big.jpg
mkdir -p "$work/src/class0" "$mnt"
head -c "$((size_mb << 20))" /dev/urandom > "$work/src/$file"

drop_caches() {
  sync
  echo 3 > /proc/sys/vm/drop_caches
}

# MB/s of `cat PATH > /dev/null`, from disk.
rate() {
  local t0 t1
  drop_caches
  t0=$(date +%s.%N)
  cat "$1" > /dev/null
  t1=$(date +%s.%N)
  awk -v mb="$size_mb" -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f\n", mb / (b - a) }'
}

stagefs_mount() {
  "$bin" mount "$work/src" "$mnt" --cache "$cache" "$@"
}

xattr() {
  getfattr --absolute-names --only-values -n "user.stagefs.$1" "$2"
}

# Waits (at most 10 minutes) until the mount has the file in its cache.
wait_cached() {
  local i
  for ((i = 0; i < 3000; i++)); do
    [ "$(xattr state "$mnt/$file")" = cached ] && return 0
    sleep 0.2
  done
  echo "$file never got cached" >&2
  exit 1
}

median() {
  sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

: > "$work/direct" && : > "$work/copy" && : > "$work/cold" && : > "$work/passthrough" && : > "$work/pread"
for ((r = 1; r <= repeats; r++)); do
  rate "$work/src/$file" >> "$work/direct"

  rm -rf "$cache"
  stagefs_mount
  [ "$(xattr passthrough "$mnt")" = true ] || echo "warning: passthrough is not in use" >&2
  rate "$mnt/$file" >> "$work/cold"
  wait_cached
  rate "$mnt/$file" >> "$work/passthrough"
  "$bin" unmount "$mnt"
  # The staged copy read directly: the local-disk ceiling for the cached reads.
  rate "$(find "$cache/data" -type f -size +1M)" >> "$work/copy"

  # Same cache: the remount reuses the staged copy.
  stagefs_mount --no-passthrough
  [ "$(xattr state "$mnt/$file")" = cached ] || { echo "remount did not reuse the cache" >&2; exit 1; }
  rate "$mnt/$file" >> "$work/pread"
  "$bin" unmount "$mnt"
done

direct=$(median < "$work/direct")
echo "cat of a ${size_mb} MB file, page cache dropped before each read; median of $repeats, MB/s"
printf '%-44s %8s %8s  %s\n' "read" "MB/s" "ratio" "runs"
for kind in direct copy cold passthrough pread; do
  case $kind in
    direct) label="local disk (SOURCE itself)" ;;
    copy) label="local disk (the staged copy in the cache)" ;;
    cold) label="stagefs cold (read through while staging)" ;;
    passthrough) label="stagefs cached, FUSE passthrough" ;;
    pread) label="stagefs cached, --no-passthrough (pread)" ;;
  esac
  m=$(median < "$work/$kind")
  printf '%-44s %8s %8s  %s\n' "$label" "$m" "$(awk -v a="$m" -v b="$direct" 'BEGIN { printf "%.2f", a / b }')" \
    "$(paste -sd' ' "$work/$kind")"
done
