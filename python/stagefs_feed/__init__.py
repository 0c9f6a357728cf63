"""stagefs feed hook: a PyTorch job announces the order its samplers drew to stagefs.

Once installed (``eval "$(stagefs feed-env)"``, or ``import stagefs_feed;
stagefs_feed.install()``), every ``torch.utils.data.DataLoader`` epoch does this in the
process that iterates the loader (the main process; workers only fetch):

1. at the first batch, the sampler (or batch sampler) is iterated as far as it is long, once,
   exactly as the loader would; the loader then gets exactly those indices, followed by
   whatever the sampler yields beyond its length;
2. the indices are announced to the stagefs mount holding the dataset's files, as file paths
   when the dataset exposes them (``samples``/``imgs`` of ImageFolder and DatasetFolder,
   timm's ``reader.samples``, a list of paths in ``files``/``paths``, through ``Subset`` and
   ``ConcatDataset``), else as sample indices for the mount's ``--layout`` of the dataset's
   ``root`` (the mount named by ``STAGEFS_FEED_MOUNT``), each loader as a stream of its own:
   its dataset's directory, and whether its sampler shuffles (the mount follows the training
   loader's stream; validation passes are read on demand and never count against it);
3. where the next epoch's order can be computed without touching the job's random state (a
   sampler with ``set_epoch``, as DistributedSampler), it is announced too, so staging crosses
   the epoch boundary without waiting;
   a DistributedSampler's epoch is also announced whole (every rank's share) when the mount
   asks for it: a mount with peers places the job's files on its nodes with it;
4. wherever a batch is fetched (workers, or the main process), its files are opened with one
   request to the mount and read from the descriptors it sends back (``opens``), whatever
   tells the mount its order: flags, detection or these announcements.

The job's random number generators are consumed exactly as without the hook: the sampler is
iterated once, at the moment the loader would have started it, and the look-ahead runs on a
copy with every generator's state put back afterwards. Anything that goes wrong (no mount,
the daemon gone or refusing, a dataset without usable paths) costs one warning line on stderr
and nothing else: the job runs on unchanged.
"""

import copy
import itertools
import os
import random
import sys
import threading

from . import opens
from .channel import Channel, ChannelBusy, ChannelError, ChannelRefused, mount_of

__all__ = ["install", "installed"]

_MODULE = "torch.utils.data.dataloader"
_lock = threading.Lock()
_installed = False
_warned = set()
# mountpoint -> Channel (one connection per process and mount, opened at the first announcement)
_channels = {}
# (mountpoint, stream) -> how many epochs this process announced of that loader's stream: the
# epoch number the daemon files an announcement under, the same on every rank as long as
# ranks iterate alike.
_epochs = {}
# id(dataset) -> (dataset, target); the dataset is kept so its id is never reused.
_targets = {}
# Mounts that failed or refused: no more announcements to them from this process.
_disabled = set()
# Samplers (by id) whose epochs cannot be announced whole: not tried again.
_no_whole_epochs = set()
# Mounts that failed a batch open: no more batch opens on them from this process.
_no_batch_opens = set()
# What the daemon takes in one announcement (its MAX_ANNOUNCED).
MAX_ANNOUNCED = 1 << 26
# Most files one batch open names (the daemon's MAX_BATCH).
_BATCH = 250


def _warn(key, message):
    if key not in _warned:
        _warned.add(key)
        print(f"stagefs-feed: warning: {message}; the job goes on unchanged", file=sys.stderr)


def installed():
    return _installed


def install():
    """Hooks DataLoader iteration now, or when torch's DataLoader is first imported."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    module = sys.modules.get(_MODULE)
    if module is not None:
        _patch(module)
    else:
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport:
    """Finds torch's dataloader module with the other finders and patches it once loaded,
    so installing the hook costs nothing in a process that never imports torch."""

    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _patch(module):
    base = module._BaseDataLoaderIter
    if getattr(base, "_stagefs_feed", False):
        return
    if opens.enabled():
        _patch_fetch()
    original_init, original_reset = base.__init__, base._reset

    def __init__(self, loader, *args, **kwargs):
        original_init(self, loader, *args, **kwargs)
        _wrap(self, loader)

    def _reset(self, loader, *args, **kwargs):
        original_reset(self, loader, *args, **kwargs)
        _wrap(self, loader)

    base.__init__, base._reset = __init__, _reset
    base._stagefs_feed = True


def _patch_fetch():
    """Opens each batch's files with one request before the map-style fetcher reads them."""
    from torch.utils.data._utils import fetch

    fetcher = fetch._MapDatasetFetcher
    original = fetcher.fetch

    def fetch_batch(self, possibly_batched_index):
        kept = _open_batch(self.dataset, possibly_batched_index, self.auto_collation)
        try:
            return original(self, possibly_batched_index)
        finally:
            opens.close_unused(kept)

    fetcher.fetch = fetch_batch
    opens.install_open()


def _open_batch(dataset, index, batched):
    """Asks the mount holding `dataset` for descriptors of the files of the batch at `index`;
    returns what was kept for the batch's opens (nothing if the dataset is not on a mount, or
    on any failure, after one warning)."""
    kept = []
    try:
        target = _target_of(dataset)
        if target is None or target[2] is None:
            return []
        mountpoint, address, relative, _, named = target
        with _lock:
            if mountpoint in _no_batch_opens:
                return []
            channel = _channels.setdefault(mountpoint, Channel(mountpoint, address))
        _, to_base = _base_of(dataset)
        wanted = [i for i in to_base(list(index) if batched else [index]) if relative[i] is not None]
        for start in range(0, len(wanted), _BATCH):
            part = wanted[start:start + _BATCH]
            message = {"op": "open", "paths": [relative[i] for i in part]}
            reply, fds = channel.request_with_fds(message, max_fds=len(part))
            try:
                kept += opens.grant([named[i] for i in part], reply.get("files"), fds)
            except ValueError:
                for fd in fds:
                    os.close(fd)
                raise
        return kept
    except Exception as e:  # the job must never fail because of the hook
        opens.close_unused(kept)  # what earlier parts of a long batch got
        if "target" in locals() and target is not None:
            with _lock:
                _no_batch_opens.add(target[0])
        # A mount that does not take this user's requests has nothing for the hook to do.
        if not _not_for_this_job(e):
            _warn(("batch", type(e).__name__),
                  f"cannot open a batch's files through stagefs: {e}; opening them through the mount")
        return []


def _wrap(loader_iter, loader):
    # The loader makes its sampler iterator in __init__ and again in _reset (the
    # multi-process iterator calls both); only the one it draws from is ever primed.
    it = loader_iter._sampler_iter
    if it is not None and not isinstance(it, _AnnouncingIterator):
        loader_iter._sampler_iter = _AnnouncingIterator(it, loader)


class _AnnouncingIterator:
    """The loader's sampler iterator, primed (and announced) at the first index drawn."""

    def __init__(self, it, loader):
        self._it = it
        self._loader = loader
        self._primed = False

    def __iter__(self):
        return self

    def __next__(self):
        if not self._primed:
            self._primed = True
            self._prime()
        return next(self._it)

    def _prime(self):
        sampler = self._loader._index_sampler
        try:
            target = _target_of(self._loader.dataset)
            length = len(sampler) if target is not None else None
        except TypeError:
            return  # unsized (an infinite sampler): nothing to announce
        except Exception as e:  # the job must never fail because of the hook
            return _warn(("target", type(e).__name__), f"cannot find the dataset's stagefs mount: {e}")
        if target is None:
            return  # not on a stagefs mount: the loader is left exactly as it was
        if length > MAX_ANNOUNCED:
            return _warn(("length", length), f"a sampler of {length} items is longer than stagefs takes")
        head = list(itertools.islice(self._it, max(length - 1, 0)))
        # Reaching the last item can end the sampler's loop, and a sampler may draw there:
        # RandomSampler's remainder randperm, which a batch sampler's partial last batch
        # reaches. Without the hook that draw happens only if the job asks for the last item
        # (not after a peek or a break), so once announced (the look-ahead goes on from the
        # epoch's end) the generators that draw moved are put back, and moved on again when
        # the job asks.
        generators = _generators(sampler)
        before = [g.get_state() for g in generators]
        last = list(itertools.islice(self._it, min(length, 1)))
        moved = [(g, b, g.get_state()) for g, b in zip(generators, before)]
        moved = [(g, b, a) for g, b, a in moved if not _torch_equal(b, a)]
        try:
            _announce(target, self._loader, sampler, head + last)
        except Exception as e:
            _warn(("announce", type(e).__name__), f"cannot announce the order to stagefs: {e}")
        for gen, state, _ in moved:
            gen.set_state(state)
        self._it = itertools.chain(head, _after_last(moved, last), self._it)


def _torch_equal(a, b):
    import torch

    return torch.equal(a, b)


def _after_last(moved, items):
    """Yields `items` once each generator of `moved` (generator, state put back, state the
    last item's draw left) is moved on to where that draw left it, when the job asks for
    them. A generator drawn from meanwhile by something else is left as it is: setting it
    would undo those draws."""
    for gen, put_back, after in moved:
        if _torch_equal(gen.get_state(), put_back):
            gen.set_state(after)
        else:
            _warn(("moved", id(gen)), "a sampler's generator was drawn from by something else during the epoch; "
                  "its end-of-epoch draw is dropped")
    yield from items


def _flatten(drawn, batched):
    if not batched:
        return [int(i) for i in drawn]
    return [int(i) for batch in drawn for i in batch]


def _rank():
    """(rank, world size) of this process in the job."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    for rank_var, world_var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_var in os.environ and world_var in os.environ:
            try:
                return int(os.environ[rank_var]), int(os.environ[world_var])
            except ValueError:
                pass
    return 0, 1


def _announce(target, loader, sampler, drawn):
    mountpoint, address, paths, root, _ = target
    with _lock:
        if mountpoint in _disabled:
            return
        channel = _channels.setdefault(mountpoint, Channel(mountpoint, address))
    batched = loader._auto_collation
    base, to_base = _base_of(loader.dataset)
    holder, _ = _with_set_epoch(sampler)
    # What a DistributedSampler reads is its own rank's share, whatever the environment says.
    rank, world = (holder.rank, holder.num_replicas) if holder is not None else _rank()
    stream = {"root": root, "shuffled": _shuffles(sampler)}
    # Loaders over one dataset (new Subsets each epoch) are one stream; training and
    # validation over it are two (only one shuffles).
    key = (mountpoint, root if root is not None else id(base), stream["shuffled"])
    with _lock:
        epoch = _epochs.get(key, 0)
        _epochs[key] = epoch + 1
    try:
        channel.connect()
        dataset = _register(channel, base, paths) if paths is not None else None
        for offset in (0, 1):
            own = _flatten(drawn, batched) if offset == 0 else _next_epoch_indices(loader, sampler, batched)
            if own is None:
                break
            reply = _send_order(channel, dataset, stream, epoch + offset, rank, world, to_base(own),
                                current=offset == 0)
            if reply.get("world") and holder is not None:
                _send_whole_epoch(channel, dataset, stream, epoch + offset, holder, own, offset, to_base)
    except ChannelBusy as e:
        channel.close()
        _warn(("busy", mountpoint), f"{e}; this epoch is not announced")
    except ChannelError as e:
        # Gone, stopped or refusing: it will be next epoch too. Say so once and leave it be;
        # a mount that takes no announcements from this user (its order is configured or its
        # own to find) has nothing for the hook to do but batch opens: no warning then.
        with _lock:
            _disabled.add(mountpoint)
        if not _not_for_this_job(e):
            with _lock:
                _channels.pop(mountpoint, None)
            channel.close()
            _warn(("channel", mountpoint), f"{e}; not announcing to it any more")


# How the daemon says a request is not for this process: the user may only announce to a
# mount that follows announcements, or the mount predicts its order itself (flags). The hook
# then has nothing to do there (but batch opens) and says nothing.
_NOT_FOR_THIS_JOB = ("only the mount's owner", "predicts the order itself")


def _not_for_this_job(error):
    return isinstance(error, ChannelError) and any(s in str(error) for s in _NOT_FOR_THIS_JOB)


def _send_order(channel, dataset, stream, epoch, rank, world, indices, current):
    message = {
        "op": "order",
        "epoch": epoch,
        "rank": rank,
        "world_size": world,
        "current": current,
        "shuffled": stream["shuffled"],
        "indices": indices,
    }
    return channel.request(_for_stream(message, dataset, stream))


def _for_stream(message, dataset, stream):
    if stream["root"] is not None:
        message["root"] = stream["root"]
    if dataset is not None:
        message["dataset"] = dataset
    return message


def _send_whole_epoch(channel, dataset, stream, epoch, holder, own, offset, to_base):
    """Announces the whole of `epoch` of DistributedSampler `holder` (its epoch, or the next
    one with `offset` 1): every rank's share, rank r of W reading every W-th index from r.
    Computed by the sampler's own code on a copy that reads for a world of one; sent only if
    this rank's share of it is what the rank reads (`own`). A failure here costs the mount's
    peers this epoch and nothing else: the orders go on."""
    if id(holder) in _no_whole_epochs:
        return
    try:
        whole = copy.copy(holder)
        whole.num_replicas, whole.rank, whole.num_samples = 1, 0, holder.total_size
        whole.set_epoch(holder.epoch + offset)
        if holder.total_size > MAX_ANNOUNCED:
            raise ValueError(f"an epoch of {holder.total_size} samples is more than stagefs takes whole")
        # DistributedSampler draws from a generator of its own: no random state of the job moves.
        indices = [int(i) for i in whole]
        share = indices[holder.rank::holder.num_replicas]
        if len(indices) != holder.total_size or share[:len(own)] != own:
            raise ValueError("the sampler's epoch as a whole does not give this rank's share")
        message = {
            "op": "world",
            "epoch": epoch,
            "world_size": holder.num_replicas,
            "shuffled": stream["shuffled"],
            "indices": to_base(indices),
        }
        channel.request(_for_stream(message, dataset, stream))
    except ChannelBusy:
        raise  # the channel itself: as for the orders
    except ChannelError as e:
        if not isinstance(e, ChannelRefused):
            raise
        with _lock:
            _no_whole_epochs.add(id(holder))
        _warn(("whole", "refused"), f"{e}; the mount's peers stage this job's files from the source")
    except Exception as e:
        with _lock:
            _no_whole_epochs.add(id(holder))
        _warn(("whole", type(e).__name__),
              f"cannot announce the epoch whole: {e}; the mount's peers stage this job's files from the source")


def _shuffles(sampler, depth=0):
    """Whether a loader's (batch) sampler shuffles: a training loader's does, a validation
    loader's reads in order. Through batch samplers and wrappers (Lightning's distributed
    wrapper keeps the user's sampler in its ``dataset``); one it does not know shuffles."""
    from torch.utils.data import (
        RandomSampler,
        SequentialSampler,
        SubsetRandomSampler,
        WeightedRandomSampler,
    )

    if depth > 4 or sampler is None:
        return True
    if isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)):
        return True
    if isinstance(sampler, SequentialSampler):
        return False
    if getattr(sampler, "shuffle", None) is True:
        return True
    inner = getattr(sampler, "sampler", None) or getattr(sampler, "_sampler", None)
    if inner is None:
        inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)
    if inner is not None and inner is not sampler:
        return _shuffles(inner, depth + 1)
    return getattr(sampler, "shuffle", True) is not False


def _register(channel, dataset, paths):
    """The daemon's handle for `dataset`'s file list on this connection."""
    handle = channel.datasets.get(id(dataset))
    if handle is None:
        handle = channel.request({"op": "dataset", "paths": paths})["dataset"]
        channel.datasets[id(dataset)] = handle
    return handle


def _base_of(dataset):
    """(the dataset under any `Subset`s, a function from indices into `dataset` to indices
    into it): a job that takes a new `Subset` every epoch registers its files once."""
    from torch.utils.data import Subset

    maps = []
    while isinstance(dataset, Subset):
        maps.append(dataset.indices)
        dataset = dataset.dataset

    def to_base(indices):
        for m in maps:
            indices = [int(m[i]) for i in indices]
        return indices

    return dataset, to_base


def _dataset_paths(dataset):
    """The file each index of `dataset` reads, if the dataset says; else None."""
    try:
        from torch.utils.data import ConcatDataset, Subset
    except ImportError:  # pragma: no cover - torch is what calls us
        return None
    if isinstance(dataset, Subset):
        inner = _dataset_paths(dataset.dataset)
        return None if inner is None else [inner[int(i)] for i in dataset.indices]
    if isinstance(dataset, ConcatDataset):
        parts = [_dataset_paths(d) for d in dataset.datasets]
        return None if any(p is None for p in parts) else [p for part in parts for p in part]
    for holder in _path_holders(dataset):
        for name in ("samples", "imgs"):
            items = getattr(holder, name, None)
            if isinstance(items, list) and items and isinstance(items[0], tuple):
                return [os.fspath(item[0]) for item in items]
        for name in ("files", "paths", "file_paths", "image_paths"):
            items = getattr(holder, name, None)
            if isinstance(items, list) and items and isinstance(items[0], (str, os.PathLike)):
                return [os.fspath(item) for item in items]
    # A wrapper sample for sample (adding a transform, returning the index too): its files
    # are those of the dataset it wraps.
    inner = getattr(dataset, "dataset", None)
    try:
        if inner is not None and inner is not dataset and len(inner) == len(dataset):
            return _dataset_paths(inner)
    except TypeError:
        pass
    return None


def _path_holders(dataset):
    """The dataset, and what libraries keep its file list in: timm's ``reader`` (``parser``
    before timm 0.9)."""
    yield dataset
    for name in ("reader", "parser"):
        inner = getattr(dataset, name, None)
        if inner is not None and not isinstance(inner, (str, bytes)):
            yield inner


def _root_of(dataset):
    """The directory the dataset says it reads (torchvision's and timm's ``root``), if any."""
    for holder in _path_holders(dataset):
        root = getattr(holder, "root", None)
        if isinstance(root, (str, os.PathLike)) and os.fspath(root):
            return os.path.realpath(os.fspath(root))
    return None


def _real_paths(paths):
    """Each path with the links in its directory resolved (a dataset reached through a link to
    the mount is on the mount), each directory resolved once: the file's own name is kept, as
    the mount resolves a link there itself."""
    real_dirs = {}
    out = []
    for path in paths:
        directory, name = os.path.split(os.path.abspath(path))
        real = real_dirs.get(directory)
        if real is None:
            real = real_dirs[directory] = os.path.realpath(directory)
        out.append(os.path.join(real, name))
    return out


def _relative(mountpoint, path):
    """`path` (absolute) relative to `mountpoint`, `.` for the mountpoint, None outside it."""
    if path == mountpoint:
        return "."
    prefix = mountpoint.rstrip("/") + "/"
    return path[len(prefix):] if path.startswith(prefix) else None


def _target_of(dataset):
    """(mountpoint, control address, paths relative to it or None, the dataset's root
    relative to it or None, the paths as the dataset names them or None) for `dataset` (under
    its `Subset`s), or None if no stagefs mount holds it. Looked up once per dataset."""
    dataset, _ = _base_of(dataset)
    key = id(dataset)
    if key in _targets:
        return _targets[key][1]
    target = None
    paths = _dataset_paths(dataset)
    root = _root_of(dataset)
    if paths:
        found = mount_of(_real_paths(paths[:1])[0])
        if found is not None:
            mountpoint, address = found
            relative = [_relative(mountpoint, p) for p in _real_paths(paths)]
            target = (mountpoint, address, relative, root and _relative(mountpoint, root), paths)
    elif os.environ.get("STAGEFS_FEED_MOUNT"):
        found = mount_of(os.environ["STAGEFS_FEED_MOUNT"])
        if found is None:
            _warn(("mount", os.environ["STAGEFS_FEED_MOUNT"]),
                  f"STAGEFS_FEED_MOUNT={os.environ['STAGEFS_FEED_MOUNT']} is not a stagefs mount")
        else:
            mountpoint, address = found
            target = (mountpoint, address, None, root and _relative(mountpoint, root), None)
    elif root is not None and (found := mount_of(root)) is not None:
        # On a mount, but no list of files to announce: say so, here and in its statistics.
        _tell_unmapped(*found, type(dataset).__name__)
    _targets[key] = (dataset, target)
    return target


def _tell_unmapped(mountpoint, address, kind):
    """Says once, on stderr and to the mount (its statistics show it), that a dataset on the
    mount lists no files the hook can map."""
    _warn(("unmapped", kind),
          f"{kind} on the stagefs mount {mountpoint} lists no files the hook knows how to read "
          f"(samples, imgs, files, paths, reader.samples); its order is not announced. Set "
          f"STAGEFS_FEED_MOUNT={mountpoint} to announce its indices in the mount's --layout")
    with _lock:
        if mountpoint in _disabled:
            return
        channel = _channels.setdefault(mountpoint, Channel(mountpoint, address))
    try:
        channel.request({"op": "unmapped", "dataset": kind})
    except ChannelError:
        pass


def _generators(obj, depth=0):
    """torch Generators reachable from a sampler through the usual attribute names."""
    import torch

    found = []
    if depth > 3 or obj is None:
        return found
    gen = getattr(obj, "generator", None)
    if isinstance(gen, torch.Generator):
        found.append(gen)
    # `dataset`: Lightning's distributed wrapper keeps the user's sampler in its dataset.
    for name in ("sampler", "batch_sampler", "_sampler", "dataset"):
        inner = getattr(obj, name, None)
        if inner is not None and inner is not obj:
            found += _generators(inner, depth + 1)
    return found


class _RandomStateKept:
    """Puts back every random state a look-ahead may touch: the global torch, numpy and
    Python generators and the samplers' own generators."""

    def __init__(self, sampler):
        self._sampler = sampler

    def __enter__(self):
        import torch

        self._torch = torch.get_rng_state()
        self._python = random.getstate()
        numpy = sys.modules.get("numpy")
        self._numpy = (numpy, numpy.random.get_state()) if numpy is not None else None
        self._generators = [(g, g.get_state()) for g in _generators(self._sampler)]

    def __exit__(self, *exc):
        import torch

        torch.set_rng_state(self._torch)
        random.setstate(self._python)
        if self._numpy is not None:
            numpy, state = self._numpy
            numpy.random.set_state(state)
        for gen, state in self._generators:
            gen.set_state(state)
        return False


def _with_set_epoch(sampler):
    """(the sampler or the one it batches, if its ``set_epoch`` and its iteration are
    DistributedSampler's, and the batch sampler). Another ``set_epoch`` may do more than set a
    number (tell the dataset, say), which on a copy would reach the job; another iteration may
    draw from a generator the job moves meanwhile (Lightning's DistributedSamplerWrapper draws
    its RandomSampler's list from the global generator as the epoch starts)."""
    from torch.utils.data import DistributedSampler

    for holder, outer in ((sampler, None), (getattr(sampler, "sampler", None), sampler)):
        if (
            isinstance(holder, DistributedSampler)
            and type(holder).set_epoch is DistributedSampler.set_epoch
            and type(holder).__iter__ is DistributedSampler.__iter__
            and isinstance(getattr(holder, "epoch", None), int)
        ):
            return holder, outer
    return None, None


def _next_epoch_indices(loader, sampler, batched):
    """The next epoch's indices where they follow from state the hook can copy, computed with
    every random state put back afterwards; else None:

    - a sampler with ``set_epoch`` (DistributedSampler; not a subclass that iterates another
      sampler, as Lightning's wrapper does): a copy, one epoch on;
    - a ``RandomSampler`` with its own generator (``DataLoader(shuffle=True, generator=g)``,
      the HF Trainer's): that generator goes on from where this epoch left it, after the
      loader's draw of its workers' base seed when it draws from the same generator.
    """
    import torch
    from torch.utils.data import RandomSampler

    if threading.current_thread() is not threading.main_thread():
        return None  # putting global random state back would undo other threads' draws
    holder, outer = _with_set_epoch(sampler)
    if holder is not None:
        ahead = copy.copy(holder)
        ahead.set_epoch(holder.epoch + 1)
        if outer is not None:
            outer = copy.copy(outer)
            outer.sampler = ahead
            ahead = outer
    else:
        inner = sampler if isinstance(sampler, RandomSampler) else getattr(sampler, "sampler", None)
        generator = getattr(inner, "generator", None)
        if not isinstance(inner, RandomSampler) or not isinstance(generator, torch.Generator):
            return None
        ahead = sampler
    with _RandomStateKept(sampler):
        if holder is None:
            # A new iterator draws its workers' base seed first (a persistent one only once).
            persistent = loader.persistent_workers and loader.num_workers > 0
            if loader.generator is generator and not persistent:
                torch.empty((), dtype=torch.int64).random_(generator=generator)
        drawn = list(itertools.islice(iter(ahead), len(ahead)))
    return _flatten(drawn, batched)
