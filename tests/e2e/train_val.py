"""The shape of the training programs users run, written here (not copied from them): a
dataset root holding train/ and val/, the training set read by ImageFolder(ROOT/train), and a
validation pass over ImageFolder(ROOT/val) between epochs, in order, as the PyTorch ImageNet
example, timm's train.py and Lightning's example do.

  --sampler global    DataLoader(shuffle=True) after a model is built from torch's global
                      generator (the ImageNet example on one process)
  --sampler ddp       DistributedSampler under torch.distributed (gloo; start one process per
                      rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), validation with
                      DistributedSampler(shuffle=False)
  --sampler wrapped   a DistributedSampler over the list a RandomSampler draws each epoch (what
                      Lightning's DistributedSamplerWrapper does to a shuffling loader), global
                      generator, under torch.distributed as ddp
  --sanity-check      two validation batches before the first epoch (Lightning's sanity check)
  --timm-like         the datasets keep their files in `reader.samples` and `reader.root`, as
                      timm's ImageDataset does, instead of torchvision's `samples`
  --no-sync           ddp without a process group: every rank reads at its own pace, and rank 1
                      computes --slow-ms more per batch (ranks drifting apart)

Prints one JSON line per training epoch (see common.run_epochs), and writes the validation
reads' indices to --val-out; nothing here knows about stagefs.
"""

import os
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler
from torchvision.datasets import ImageFolder

import common


class Reader:
    """Where a timm-like dataset keeps its files: (path, class) pairs and the root."""

    def __init__(self, root):
        folder = ImageFolder(root)
        self.root = root
        self.samples = folder.samples
        self.targets = folder.targets


class TimmLike:
    """A dataset that reads its files through a reader, as timm's ImageDataset does."""

    def __init__(self, root, loader):
        self.reader = Reader(root)
        self.load = loader

    def __len__(self):
        return len(self.reader.samples)

    def __getitem__(self, index):
        path, target = self.reader.samples[index]
        return self.load(path), target


class WrappedDistributed(DistributedSampler):
    """A DistributedSampler over the indices another sampler draws each epoch: each rank reads
    its share of the list `sampler` yields when the epoch starts."""

    class _Drawn(torch.utils.data.Dataset):
        def __init__(self, sampler):
            self._sampler = sampler
            self.drawn = []

        def draw(self):
            self.drawn = list(self._sampler)

        def __len__(self):
            return len(self._sampler)

        def __getitem__(self, i):
            return self.drawn[i]

    def __init__(self, sampler, **kwargs):
        super().__init__(WrappedDistributed._Drawn(sampler), **kwargs)

    def __iter__(self):
        self.dataset.draw()
        return (self.dataset[i] for i in super().__iter__())


def datasets(args):
    loader = common.file_loader(args.decode)
    if args.timm_like:
        make = lambda split: TimmLike(os.path.join(args.root, split), loader)  # noqa: E731
    else:
        make = lambda split: ImageFolder(os.path.join(args.root, split), loader=loader)  # noqa: E731
    return common.Indexed(make("train")), common.Indexed(make("val"))


def loaders(args, train, val):
    """The training loader (a function of the epoch) and the validation loader."""
    kw = dict(batch_size=args.batch_size, num_workers=args.workers, collate_fn=common.collate_digests)
    distributed = args.sampler in ("ddp", "wrapped")
    place = {}
    if distributed and not args.no_sync:
        torch.distributed.init_process_group("gloo")
    if args.sampler == "global":
        torch.manual_seed(args.seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        del model
        sampler = RandomSampler(train)
    elif args.sampler == "ddp":
        # Without a process group (--no-sync) the sampler is told its place, as launchers do.
        if not torch.distributed.is_initialized():
            place = dict(num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]))
        sampler = DistributedSampler(train, seed=args.seed, **place)
    elif args.sampler == "wrapped":
        torch.manual_seed(args.seed)
        sampler = WrappedDistributed(RandomSampler(train), seed=args.seed)
    else:
        raise SystemExit(f"unknown --sampler {args.sampler}")
    val_sampler = (
        DistributedSampler(val, shuffle=False, **place) if distributed else SequentialSampler(val)
    )
    train_loader = DataLoader(train, sampler=sampler, **kw)
    val_loader = DataLoader(val, sampler=val_sampler, **kw)
    return train_loader, sampler, val_loader


def in_step(args, batches):
    """Ranks of a real DDP job stay within a step of each other (every step all-reduces
    gradients); without training, a barrier per batch. Without sync, rank 1 is slower."""
    slow = args.slow_ms / 1000 if os.environ.get("RANK") == "1" else 0
    for batch in batches:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        if slow:
            time.sleep(slow)
        yield batch


def main():
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--sampler", required=True)
    p.add_argument("--sanity-check", action="store_true")
    p.add_argument("--timm-like", action="store_true")
    p.add_argument("--no-sync", action="store_true")
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--val-out", help="write the validation reads' indices here, pass after pass")
    args = p.parse_args()
    torch.set_num_threads(1)
    train, val = datasets(args)
    train_loader, sampler, val_loader = loaders(args, train, val)
    val_out = open(args.val_out, "w") if args.val_out else None

    def validate(batches=None):
        for k, batch in enumerate(val_loader):
            if batches is not None and k == batches:
                break
            if val_out:
                val_out.writelines(f"{index}\n" for index, _, _ in batch)

    if args.sanity_check:
        validate(batches=2)

    def epoch_loader(epoch):
        if epoch > 0:
            validate()
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        return in_step(args, train_loader)

    common.run_epochs(args, epoch_loader)
    validate()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
