"""The mount's control channel, as the hook sees it.

A stagefs mount answers the extended attribute ``user.stagefs.control`` on its root with the
address of its control socket (an abstract Unix socket, written with a leading ``@``). The
daemon checks the peer's credentials on every connection, so only the mount's owner, root
and, on an ``--allow-other`` mount, the users SOURCE lets read the dataset, may announce.

Messages are JSON, one per line, each answered by one line ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``.
"""

import json
import os
import socket
import threading

CONTROL_XATTR = "user.stagefs.control"

# Connecting is local and answered at once by a live daemon; a stopped daemon (SIGSTOP) must
# not hold the job for long.
CONNECT_TIMEOUT = 2.0
# An announcement of millions of indices takes the daemon about a second to check; a daemon
# that has not answered in this long is stopped or wedged, and the job must go on without it.
REPLY_TIMEOUT = 20.0


class ChannelError(Exception):
    """The mount could not be told: gone, refused, or it answered with an error."""


class ChannelBusy(ChannelError):
    """The daemon has too many connections now; later may do."""


def control_address(mountpoint):
    """The control socket of the stagefs mount at `mountpoint`, or None if it is not one."""
    try:
        value = os.getxattr(mountpoint, CONTROL_XATTR)
    except OSError:
        return None
    text = value.decode("utf-8", "replace")
    return "\0" + text[1:] if text.startswith("@") else text


def mount_of(path):
    """(mountpoint, control address) of the stagefs mount holding `path`, or None."""
    current = os.path.abspath(path)
    while True:
        if os.path.ismount(current):
            address = control_address(current)
            return (current, address) if address else None
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


class Channel:
    """One connection to one mount's daemon, reopened after a fork or a failure."""

    def __init__(self, mountpoint, address):
        self.mountpoint = mountpoint
        self.address = address
        self._sock = None
        self._reader = None
        self._pid = None
        # Dataset handles are the daemon's per connection: id(dataset) -> handle.
        self.datasets = {}
        self._lock = threading.RLock()

    def connect(self):
        """Opens the connection unless this process has one open already."""
        # A forked child shares the parent's socket: the replies would interleave.
        if self._sock is None or self._pid != os.getpid():
            self._sock = None
            self._connect()

    def _connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT)
        try:
            sock.connect(self.address)
        except OSError as e:
            sock.close()
            raise ChannelError(f"cannot reach the stagefs mount at {self.mountpoint}: {e}")
        sock.settimeout(REPLY_TIMEOUT)
        self._sock, self._reader, self._pid = sock, sock.makefile("rb"), os.getpid()
        self.datasets = {}

    def close(self):
        if self._sock is not None:
            try:
                self._reader.close()
                self._sock.close()
            except OSError:
                pass
        self._sock = self._reader = None

    def request(self, message):
        """Sends one message and returns the daemon's reply; raises ChannelError. One at a
        time: loaders iterated in several threads share the connection."""
        with self._lock:
            return self._request(message)

    def _request(self, message):
        self.connect()
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        try:
            self._sock.sendall(data)
            line = self._reader.readline()
        except OSError as e:
            self.close()
            raise ChannelError(f"the stagefs mount at {self.mountpoint} stopped answering: {e}")
        if not line:
            self.close()
            raise ChannelError(f"the stagefs mount at {self.mountpoint} closed the connection")
        try:
            reply = json.loads(line)
        except ValueError:
            self.close()
            raise ChannelError(f"the stagefs mount at {self.mountpoint} answered garbage")
        if not reply.get("ok"):
            why = reply.get("error", "no reason given")
            error = ChannelBusy if "too many connections" in why else ChannelError
            raise error(f"the stagefs mount at {self.mountpoint} refused: {why}")
        return reply
