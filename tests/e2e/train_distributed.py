"""One rank of a data-parallel PyTorch job, written the way users write it: torchvision
ImageFolder, DistributedSampler with set_epoch each epoch, DataLoader with worker processes.

num_replicas and rank are passed explicitly, so no process group is needed: running rank r
of W is exactly what rank r reads in a W-rank job. Prints one JSON line per epoch (see
common.run_epochs).

    python3 train_distributed.py ROOT --world-size W --rank R [--seed S] [--epochs E]
        [--batch-size B] [--workers N] [--compute-ms MS] [--decode] [--order-out FILE] [--step]
        [--sync-url tcp://HOST:PORT]

With --sync-url the ranks join a gloo process group there and wait for each other after every
batch, as DDP's gradient all-reduce makes them: ranks started separately (e.g. by srun) then
read in step, as the ranks of a training job do.
"""

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.datasets import ImageFolder

import common


def main():
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--sync-url", help="join a gloo process group here and step the ranks together")
    args = p.parse_args()
    if args.sync_url:
        dist.init_process_group("gloo", init_method=args.sync_url, rank=args.rank, world_size=args.world_size)

    ds = common.Indexed(ImageFolder(args.root, loader=common.file_loader(args.decode)))
    sampler = DistributedSampler(ds, num_replicas=args.world_size, rank=args.rank, seed=args.seed)
    loader = DataLoader(
        ds,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        collate_fn=common.collate_digests,
    )

    def in_step(batches):
        for batch in batches:
            yield batch
            dist.barrier()

    def epoch(e):
        sampler.set_epoch(e)
        return in_step(loader) if args.sync_url else loader

    common.run_epochs(args, epoch)


if __name__ == "__main__":
    main()
