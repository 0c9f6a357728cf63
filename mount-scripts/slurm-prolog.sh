#!/usr/bin/env bash
# slurm-prolog.sh: mount the dataset a Slurm job asked for on this node before the job starts;
# slurm-epilog.sh unmounts it and removes the job's cache when the job ends.
#
# Install (site admin), in slurm.conf on every node:
#   Prolog=/usr/local/libexec/stagefs/slurm-prolog.sh
#   Epilog=/usr/local/libexec/stagefs/slurm-epilog.sh
#   PrologFlags=Alloc      # run at allocation, on every node, before the batch script starts
# Why the slurmd Prolog: it runs as root outside the job's cgroups, so the stagefs daemon it
# starts lives as long as the job (a daemon started inside a job step is killed with that
# step), and the Epilog runs even when the job is cancelled or times out. Without an admin,
# use stagefs-run inside the job instead (slurm-example.sbatch).
#
# What the job asks for. The slurmd Prolog does not see the job's environment, so a job asks
# for a mount with a file `stagefs.env` in its working directory (sbatch --chdir; by default
# where it was submitted), read as the job's user and never executed:
#   STAGEFS_SOURCE=/lustre/datasets/imagenet/train
#   STAGEFS_SEED=42
#   STAGEFS_SAMPLER=torch-distributed
#   STAGEFS_GPUS_PER_NODE=8                  (optional, see Ranks)
#   STAGEFS_OPTIONS="--drop-last --epoch 3"  (optional, more `stagefs mount` options)
# The same variables in the script's environment take precedence over the file (they are there
# when it runs in the job's environment: as a TaskProlog, from srun, or in a test). A job with
# no STAGEFS_SOURCE (and no site default SOURCE) gets no mount. The job finds its dataset at
# MOUNTPOINT (default /mnt/stagefs/$SLURM_JOB_ID).
#
# Ranks. One mount serves every rank of its node: with N nodes of G GPUs, node i serves ranks
# i*G .. i*G+G-1 of a world of N*G, which is what torchrun --nnodes N --nproc_per_node G
# --node_rank $SLURM_NODEID gives (static rendezvous; the c10d rendezvous hands out node ranks
# in arrival order, which nothing can predict).
#   i: SLURM_NODEID. The slurmd Prolog does not get it; then i is this node's (SLURMD_NODENAME)
#      position in the job's node list (SLURM_JOB_NODELIST in the job's environment,
#      SLURM_NODELIST in slurmd's Prolog), expanded by `scontrol show hostnames` (which asks
#      slurmctld nothing: Slurm advises prologs against commands that do, run by every node
#      of every job at once).
#   N: SLURM_JOB_NUM_NODES (in the job's environment and in slurmd's Prolog).
#   G: STAGEFS_GPUS_PER_NODE, else SLURM_GPUS_ON_NODE, else the count of SLURM_JOB_GPUS,
#      else GPUS_PER_NODE from the configuration.
#
# Configuration: /etc/stagefs/slurm.conf, or the file STAGEFS_SLURM_CONF names. KEY=VALUE lines:
#   MOUNTPOINT=/mnt/stagefs/%j        patterns: %j job id, %n node index, %u user, %w work dir
#   CACHE_DIR=/tmp/stagefs-cache/%j   node-local scratch (NVMe); removed by the epilog
#   STATE_DIR=/run/stagefs-slurm      what was mounted, for the epilog
#   REQUEST_FILE=%w/stagefs.env       the job's request file (empty: environment only)
#   GPUS_PER_NODE=                    when neither the job nor Slurm says
#   SOURCE=  SAMPLER=torch-distributed  SEED=0     defaults a job overrides
#   OPTIONS=                          `stagefs mount` options for every job (patterns expanded)
#   STAGEFS=                          the stagefs binary (default: installed one, else PATH)
#   ON_FAILURE=continue               or drain (below)
#   LOG=syslog                        where messages go besides stderr: syslog, a file, or empty
#   INDEX=                            the job's listing of SOURCE, on a file system all its nodes
#                                     share (e.g. /shared/stagefs/%j.index or %w/.stagefs-%j.index)
#   INDEX_WAIT=120                    seconds the other nodes wait for it (see One listing)
#   PEER_PORT=                        base port for peers (see Peers); empty: peers off
#   PEER_ADDRESS=%h:%p                each node's peer address: %h its host name in the node
#                                     list, %p the job's port, %i its index in the job
#   PEER_KEY=/etc/stagefs/peer.key    the site's peer key: the same on every node, root's, 0600
#
# Peers. With PEER_PORT set, a job of several nodes gets `--peers` (every node of the job, in
# node-list order, at PEER_ADDRESS: its host name and port PEER_PORT + job id % 1000 unless
# the site says otherwise), `--node` (this node's index) and
# `--peer-secret-file`: a file only the job's user can read, in a directory beside the cache,
# holding the SHA-256 of the site's PEER_KEY and the job id. Every node of the job derives the
# same secret without talking to the others; another job, or a user without the key, cannot.
# A mount that cannot take peers (the port is taken) is made again without them.
#
# One listing per job. Each node's mount lists SOURCE's directories (one request per directory
# to SOURCE's metadata server, none per file). With INDEX set, node 0 lists SOURCE once into
# that file (`stagefs index`, as the job's user) and every node's mount starts from it
# (`--index`), which asks SOURCE one `lstat` per directory. A node that does not find the file
# within INDEX_WAIT seconds (node 0 failed, or INDEX is not shared), or whose mount refuses it
# (a file another user put there), lists SOURCE itself. The epilog on node 0 removes it.
#
# Failure. When a Prolog fails, Slurm drains the node and holds the job. A job's typo (a wrong
# source path) should not take a node out of service, so by default (ON_FAILURE=continue) the
# prolog reports the error, mounts nothing and lets the job start; the job should check
# `mountpoint -q "$MOUNT"`. ON_FAILURE=drain makes the prolog fail instead. slurmd puts a
# Prolog's output in its log only when the Prolog fails, so every message also goes to LOG
# (syslog by default; a file such as /var/log/stagefs-slurm.log is easier to find).
#
# stagefs runs as the job's user (setpriv), so the dataset is read with the user's rights
# (root squash on Lustre/NFS would deny root anyway) and the mount is the user's own; the
# mountpoint and cache directory are made for that user. Running it again for the same job
# and node does nothing.
#
# Tested (tests/deploy.rs) under a faked Slurm environment on one machine (two "nodes" with
# distinct %n paths), for a root job; the switch to another user is tested only as far as
# stagefs being denied a root-only source. Tested under a real slurmctld and two slurmd 22.05
# on one host (tests/slurm.rs, tests/e2e/slurm.sh), for root jobs.
set -uo pipefail

# shellcheck source-path=SCRIPTDIR
# shellcheck source=stagefs-lib.sh
. "$(dirname "$(readlink -f "$0")")/stagefs-lib.sh"

created=()     # directories this run made, parents first
cache_made=""  # the cache directory, if this run made it
give_back=""   # the mountpoint's owner before this run, to restore
state_written="" # the state file for the epilog exists
index_written="" # the job's index, if this node wrote it
peer_dir=""      # the directory of the job's peer secret, if this run made or took it
# Reports an error, removes what this run created, and exits as ON_FAILURE says.
fail() {
  warn "job ${SLURM_JOB_ID:-?}: $*; no dataset mounted"
  [ -z "$cache_made" ] || rm -rf --one-file-system -- "$cache_made"
  [ -z "$give_back" ] || chown "$give_back" -- "$mnt"
  [ -z "$state_written" ] || rm -f -- "$state"
  [ -z "$index_written" ] || as_job_user rm -f -- "$index_written"
  [ -z "$peer_dir" ] || rm -rf --one-file-system -- "$peer_dir"
  local i
  for ((i = ${#created[@]} - 1; i >= 0; i--)); do
    rmdir -- "${created[i]}" 2>/dev/null
  done
  if [ "${conf_ON_FAILURE:-continue}" = drain ]; then
    exit 1
  fi
  exit 0
}

# Prints this node's index in the job.
node_index() {
  if [ -n "${SLURM_NODEID:-}" ]; then
    printf '%s\n' "$SLURM_NODEID"
    return 0
  fi
  local me=${SLURMD_NODENAME:-$(hostname -s)} list=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}} i=0 host
  [ -n "$list" ] || return 1
  while IFS= read -r host; do
    if [ "$host" = "$me" ]; then
      printf '%s\n' "$i"
      return 0
    fi
    i=$((i + 1))
  done < <(scontrol show hostnames "$list")
  return 1
}

# Prints the GPUs (local ranks) per node.
gpus_per_node() {
  if [ -n "${req_GPUS_PER_NODE:-}" ]; then
    printf '%s\n' "$req_GPUS_PER_NODE"
  elif [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then
    printf '%s\n' "$SLURM_GPUS_ON_NODE"
  elif [ -n "${SLURM_JOB_GPUS:-}" ]; then
    local ids
    IFS=, read -r -a ids <<<"$SLURM_JOB_GPUS"
    printf '%s\n' "${#ids[@]}"
  else
    printf '%s\n' "$conf_GPUS_PER_NODE"
  fi
}

# Creates DIR (and missing parents) for the job's user with MODE.
new_dir() {
  if [ "$(id -u)" -eq 0 ]; then
    install -d -o "$job_uid" -g "$job_gid" -m "$2" -- "$1"
  else
    # shellcheck disable=SC2174 # the mode is meant for DIR; parents get the usual one
    mkdir -p -m "$2" -- "$1"
  fi
}

# Creates DIR with MODE unless it exists; remembers it for `fail`, and sets `made` to 1 if it
# made it (else 0) for the epilog.
make_dir() {
  made=0
  [ -d "$1" ] && return 0
  new_dir "$1" "$2" || return 1
  created+=("$1")
  made=1
}

is_count() {
  [[ $1 =~ ^[0-9]+$ ]] && [ "$1" -gt 0 ]
}

# Sets `index` to the job's listing of SOURCE if this node is to start from it (see One
# listing): node 0 writes it, the others wait for it. Empty when the job has none.
job_index() {
  index=""
  [ -n "$conf_INDEX" ] || return 0
  local path said waited=0
  path=$(expand_pattern "$conf_INDEX") || fail "bad INDEX"
  if [ "$node" -eq 0 ]; then
    if said=$(as_job_user "$stagefs" index "$req_SOURCE" -o "$path" 2>&1 >/dev/null); then
      index=$path
      index_written=$path
    else
      warn "job $SLURM_JOB_ID: cannot write the job's index $path (${said##*$'\n'}); every node lists SOURCE itself"
    fi
    return 0
  fi
  is_count "$conf_INDEX_WAIT" || conf_INDEX_WAIT=0
  until as_job_user test -f "$path"; do
    if [ "$waited" -ge "$conf_INDEX_WAIT" ]; then
      warn "job $SLURM_JOB_ID: no index $path from node 0 after ${waited}s; listing SOURCE here"
      return 0
    fi
    sleep 1
    waited=$((waited + 1))
  done
  index=$path
}

load_slurm_config || fail "bad configuration"
[ -n "${SLURM_JOB_ID:-}" ] || fail "SLURM_JOB_ID is not set"
job_owner || fail "unknown job user"

# The job's request: the request file, then the environment.
req_SOURCE=$conf_SOURCE
req_SEED=$conf_SEED
req_SAMPLER=$conf_SAMPLER
req_GPUS_PER_NODE=""
req_OPTIONS=""
node=""
if [ -n "$conf_REQUEST_FILE" ] && [ -n "${SLURM_JOB_WORK_DIR:-}" ]; then
  request=$(expand_pattern "$conf_REQUEST_FILE") || fail "bad REQUEST_FILE"
  if as_job_user test -f "$request"; then
    read_settings req STAGEFS_SOURCE STAGEFS_SEED STAGEFS_SAMPLER STAGEFS_GPUS_PER_NODE \
      STAGEFS_OPTIONS < <(as_job_user cat -- "$request") || fail "cannot read $request"
    for key in SOURCE SEED SAMPLER GPUS_PER_NODE OPTIONS; do
      from_file=req_STAGEFS_$key
      if [ -n "${!from_file:-}" ]; then
        printf -v "req_$key" '%s' "${!from_file}"
      fi
    done
  fi
fi
for key in SOURCE SEED SAMPLER GPUS_PER_NODE OPTIONS; do
  from_env=STAGEFS_$key
  if [ -n "${!from_env:-}" ]; then
    printf -v "req_$key" '%s' "${!from_env}"
  fi
done
if [ -z "$req_SOURCE" ]; then
  exit 0 # not a stagefs job
fi

node=$(node_index) || fail "cannot tell this node's index in the job (no SLURM_NODEID, and ${SLURMD_NODENAME:-$(hostname -s)} is not in its node list '${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}')"
nodes=${SLURM_JOB_NUM_NODES:-}
gpus=$(gpus_per_node)
is_count "$nodes" || fail "node count '${nodes}' (SLURM_JOB_NUM_NODES) is not a positive number"
is_count "$gpus" || fail "GPUs per node '${gpus}' is not a positive number (set STAGEFS_GPUS_PER_NODE or GPUS_PER_NODE)"
if ! [[ $node =~ ^[0-9]+$ ]] || [ "$node" -ge "$nodes" ]; then
  fail "node index '$node' is not below the node count $nodes"
fi
first=$((node * gpus))
ranks="$first-$((first + gpus - 1))"
world=$((nodes * gpus))

mnt=$(expand_pattern "$conf_MOUNTPOINT") || fail "bad MOUNTPOINT"
cache=$(expand_pattern "$conf_CACHE_DIR") || fail "bad CACHE_DIR"
site_options=$(expand_pattern "$conf_OPTIONS") || fail "bad OPTIONS"
job_options=$(expand_pattern "$req_OPTIONS") || fail "bad STAGEFS_OPTIONS"
states=$(state_dir) || fail "cannot create the state directory $conf_STATE_DIR"
state="$states/$SLURM_JOB_ID.$node"
stagefs=$(find_stagefs) || fail "no stagefs binary"

make_dir "$mnt" 0755 || fail "cannot create mountpoint $mnt"
mnt_made=$made
mnt=$(readlink -f -- "$mnt")
if [ -f "$state" ] && mount_listed "$mnt"; then
  exit 0 # this job's dataset is already mounted here
fi
mount_listed "$mnt" && fail "mountpoint $mnt is already a mount point"
[ -z "$(ls -A -- "$mnt")" ] || fail "mountpoint $mnt is not empty"
# fusermount3 wants the user to be able to write to the mountpoint; give back in the epilog.
mnt_owner=$(stat -c %u:%g -- "$mnt")
if [ "$(id -u)" -eq 0 ]; then
  chown "$job_uid:$job_gid" -- "$mnt" || fail "cannot hand $mnt to uid $job_uid"
  give_back=$mnt_owner
fi
cache_parent_made=0
if [ ! -d "$cache" ]; then
  make_dir "$(dirname -- "$cache")" 0755 || fail "cannot create the parent of $cache"
  cache_parent_made=$made
  cache_made=$cache
  new_dir "$cache" 0700 || fail "cannot create cache directory $cache"
fi

# What the epilog needs, written whole or not at all, and before mounting: if slurmd kills
# the prolog (PrologEpilogTimeout) during a long scan, the daemon still finishes mounting, and
# the epilog must know about it. The epilog removes the cache directory (always: it is the
# job's) and the directories this run created, if empty.
write_state() {
  {
    printf 'MOUNTPOINT=%s\n' "$mnt"
    printf 'MOUNTPOINT_OWNER=%s\n' "$mnt_owner"
    printf 'CACHE_DIR=%s\n' "$cache"
    printf 'JOB_UID=%s\nJOB_GID=%s\nJOB_USER=%s\n' "$job_uid" "$job_gid" "$job_user"
    printf 'MOUNTPOINT_MADE=%s\nCACHE_PARENT_MADE=%s\n' "$mnt_made" "$cache_parent_made"
    printf 'INDEX_FILE=%s\n' "$index_written"
    printf 'PEER_DIR=%s\n' "$peer_dir"
  } >"$state.tmp" && mv -f -- "$state.tmp" "$state"
}
# Sets `peer_args` to the job's --peers options, and `peer_dir` to the directory made for its
# secret (see Peers); both empty with PEER_PORT unset, a single node, or no usable key (said).
job_peers() {
  peer_args=() peer_dir=""
  [ -n "$conf_PEER_PORT" ] && [ "$nodes" -gt 1 ] || return 0
  local port list=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}} host addrs="" i=0 addr
  if ! [[ $conf_PEER_PORT =~ ^[0-9]+$ ]] || [ "$conf_PEER_PORT" -gt 64535 ]; then
    warn "job $SLURM_JOB_ID: PEER_PORT '$conf_PEER_PORT' is not a port below 64536; peers off"
    return 0
  fi
  port=$((conf_PEER_PORT + SLURM_JOB_ID % 1000))
  while IFS= read -r host; do
    addr=${conf_PEER_ADDRESS//%h/$host}
    addr=${addr//%p/$port}
    addrs+="${addrs:+,}${addr//%i/$i}"
    i=$((i + 1))
  done < <(scontrol show hostnames "$list")
  if [ "$(stat -L -c %u:%a -- "$conf_PEER_KEY" 2>/dev/null)" != "0:600" ] || [ ! -f "$conf_PEER_KEY" ]; then
    warn "job $SLURM_JOB_ID: peer key $conf_PEER_KEY is not a root-owned 0600 file; peers off"
    return 0
  fi
  [ -n "$addrs" ] || {
    warn "job $SLURM_JOB_ID: scontrol expanded the node list '$list' to nothing; peers off"
    return 0
  }
  local dir="$cache.peers" parent
  # Beside the cache, in a directory nobody else could swap it in (root's or the job's user's,
  # and writable by no one else unless sticky, as /tmp is).
  parent=$(stat -c %u:%a -- "$(dirname -- "$cache")") || parent=""
  case $parent in
    0:* | "$job_uid":*) ;;
    *) parent="" ;;
  esac
  local mode=${parent#*:}
  if [ -z "$parent" ] || (((8#$mode & 8#022) != 0 && (8#$mode & 8#1000) == 0)); then
    warn "job $SLURM_JOB_ID: the directory of $cache could be changed by other users; peers off"
    return 0
  fi
  # One a killed run of this prolog made is taken again: the job's user's own, private.
  if ! { [ -d "$dir" ] && [ ! -L "$dir" ] && [ "$(stat -c %u:%a -- "$dir")" = "$job_uid:700" ]; } &&
    { [ -e "$dir" ] || [ -L "$dir" ] || ! new_dir "$dir" 0700; }; then
    warn "job $SLURM_JOB_ID: cannot create $dir for the peer secret; peers off"
    return 0
  fi
  peer_dir=$dir
  # Written by the job's user into its own directory: root never writes where it could be
  # led by a link.
  # shellcheck disable=SC2016 # $1 is the inner shell's argument
  { cat -- "$conf_PEER_KEY"; printf 'stagefs peers, job %s\n' "$SLURM_JOB_ID"; } | sha256sum | cut -d' ' -f1 |
    as_job_user sh -c 'umask 077 && cat >"$1"' sh "$peer_dir/secret" || {
    warn "job $SLURM_JOB_ID: cannot write the peer secret; peers off"
    return 0
  }
  peer_args=(--peers "$addrs" --node "$node" --peer-secret-file "$peer_dir/secret")
}
job_index
job_peers
write_state || fail "cannot write $state"
state_written=1

# Mounts with the arguments given besides the job's request. stagefs's own message (why it
# refused) is printed, to go where the prolog's messages go (see LOG). The detached daemon's
# output is /dev/null, so this returns when `stagefs mount` does.
mount_dataset() {
  set -f # the options are words, not globs
  # shellcheck disable=SC2086,SC2069 # OPTIONS are split into words on purpose; stderr is
  # what is printed, stdout goes
  as_job_user "$stagefs" mount "$req_SOURCE" "$mnt" --cache "$cache" \
    --sampler "$req_SAMPLER" --seed "$req_SEED" --world-size "$world" --ranks "$ranks" \
    "$@" $site_options $job_options 2>&1 >/dev/null
  local status=$?
  set +f
  return "$status"
}
if [ "${#peer_args[@]}" -gt 0 ] && ! said=$(mount_dataset "${peer_args[@]}" ${index:+--index "$index"}); then
  warn "job $SLURM_JOB_ID: mounting with peers failed (${said:-no message}); mounting without them"
  peer_args=()
elif [ "${#peer_args[@]}" -gt 0 ]; then
  index="" mounted_with_peers=1
fi
if [ -z "${mounted_with_peers:-}" ] && [ -n "$index" ] && ! said=$(mount_dataset --index "$index"); then
  warn "job $SLURM_JOB_ID: mounting from the index $index failed (${said:-no message}); listing SOURCE here"
  index=""
fi
if [ -z "${mounted_with_peers:-}" ] && [ -z "$index" ] && ! said=$(mount_dataset); then
  fail "stagefs mount $req_SOURCE failed: ${said:-no message}"
fi
[ -z "$said" ] || warn "job $SLURM_JOB_ID: $said"

warn "job $SLURM_JOB_ID: mounted $req_SOURCE at $mnt (node $node: ranks $ranks of $world)"
