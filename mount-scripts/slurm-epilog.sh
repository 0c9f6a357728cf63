#!/usr/bin/env bash
# slurm-epilog.sh: undo slurm-prolog.sh when a Slurm job ends: unmount the job's stagefs
# mount(s) on this node, remove the job's cache directory, remove the directories the prolog
# made (if empty), give a pre-existing mountpoint back to its owner, and remove the job's index
# (INDEX) if this node wrote it.
#
# Install as slurm.conf's Epilog next to the Prolog (see slurm-prolog.sh). It needs only
# SLURM_JOB_ID and the configuration (STATE_DIR): everything else comes from the state files
# the prolog wrote, so it works although the slurmd Epilog gets no SLURM_NODEID. Running it
# again, or for a job the prolog did not mount anything for, does nothing.
#
# The unmount runs as the mount's owner (root cannot even stat another user's FUSE mount) and
# waits for the stagefs daemon to exit; a mount still busy after STAGEFS_UNMOUNT_TRIES tries
# (default 10, a second apart) is detached lazily. Exit status 1 (Slurm then drains the node)
# only if a mount could not be removed at all. Messages go to stderr and to the configuration's
# LOG, as the prolog's do.
set -uo pipefail

# shellcheck source-path=SCRIPTDIR
# shellcheck source=stagefs-lib.sh
. "$(dirname "$(readlink -f "$0")")/stagefs-lib.sh"

load_slurm_config || exit 1
if [ -z "${SLURM_JOB_ID:-}" ]; then
  warn "SLURM_JOB_ID is not set"
  exit 1
fi

# Removes one node's mount of this job, as recorded in STATE.
clean_up() {
  local state=$1
  st_MOUNTPOINT="" st_CACHE_DIR="" st_MOUNTPOINT_OWNER="" st_MOUNTPOINT_MADE=0 st_CACHE_PARENT_MADE=0
  st_JOB_UID=$(id -u) st_JOB_GID=$(id -g) st_JOB_USER="" st_INDEX_FILE="" st_PEER_DIR=""
  read_settings st MOUNTPOINT MOUNTPOINT_OWNER CACHE_DIR JOB_UID JOB_GID JOB_USER \
    MOUNTPOINT_MADE CACHE_PARENT_MADE INDEX_FILE PEER_DIR <"$state" || return 1
  job_uid=$st_JOB_UID job_gid=$st_JOB_GID job_user=$st_JOB_USER
  if [[ $st_MOUNTPOINT != /?* ]] || [[ $st_CACHE_DIR != /?* ]]; then
    warn "$state does not name absolute directories; leaving it"
    return 1
  fi
  if ! unmount_stagefs "$st_MOUNTPOINT" as_job_user; then
    warn "job $SLURM_JOB_ID: cannot unmount $st_MOUNTPOINT"
    return 1
  fi
  rm -rf --one-file-system -- "$st_CACHE_DIR"
  # The job's peer secret (see the prolog's Peers).
  [[ $st_PEER_DIR != /?*.peers ]] || rm -rf --one-file-system -- "$st_PEER_DIR"
  # The job's index, which node 0 wrote (on a shared file system, as the job's user).
  [ -z "$st_INDEX_FILE" ] || as_job_user rm -f -- "$st_INDEX_FILE"
  if [ "$st_CACHE_PARENT_MADE" = 1 ]; then
    rmdir -- "$(dirname -- "$st_CACHE_DIR")" 2>/dev/null # still used by another job: kept
  fi
  if [ "$st_MOUNTPOINT_MADE" = 1 ]; then
    rmdir -- "$st_MOUNTPOINT"
  elif [ "$(id -u)" -eq 0 ] && [ -n "$st_MOUNTPOINT_OWNER" ]; then
    chown "$st_MOUNTPOINT_OWNER" -- "$st_MOUNTPOINT"
  fi
  rm -f -- "$state"
}

status=0
shopt -s nullglob
for state in "$conf_STATE_DIR/$SLURM_JOB_ID".*; do
  case $state in *.tmp) rm -f -- "$state" && continue ;; esac
  clean_up "$state" || status=1
done
exit "$status"
