"""Checks the feed hook's look-ahead against the real torch, without a mount: for each sampler
whose next epoch the hook announces ahead, that announcement must equal what the next epoch
then really draws, and the job must draw exactly what it draws without the hook, also when
it stops an epoch early (a peek, a break). A mount with peers asks for each epoch whole: a
DistributedSampler's must give every rank the share that rank's own sampler draws, and no
other sampler's is sent. Exits non-zero with the first difference.

    PYTHONPATH=python python3 tests/e2e/hook_lookahead.py
"""

import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

import stagefs_feed

N = 97
sent = []
# Whether FakeChannel refuses whole epochs, as a mount does one over its limits.
refuse_worlds = False


def fake_target(dataset):
    return ("/fake", "@fake", None, None, None)


class FakeChannel:
    datasets = {}

    def connect(self):
        pass

    def request(self, message):
        sent.append(message)
        if refuse_worlds and message["op"] == "world":
            raise stagefs_feed.ChannelRefused("refused: the announced orders would hold too many files")
        # As a mount with peers answers an order: send the epoch whole.
        return {"ok": True, "world": message["op"] == "order"}


def loaders():
    ds = TensorDataset(torch.arange(N))
    yield "loader generator", lambda: DataLoader(
        ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3), num_workers=2
    ), None
    yield "loader generator, persistent workers", lambda: DataLoader(
        ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3),
        num_workers=2, persistent_workers=True,
    ), None
    yield "loader generator, no workers", lambda: DataLoader(
        ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)
    ), None
    yield "RandomSampler(generator=g)", lambda: DataLoader(
        ds, batch_size=8, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(4)),
        num_workers=2,
    ), None

    yield "a Subset of the dataset (indices announced as the base dataset's)", lambda: DataLoader(
        torch.utils.data.Subset(ds, list(reversed(range(N)))), batch_size=8, shuffle=True,
        generator=torch.Generator().manual_seed(6),
    ), None

    def distributed():
        s = DistributedSampler(ds, num_replicas=2, rank=1, seed=5)
        return DataLoader(ds, batch_size=8, sampler=s)

    yield "DistributedSampler with set_epoch", distributed, "set_epoch"

    def distributed_dropping():
        s = DistributedSampler(ds, num_replicas=3, rank=2, seed=7, drop_last=True)
        return DataLoader(ds, batch_size=8, sampler=s)

    yield "DistributedSampler(drop_last=True) with set_epoch", distributed_dropping, "set_epoch"


def whole_epochs_failures(name, make):
    """Each epoch announced whole must give every rank what that rank's own sampler draws."""
    worlds = [m for m in sent if m["op"] == "world"]
    sampler = make().sampler
    if not isinstance(sampler, DistributedSampler):
        return [f"{name}: an epoch was announced whole"] if worlds else []
    failures = []
    if sorted(m["epoch"] for m in worlds) != [0, 1, 1, 2, 2, 3]:
        failures.append(f"{name}: epochs announced whole: {[m['epoch'] for m in worlds]}")
    for m in worlds:
        for rank in range(sampler.num_replicas):
            own = DistributedSampler(
                sampler.dataset, num_replicas=sampler.num_replicas, rank=rank,
                seed=sampler.seed, drop_last=sampler.drop_last,
            )
            own.set_epoch(m["epoch"])
            if m["indices"][rank::m["world_size"]] != list(own):
                failures.append(f"{name}: epoch {m['epoch']} announced whole gives rank {rank} another share")
    return failures


# How a job may leave an epoch unfinished: a look at one batch before training, or a break
# partway through the first epoch. Either way the sampler never reaches its end there.
INTERRUPTIONS = (None, "peek", "break")


class ShortSampler(torch.utils.data.Sampler):
    """Yields fewer indices than its len() says (the loader takes what comes)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n + 16  # two batches more than it yields


def short_loader():
    return DataLoader(TensorDataset(torch.arange(N)), batch_size=8, sampler=ShortSampler(N))


def run(make, hook, epochs=3, epoch_hook=None, interruption=None):
    torch.manual_seed(11)
    loader = make()
    if interruption == "peek":
        next(iter(loader))
    order = []
    for epoch in range(epochs):
        if epoch_hook:
            loader.sampler.set_epoch(epoch)
        indices = []
        for k, batch in enumerate(loader):
            if interruption == "break" and epoch == 0 and k == 2:
                break
            indices += [int(i) for i in batch[0]]
        order.append(indices)
    return order, torch.rand(2).tolist()


def refused_worlds_failures():
    """A whole epoch the mount refuses costs its peers and nothing else: every epoch's order
    is still announced, and the hook does not try that sampler again."""
    global refuse_worlds
    name, make, epoch_hook = [loader for loader in loaders() if loader[0].startswith("DistributedSampler")][0]
    sent.clear()
    stagefs_feed._epochs.clear()
    refuse_worlds = True
    try:
        run(make, True, epoch_hook=epoch_hook)
    finally:
        refuse_worlds = False
    orders = sorted((m["epoch"], m["current"]) for m in sent if m["op"] == "order")
    worlds = [m for m in sent if m["op"] == "world"]
    if orders != [(0, True), (1, False), (1, True), (2, False), (2, True), (3, False)] or len(worlds) != 1:
        print(f"{name}, whole epochs refused: orders {orders}, {len(worlds)} whole epochs tried", file=sys.stderr)
        return 1
    return 0


def main():
    plain = {
        (name, i): run(make, False, epoch_hook=eh, interruption=i)
        for name, make, eh in loaders()
        for i in INTERRUPTIONS
    }
    plain_short = run(short_loader, False)
    stagefs_feed._target_of = fake_target
    stagefs_feed._channels["/fake"] = FakeChannel()
    stagefs_feed.install()
    failures = 0
    for name, make, epoch_hook in loaders():
        sent.clear()
        stagefs_feed._epochs.clear()
        for interruption in INTERRUPTIONS[1:]:
            drawn = run(make, True, epoch_hook=epoch_hook, interruption=interruption)
            if drawn != plain[(name, interruption)]:
                print(f"{name}, {interruption}: the hook changed what the job drew", file=sys.stderr)
                failures += 1
        sent.clear()
        stagefs_feed._epochs.clear()
        order, after = run(make, True, epoch_hook=epoch_hook)
        if (order, after) != plain[(name, None)]:
            print(f"{name}: the hook changed what the job drew", file=sys.stderr)
            failures += 1
            continue
        orders = [m for m in sent if m["op"] == "order"]
        current = {m["epoch"]: m["indices"] for m in orders if m["current"]}
        ahead = {m["epoch"]: m["indices"] for m in orders if not m["current"]}
        for failure in whole_epochs_failures(name, make):
            print(failure, file=sys.stderr)
            failures += 1
        for epoch in range(3):
            if current.get(epoch) != order[epoch]:
                print(f"{name}: epoch {epoch} announced wrong", file=sys.stderr)
                failures += 1
            if epoch + 1 < 3 and ahead.get(epoch + 1) != order[epoch + 1]:
                print(f"{name}: epoch {epoch + 1} announced ahead wrong", file=sys.stderr)
                failures += 1
    failures += refused_worlds_failures()
    if run(short_loader, True) != plain_short:
        print("a sampler shorter than its len(): the hook changed what the job drew", file=sys.stderr)
        failures += 1
    print("ok" if failures == 0 else f"{failures} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
