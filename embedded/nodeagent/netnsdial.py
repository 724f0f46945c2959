"""A TCP connection to a port inside a container's network namespace: what port-forward dials.

Every container runs in a network namespace of its own (sandbox.py: `--unshare-net`), so the kubelet emulator
cannot reach its ports from the host. A short helper process joins the container's user and network namespaces
(`nsenter --user --net`, as exec joins the container, the caller's uid kept), connects to localhost:<port>
(IPv4, then IPv6, as containerd's port-forward does), hands the connected socket back over a socketpair
(SCM_RIGHTS) and exits; the socket stays in the container's namespace and the emulator moves its bytes with
asyncio. Which container of a pod: the one whose namespace has a listener on the port (read from its
`/proc/<pid>/net/tcp{,6}`), else the first that runs. Owns nothing of the protocol above (portforward.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys

CONNECT_TIMEOUT = 10.0
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column

# Runs inside the namespace: argv is the socketpair's fd and the port. Writes the connected socket back, or why
# it could not connect, worded as containerd words it (Go's dial errors).
HELPER = r"""
import socket, sys
back, port, errors = socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]), []
for family, host, net in ((socket.AF_INET, "127.0.0.1", "tcp4"), (socket.AF_INET6, "::1", "tcp6")):
    conn = socket.socket(family, socket.SOCK_STREAM)
    try:
        conn.connect((host, port))
    except OSError as exc:
        conn.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        errors.append(f"dial {net} {where}: connect: {(exc.strerror or str(exc)).lower()}")
        continue
    socket.send_fds(back, [b"ok"], [conn.fileno()])
    sys.exit(0)
back.sendall(f"IPv4: {errors[0]} IPv6 {errors[1]} ".encode())
"""


class DialError(OSError):
    """The port could not be reached; the message says why."""


def _listens(pid: int, port: int) -> bool:
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


async def pick(pids: list[int], port: int) -> int:
    """Of the containers' PID 1s, the one whose network namespace listens on `port` (the first if none does)."""
    for pid in pids:
        if await asyncio.to_thread(_listens, pid, port):
            return pid
    return pids[0]


def nsenter_argv(target: int, fd: int, port: int) -> list[str]:
    return [
        "nsenter",
        f"--target={target}",
        "--user",
        "--net",
        "--preserve-credentials",
        "--",
        sys.executable,
        "-I",
        "-S",
        "-c",
        HELPER,
        str(fd),
        str(port),
    ]


async def connect(
    target: int, port: int, timeout: float = CONNECT_TIMEOUT
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to localhost:`port` in the network namespace of process `target`, or DialError."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = await asyncio.create_subprocess_exec(
            *nsenter_argv(target, theirs.fileno(), port),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        try:
            _, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise DialError(f"timed out connecting to localhost:{port}") from None
        mine.setblocking(False)  # the helper has exited: what it sent is already here
        try:
            message, fds, _, _ = socket.recv_fds(mine, 4096, 1)
        except BlockingIOError:
            message, fds = b"", []
        if fds:
            conn = socket.socket(fileno=fds[0])
            conn.setblocking(False)
            return await asyncio.open_connection(sock=conn)
        if message:  # containerd's words
            raise DialError(
                f'failed to connect to localhost:{port} inside namespace "/proc/{target}/ns/net", '
                + message.decode(errors="replace")
            )
        why = err.decode(errors="replace").strip()
        raise DialError(why or f"the namespace helper exited with status {proc.returncode}")
    finally:
        mine.close()
        theirs.close()
