#!/usr/bin/env python3
"""Hit-path benchmark: what an unmodified DataLoader epoch costs over a stagefs mount whose
files are all cached, against the same files in a local directory, with and without the feed
hook's batch opens, with a warm page cache and with it dropped before each epoch.

Run by hand, as root, after `cargo build --release` (not in CI: timings on a shared machine are
noisy; compare the ratios within one run):

    /usr/bin/python3 tests/bench/hit_path_bench.py [--files 2000] [--kb 110] [--epochs 3]
        [--workers 2] [--work /var/tmp/stagefs-hit-bench]

The dataset is written to WORK/local (ImageFolder shape, random bytes), mounted from there
with --sampler torch-random predicting the loader's generator, and read once through the
mount so every file is cached. Then each case runs the same loader (DatasetFolder whose loader
reads the file whole with open(path, "rb"), as torchvision's pil_loader opens it; no decode,
no compute) for --epochs epochs and reports the median epoch time, and for the mount the FUSE
OPENs the kernel sent per epoch (the mount's `ops` counters):

  local          WORK/local read directly (the limit: what a copy to local disk gives)
  mount          the mount, no hook (every open is a FUSE OPEN and the isatty IOCTL)
  mount+hook     the mount with `stagefs feed-env` (one batch open per batch)

Also a plain Python loop, open(path, "rb").read() of every file, mount / local.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
STAGEFS = os.environ.get("STAGEFS", os.path.join(REPO, "target", "release", "stagefs"))
PYTHON = "/usr/bin/python3"
SEED = 5

JOB = r"""
import json, os, sys, time
import torch
from torch.utils.data import DataLoader
from torchvision.datasets import DatasetFolder

root, epochs, workers, cold, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "cold", int(sys.argv[5])

def read(path):
    with open(path, "rb") as f:
        return len(f.read())

dataset = DatasetFolder(root, loader=read, extensions=(".jpg",))
loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=workers,
                    generator=torch.Generator().manual_seed(seed), persistent_workers=workers > 0,
                    collate_fn=lambda b: sum(x for x, _ in b))
for epoch in range(epochs):
    if cold:
        os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
    started = time.perf_counter()
    total = sum(loader)
    print(json.dumps({"epoch": epoch, "seconds": time.perf_counter() - started, "bytes": total}), flush=True)
"""

LOOP = r"""
import os, sys, time
root, cold = sys.argv[1], sys.argv[2] == "cold"
paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
def read_all():
    for p in paths:
        with open(p, "rb") as f:
            f.read()
if cold:
    os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
else:
    read_all()  # warm: everything in the page cache first
started = time.perf_counter()
read_all()
print(time.perf_counter() - started)
"""


def sh(*cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def make_dataset(root, files, kb):
    if os.path.isdir(root) and sum(len(f) for _, _, f in os.walk(root)) == files:
        return
    sh("rm", "-rf", root)
    for i in range(files):
        d = os.path.join(root, f"class{i % 20:03d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"img{i:06d}.jpg"), "wb") as f:
            f.write(os.urandom(kb * 1024))


def stats(mnt):
    return json.loads(sh(STAGEFS, "stats", "--json", mnt, capture_output=True).stdout)


def hook_env():
    out = sh("sh", "-c", 'eval "$("$0" feed-env)" && printf %s "$PYTHONPATH"', STAGEFS,
             capture_output=True, text=True).stdout
    return dict(os.environ, PYTHONPATH=out)


def run_job(root, args, env=None, cold=False):
    out = sh(PYTHON, "-c", JOB, root, str(args.epochs), str(args.workers), "cold" if cold else "warm",
             str(SEED), capture_output=True, text=True, env=env or dict(os.environ, PYTHONPATH="")).stdout
    epochs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return statistics.median(e["seconds"] for e in epochs)


def loop(root, cold):
    out = sh(PYTHON, "-c", LOOP, root, "cold" if cold else "warm", capture_output=True, text=True,
             env=dict(os.environ, PYTHONPATH="")).stdout
    return float(out.strip())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--kb", type=int, default=110)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", default="/var/tmp/stagefs-hit-bench")
    args = ap.parse_args()
    local, mnt, cache = (os.path.join(args.work, n) for n in ("local", "mnt", "cache"))
    make_dataset(local, args.files, args.kb)
    os.makedirs(mnt, exist_ok=True)
    sh("rm", "-rf", cache)
    sh(STAGEFS, "mount", local, mnt, "--cache", cache, "--sampler", "torch-random", "--seed", str(SEED),
       "--log-file", os.path.join(args.work, "stagefs.log"))
    try:
        run_job(mnt, argparse.Namespace(epochs=1, workers=args.workers))  # stage everything
        deadline = time.time() + 120
        while stats(mnt)["cached_files"] < args.files and time.time() < deadline:
            time.sleep(0.5)
        print(f"{args.files} files of {args.kb} KB, all cached: {stats(mnt)['cached_files']}; "
              f"{args.workers} workers, median of {args.epochs} epochs")
        print(f"{'page cache':<12}{'local s':>9}{'mount s':>9}{'hook s':>9}{'mount/local':>13}"
              f"{'hook/local':>12}{'FUSE opens/epoch (mount, hook)':>34}")
        for cold in (False, True):
            local_s = run_job(local, args, cold=cold)
            before = stats(mnt)["ops"]["open"]
            mount_s = run_job(mnt, args, cold=cold)
            middle = stats(mnt)["ops"]["open"]
            hook_s = run_job(mnt, args, env=hook_env(), cold=cold)
            after = stats(mnt)["ops"]["open"]
            opens = ((middle - before) / args.epochs, (after - middle) / args.epochs)
            print(f"{'dropped' if cold else 'warm':<12}{local_s:>9.3f}{mount_s:>9.3f}{hook_s:>9.3f}"
                  f"{mount_s / local_s:>13.2f}{hook_s / local_s:>12.2f}{opens[0]:>20.0f}{opens[1]:>14.0f}")
        for cold in (False, True):
            l, m = loop(local, cold), loop(mnt, cold)
            print(f"python open().read() loop, page cache {'dropped' if cold else 'warm'}: "
                  f"local {l:.3f} s, mount {m:.3f} s, mount/local {m / l:.2f}")
        s = stats(mnt)
        print(f"mount totals: {s['descriptor_opens']} opens by descriptor in {s['batch_requests']} "
              f"batch requests, {s['ops']['open']} FUSE opens, hit ratio {s['hit_ratio']:.4f}")
    finally:
        sh(STAGEFS, "unmount", mnt)


if __name__ == "__main__":
    sys.exit(main())
