"""The hook's side of the control channel against hostile servers (run as root by
tests/e2e.rs: `hook_channel.py STAGEFS_MOUNT WORKDIR`, with PYTHONPATH at the checkout's
python/). Each case must end in a ChannelError, quickly and in little memory:

- a server trickling its reply one byte at a time (a per-read timeout never fires);
- a server answering with hundreds of megabytes and no newline;
- a socket named by `user.stagefs.control` on a mount that is not a stagefs mount (a tmpfs);
- a socket of another user than root or the mount's owner, for a real stagefs mount;

and a connection the daemon closed while idle is opened again.

Needs only the standard library.
"""

import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

from stagefs_feed import channel
from stagefs_feed.channel import Channel, ChannelError, mount_of

# A case that hangs fails here, not in the harness's timeout.
signal.alarm(120)
channel.REPLY_TIMEOUT = 2.0


def listener():
    """An abstract socket of this process: (socket, address as the hook takes it)."""
    name = f"\0stagefs-test/{os.getpid()}/{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(name)
    sock.listen(4)
    return sock, name


def serve_once(answer):
    """Serves one connection on a thread: `answer(conn)` after the request line came."""
    sock, address = listener()
    accepted = []

    def run():
        conn, _ = sock.accept()
        accepted.append(conn)
        conn.makefile("rb").readline()
        try:
            answer(conn)
        except OSError:
            pass  # the client gave up, as it should

    threading.Thread(target=run, daemon=True).start()
    return address, accepted


def answer_and_close(connections):
    """Serves `connections` connections on a thread, each answering one request and
    closing: a daemon that dropped an idle client."""
    sock, address = listener()

    def run():
        for _ in range(connections):
            conn, _ = sock.accept()
            conn.makefile("rb").readline()
            conn.sendall(b'{"ok":true,"dataset":0}\n')
            conn.close()

    threading.Thread(target=run, daemon=True).start()
    return address


def expect_refusal(case, ch, why):
    try:
        reply = ch.request({"op": "epoch", "epoch": 1})
    except ChannelError as e:
        assert why in str(e), f"{case}: {e}"
        print(f"{case}: refused: {e}")
        return
    raise AssertionError(f"{case}: the hook took {reply!r}")


def trickle(conn):
    while True:
        conn.sendall(b" ")
        time.sleep(0.2)


def huge(conn):
    chunk = b"x" * (1 << 20)
    for _ in range(300):
        conn.sendall(chunk)
    conn.sendall(b"\n")


def main(stagefs_mount, work):
    address, _ = serve_once(trickle)
    expect_refusal("trickle", Channel(stagefs_mount, address), "no whole answer within")

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    address, _ = serve_once(huge)
    expect_refusal("huge reply", Channel(stagefs_mount, address), "longer than")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 64 << 10, f"huge reply: the hook grew by {grown} KB"

    # A tmpfs carrying the attribute: a mount point with a control address, not stagefs.
    fake = os.path.join(work, "fake-mount")
    os.makedirs(fake, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", fake], check=True)
    try:
        address, accepted = serve_once(lambda conn: conn.sendall(b'{"ok":true}\n'))
        os.setxattr(fake, channel.CONTROL_XATTR, ("@" + address[1:]).encode())
        found = mount_of(os.path.join(fake, "class0/x.jpg"))
        assert found == (fake, address), found
        expect_refusal("not a stagefs mount", Channel(*found), "is not a stagefs mount")
        time.sleep(0.2)
        assert not accepted, "the hook connected to a look-alike's socket"
    finally:
        subprocess.run(["umount", fake], check=True)

    # A socket of nobody's, for root's real stagefs mount.
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.setgid(65534)
        os.setuid(65534)
        sock, address = listener()
        os.write(write_end, address.encode() + b"\n")
        conn, _ = sock.accept()
        conn.makefile("rb").readline()
        conn.sendall(b'{"ok":true}\n')
        os._exit(0)
    address = os.read(read_end, 4096).decode().rstrip("\n")
    expect_refusal("another user's socket", Channel(stagefs_mount, address), "belongs to uid 65534")
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)

    # A connection the daemon closed while idle is opened again (its dataset handles reset).
    ch = Channel(stagefs_mount, answer_and_close(2))
    ch.request({"op": "dataset", "paths": []})
    ch.datasets["x"] = 0
    time.sleep(0.2)
    assert ch.request({"op": "dataset", "paths": []})["ok"]
    assert ch.datasets == {}, "handles of the closed connection kept"
    print("reconnected after the daemon closed an idle connection")

    # And the real daemon is still talked to.
    real = mount_of(stagefs_mount)
    assert real is not None
    reply = Channel(*real).request({"op": "dataset", "paths": []})
    assert reply["ok"], reply
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
