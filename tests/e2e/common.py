"""Shared by the end-to-end training scripts and the epoch benchmark: the command line, the
file loaders, per-sample digests and epoch checksums, the timed epoch loop that prints one
JSON line per epoch, and the synthetic ImageFolder dataset.

Nothing here knows about stagefs: the scripts are what a user runs against a directory, and
the test compares what they read through a mount with what they read directly.

Run as a program it writes a dataset (real JPEG files of random pixels):

    python3 common.py make-dataset ROOT --files N [--classes C] [--seed S]
                                        [--min-kb A --max-kb B | --imagenet-sizes]

and prints {"files": N, "bytes": TOTAL} as one JSON line.
"""

import argparse
import hashlib
import io
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# torchvision's IMG_EXTENSIONS: which files ImageFolder counts as samples.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def parser(description):
    """The options every training script takes; scripts add their own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("root", help="ImageFolder root (one directory per class)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="loader worker processes (threads for the chainer-style loop)")
    p.add_argument("--compute-ms", type=float, default=0.0, help="simulated compute per batch (sleep)")
    p.add_argument(
        "--decode",
        action="store_true",
        help="decode each file as an image (PIL, like torchvision's default loader) instead of returning its bytes",
    )
    p.add_argument("--order-out", help="write the sample indices in the order the loop received them, one per line, epoch after epoch")
    p.add_argument(
        "--step",
        action="store_true",
        help="after each epoch but the last, wait for a line on stdin before going on "
        "(stands for between-epoch work such as evaluation; lets a driver look at the system there)",
    )
    return p


def read_bytes(path):
    """The default loader: the file's bytes, as a job that decodes on the GPU would take them."""
    with open(path, "rb") as f:
        return f.read()


def decode_rgb(path):
    """torchvision's pil_loader, returning the decoded pixels so they can be hashed."""
    from PIL import Image

    with open(path, "rb") as f:
        return Image.open(f).convert("RGB").tobytes()


def file_loader(decode):
    return decode_rgb if decode else read_bytes


class Indexed:
    """A map-style dataset that also returns each sample's index (for the checksum)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        sample, target = self.dataset[index]
        return index, sample, target


def collate_digests(batch):
    """collate_fn: a batch of (index, sample, target) becomes (index, digest, size) records,
    hashed in the worker so the main loop stays light."""
    return [(index, hashlib.sha256(sample).digest(), len(sample)) for index, sample, _ in batch]


def epoch_checksum(records):
    """sha256 over the (index, digest) records sorted by index: independent of read order and
    of how the epoch was split into batches, so it compares to a direct read."""
    h = hashlib.sha256()
    for index, digest, _ in sorted(records):
        h.update(index.to_bytes(8, "little"))
        h.update(digest)
    return h.hexdigest()


def run_epochs(args, epoch_batches):
    """The training loop: for each epoch, iterate `epoch_batches(epoch)` (batches of
    (index, digest, size) records), simulate compute per batch and print one JSON line."""
    order_out = open(args.order_out, "w") if args.order_out else None
    for epoch in range(args.epochs):
        started = time.perf_counter()
        wait = compute = 0.0
        records = []
        t = time.perf_counter()
        batches = iter(epoch_batches(epoch))  # DataLoader workers start here
        wait += time.perf_counter() - t
        while True:
            t = time.perf_counter()
            batch = next(batches, None)
            wait += time.perf_counter() - t
            if batch is None:
                break
            records.extend(batch)
            if args.compute_ms > 0:
                t = time.perf_counter()
                time.sleep(args.compute_ms / 1000)
                compute += time.perf_counter() - t
        wall = time.perf_counter() - started
        if order_out:
            order_out.write("".join(f"{index}\n" for index, _, _ in records))
            order_out.flush()
        line = {
            "epoch": epoch,
            "samples": len(records),
            "bytes": sum(size for _, _, size in records),
            "checksum": epoch_checksum(records),
            "wall_s": round(wall, 4),
            "wait_s": round(wait, 4),
            "compute_s": round(compute, 4),
        }
        print(json.dumps(line), flush=True)
        if args.step and epoch + 1 < args.epochs:
            sys.stdin.readline()
    if order_out:
        order_out.close()


def image_folder_samples(root):
    """(path, class index) in torchvision ImageFolder's order, without torchvision: classes are
    the sorted subdirectories, files sorted within each (walked recursively)."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for target, cls in enumerate(classes):
        for dirpath, _, fnames in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for fname in sorted(fnames):
                if fname.lower().endswith(IMG_EXTENSIONS):
                    samples.append((os.path.join(dirpath, fname), target))
    return samples


def _target_sizes(rng, n, args):
    if args.imagenet_sizes:
        # ImageNet-1k train JPEGs: mean about 110 KB, long right tail; lognormal with sigma 0.6
        # and that mean, clipped to what the real set spans.
        sigma = 0.6
        mu = math.log(110_000) - sigma * sigma / 2
        return [int(min(max(s, 8_000), 2_000_000)) for s in rng.lognormal(mu, sigma, n)]
    lo, hi = int(args.min_kb * 1000), int(args.max_kb * 1000)
    return [int(s) for s in rng.integers(lo, hi + 1, n)]


def _jpeg(rng, target):
    """A JPEG of random pixels of about `target` bytes (noise at quality 90 costs about 0.93
    bytes per pixel), with a random aspect ratio."""
    import numpy as np
    from PIL import Image

    pixels = max(target / 0.93, 64)
    aspect = rng.uniform(0.75, 1.33)
    w = max(8, int(math.sqrt(pixels * aspect)))
    h = max(8, int(pixels / w))
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def make_dataset(args):
    import numpy as np

    rng = np.random.default_rng(args.seed)
    sizes = _target_sizes(rng, args.files, args)
    seeds = rng.integers(0, 2**63, args.files)

    def write(i):
        data = _jpeg(np.random.default_rng(int(seeds[i])), sizes[i])
        path = os.path.join(args.root, f"class{i % args.classes:03d}", f"img{i:07d}.jpg")
        with open(path, "wb") as f:
            f.write(data)
        return len(data)

    for c in range(args.classes):
        os.makedirs(os.path.join(args.root, f"class{c:03d}"), exist_ok=True)
    # Several writes in flight: a parallel file system rewards concurrency.
    with ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(write, range(args.files)))
    print(json.dumps({"files": args.files, "bytes": total}), flush=True)


def main():
    p = argparse.ArgumentParser(description="synthetic ImageFolder datasets")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make-dataset", help="write N JPEG files of random pixels under ROOT/classNNN/")
    m.add_argument("root")
    m.add_argument("--files", type=int, required=True)
    m.add_argument("--classes", type=int, default=10)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--min-kb", type=float, default=10)
    m.add_argument("--max-kb", type=float, default=200)
    m.add_argument("--imagenet-sizes", action="store_true", help="sizes drawn like ImageNet's (mean about 110 KB)")
    args = p.parse_args()
    if args.command == "make-dataset":
        make_dataset(args)


if __name__ == "__main__":
    main()
