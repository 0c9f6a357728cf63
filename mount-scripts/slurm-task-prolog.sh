#!/usr/bin/env bash
# slurm-task-prolog.sh: turns the stagefs feed hook on in every task of a job (Slurm
# TaskProlog), so the job's PyTorch DataLoaders open each batch's files with one request to the
# stagefs mount and read the cached copies' descriptors (no FUSE round trip per file), and
# announce their order to a mount that follows announcements (STAGEFS_SAMPLER=feed).
#
# Install (site admin), in slurm.conf on every node, beside the Prolog and Epilog:
#   TaskProlog=/usr/local/libexec/stagefs/slurm-task-prolog.sh
# slurmd runs it as the job's user, in the task's environment, before each task; each
# `export NAME=value` line it prints is set in the task's environment (Slurm does no shell
# expansion there, so the value is printed whole).
#
# Off: a job sets STAGEFS_HOOK=0 in its environment (`export STAGEFS_HOOK=0` in the batch
# script, or `sbatch --export=ALL,STAGEFS_HOOK=0`); the task's environment is then left alone.
# The hook costs nothing to a process that never imports torch, and does nothing for datasets
# that are not on a stagefs mount. A failure here prints a warning to the task's stderr
# (`print` lines reach the task's stdout) and never stops the task.
set -uo pipefail

# shellcheck source-path=SCRIPTDIR
# shellcheck source=stagefs-lib.sh
. "$(dirname "$(readlink -f "$0")")/stagefs-lib.sh"

stagefs=$(find_stagefs 2>/dev/null) || exit 0
[ "${STAGEFS_HOOK:-1}" != 0 ] || exit 0
hook=$(unset PYTHONPATH && eval "$("$stagefs" feed-env)" && printf '%s' "$PYTHONPATH") || {
  echo "stagefs: the feed hook is not on in this task: stagefs feed-env failed" >&2
  exit 0
}
printf 'export PYTHONPATH=%s\n' "$hook${PYTHONPATH:+:$PYTHONPATH}"
