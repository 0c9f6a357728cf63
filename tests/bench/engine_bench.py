#!/usr/bin/env python3
"""Engine benchmark through a real mount (run by hand as root, not in CI).

Usage: tests/bench/engine_bench.py [--files N] [--epochs E] [--compute-ms MS] [--binary PATH]

A synthetic ImageFolder dataset on local disk stands in for the parallel file system. A
reader follows the torch-distributed order that `stagefs order --paths` prints (what
DataLoader(sampler=DistributedSampler(seed=0)) opens), two worker threads taking alternate
batches, sleeping --compute-ms per batch. It reports, per scenario and epoch: hit ratio,
bytes read from SOURCE / share bytes, wasted staging, and hit read throughput through the
mount versus reading the same files directly (page cache dropped before each).

Scenarios: cache = 100% of the share; cache = 30% with the prediction (Belady); cache = 30%
with --sampler none (on-demand, LRU), the baseline the prediction is meant to beat.
"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

BATCH = 32
WORKERS = 2


def make_dataset(root, files):
    sizes = []
    for i in range(files):
        d = os.path.join(root, "class%03d" % (i % 50))
        os.makedirs(d, exist_ok=True)
        # ImageNet-like spread around ~110 KB.
        size = 20_000 + (i * 2654435761 % 180_000) + (100_000 if i % 7 == 0 else 0)
        with open(os.path.join(d, "img%06d.jpg" % i), "wb") as f:
            f.write(os.urandom(size))
        sizes.append(size)
    return sum(sizes)


def drop_caches():
    """Drops file contents only (1), keeping dentries and inodes: a training job's metadata is
    in the kernel's caches after its dataset class listed the tree, its data is not."""
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def stats(mnt):
    out = subprocess.run(["getfattr", "--only-values", "-n", "user.stagefs.stats", mnt],
                         check=True, capture_output=True).stdout
    return json.loads(out)


def read_files(paths, compute_s):
    """Reads paths as WORKERS DataLoader workers would; returns (seconds, bytes)."""
    batches = [paths[i:i + BATCH] for i in range(0, len(paths), BATCH)]
    total = [0] * WORKERS

    def worker(w):
        for b in batches[w::WORKERS]:
            for p in b:
                with open(p, "rb") as f:
                    while True:
                        chunk = f.read(1 << 20)
                        if not chunk:
                            break
                        total[w] += len(chunk)
            if compute_s:
                time.sleep(compute_s)

    start = time.monotonic()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - start, sum(total)


def order_paths(binary, source, epoch):
    out = subprocess.run([binary, "order", "--source", source, "--paths", "--epoch", str(epoch)],
                         check=True, capture_output=True, text=True).stdout
    return out.splitlines()


def scenario(binary, work, source, share, name, extra, epochs, compute_s):
    mnt = os.path.join(work, "mnt-" + name)
    cache = os.path.join(work, "cache-" + name)
    os.makedirs(mnt)
    subprocess.run([binary, "mount", source, mnt, "--cache", cache] + extra, check=True)
    rows = []
    try:
        for e in range(epochs):
            rel = order_paths(binary, source, e)
            before = stats(mnt)
            seconds, _ = read_files([os.path.join(mnt, p) for p in rel], compute_s)
            after = stats(mnt)
            opens = (after["hits"] - before["hits"]) + (after["misses"] - before["misses"])
            rows.append({
                "scenario": name, "epoch": e, "seconds": round(seconds, 2),
                "hit_ratio": round((after["hits"] - before["hits"]) / max(opens, 1), 4),
                "source_over_share": round((after["source_bytes"] - before["source_bytes"]) / share, 3),
                "wasted_over_staged": round(after["wasted_bytes"] / max(after["staged_bytes"], 1), 4),
                "stall_s": round(after["stall_seconds"] - before["stall_seconds"], 2),
                "mispredictions": after["mispredictions"],
            })
            print(json.dumps(rows[-1]), flush=True)
    finally:
        subprocess.run([binary, "unmount", mnt], check=False)
    return rows


def throughput(binary, work, source, epochs_ok):
    """Hit read throughput through the mount vs reading the cache's own disk directly."""
    mnt = os.path.join(work, "mnt-tp")
    cache = os.path.join(work, "cache-tp")
    os.makedirs(mnt)
    result = {}
    for label, extra in (("passthrough", []), ("pread", ["--no-passthrough"])):
        subprocess.run([binary, "mount", source, mnt, "--cache", cache] + extra, check=True)
        try:
            rel = order_paths(binary, source, 0)
            read_files([os.path.join(mnt, p) for p in rel], 0)  # make sure all are cached
            drop_caches()
            secs, nbytes = read_files([os.path.join(mnt, p) for p in rel], 0)
            result[label + "_MBps"] = round(nbytes / secs / 1e6, 1)
        finally:
            subprocess.run([binary, "unmount", mnt], check=False)
    drop_caches()
    rel = order_paths(binary, source, 0)
    secs, nbytes = read_files([os.path.join(source, p) for p in rel], 0)
    result["direct_MBps"] = round(nbytes / secs / 1e6, 1)
    result["passthrough_over_direct"] = round(result["passthrough_MBps"] / result["direct_MBps"], 3)
    result["pread_over_direct"] = round(result["pread_MBps"] / result["direct_MBps"], 3)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--compute-ms", type=float, default=20.0)
    ap.add_argument("--binary", default=os.path.join(os.path.dirname(__file__), "../../target/release/stagefs"))
    args = ap.parse_args()
    binary = os.path.abspath(args.binary)
    work = tempfile.mkdtemp(prefix="stagefs-bench.")
    try:
        source = os.path.join(work, "source")
        share = make_dataset(source, args.files)
        print("dataset: %d files, %.1f MB" % (args.files, share / 1e6), flush=True)
        small = str(int(share * 0.3))
        compute = args.compute_ms / 1000
        rows = []
        rows += scenario(binary, work, source, share, "full", [], args.epochs, compute)
        rows += scenario(binary, work, source, share, "30pct", ["--cache-size", small], args.epochs, compute)
        rows += scenario(binary, work, source, share, "30pct-lru", ["--cache-size", small, "--sampler", "none"],
                         args.epochs, compute)
        tp = throughput(binary, work, source, args.epochs)
        print(json.dumps(tp))
        print("\n%-10s %5s %8s %9s %12s %8s %7s" % ("scenario", "epoch", "seconds", "hit", "src/share", "wasted", "stall"))
        for r in rows:
            print("%-10s %5d %8.2f %9.4f %12.3f %8.4f %7.2f" % (
                r["scenario"], r["epoch"], r["seconds"], r["hit_ratio"], r["source_over_share"],
                r["wasted_over_staged"], r["stall_s"]))
        for name in ("full", "30pct", "30pct-lru"):
            mine = [r for r in rows if r["scenario"] == name]
            print("%-10s all epochs: SOURCE bytes / (epochs x share) = %.3f, wasted %.4f" % (
                name, sum(r["source_over_share"] for r in mine) / len(mine), mine[-1]["wasted_over_staged"]))
        print("hit throughput: passthrough %.1f MB/s, pread %.1f MB/s, direct %.1f MB/s "
              "(passthrough/direct %.3f, pread/direct %.3f)" % (
                  tp["passthrough_MBps"], tp["pread_MBps"], tp["direct_MBps"],
                  tp["passthrough_over_direct"], tp["pread_over_direct"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
