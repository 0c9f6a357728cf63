"""Batch opens: the hook opens a batch's files with one request to the mount, not two FUSE
round trips per file.

Before a DataLoader fetches a batch (in its workers, or in the main process when
``num_workers=0``), the hook names the batch's files to the mount holding the dataset in one
request. The daemon decides each exactly as it would the process's own open through the
mount (its credentials, SOURCE's permissions, the tracker sees the opens in batch order, a
miss is staged at once) and sends back read-only descriptors of the cached copies. While the
batch is fetched, ``open()`` / ``io.open()`` of exactly one of those paths, in binary read
mode, returns a file on its descriptor (``name`` is the path), once; every other open is left
alone, and what the batch did not use is closed when it is fetched.

This covers whatever reads through ``builtins.open``: PIL's ``Image.open(path)``,
torchvision's loaders, timm's readers, ``numpy.load``. Readers written in C that open the
path themselves (``cv2.imread``) keep the FUSE path. ``STAGEFS_BATCH_OPENS=0`` turns batch
opens off. Anything that goes wrong costs one warning line, and the files are opened
through the mount as without the hook.
"""

import builtins
import io
import os

_original_open = builtins.open
# path as the dataset names it -> what the daemon answered for it, oldest first: ("fd", n)
# or ("errno", n). A batch may read a file twice (a padded DistributedSampler).
_granted = {}


def enabled():
    return os.environ.get("STAGEFS_BATCH_OPENS", "1") != "0"


def install_open():
    """Routes ``open``/``io.open`` through the batch's descriptors (idempotent)."""
    if builtins.open is not _open:
        builtins.open = _open
        io.open = _open


class _BatchOpen:
    """``open`` as the hook replaces it. An object, not a function: a function kept as a
    class attribute becomes a method of the instances, where the built-in it replaces does
    not (pathlib keeps ``open = io.open`` in a class on Python 3.8 to 3.10, and its
    ``read_text`` then passed the accessor as the file: ``import torch`` failed)."""

    __slots__ = ()
    __doc__ = _original_open.__doc__

    def __call__(self, file, mode="r", buffering=-1, *args, **kwargs):
        if _granted and mode in ("rb", "br") and all(a is None for a in args) and all(
            v is None for v in kwargs.values()
        ):
            name = file if isinstance(file, str) else os.fspath(file) if isinstance(file, os.PathLike) else None
            answers = _granted.get(name) if isinstance(name, str) else None
            if answers:
                kind, value = answers.pop(0)
                if not answers:
                    del _granted[name]
                if kind == "errno":
                    raise OSError(value, os.strerror(value), name)
                return _file_on(value, name, buffering)
        return _original_open(file, mode, buffering, *args, **kwargs)


_open = _BatchOpen()


def _file_on(fd, name, buffering):
    raw = io.FileIO(fd, "rb", closefd=True)
    raw.name = name
    if buffering == 0:
        return raw
    return io.BufferedReader(raw, buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE)


def grant(paths, files, fds):
    """Keeps the daemon's answer `files` (one per path: a descriptor's number in `fds`,
    ``{"errno": n}``, or None to open through the mount) for the batch's opens; returns what
    was kept, for `close_unused`. A reply that does not fit the request is refused whole."""
    if not isinstance(files, list) or len(files) != len(paths):
        raise ValueError("the reply does not answer each file once")
    numbers = [f for f in files if isinstance(f, int) and not isinstance(f, bool)]
    if sorted(numbers) != list(range(len(fds))):
        raise ValueError("the reply's descriptors do not match what came with it")
    kept = []
    for path, answer in zip(paths, files):
        if isinstance(answer, int) and not isinstance(answer, bool):
            entry = ("fd", fds[answer])
        elif isinstance(answer, dict) and isinstance(answer.get("errno"), int):
            entry = ("errno", answer["errno"])
        else:
            continue
        _granted.setdefault(path, []).append(entry)
        kept.append((path, entry))
    return kept


def close_unused(kept):
    """Closes the descriptors in `kept` the batch did not open, and forgets its answers."""
    for path, entry in kept:
        answers = _granted.get(path)
        if answers and entry in answers:
            answers.remove(entry)
            if not answers:
                del _granted[path]
            if entry[0] == "fd":
                try:
                    os.close(entry[1])
                except OSError:
                    pass
