#!/usr/bin/env python3
"""Epoch benchmark: one PyTorch loader (tests/e2e/train_distributed.py: ImageFolder,
DistributedSampler, DataLoader with worker processes) over a synthetic ImageFolder dataset on
GlusterFS, in each of the ways a job can get at the data, epoch by epoch.

Run by hand, as root, from anywhere, after `cargo build --release` (not run in CI: it takes
minutes and timings on a shared machine are noisy):

    /usr/bin/python3 tests/bench/epoch_bench.py [--files 3000] [--epochs 3] [--compute-ms 60]
        [--batch-size 32] [--workers 2] [--work /var/tmp/stagefs-epoch-bench] [--out DIR]
        [--only SCENARIO,...] [--client-cache] [--keep]

Needs (apt): glusterfs-server, fuse3, attr, rclone, python3-torch, python3-torchvision; the PNG
chart also needs python3-matplotlib (without it the chart is skipped, the table and JSON are
still written). --keep leaves the GlusterFS volume and dataset in place for the next run, which
reuses them when --files matches.

Scenarios, each run without and with simulated compute per batch:
  direct       the loader reads the GlusterFS mount
  copy-first   `cp -r` of the dataset to local disk (timed, counted as setup), then train
  stagefs      stagefs over the GlusterFS mount, predicting the DistributedSampler order
  stagefs-30%  the same with --cache-size 30% of the node's share
  stagefs-none stagefs with --sampler none (caches what is read, no prediction)
  rclone       rclone mount :local:<GlusterFS dir> --vfs-cache-mode full
  local        the data already on local disk (the limit)
Before each scenario the page cache is dropped and the GlusterFS client remounted. By default
the client caches nothing on the node (mount -o direct-io-mode=enable, quick-read off), as when
the dataset is much larger than the node's memory: without that, a dataset that fits in RAM is
read from GlusterFS once and then served by the node's page cache, whatever the scenario
(--client-cache measures that case). The bricks live on this machine, so their files may come
from the page cache, as a PFS server's cache would serve them.

Measured per epoch: wall time and time waiting for batches (from the loader's JSON lines), hit
ratio (stagefs counters), bytes read from GlusterFS = growth of `rchar` in /proc/PID/io of the
GlusterFS FUSE client process (what it received from the bricks plus FUSE request headers, so
slightly above the payload; for stagefs scenarios the mount's own source_bytes is in the JSON
too), and the peak RSS (VmHWM) of the stagefs daemon and of rclone. Epoch 0 counts from the
mount (stagefs and rclone start reading when mounted); the stager reads ahead into the next
epochs, so per-epoch bytes are what was read during that epoch, steady from epoch 1 on.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
E2E = os.path.join(REPO, "tests", "e2e")
STAGEFS = os.path.join(REPO, "target", "release", "stagefs")
PYTHON = "/usr/bin/python3"  # Debian's, where apt's torch is
VOLUME = "stagefs_epoch_bench"
SEED = 11
SCENARIOS = ["direct", "copy-first", "stagefs", "stagefs-30%", "stagefs-none", "rclone", "local"]


def sh(*cmd, capture=False):
    pipe = subprocess.PIPE if capture else None
    r = subprocess.run(cmd, check=True, text=True, stdout=pipe, stderr=pipe)
    return r.stdout


def mounted(path):
    return subprocess.run(["mountpoint", "-q", path]).returncode == 0


def vm_hwm_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def find_pid(*needles):
    """The process whose command line contains every needle (the GlusterFS client, rclone)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmd for n in needles):
            return int(pid)
    return None


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = args.work
        self.bricks = os.path.join(self.work, "bricks")
        self.gmnt = os.path.join(self.work, "gluster")
        self.train = os.path.join(self.gmnt, "train")
        self.local = os.path.join(self.work, "local", "train")
        self.mnt = os.path.join(self.work, "mnt")
        self.cache = os.path.join(self.work, "cache")
        self.results = []

    # GlusterFS -----------------------------------------------------------------------------

    def gluster(self, verb):
        env = dict(os.environ)
        if not self.args.client_cache:
            env["GLUSTER_MOUNT_OPTIONS"] = "direct-io-mode=enable"
        cmd = [os.path.join(E2E, "gluster.sh"), verb, VOLUME, self.bricks, self.gmnt] + (["4"] if verb == "up" else [])
        subprocess.run(cmd, check=True, env=env)
        if verb == "up":
            quick_read = "on" if self.args.client_cache else "off"
            sh("gluster", "--mode=script", "volume", "set", VOLUME, "performance.quick-read", quick_read, capture=True)

    def fresh_start(self):
        """Cold caches: page cache dropped, GlusterFS client remounted."""
        if mounted(self.gmnt):
            sh("umount", self.gmnt)
        self.gluster("up")
        sh("sync")
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")

    def client_rchar(self):
        pid = find_pid("glusterfs", f"--volfile-id=/{VOLUME}", self.gmnt)
        with open(f"/proc/{pid}/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])

    def dataset(self):
        marker = os.path.join(self.work, "dataset.json")
        self.gluster("up")
        if os.path.exists(marker):
            info = json.load(open(marker))
            if info["files"] == self.args.files and os.path.isdir(self.train):
                return info
        shutil.rmtree(self.train, ignore_errors=True)
        print(f"writing {self.args.files} JPEG files (ImageNet-like sizes) to GlusterFS ...", flush=True)
        out = sh(
            PYTHON,
            os.path.join(E2E, "common.py"),
            "make-dataset",
            self.train,
            "--files",
            str(self.args.files),
            "--classes",
            "100",
            "--imagenet-sizes",
            capture=True,
        )
        info = json.loads(out)
        json.dump(info, open(marker, "w"))
        return info

    # the loader ----------------------------------------------------------------------------

    def train_on(self, root, compute_ms, at_epoch_end):
        """Runs the loader for all epochs; `at_epoch_end(epoch)` runs while it waits between
        epochs (and after the last) and returns extra fields for that epoch."""
        a = self.args
        cmd = [PYTHON, os.path.join(E2E, "train_distributed.py"), root, "--epochs", str(a.epochs)]
        cmd += ["--batch-size", str(a.batch_size), "--workers", str(a.workers), "--seed", str(SEED)]
        cmd += ["--compute-ms", str(compute_ms), "--step"]
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        epochs = []
        for line in p.stdout:
            e = json.loads(line)
            e.update(at_epoch_end(e["epoch"]))
            epochs.append(e)
            if e["epoch"] + 1 < a.epochs:
                p.stdin.write("\n")
                p.stdin.flush()
        if p.wait() != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed")
        return epochs

    def measured(self, root, compute_ms, stats=None, rchar_before=None):
        """Trains on `root`, recording GlusterFS client bytes per epoch (and stagefs counters
        when `stats` reads them; they start at zero on a fresh mount). `rchar_before`: the
        client's count before the mount, so epoch 0 includes what was read before training."""
        zero = {"hits": 0, "misses": 0, "source_bytes": 0}
        last = {"rchar": self.client_rchar() if rchar_before is None else rchar_before, "stats": zero}

        def at_end(_epoch):
            now = {"rchar": self.client_rchar(), "stats": stats() if stats else None}
            extra = {"gluster_bytes": now["rchar"] - last["rchar"]}
            if stats:
                d = {k: now["stats"][k] - last["stats"][k] for k in ("hits", "misses", "source_bytes")}
                extra["hit_ratio"] = d["hits"] / max(1, d["hits"] + d["misses"])
                extra["source_bytes"] = d["source_bytes"]
            last.update(now)
            return extra

        return self.train_on(root, compute_ms, at_end)

    # scenarios -----------------------------------------------------------------------------

    def copy_local(self):
        shutil.rmtree(os.path.dirname(self.local), ignore_errors=True)
        os.makedirs(os.path.dirname(self.local))
        before = self.client_rchar()
        t = time.perf_counter()
        sh("cp", "-r", self.train, self.local)
        return time.perf_counter() - t, self.client_rchar() - before

    def run_direct(self, compute_ms):
        return {"epochs": self.measured(self.train, compute_ms)}

    def run_copy_first(self, compute_ms):
        secs, gbytes = self.copy_local()
        return {"setup_s": secs, "setup_gluster_bytes": gbytes, "epochs": self.measured(self.local, compute_ms)}

    def run_local(self, compute_ms):
        if not os.path.isdir(self.local):
            self.copy_local()
            self.fresh_start()
        return {"epochs": self.measured(self.local, compute_ms)}

    def run_stagefs(self, compute_ms, extra):
        shutil.rmtree(self.cache, ignore_errors=True)
        os.makedirs(self.mnt, exist_ok=True)
        cmd = [STAGEFS, "mount", self.train, self.mnt, "--cache", self.cache]
        cmd += ["--log-file", os.path.join(self.work, "stagefs.log")] + extra
        rchar = self.client_rchar()
        t = time.perf_counter()
        sh(*cmd)
        setup = time.perf_counter() - t
        try:
            pid = int(sh("getfattr", "--only-values", "-n", "user.stagefs.pid", self.mnt, capture=True))

            def stats():
                return json.loads(sh("getfattr", "--only-values", "-n", "user.stagefs.stats", self.mnt, capture=True))

            epochs = self.measured(self.mnt, compute_ms, stats, rchar)
            final = stats()
            return {"setup_s": setup, "epochs": epochs, "rss_kb": vm_hwm_kb(pid), "stats": final}
        finally:
            sh(STAGEFS, "unmount", self.mnt)

    def run_rclone(self, compute_ms):
        shutil.rmtree(self.cache, ignore_errors=True)
        os.makedirs(self.mnt, exist_ok=True)
        rchar = self.client_rchar()
        t = time.perf_counter()
        sh("rclone", "mount", f":local:{self.train}", self.mnt, "--vfs-cache-mode", "full", "--cache-dir", self.cache, "--daemon")
        for _ in range(100):
            if mounted(self.mnt):
                break
            time.sleep(0.1)
        setup = time.perf_counter() - t
        pid = find_pid("rclone", "mount", self.mnt)
        try:
            epochs = self.measured(self.mnt, compute_ms, rchar_before=rchar)
            return {"setup_s": setup, "epochs": epochs, "rss_kb": vm_hwm_kb(pid)}
        finally:
            sh("fusermount", "-u", self.mnt)
            for _ in range(100):  # the daemon flushes its cache state and exits
                if pid is None or not os.path.exists(f"/proc/{pid}"):
                    break
                time.sleep(0.1)

    def run(self, scenario, compute_ms, share_bytes):
        sampler = ["--sampler", "torch-distributed", "--seed", str(SEED), "--world-size", "1", "--rank", "0"]
        self.fresh_start()
        if scenario == "direct":
            return self.run_direct(compute_ms)
        if scenario == "copy-first":
            return self.run_copy_first(compute_ms)
        if scenario == "local":
            return self.run_local(compute_ms)
        if scenario == "stagefs":
            return self.run_stagefs(compute_ms, sampler)
        if scenario == "stagefs-30%":
            return self.run_stagefs(compute_ms, sampler + ["--cache-size", str(int(share_bytes * 0.3))])
        if scenario == "stagefs-none":
            return self.run_stagefs(compute_ms, ["--sampler", "none"])
        if scenario == "rclone":
            return self.run_rclone(compute_ms)
        raise ValueError(scenario)


# report ----------------------------------------------------------------------------------------


def total(r):
    return r.get("setup_s", 0.0) + sum(e["wall_s"] for e in r["epochs"])


def warm(r):
    w = [e["wall_s"] for e in r["epochs"][1:]]
    return sum(w) / len(w) if w else float("nan")


def table(results):
    epochs = max(len(r["epochs"]) for r in results)
    head = f"{'scenario':<13}{'compute':>8}{'setup':>8}" + "".join(f"{'e' + str(i):>8}" for i in range(epochs))
    head += f"{'total':>8}{'/local':>8}{'/direct':>8}{'wait':>8}  {'hit ratio':<16}{'GlusterFS MB/epoch':<20}{'RSS MB':>6}"
    lines = [head, "-" * len(head)]
    by = {(r["scenario"], r["compute_ms"]): r for r in results}
    for r in results:
        c = r["compute_ms"]
        loc, dire = by.get(("local", c)), by.get(("direct", c))
        row = f"{r['scenario']:<13}{c:>8g}{r.get('setup_s', 0):>8.2f}"
        row += "".join(f"{e['wall_s']:>8.2f}" for e in r["epochs"])
        row += f"{total(r):>8.2f}"
        row += f"{total(r) / total(loc):>8.2f}" if loc else f"{'':>8}"
        row += f"{total(r) / total(dire):>8.2f}" if dire else f"{'':>8}"
        row += f"{sum(e['wait_s'] for e in r['epochs']):>8.2f}"
        hits = [e.get("hit_ratio") for e in r["epochs"]]
        row += f"  {'/'.join(f'{h:.2f}' for h in hits) if hits[0] is not None else '-':<16}"
        gb = [e["gluster_bytes"] / 1e6 for e in r["epochs"]]
        if r.get("setup_gluster_bytes"):
            gb[0] += r["setup_gluster_bytes"] / 1e6
        row += f"{'/'.join(f'{b:.0f}' for b in gb):<20}"
        row += f"{r['rss_kb'] / 1024:>6.0f}" if r.get("rss_kb") else f"{'-':>6}"
        lines.append(row)
    return "\n".join(lines)


def goals(results, share_bytes, compute_ms):
    by = {(r["scenario"], r["compute_ms"]): r for r in results}
    out = []

    def goal(name, value, limit, op="<="):
        ok = value <= limit if op == "<=" else value < limit
        out.append({"goal": name, "value": round(value, 3), "limit": f"{op} {limit}", "met": ok})

    for c in sorted({r["compute_ms"] for r in results}):
        s, loc, dire = by.get(("stagefs", c)), by.get(("local", c)), by.get(("direct", c))
        cp, rc, s30 = by.get(("copy-first", c)), by.get(("rclone", c)), by.get(("stagefs-30%", c))
        tag = f"[compute {c:g} ms]"
        if s and loc and len(s["epochs"]) > 1:
            goal(f"warm epoch stagefs / local {tag}", warm(s) / warm(loc), 1.05)
        if s and dire:
            goal(f"epoch stagefs / direct GlusterFS, all epochs {tag}", total(s) / total(dire), 0.2)
            if len(s["epochs"]) > 1:
                goal(f"warm epoch stagefs / direct GlusterFS {tag}", warm(s) / warm(dire), 0.2)
        if s and cp and loc:
            goal(f"E epochs stagefs / (copy first + E local) {tag}", total(s) / (cp["setup_s"] + total(loc) - loc.get("setup_s", 0)), 1.0, "<")
        if s and rc:
            goal(f"cold epoch stagefs / cold rclone {tag}", s["epochs"][0]["wall_s"] / rc["epochs"][0]["wall_s"], 0.5)
        if s30 and len(s30["epochs"]) > 1:
            # Steady state: epoch 0 also fills the cache ahead for epoch 1.
            steady = [e["source_bytes"] for e in s30["epochs"][1:]]
            goal(f"cache 30%: GlusterFS bytes per epoch (epochs 1+) / share {tag}", sum(steady) / len(steady) / share_bytes, 1.02)
        if c > 0 and s and cp:
            compute_only = s["epochs"][0]["compute_s"]
            goal(
                f"cold epoch / max(compute only {compute_only:.1f}s, copy {cp['setup_s']:.1f}s) {tag}",
                s["epochs"][0]["wall_s"] / max(compute_only, cp["setup_s"]),
                1.10,
            )
    return out


def chart(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not found (apt-get install python3-matplotlib): no chart", file=sys.stderr)
        return False
    computes = sorted({r["compute_ms"] for r in results})
    fig, axes = plt.subplots(1, len(computes), figsize=(7 * len(computes), 5), squeeze=False)
    for ax, c in zip(axes[0], computes):
        rs = [r for r in results if r["compute_ms"] == c]
        names = [r["scenario"] for r in rs]
        bottom = [0.0] * len(rs)
        setup = [r.get("setup_s", 0.0) for r in rs]
        ax.bar(names, setup, bottom=bottom, color="lightgray", hatch="//", label="setup (copy / mount)")
        bottom = setup[:]
        for e in range(max(len(r["epochs"]) for r in rs)):
            h = [r["epochs"][e]["wall_s"] if e < len(r["epochs"]) else 0 for r in rs]
            ax.bar(names, h, bottom=bottom, label=f"epoch {e}")
            bottom = [b + x for b, x in zip(bottom, h)]
        ax.set_title(f"compute {c:g} ms per batch")
        ax.set_ylabel("seconds")
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=8)
    fig.suptitle("Per-epoch time by scenario (ImageFolder on GlusterFS, PyTorch DataLoader)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--compute-ms", type=float, default=60.0, help="simulated compute per batch in the 'with compute' runs")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--work", default="/var/tmp/stagefs-epoch-bench", help="bricks, mounts, caches and the local copy")
    p.add_argument("--out", default=None, help="where the table, JSON and PNG go [default: WORK/results]")
    p.add_argument("--only", default=None, help="comma-separated scenarios to run")
    p.add_argument("--keep", action="store_true", help="leave the GlusterFS volume and dataset for the next run")
    p.add_argument(
        "--client-cache",
        action="store_true",
        help="let the GlusterFS client cache in the node's page cache and quick-read (a dataset that fits in RAM)",
    )
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (GlusterFS volumes, mounts, drop_caches)")
    if not os.path.exists(STAGEFS):
        sys.exit(f"{STAGEFS} not found: cargo build --release first")
    out = args.out or os.path.join(args.work, "results")
    os.makedirs(out, exist_ok=True)
    scenarios = args.only.split(",") if args.only else SCENARIOS
    bench = Bench(args)
    try:
        info = bench.dataset()
        share = info["bytes"]  # one node (world size 1): its share is the whole dataset
        print(f"dataset: {info['files']} files, {share / 1e6:.0f} MB on GlusterFS ({VOLUME}, 4 bricks)", flush=True)
        for c in (0.0, args.compute_ms):
            for s in scenarios:
                print(f"-- {s}, compute {c:g} ms/batch", flush=True)
                r = bench.run(s, c, share)
                r.update(scenario=s, compute_ms=c)
                bench.results.append(r)
                print("   " + ", ".join(f"e{e['epoch']} {e['wall_s']:.2f}s" for e in r["epochs"]), flush=True)
    finally:
        if mounted(bench.mnt):
            subprocess.run(["umount", "-l", bench.mnt])
        if not args.keep:
            bench.gluster("down")
            shutil.rmtree(os.path.dirname(bench.local), ignore_errors=True)
            shutil.rmtree(bench.cache, ignore_errors=True)
            marker = os.path.join(args.work, "dataset.json")
            if os.path.exists(marker):
                os.remove(marker)
    res = bench.results
    g = goals(res, share, args.compute_ms)
    text = table(res) + "\n\nGoals:\n" + "\n".join(
        f"  {'met ' if x['met'] else 'MISS'} {x['goal']}: {x['value']} (goal {x['limit']})" for x in g
    )
    print("\n" + text)
    with open(os.path.join(out, "epoch_bench.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "epoch_bench.json"), "w") as f:
        json.dump({"dataset": info, "args": vars(args), "results": res, "goals": g}, f, indent=1)
    if chart(res, os.path.join(out, "epoch_bench.png")):
        print(f"chart: {os.path.join(out, 'epoch_bench.png')}")


if __name__ == "__main__":
    main()
