"""The mount's control channel, as the hook sees it.

A stagefs mount answers the extended attribute ``user.stagefs.control`` on its root with the
address of its control socket (an abstract Unix socket, written with a leading ``@``). The
daemon checks the peer's credentials on every connection, so only the mount's owner, root
and, on an ``--allow-other`` mount, the job's user it names (``--job-user``) may announce.

The hook trusts none of that by its looks: it talks only to the daemon of a real stagefs
mount (``fuse.stagefs`` at that mount point in /proc/self/mountinfo) whose socket belongs to
root or to the mount's owner (its ``user_id=``), and a daemon that answers slowly, endlessly
or not at all costs the job a bounded wait and a bounded buffer, never more.

Messages are JSON, one per line, each answered by one line ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``.
"""

import json
import os
import select
import socket
import struct
import threading
import time

CONTROL_XATTR = "user.stagefs.control"
MOUNT_TYPE = "fuse.stagefs"

# Connecting is local and answered at once by a live daemon; a stopped daemon (SIGSTOP) must
# not hold the job for long.
CONNECT_TIMEOUT = 2.0
# An announcement of millions of indices takes the daemon a few seconds to check; a daemon
# that has not answered whole in this long (counted from the request, however it trickles)
# is stopped or wedged, and the job must go on without it.
REPLY_TIMEOUT = 20.0
# Replies are a few dozen bytes (a batch open's a few kilobytes); a longer one is not the
# daemon's.
MAX_REPLY_BYTES = 64 << 10
# Most descriptors one message carries (the kernel's SCM_MAX_FD).
MAX_FDS = 253


class ChannelError(Exception):
    """The mount could not be told: gone, refused, or it answered with an error."""


class ChannelRefused(ChannelError):
    """The daemon answered the request with a refusal: the connection itself still works."""


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


def _unescape(field):
    """A mountinfo path field: spaces, tabs, newlines and backslashes come as octal escapes."""
    out, i = bytearray(), 0
    raw = field.encode("utf-8", "surrogateescape")
    while i < len(raw):
        digits = raw[i + 1:i + 4]
        if raw[i] == 0x5C and len(digits) == 3 and digits.isdigit():
            out.append(int(digits, 8) & 0xFF)
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode("utf-8", "surrogateescape")


def mount_owner(mountpoint):
    """The uid owning the stagefs mount at `mountpoint` (its `user_id=`), or None if the
    mount there (the last one stacked on it) is not a stagefs mount."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = os.path.realpath(mountpoint)
    found = None
    for line in lines:
        fields = line.split(" ")
        if len(fields) < 10 or "-" not in fields[6:]:
            continue
        after = fields.index("-", 6)
        if _unescape(fields[4]) != wanted or len(fields) < after + 4:
            continue
        options = fields[after + 3].split(",")
        owner = [o[len("user_id="):] for o in options if o.startswith("user_id=")]
        found = int(owner[0]) if fields[after + 1] == MOUNT_TYPE and owner and owner[0].isdigit() else None
    return found


def _peer_uid(sock):
    _pid, uid, _gid = struct.unpack("iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


class Channel:
    """One connection to one mount's daemon, reopened after a fork or a failure."""

    def __init__(self, mountpoint, address):
        self.mountpoint = mountpoint
        self.address = address
        self._sock = None
        self._pending = b""
        self._pid = None
        # Dataset handles are the daemon's per connection: id(dataset) -> handle.
        self.datasets = {}
        self._lock = threading.RLock()

    def connect(self):
        """Opens the connection unless this process has one open already that the daemon
        has not closed (its dataset handles go with it)."""
        # A forked child shares the parent's socket: the replies would interleave.
        if self._sock is None or self._pid != os.getpid() or self._stale():
            self._sock = None
            self._connect()

    def _stale(self):
        """Whether the daemon closed the connection, or sent something unasked, while idle."""
        poll = select.poll()
        poll.register(self._sock, select.POLLIN)
        if not poll.poll(0):
            return False
        self.close()
        return True

    def _connect(self):
        owner = mount_owner(self.mountpoint)
        if owner is None:
            raise ChannelError(f"{self.mountpoint} is not a stagefs mount ({MOUNT_TYPE} in /proc/self/mountinfo)")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT)
        try:
            sock.connect(self.address)
            server = _peer_uid(sock)
        except OSError as e:
            sock.close()
            raise ChannelError(f"cannot reach the stagefs mount at {self.mountpoint}: {e}")
        if server not in (0, owner):
            sock.close()
            raise ChannelError(
                f"the control socket of {self.mountpoint} belongs to uid {server}, "
                f"not to root or the mount's owner (uid {owner})"
            )
        sock.setblocking(False)
        self._sock, self._pending, self._pid = sock, b"", os.getpid()
        self.datasets = {}

    def close(self):
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None

    def request(self, message):
        """Sends one message and returns the daemon's reply; raises ChannelError. One at a
        time: loaders iterated in several threads share the connection."""
        reply, fds = self.request_with_fds(message, max_fds=0)
        return reply

    def request_with_fds(self, message, max_fds):
        """Sends one message and returns (the daemon's reply, the descriptors sent with it:
        at most `max_fds`, close-on-exec, the caller's to close); raises ChannelError, with
        every descriptor received closed."""
        fds = []
        try:
            with self._lock:
                return self._request(message, fds, max_fds), fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _request(self, message, fds, max_fds):
        self.connect()
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        deadline = time.monotonic() + REPLY_TIMEOUT
        try:
            self._send(data, deadline)
            line = self._receive_line(deadline, fds)
            if len(fds) > max_fds:
                raise ChannelError(f"{len(fds)} descriptors sent where at most {max_fds} were asked for")
        except (OSError, ChannelError) as e:
            self.close()
            raise ChannelError(f"the stagefs mount at {self.mountpoint} stopped answering: {e}")
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            self.close()
            raise ChannelError(f"the stagefs mount at {self.mountpoint} answered garbage")
        if not reply.get("ok"):
            why = str(reply.get("error", "no reason given"))[:500]
            error = ChannelBusy if "too many connections" in why else ChannelRefused
            raise error(f"the stagefs mount at {self.mountpoint} refused: {why}")
        return reply

    def _wait(self, deadline, readable):
        """Whether the socket became ready before the deadline's check; raises past it."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelError(f"no whole answer within {REPLY_TIMEOUT:.0f} s")
        poll = select.poll()
        poll.register(self._sock, select.POLLIN if readable else select.POLLOUT)
        return bool(poll.poll(left * 1000))

    def _send(self, data, deadline):
        view = memoryview(data)
        while view:
            if self._wait(deadline, readable=False):
                try:
                    view = view[self._sock.send(view):]
                except BlockingIOError:
                    pass

    def _receive_line(self, deadline, fds):
        """The next reply line, whole within the deadline and at most MAX_REPLY_BYTES; the
        descriptors that came with it are appended to `fds`."""
        while b"\n" not in self._pending:
            if len(self._pending) > MAX_REPLY_BYTES:
                raise ChannelError(f"a reply longer than {MAX_REPLY_BYTES} bytes")
            if not self._wait(deadline, readable=True):
                continue
            try:
                chunk, ancillary, flags, _ = self._sock.recvmsg(
                    MAX_REPLY_BYTES + 1 - len(self._pending),
                    socket.CMSG_SPACE(MAX_FDS * 4),
                    socket.MSG_CMSG_CLOEXEC,
                )
            except BlockingIOError:
                continue
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(payload) - len(payload) % 4
                    fds.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
            if flags & socket.MSG_CTRUNC:
                raise ChannelError("more descriptors than a message carries")
            if not chunk:
                raise ChannelError("it closed the connection")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        if len(line) > MAX_REPLY_BYTES:
            raise ChannelError(f"a reply longer than {MAX_REPLY_BYTES} bytes")
        return line
