"""The training stacks whose order no flag can name, as users write them, unmodified:

  global       torch.manual_seed(S), a model built, DataLoader(shuffle=True): the global
               generator has been drawn from before the sampler draws its seed
  loader       DataLoader(shuffle=True, generator=g)  (--persistent: persistent workers)
  sampler      DataLoader(sampler=RandomSampler(ds, generator=g)): no loader base-seed draw
               from g, as the HF Trainer does
  weighted     WeightedRandomSampler over per-class weights, global generator
  balanced     a user-defined class-balanced sampler (a class, then a sample of it)
  numpy        idx = np.arange(n); np.random.shuffle(idx) every epoch, DataLoader(sampler=idx)
  ddp          DistributedSampler under torch.distributed (gloo): start one process per rank
               with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (--start-epoch E: a job
               resumed at epoch E; --no-set-epoch: a job that forgets sampler.set_epoch), or
               one process with --spawn N, which starts the N ranks itself with
               torch.multiprocessing.spawn as DDP tutorials do: then no launcher variable
               tells a rank's number (MASTER_ADDR/MASTER_PORT still come from the
               environment), and rank R writes its --order-out to PATH.R

Prints one JSON line per epoch (see common.run_epochs); nothing here knows about stagefs.

    python3 train_stacks.py ROOT --stack NAME [--persistent] [--opaque] [--start-epoch E]
        [--no-set-epoch] [--spawn N] [common options]
"""

import os

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, WeightedRandomSampler
from torchvision.datasets import ImageFolder

import common


class ClassBalanced(Sampler):
    """Draws a class uniformly, then a sample of it, `len(dataset)` times per epoch."""

    def __init__(self, targets):
        self.by_class = {}
        for i, t in enumerate(targets):
            self.by_class.setdefault(t, []).append(i)
        self.classes = sorted(self.by_class)
        self.n = len(targets)

    def __iter__(self):
        picks = torch.randint(len(self.classes), (self.n,)).tolist()
        for c in picks:
            members = self.by_class[self.classes[c]]
            yield members[torch.randint(len(members), ()).item()]

    def __len__(self):
        return self.n


def loaders(args, ds, targets):
    """A function from epoch to the batches of that epoch."""
    common_kw = dict(
        batch_size=args.batch_size,
        num_workers=args.workers,
        collate_fn=common.collate_digests,
        persistent_workers=args.persistent and args.workers > 0,
    )
    if args.stack == "global":
        torch.manual_seed(args.seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        del model
        loader = DataLoader(ds, shuffle=True, **common_kw)
    elif args.stack == "loader":
        loader = DataLoader(ds, shuffle=True, generator=torch.Generator().manual_seed(args.seed), **common_kw)
    elif args.stack == "sampler":
        g = torch.Generator().manual_seed(args.seed)
        loader = DataLoader(ds, sampler=RandomSampler(ds, generator=g), **common_kw)
    elif args.stack == "weighted":
        torch.manual_seed(args.seed)
        counts = np.bincount(targets)
        weights = torch.tensor([1.0 / counts[t] for t in targets], dtype=torch.double)
        loader = DataLoader(ds, sampler=WeightedRandomSampler(weights, len(ds)), **common_kw)
    elif args.stack == "balanced":
        torch.manual_seed(args.seed)
        loader = DataLoader(ds, sampler=ClassBalanced(targets), **common_kw)
    elif args.stack == "numpy":
        np.random.seed(args.seed)
        idx = np.arange(len(ds))

        def epoch_loader(_epoch):
            np.random.shuffle(idx)
            return DataLoader(ds, sampler=idx.tolist(), **common_kw)

        return epoch_loader
    elif args.stack == "ddp":
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
        sampler = torch.utils.data.distributed.DistributedSampler(ds, seed=args.seed)
        loader = DataLoader(ds, sampler=sampler, **common_kw)

        def in_step(batches):
            # Ranks of a real DDP job stay within a step of each other: every step all-reduces
            # gradients. Without training, a barrier per batch keeps them as close.
            for batch in batches:
                torch.distributed.barrier()
                yield batch

        def epoch_loader(epoch):
            if not args.no_set_epoch:
                sampler.set_epoch(args.start_epoch + epoch)
            return in_step(loader)

        return epoch_loader
    else:
        raise SystemExit(f"unknown --stack {args.stack}")
    return lambda _epoch: loader


class Opaque:
    """A dataset that reads its files itself and tells nobody which they are (no `samples`,
    no `dataset`): the hook can only announce its indices, to STAGEFS_FEED_MOUNT."""

    def __init__(self, folder):
        self._read = folder.loader
        self._paths = [p for p, _ in folder.samples]
        self._targets = folder.targets

    def __len__(self):
        return len(self._paths)

    def __getitem__(self, index):
        return index, self._read(self._paths[index]), self._targets[index]


def main():
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--stack", required=True)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--opaque", action="store_true", help="hide the dataset's file paths (see Opaque)")
    p.add_argument("--start-epoch", type=int, default=0, help="ddp: the epoch a resumed job starts at")
    p.add_argument("--no-set-epoch", action="store_true", help="ddp: never call sampler.set_epoch")
    p.add_argument("--spawn", type=int, default=0, help="ddp: start this many ranks with torch.multiprocessing.spawn")
    args = p.parse_args()
    if args.spawn:
        if args.stack != "ddp" or args.step:
            raise SystemExit("--spawn is for --stack ddp, without --step (the ranks share stdin)")
        torch.multiprocessing.spawn(spawned_rank, args=(args,), nprocs=args.spawn)
    else:
        train(args)


def spawned_rank(rank, args):
    """One rank started by torch.multiprocessing.spawn: its number is this argument only."""
    torch.distributed.init_process_group("gloo", rank=rank, world_size=args.spawn)
    if args.order_out:
        args.order_out = f"{args.order_out}.{rank}"
    train(args)


def train(args):
    torch.set_num_threads(1)
    folder = ImageFolder(args.root, loader=common.file_loader(args.decode))
    ds = Opaque(folder) if args.opaque else common.Indexed(folder)
    common.run_epochs(args, loaders(args, ds, folder.targets))
    if args.stack == "ddp":
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
