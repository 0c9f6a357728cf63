#!/usr/bin/env python3
"""What SOURCE's permission check adds to an open through the mount (run by hand as root).

Usage: tests/bench/access_bench.py [--files N] [--rounds R] [--binary PATH]

N small files are mounted with --allow-other and staged completely (root reads them all).
Then open+close of every file (no read: the open is what is measured), in microseconds per
file, median of R rounds, single reader:

- root: the daemon's own uid, so only the re-entrancy check runs (one stat in /proc);
- nobody, first opens: each file's decision is made by SOURCE (read /proc/PID/status, switch
  this FUSE thread's fsuid/fsgid/groups, openat2 beneath SOURCE, faccessat2, switch back);
- nobody, decided: the decisions are cached (read /proc/PID/status, two bits);
- the same opens directly on the source directory, for scale.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import tempfile

NOBODY = 65534

LOOP = r"""
import os, sys, time
paths = sys.argv[1:]
start = time.monotonic()
for p in paths:
    os.close(os.open(p, os.O_RDONLY))
print((time.monotonic() - start) * 1e6 / len(paths))
"""


def as_nobody():
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)


def per_file(paths, nobody):
    """Microseconds per open+close of `paths`, in a fresh process (as nobody, or as root).
    The system interpreter: nobody may not be able to run a per-user one (pyenv)."""
    out = subprocess.run(["/usr/bin/python3", "-c", LOOP, *paths], check=True, capture_output=True,
                         text=True, preexec_fn=as_nobody if nobody else None)
    return float(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--binary", default=os.path.join(os.path.dirname(__file__), "../../target/release/stagefs"))
    args = ap.parse_args()
    binary = os.path.abspath(args.binary)
    work = tempfile.mkdtemp(prefix="stagefs-access.", dir="/var/tmp")
    os.chmod(work, 0o755)
    source, mnt, cache = (os.path.join(work, d) for d in ("source", "mnt", "cache"))
    os.makedirs(mnt)
    rel = []
    for i in range(args.files):
        r = "class%03d/img%06d.jpg" % (i % 50, i)
        os.makedirs(os.path.join(source, os.path.dirname(r)), exist_ok=True)
        with open(os.path.join(source, r), "wb") as f:
            f.write(os.urandom(4096))
        rel.append(r)
    subprocess.run([binary, "mount", source, mnt, "--cache", cache, "--allow-other"], check=True)
    try:
        on_mount = [os.path.join(mnt, r) for r in rel]
        on_source = [os.path.join(source, r) for r in rel]
        per_file(on_mount, False)  # stages every file, and warms the kernel's dentries
        first = per_file(on_mount, True)
        rows = [
            ("direct on SOURCE, nobody", [per_file(on_source, True) for _ in range(args.rounds)]),
            ("mount, root (re-entrancy check only)", [per_file(on_mount, False) for _ in range(args.rounds)]),
            ("mount, nobody, first opens (SOURCE decides)", [first]),
            ("mount, nobody, decided (cached)", [per_file(on_mount, True) for _ in range(args.rounds)]),
        ]
        print("%d files of 4 KB, all cached, open+close, one reader" % len(rel))
        for label, values in rows:
            print("%-46s %7.1f us/file" % (label, statistics.median(values)), flush=True)
    finally:
        subprocess.run([binary, "unmount", mnt], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
