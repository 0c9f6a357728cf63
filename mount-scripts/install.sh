#!/usr/bin/env bash
# install.sh: install the stagefs binary and these deployment scripts (as root).
#
#   mount-scripts/install.sh [--binary PATH]
#
# PATH defaults to target/release/stagefs of this checkout (`cargo build --release`).
# Environment: PREFIX (default /usr/local), DESTDIR (staging root for packaging, default
# none), SBINDIR (where mount(8) looks for helpers, default /sbin), UNITDIR (default
# /etc/systemd/system). Installs:
#   PREFIX/bin/stagefs
#   PREFIX/libexec/stagefs/   stagefs-run, mount.fuse.stagefs, slurm-prolog.sh, slurm-task-prolog.sh,
#                             slurm-epilog.sh, stagefs-lib.sh, slurm-example.sbatch
#   PREFIX/bin/stagefs-run -> ../libexec/stagefs/stagefs-run
#   PREFIX/lib/stagefs/python/  the feed hook (what `stagefs feed-env` puts on PYTHONPATH)
#   SBINDIR/mount.fuse.stagefs -> PREFIX/libexec/stagefs/mount.fuse.stagefs
#   UNITDIR/stagefs@.service  (ExecStart/ExecStop pointing at PREFIX/bin/stagefs)
# The scripts find the binary as ../../bin/stagefs from their own directory, so any PREFIX
# works without PATH changes. Nothing in /etc/stagefs is written: see the headers of
# stagefs@.service and slurm-prolog.sh for the files to create. Run `systemctl
# daemon-reload` after installing the unit.
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")
binary=$here/../target/release/stagefs
while [ $# -gt 0 ]; do
  case $1 in
    --binary)
      binary=${2:?--binary needs a path}
      shift 2
      ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "install.sh: unknown argument $1 (see --help)" >&2
      exit 2
      ;;
  esac
done
[ -x "$binary" ] || {
  echo "install.sh: no stagefs binary at $binary (cargo build --release, or --binary PATH)" >&2
  exit 1
}

prefix=${PREFIX:-/usr/local}
dest=${DESTDIR:-}
sbindir=${SBINDIR:-/sbin}
unitdir=${UNITDIR:-/etc/systemd/system}
libexec=$prefix/libexec/stagefs

install -d "$dest$prefix/bin" "$dest$libexec" "$dest$sbindir" "$dest$unitdir"
install -m 0755 "$binary" "$dest$prefix/bin/stagefs"
for f in stagefs-run mount.fuse.stagefs slurm-prolog.sh slurm-epilog.sh slurm-task-prolog.sh; do
  install -m 0755 "$here/$f" "$dest$libexec/$f"
done
install -m 0644 "$here/stagefs-lib.sh" "$here/slurm-example.sbatch" "$dest$libexec/"
install -d "$dest$prefix/lib/stagefs/python/stagefs_feed"
install -m 0644 "$here/../python/sitecustomize.py" "$dest$prefix/lib/stagefs/python/"
install -m 0644 "$here/../python/stagefs_feed/"*.py "$dest$prefix/lib/stagefs/python/stagefs_feed/"
ln -sfn ../libexec/stagefs/stagefs-run "$dest$prefix/bin/stagefs-run"
ln -sfn "$libexec/mount.fuse.stagefs" "$dest$sbindir/mount.fuse.stagefs"
sed "s|/usr/local/bin/stagefs|$prefix/bin/stagefs|g" "$here/stagefs@.service" \
  >"$dest$unitdir/stagefs@.service"
chmod 0644 "$dest$unitdir/stagefs@.service"
echo "installed stagefs into $dest$prefix (helper: $dest$sbindir/mount.fuse.stagefs, unit: $dest$unitdir/stagefs@.service)"
