"""A single-process PyTorch job with a shuffled DataLoader: ImageFolder,
DataLoader(shuffle=True, generator=torch.Generator().manual_seed(S)), worker processes.

The generator is the loader's own, as reproducible jobs set it; each epoch the DataLoader
draws its workers' base seed and then the permutation from it. Prints one JSON line per epoch
(see common.run_epochs).

    python3 train_random.py ROOT [--seed S] [--epochs E] [--batch-size B] [--workers N]
        [--compute-ms MS] [--decode] [--order-out FILE] [--step]
"""

import torch
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

import common


def main():
    args = common.parser(__doc__.splitlines()[0]).parse_args()

    ds = common.Indexed(ImageFolder(args.root, loader=common.file_loader(args.decode)))
    loader = DataLoader(
        ds,
        batch_size=args.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
        num_workers=args.workers,
        collate_fn=common.collate_digests,
    )
    common.run_epochs(args, lambda _epoch: loader)


if __name__ == "__main__":
    main()
