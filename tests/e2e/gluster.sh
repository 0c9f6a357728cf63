#!/usr/bin/env bash
# A throwaway GlusterFS volume on loopback, for the end-to-end tests and the epoch benchmark:
# a real distributed file system (files hashed over several bricks, served by brick daemons,
# read through the FUSE client) without a cluster.
#
#   gluster.sh up   NAME BRICKS_DIR MOUNTPOINT [N_BRICKS]   (default 3 bricks)
#   gluster.sh down NAME BRICKS_DIR MOUNTPOINT
#   gluster.sh stop-daemon          (stops glusterd if no volume is left; optional)
#
# GLUSTER_MOUNT_OPTIONS, if set, is passed to `mount -o` (e.g. direct-io-mode=enable: no
# client-side page cache, as when the dataset is much larger than the node's memory).
#
# Needs root and glusterfs-server. Both verbs are idempotent and safe on a half set-up
# volume: `up` finishes what is missing, `down` removes whatever exists (mount, volume,
# bricks) and fails only if something could not be removed.
#
# What was found by trying (glusterfs 10.3, Debian 12, no systemd):
# - glusterd is started here when it is not answering (`glusterd -p /run/glusterd.pid`;
#   its state lives in /var/lib/glusterd, which the package creates).
# - `volume create` refuses the literal hosts localhost/127.0.0.1, but any other loopback
#   address is accepted as this node: bricks are named 127.0.0.2:/path, so all traffic stays
#   on lo whatever the hostname resolves to (override with GLUSTER_BRICK_HOST).
# - bricks on the root file system need `force`.
# - concurrent volume operations may be refused with "Another transaction is in progress" /
#   "Locking failed": every gluster call is retried.
# - glusterd may be left running after the suite (it holds no volume then and idles);
#   `stop-daemon` stops it when nothing uses it any more.
set -euo pipefail

BRICK_HOST="${GLUSTER_BRICK_HOST:-127.0.0.2}"
PIDFILE=/run/glusterd.pid
LOCKFILE=/run/lock/stagefs-glusterd.lock

die() {
  echo "gluster.sh: $*" >&2
  exit 1
}

usage() {
  cat >&2 <<'EOF'
usage: gluster.sh up   NAME BRICKS_DIR MOUNTPOINT [N_BRICKS]
       gluster.sh down NAME BRICKS_DIR MOUNTPOINT
       gluster.sh stop-daemon
EOF
  exit 2
}

glusterd_answers() {
  gluster --mode=script pool list >/dev/null 2>&1
}

ensure_glusterd() {
  glusterd_answers && return 0
  command -v glusterd >/dev/null || die "glusterd not found (apt-get install glusterfs-server)"
  # Tests set volumes up in parallel: one caller starts glusterd, the others wait for it.
  (
    flock 9
    glusterd_answers && exit 0
    # Not holding the lock (fd 9) nor our output: it outlives us. Its log is in /var/log/glusterfs.
    glusterd -p "$PIDFILE" </dev/null >/dev/null 2>&1 9>&- || true
    for _ in $(seq 1 60); do
      glusterd_answers && exit 0
      sleep 0.5
    done
    exit 1
  ) 9>"$LOCKFILE" || die "glusterd does not answer (see /var/log/glusterfs/glusterd.log)"
}

# gl ARGS...: `gluster --mode=script ARGS`, retried while glusterd is busy with another
# transaction. Prints gluster's output on failure.
gl() {
  local out
  for _ in $(seq 1 40); do
    if out=$(gluster --mode=script "$@" 2>&1); then
      return 0
    fi
    case "$out" in
      *"in progress"* | *"ocking failed"* | *"try again"* | *"not connected"*) sleep 0.5 ;;
      *)
        echo "$out" >&2
        return 1
        ;;
    esac
  done
  echo "$out" >&2
  return 1
}

volume_exists() {
  gluster --mode=script volume info "$1" >/dev/null 2>&1
}

volume_started() {
  gluster --mode=script volume info "$1" 2>/dev/null | grep -q '^Status: Started'
}

is_mounted() {
  mountpoint -q "$1" 2>/dev/null
}

up() {
  local name=$1 bricks=$2 mnt=$3 n=${4:-3}
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "N_BRICKS must be a positive integer, not '$n'"
  ensure_glusterd
  mkdir -p "$mnt"
  if ! volume_exists "$name"; then
    local spec=() i
    for i in $(seq 1 "$n"); do
      mkdir -p "$bricks/b$i"
      spec+=("$BRICK_HOST:$(realpath "$bricks/b$i")")
    done
    gl volume create "$name" "${spec[@]}" force || die "cannot create volume $name"
  fi
  volume_started "$name" || gl volume start "$name" || die "cannot start volume $name"
  if ! is_mounted "$mnt"; then
    # The bricks may need a moment after `volume start` before a client can attach.
    local ok=0
    for _ in $(seq 1 20); do
      if mount -t glusterfs ${GLUSTER_MOUNT_OPTIONS:+-o "$GLUSTER_MOUNT_OPTIONS"} "127.0.0.1:/$name" "$mnt" 2>/dev/null &&
        is_mounted "$mnt"; then
        ok=1
        break
      fi
      sleep 0.5
    done
    [ "$ok" = 1 ] || die "cannot mount 127.0.0.1:/$name at $mnt (see /var/log/glusterfs/)"
  fi
  # The client answers once it has the layout of every brick.
  for _ in $(seq 1 40); do
    stat "$mnt/." >/dev/null 2>&1 && touch "$mnt/.probe" 2>/dev/null && rm -f "$mnt/.probe" && return 0
    sleep 0.5
  done
  die "volume $name is mounted at $mnt but not writable"
}

down() {
  local name=$1 bricks=$2 mnt=$3 failed=0
  if is_mounted "$mnt"; then
    umount "$mnt" 2>/dev/null || umount -l "$mnt" || failed=1
  fi
  # A volume known to glusterd's store but with glusterd not running: start it to delete.
  if [ -d "/var/lib/glusterd/vols/$name" ] || glusterd_answers; then
    ensure_glusterd
    if volume_exists "$name"; then
      if volume_started "$name"; then
        gl volume stop "$name" force >/dev/null || failed=1
      fi
      gl volume delete "$name" >/dev/null || failed=1
    fi
  fi
  # Brick directories carry trusted.* xattrs and a .glusterfs tree: plain rm removes both.
  rm -rf -- "$bricks" || failed=1
  [ -d "$mnt" ] && ! is_mounted "$mnt" && rmdir --ignore-fail-on-non-empty -- "$mnt"
  [ "$failed" = 0 ] || die "could not remove everything of volume $name"
}

stop_daemon() {
  glusterd_answers || return 0
  if gluster --mode=script volume list 2>/dev/null | grep -qv '^No volumes present'; then
    echo "gluster.sh: volumes remain; glusterd left running" >&2
    return 0
  fi
  if [ -s "$PIDFILE" ]; then
    kill "$(cat "$PIDFILE")" 2>/dev/null || true
    rm -f "$PIDFILE"
  fi
}

case "${1:-}" in
  up)
    if [ $# -lt 4 ] || [ $# -gt 5 ]; then usage; fi
    up "$2" "$3" "$4" "${5:-3}"
    ;;
  down)
    if [ $# -ne 4 ]; then usage; fi
    down "$2" "$3" "$4"
    ;;
  stop-daemon) stop_daemon ;;
  *) usage ;;
esac
