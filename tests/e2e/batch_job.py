"""tests/batch_opens.rs: `batch_job.py ROOT WORKERS EPOCHS SEED [MS]`: an unmodified
DataLoader over a DatasetFolder whose loader reads each file with open(path, "rb") (as
torchvision's pil_loader does), shuffled by a seeded generator, taking MS milliseconds per
sample (default 0). Prints one JSON line: the files in the order read and the MD5 of each
file's bytes."""

import hashlib
import io
import json
import sys
import time

import torch
from torch.utils.data import DataLoader
from torchvision.datasets import DatasetFolder


DELAY = float(sys.argv[5]) / 1000 if len(sys.argv) > 5 else 0.0


class Accessor:
    """Keeps ``io.open`` as a class attribute, as pathlib does on Python 3.8 to 3.10 (made
    after the hook is in, as pathlib is when first imported after torch): the hook's open
    must not become a method here."""

    open = io.open


with Accessor().open(__file__, "rb") as own:
    assert own.read(3) == b'"""', "io.open kept in a class opens another file"


def read(path):
    time.sleep(DELAY)
    with open(path, "rb") as f:
        return path, hashlib.md5(f.read()).hexdigest()


def main():
    root, workers, epochs, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dataset = DatasetFolder(root, loader=read, extensions=(".jpg",))
    loader = DataLoader(
        dataset,
        batch_size=16,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=lambda batch: batch,
    )
    read_order = []
    for _ in range(epochs):
        for batch in loader:
            read_order += [(path[len(root):], digest) for (path, digest), _ in batch]
    print(json.dumps(read_order))


if __name__ == "__main__":
    main()
