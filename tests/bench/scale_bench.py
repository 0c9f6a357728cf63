#!/usr/bin/env python3
"""Scale benchmark through a real mount (run by hand as root, not in CI).

Usage: tests/bench/scale_bench.py [--files 1281167] [--classes 1000] [--workdir DIR] [--binary PATH]

Builds an ImageNet-shaped tree of empty files on local disk (1,281,167 files in 1,000 folders
by default; about a minute to create), then measures: the scan (`stagefs index`), a mount
from the saved index and a mount that scans, the daemon's memory per file (VmRSS, VmHWM),
`stat` of 100,000 random paths through the mount (4 processes), and readdir of one
1,300-entry folder. The 14.2 M-entry case, which would use up this machine's inodes, is
measured in process by `cargo run --release --example scale_bench -- 14197103 21841`.
"""
import argparse
import multiprocessing
import os
import random
import shutil
import subprocess
import tempfile
import time


def make_tree(root, files, classes):
    for c in range(classes):
        d = os.path.join(root, "n%08d" % c)
        os.makedirs(d, exist_ok=True)
        lo, hi = c * files // classes, (c + 1) * files // classes
        for i in range(lo, hi):
            os.close(os.open(os.path.join(d, "n%08d_%d.JPEG" % (c, i)), os.O_CREAT | os.O_WRONLY, 0o644))


def daemon_memory(mnt):
    pid = subprocess.run(["getfattr", "--only-values", "-n", "user.stagefs.pid", mnt],
                         check=True, capture_output=True, text=True).stdout.strip()
    fields = {}
    with open("/proc/%s/status" % pid) as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                fields[k] = int(v.split()[0]) * 1024
    return fields


def stat_chunk(paths):
    for p in paths:
        os.stat(p)
    return len(paths)


def timed_mount(binary, source, mnt, cache, extra):
    start = time.monotonic()
    subprocess.run([binary, "mount", source, mnt, "--cache", cache] + extra, check=True)
    return time.monotonic() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1_281_167)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--binary", default=os.path.join(os.path.dirname(__file__), "../../target/release/stagefs"))
    args = ap.parse_args()
    binary = os.path.abspath(args.binary)
    work = args.workdir or tempfile.mkdtemp(prefix="stagefs-scale.")
    source, mnt = os.path.join(work, "source"), os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    try:
        t = time.monotonic()
        make_tree(source, args.files, args.classes)
        print("created %d files in %d folders in %.1f s" % (args.files, args.classes, time.monotonic() - t), flush=True)
        index = os.path.join(work, "imagenet.index")
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        t = time.monotonic()
        subprocess.run([binary, "index", source, "-o", index], check=True, capture_output=True)
        print("scan + save index (stagefs index, page cache dropped): %.2f s" % (time.monotonic() - t), flush=True)

        # A mount that scans (no index anywhere), for comparison.
        secs = timed_mount(binary, source, mnt, os.path.join(work, "cache-scan"), ["--sampler", "none"])
        mem = daemon_memory(mnt)
        subprocess.run([binary, "unmount", mnt], check=True)
        print("mount with a scan: %.2f s; daemon VmRSS %.1f B/file, VmHWM %.1f B/file"
              % (secs, mem["VmRSS"] / args.files, mem["VmHWM"] / args.files), flush=True)

        secs = timed_mount(binary, source, mnt, os.path.join(work, "cache-index"), ["--index", index])
        mem = daemon_memory(mnt)
        print("mount from the saved index (torch-distributed plan included): %.2f s; daemon VmRSS %.1f B/file, VmHWM %.1f B/file"
              % (secs, mem["VmRSS"] / args.files, mem["VmHWM"] / args.files), flush=True)
        try:
            rng = random.Random(0)
            names = []
            for _ in range(100_000):
                i = rng.randrange(args.files)
                c = next(c for c in range(i * args.classes // args.files, args.classes)
                         if (c + 1) * args.files // args.classes > i)
                names.append(os.path.join(mnt, "n%08d" % c, "n%08d_%d.JPEG" % (c, i)))
            chunks = [names[k::4] for k in range(4)]
            with multiprocessing.Pool(4) as pool:
                t = time.monotonic()
                n = sum(pool.map(stat_chunk, chunks))
                secs = time.monotonic() - t
            print("stat of %d random paths through the mount: %.0f ops/s" % (n, n / secs), flush=True)
            folder = os.path.join(mnt, "n%08d" % (args.classes // 2))
            t = time.monotonic()
            entries = len(os.listdir(folder))
            first = time.monotonic() - t
            t = time.monotonic()
            for _ in range(100):
                os.listdir(folder)
            again = (time.monotonic() - t) / 100
            print("readdir of a %d-entry folder: first %.2f ms, then %.3f ms" % (entries, first * 1e3, again * 1e3))
        finally:
            subprocess.run([binary, "unmount", mnt], check=False)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
