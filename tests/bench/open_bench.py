#!/usr/bin/env python3
"""What each open of a cached file costs through the mount (run by hand as root, not in CI).

Usage: tests/bench/open_bench.py [--files N] [--readers 1,2,8] [--binary PATH] [--probe PATH]

A synthetic ImageFolder of ~110 KB files on local disk is mounted and staged completely; then
each measurement reads every file once (open, read to the end, close), alternating between the
source directory ("direct") and the mount, median of three rounds:

- `os.open` loop: the system calls a C reader makes (FUSE: OPEN, and RELEASE after close);
- Python `open()` loop: what torchvision's loader does (adds fstat and the TCGETS ioctl of
  isatty, hence a GETATTR and an IOCTL round trip);
- warm (files in the page cache) and cold (page cache dropped, as for a dataset larger than
  memory), with several reader threads;
- pinned: the Python loop with the reader and the daemon on one CPU, then on different CPUs,
  which shows how much of a round trip is waking an idle CPU.

With `--probe target/release/examples/open_cost`, the source directory is also mounted through
that bare FUSE server twice, and every row gains its two columns: `probe 1 OPEN` (an OPEN
answered with passthrough and nothing else: the floor of a hit path that sees every open) and
`probe 0 OPEN` (OPEN answered ENOSYS: the kernel sends no OPEN or RELEASE again and keeps the
page cache; only a cold page's READ and Python's IOCTL still reach the daemon). Each mount's
request counts are printed at the end.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

# The same synthetic ImageFolder and page-cache drop as the engine benchmark next to this file.
from engine_bench import drop_caches, make_dataset


def python_reader(paths):
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass


def syscall_reader(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        while os.read(fd, 1 << 20):
            pass
        os.close(fd)


def timed(reader, paths, threads):
    """Microseconds per file with `threads` readers splitting the files."""
    parts = [paths[k::threads] for k in range(threads)]
    workers = [threading.Thread(target=reader, args=(part,)) for part in parts]
    start = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return (time.monotonic() - start) * 1e6 / len(paths)


def compare(rel, roots, reader, threads, cold):
    """{name: median microseconds per file} over three rounds alternating between `roots`."""
    results = {name: [] for name in roots}
    for _ in range(3):
        for name, root in roots.items():
            paths = [os.path.join(root, p) for p in rel]
            if cold:
                drop_caches()
            else:
                timed(reader, paths, threads)
            results[name].append(timed(reader, paths, threads))
    return {name: statistics.median(times) for name, times in results.items()}


def report(label, times):
    direct = times["direct"]
    columns = ["direct %7.1f us" % direct]
    for name, mount in times.items():
        if name != "direct":
            columns.append("%s %7.1f us (+%6.1f, ratio %.3f)" % (name, mount, mount - direct, direct / mount))
    print("%-30s %s" % (label, "  ".join(columns)), flush=True)


def pinned(rel, mnt, daemon_pid, reader_cpu, daemon_cpu):
    """Python-loop microseconds per file with the reader and the daemon pinned."""
    subprocess.run(["taskset", "-a", "-p", "-c", str(daemon_cpu), str(daemon_pid)],
                   check=True, capture_output=True)
    os.sched_setaffinity(0, {reader_cpu})
    try:
        paths = [os.path.join(mnt, p) for p in rel]
        timed(python_reader, paths, 1)
        return statistics.median(timed(python_reader, paths, 1) for _ in range(3))
    finally:
        every = set(range(os.cpu_count()))
        os.sched_setaffinity(0, every)
        subprocess.run(["taskset", "-a", "-p", "-c", "0-%d" % (os.cpu_count() - 1), str(daemon_pid)],
                       check=True, capture_output=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--readers", default="1,2,8")
    ap.add_argument("--binary", default=os.path.join(os.path.dirname(__file__), "../../target/release/stagefs"))
    ap.add_argument("--probe", help="examples/open_cost binary: also measure a bare FUSE server with 1 and 0 OPEN round trips")
    args = ap.parse_args()
    binary = os.path.abspath(args.binary)
    work = tempfile.mkdtemp(prefix="stagefs-open.", dir="/var/tmp")
    source, mnt, cache = (os.path.join(work, d) for d in ("source", "mnt", "cache"))
    os.makedirs(mnt)
    make_dataset(source, args.files)
    subprocess.run([binary, "mount", source, mnt, "--cache", cache], check=True)
    roots = {"direct": source, "stagefs": mnt}
    probes = []
    if args.probe:
        for name, mode in (("probe 1 OPEN", "passthrough"), ("probe 0 OPEN", "no-open")):
            root = os.path.join(work, mode)
            os.makedirs(root)
            probes.append((name, root, subprocess.Popen([os.path.abspath(args.probe), source, root, mode],
                                                         stdout=subprocess.PIPE, text=True)))
            roots[name] = root
        deadline = time.monotonic() + 10
        while not all(os.path.ismount(r) for _, r, _ in probes) and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        rel = subprocess.run([binary, "order", "--source", source, "--paths"], check=True,
                             capture_output=True, text=True).stdout.split()
        syscall_reader([os.path.join(mnt, p) for p in rel])  # stages every file
        stats = subprocess.run(["getfattr", "--only-values", "-n", "user.stagefs.stats", mnt],
                               check=True, capture_output=True, text=True).stdout
        print("%d files of ~110 KB, all cached; passthrough: %s" % (
            len(rel), '"passthrough":true' in stats.replace(" ", "")), flush=True)
        for cold in (False, True):
            for threads in (int(t) for t in args.readers.split(",")):
                for name, reader in (("os.open", syscall_reader), ("Python open", python_reader)):
                    label = "%s, %s, %d reader%s" % (name, "cold" if cold else "warm", threads,
                                                      "" if threads == 1 else "s")
                    report(label, compare(rel, roots, reader, threads, cold))
        if os.cpu_count() >= 2:
            pid = int(subprocess.run(["pgrep", "-f", "stagefs mount %s " % source], check=True,
                                     capture_output=True, text=True).stdout.split()[0])
            same = pinned(rel, mnt, pid, 0, 0)
            other = pinned(rel, mnt, pid, 0, 1)
            print("Python open, warm, reader and daemon on one CPU: %.1f us/file; on two: %.1f us/file"
                  % (same, other), flush=True)
    finally:
        for name, root, probe in probes:
            probe.terminate()
            print("%s: %s" % (name, probe.communicate()[0].strip()), flush=True)
        subprocess.run([binary, "unmount", mnt], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
