"""Writes more_torch.json and more_numpy.json: golden orders of the loaders modelled after
torch.json and numpy.json were made (same format), from the real libraries.

    /usr/bin/python3 tests/data/golden/more.py tests/data/golden

Each order is read from the loader as a training loop reads it, iterating every epoch before
the one recorded.
"""

import hashlib
import json
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler


def case(params, order):
    order = [int(i) for i in order]
    text = "".join(f"{i}\n" for i in order)
    out = dict(params, order_len=len(order), head=order[:64])
    out["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    if len(order) <= 64:
        out["order"] = order
    return out


def epochs_of(loader, count):
    return [list(loader) for _ in range(count)]


def sampler_generator_cases():
    """DataLoader(sampler=RandomSampler(ds, generator=g)): the loader itself has no generator."""
    for seed in [0, 42, -1, 2**64 - 1]:
        for n in [1, 2, 10, 1003]:
            for persistent in [False, True]:
                torch.manual_seed(123)  # the global RNG the loader's base seed comes from
                g = torch.Generator().manual_seed(seed)
                workers = dict(num_workers=2, persistent_workers=True) if persistent else {}
                loader = DataLoader(
                    range(n), batch_size=None, sampler=RandomSampler(range(n), generator=g), **workers
                )
                for epoch, order in enumerate(epochs_of(loader, 3)):
                    params = dict(sampler="torch-random", seed=seed, len=n, generator="sampler",
                                  persistent_workers=persistent, epoch=epoch)
                    yield case(params, order)


def no_set_epoch_cases():
    """A DistributedSampler iterated epoch after epoch, set_epoch never called."""
    for seed, n, world, drop_last in [(0, 10, 1, False), (7, 101, 4, False), (7, 101, 4, True), (3, 1000, 3, False)]:
        for rank in range(world):
            s = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=seed, drop_last=drop_last)
            for epoch in range(3):
                params = dict(sampler="torch-distributed", seed=seed, len=n, world_size=world, rank=rank,
                              epoch=epoch, drop_last=drop_last, set_epoch=False)
                yield case(params, list(s))


def inplace_cases():
    """np.random.seed(seed); idx = np.arange(n); each epoch np.random.shuffle(idx)."""
    for seed in [0, 5, 2**32 - 1]:
        for n in [1, 2, 10, 1003]:
            np.random.seed(seed)
            idx = np.arange(n)
            for epoch in range(4):
                np.random.shuffle(idx)
                yield case(dict(sampler="numpy-inplace", seed=seed, len=n, epoch=epoch), idx)


def write(path, produced_by, cases):
    doc = dict(produced_by=produced_by, digest="sha256 of the order as decimal lines, each ending in \\n",
               cases=list(cases))
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    out = sys.argv[1]
    write(f"{out}/more_torch.json", f"torch {torch.__version__}",
          [*sampler_generator_cases(), *no_set_epoch_cases()])
    write(f"{out}/more_numpy.json", f"numpy {np.__version__}", inplace_cases())
