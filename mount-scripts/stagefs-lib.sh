# shellcheck shell=bash
# shellcheck disable=SC2034 # conf_* and job_* are used by the scripts that source this file
# stagefs-lib.sh: helpers shared by the deployment scripts in this directory (stagefs-run,
# mount.fuse.stagefs, slurm-prolog.sh, slurm-epilog.sh). It is sourced, never run.
#
# The scripts find it next to their own resolved path (`readlink -f "$0"`), so symlinks to
# them (install.sh puts /sbin/mount.fuse.stagefs and PREFIX/bin/stagefs-run) keep working.

# Slurm runs prologs and epilogs without a search path, and mount(8) may pass a minimal one.
case ":${PATH:-}:" in
  *:/usr/bin:*) ;;
  *) PATH="${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" ;;
esac
export PATH

STAGEFS_LIB_DIR=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
# Name used in messages: the script that sourced us.
STAGEFS_PROG=${STAGEFS_PROG:-$(basename "$0")}

warn() {
  printf '%s: %s\n' "$STAGEFS_PROG" "$*" >&2
  if [ -n "${conf_LOG:-}" ]; then
    log_site "$*"
  fi
}

# Prints the stagefs binary to use: $STAGEFS, else PREFIX/bin/stagefs of an installed copy of
# these scripts (PREFIX/libexec/stagefs/..), else the first `stagefs` on PATH.
find_stagefs() {
  if [ -n "${STAGEFS:-}" ]; then
    if [ -x "$STAGEFS" ] && [ -f "$STAGEFS" ]; then
      printf '%s\n' "$STAGEFS"
      return 0
    fi
    warn "STAGEFS=$STAGEFS is not an executable file"
    return 1
  fi
  local installed="$STAGEFS_LIB_DIR/../../bin/stagefs"
  if [ -x "$installed" ] && [ -f "$installed" ]; then
    readlink -f "$installed"
    return 0
  fi
  if command -v stagefs; then
    return 0
  fi
  warn "cannot find the stagefs binary: set STAGEFS=/path/to/stagefs or put it on PATH"
  return 1
}

# True if the absolute, symlink-free PATH is listed in /proc/self/mountinfo. Reading the table
# instead of stat()ing the path also works for a dead FUSE mount (ENOTCONN) and for another
# user's FUSE mount, which even root cannot stat without allow_other/allow_root.
mount_listed() {
  local p=$1
  # mountinfo escapes these four characters as octal.
  p=${p//\\/\\134}
  p=${p// /\\040}
  p=${p//$'\t'/\\011}
  p=${p//$'\n'/\\012}
  WANT=$p awk '$5 == ENVIRON["WANT"] { found = 1 } END { exit !found }' /proc/self/mountinfo
}

# Unmounts a stagefs mount: `stagefs unmount` (which waits for the daemon to exit so its cache
# is free), retried while the mount is busy (e.g. DataLoader workers that outlive the job's
# main process), then a lazy detach as the last resort. Any arguments after MOUNTPOINT are a
# command prefix to run `stagefs unmount` with (e.g. to run it as the mount's owner).
# Returns 0 once MOUNTPOINT is no longer mounted.
unmount_stagefs() {
  local mnt=$1 stagefs tries=${STAGEFS_UNMOUNT_TRIES:-10} i
  shift
  stagefs=$(find_stagefs) || return 1
  for ((i = 1; i <= tries; i++)); do
    mount_listed "$mnt" || return 0
    "$@" "$stagefs" unmount "$mnt" && return 0
    mount_listed "$mnt" || return 0
    [ "$i" -lt "$tries" ] && sleep 1
  done
  warn "$mnt is still busy after $tries attempts; detaching it lazily (it disappears once unused)"
  if [ "$(id -u)" -eq 0 ]; then
    umount -l "$mnt"
  else
    fusermount3 -u -z "$mnt"
  fi
  ! mount_listed "$mnt"
}

# ---- Slurm prolog/epilog (slurm-prolog.sh, slurm-epilog.sh) ---------------------------------

# Reads KEY=VALUE lines (comments, blank lines and `export ` allowed; one pair of surrounding
# quotes stripped; nothing expanded or executed) from stdin. For each KEY listed in the
# arguments it sets the variable PREFIX_KEY, where PREFIX is the first argument. Other keys are
# reported and ignored. The site configuration, the job's request file and the prolog's state
# files all use this format, and none of them is ever sourced: the request file belongs to
# the job's user and is read by a root prolog.
read_settings() {
  local prefix=$1 line key value known
  shift
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line#"${line%%[![:space:]]*}"}
    case $line in "" | "#"*) continue ;; esac
    line=${line#export }
    key=${line%%=*}
    if [ "$key" = "$line" ] || ! [[ $key =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]]; then
      warn "ignoring a line that is not KEY=VALUE"
      continue
    fi
    value=${line#*=}
    case $value in
      \"*\") value=${value:1:${#value}-2} ;;
      \'*\') value=${value:1:${#value}-2} ;;
    esac
    for known in "$@"; do
      if [ "$known" = "$key" ]; then
        printf -v "${prefix}_$key" '%s' "$value"
        continue 2
      fi
    done
    warn "ignoring unknown setting $key"
  done
}

# Site configuration: /etc/stagefs/slurm.conf, or the file $STAGEFS_SLURM_CONF names (which
# must exist). Sets conf_* with the defaults below for what the file leaves out.
load_slurm_config() {
  conf_MOUNTPOINT=/mnt/stagefs/%j
  conf_CACHE_DIR=/tmp/stagefs-cache/%j
  conf_STATE_DIR=/run/stagefs-slurm
  conf_REQUEST_FILE=%w/stagefs.env
  conf_ON_FAILURE="continue"
  conf_GPUS_PER_NODE=""
  conf_SOURCE=""
  conf_SAMPLER=torch-distributed
  conf_SEED=0
  conf_OPTIONS=""
  conf_STAGEFS=""
  conf_LOG=syslog
  conf_INDEX=""
  conf_INDEX_WAIT=120
  conf_PEER_PORT=""
  conf_PEER_ADDRESS=%h:%p
  conf_PEER_KEY=/etc/stagefs/peer.key
  local file=${STAGEFS_SLURM_CONF:-/etc/stagefs/slurm.conf}
  if [ -n "${STAGEFS_SLURM_CONF:-}" ] && [ ! -r "$file" ]; then
    warn "STAGEFS_SLURM_CONF=$file is not a readable file"
    return 1
  fi
  if [ -r "$file" ]; then
    read_settings conf MOUNTPOINT CACHE_DIR STATE_DIR REQUEST_FILE ON_FAILURE GPUS_PER_NODE \
      SOURCE SAMPLER SEED OPTIONS STAGEFS LOG INDEX INDEX_WAIT PEER_PORT PEER_ADDRESS PEER_KEY <"$file"
  fi
  if [ -z "${STAGEFS:-}" ] && [ -n "$conf_STAGEFS" ]; then
    STAGEFS=$conf_STAGEFS
  fi
}

# Sends one message of the Prolog or Epilog where the site reads it (LOG: `syslog`, a file,
# or empty for stderr only). slurmd logs a script's output only when the script fails (tested
# with 22.05): without this, the message of a prolog that lets the job start without a mount
# (ON_FAILURE=continue) would be lost. A syslog without /dev/log (a container) is skipped.
log_site() {
  case $conf_LOG in
    syslog)
      if [ -S /dev/log ]; then
        logger -t "$STAGEFS_PROG" -- "$1" 2>/dev/null || true
      fi
      ;;
    *)
      printf '%s %s[%s]: %s\n' "$(date '+%Y-%m-%dT%H:%M:%S')" "$STAGEFS_PROG" "$$" "$1" \
        >>"$conf_LOG" 2>/dev/null || true
      ;;
  esac
}

# Expands %j (job id), %n (node index in the job: $node), %u (job user: $job_user), %w (job
# working directory) and %% in a path pattern from the configuration.
expand_pattern() {
  local s=$1 out="" c i
  for ((i = 0; i < ${#s}; i++)); do
    c=${s:i:1}
    if [ "$c" != % ]; then
      out+=$c
      continue
    fi
    i=$((i + 1))
    case ${s:i:1} in
      j) out+=$SLURM_JOB_ID ;;
      n) out+=${node:?} ;;
      u) out+=${job_user:?} ;;
      w) out+=${SLURM_JOB_WORK_DIR:-} ;;
      %) out+=% ;;
      *)
        warn "unknown %${s:i:1} in $s (known: %j %n %u %w %%)"
        return 1
        ;;
    esac
  done
  printf '%s\n' "$out"
}

# The job's owner, as the prolog and epilog see it: SLURM_JOB_UID (and _GID, _USER), else
# whoever runs the script. Sets job_uid, job_gid and job_user.
job_owner() {
  job_uid=${SLURM_JOB_UID:-$(id -u)}
  job_gid=${SLURM_JOB_GID:-$(getent passwd "$job_uid" | cut -d: -f4)}
  job_user=${SLURM_JOB_USER:-$(getent passwd "$job_uid" | cut -d: -f1)}
  if [ -z "$job_gid" ] || [ -z "$job_user" ]; then
    warn "cannot resolve the job's user (uid $job_uid)"
    return 1
  fi
}

# Runs a command as the job's owner: a root prolog must not read the job's files or the
# dataset with root's rights (root squash on Lustre/NFS would also deny them), and the FUSE
# mount must belong to the user so the job can use it without allow_other.
as_job_user() {
  if [ "$(id -u)" -eq 0 ] && [ "$job_uid" -ne 0 ]; then
    setpriv --reuid="$job_uid" --regid="$job_gid" --init-groups -- "$@"
  else
    "$@"
  fi
}

# Prints the directory of the prolog's state files (one per job and node), created private.
state_dir() {
  # shellcheck disable=SC2174 # only the state directory itself needs to be private
  mkdir -p -m 0700 -- "$conf_STATE_DIR" || return 1
  printf '%s\n' "$conf_STATE_DIR"
}

# Prints the shell lines that turn the feed hook on for a job using the mount at $2 (`$1
# feed-env`), or nothing when the job's environment has STAGEFS_HOOK=0.
stagefs_hook_env() {
  [ "${STAGEFS_HOOK:-1}" != 0 ] || return 0
  "$1" feed-env "$2"
}
