"""A Chainer-style training loop in plain Python and numpy (no Chainer, no torch):
np.random.seed(S) once, then each epoch order = np.random.permutation(N) over the samples in
ImageFolder order, read batch by batch with a few reader threads, the next batch read while
the current one computes (as Chainer's MultiprocessIterator prefetches). Prints one JSON line
per epoch (see common.run_epochs).

    python3 train_chainer_style.py ROOT [--seed S] [--epochs E] [--batch-size B]
        [--workers N] [--compute-ms MS] [--decode] [--order-out FILE] [--step]
"""

import hashlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import common


def main():
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    samples = common.image_folder_samples(args.root)
    load = common.file_loader(args.decode)
    np.random.seed(args.seed)
    pool = ThreadPoolExecutor(max(1, args.workers))

    def read(index):
        data = load(samples[index][0])
        return index, hashlib.sha256(data).digest(), len(data)

    def epoch(_e):
        order = np.random.permutation(len(samples))
        starts = range(0, len(order), args.batch_size)
        # One batch read ahead: submit batch k+1 before handing out batch k.
        pending = None
        for s in starts:
            submitted = [pool.submit(read, int(i)) for i in order[s : s + args.batch_size]]
            if pending is not None:
                yield [f.result() for f in pending]
            pending = submitted
        if pending is not None:
            yield [f.result() for f in pending]

    common.run_epochs(args, epoch)
    pool.shutdown()


if __name__ == "__main__":
    main()
