"""The directory of a node's Unix-domain data socket, and the check of who listens there.

A fed node's supervisor makes a directory of mode 0700 under ``TMPDIR``
(:func:`make_socket_dir`) before it starts the TF process, whose data server listens on
``<dir>/s`` (:class:`tfos._data.feed_hub.FeedHub`); feed tasks on the same host connect
there before the node's TCP port. The TF process removes the directory when it ends and
when it finds its supervisor gone, the supervisor after the TF process ended (one that was
killed; :func:`remove_socket_dir`), and any supervisor sweeps directories whose owner died
with its TF process (a process-group or cgroup kill; :func:`sweep_stale_socket_dirs`).

A directory is named ``tfos-feed-<pid namespace>-<pid>-<random>``: the pid of the process
that made it, in the pid namespace it belongs to, so that a sweep only judges directories
of its own pid namespace (containers that share ``/tmp`` reuse small pids).

Where it runs: the supervisor and the TF process (directories); a feed task in a Spark
task (:func:`peer_is_node`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import stat
import struct
import tempfile
import time
from typing import Optional

from tfos._common.admission import listen_backlog

log = logging.getLogger(__name__)

PREFIX = "tfos-feed-"
#: Name of the socket inside the directory.
SOCKET_NAME = "s"
# sun_path holds 108 bytes on Linux, 104 on macOS, with the terminating NUL.
_MAX_UNIX_PATH = 103
#: A directory with no socket yet is left alone this long (its node is starting).
EMPTY_DIR_GRACE_S = 600.0
#: Unix-domain data sockets are used only where the listener's process can be checked.
SUPPORTED = hasattr(socket, "AF_UNIX") and hasattr(socket, "SO_PEERCRED")


@dataclasses.dataclass(frozen=True)
class SocketDir:
    """A socket directory this user made: its path and identity (device, inode)."""

    path: str
    dev: int
    ino: int

    @property
    def socket_path(self) -> str:
        return os.path.join(self.path, SOCKET_NAME)

    @classmethod
    def adopt(cls, path: str) -> Optional["SocketDir"]:
        """The directory at ``path`` if it is one this user owns with mode 0700, else None
        (the TF process adopting the directory its supervisor made)."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
            return None
        return cls(path, st.st_dev, st.st_ino)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def make_socket_dir() -> Optional[SocketDir]:
    """Makes a new 0700 directory for a data socket under ``TMPDIR``.

    Returns:
        The directory, or None when Unix-domain data sockets are not supported here, the
        temp dir's path is too long for a socket path (``sun_path``), or it cannot be made
        (the node then serves TCP only; logged at INFO).
    """
    if not SUPPORTED:
        return None
    d = ""
    try:
        d = tempfile.mkdtemp(prefix=f"{PREFIX}{_pid_namespace()}-{os.getpid()}-")  # mode 0700
        if len(os.fsencode(os.path.join(d, SOCKET_NAME))) > _MAX_UNIX_PATH:
            raise OSError(f"{d!r} is too long for a Unix socket path")
        sd = SocketDir.adopt(d)
        if sd is None:
            raise OSError(f"{d!r} is not a private directory")
        return sd
    except OSError as exc:
        log.info("no Unix-domain data socket (%s); same-host feed tasks use TCP", exc)
        if d:
            shutil.rmtree(d, ignore_errors=True)
        return None


def remove_socket_dir(sd: Optional[SocketDir]) -> bool:
    """Removes ``sd`` if the path still holds that very directory (same device and inode,
    this user's, not a symlink); a directory someone else put there is left alone.

    Returns:
        True when it was removed.
    """
    if sd is None:
        return False
    try:
        st = os.lstat(sd.path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or (st.st_dev, st.st_ino) != (sd.dev, sd.ino):
        log.warning("not removing %s: it is no longer the data-socket directory this node made", sd.path)
        return False
    shutil.rmtree(sd.path, ignore_errors=True)
    return True


def _owner(name: str) -> Optional[tuple[int, int]]:
    """``(pid namespace, pid)`` from a directory name, None if it is not one of ours."""
    parts = name[len(PREFIX):].split("-")
    if not name.startswith(PREFIX) or len(parts) != 3:
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return None


#: Largest pid Linux hands out (``pid_max`` is at most 2**22).
_MAX_PID = 1 << 22


def _alive(pid: int) -> bool:
    if not 0 < pid <= _MAX_PID:
        return True  # not a pid this kernel made: never judged dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # e.g. EPERM: a process of another user has the pid
        return True
    return True


def stale_socket_dirs(base: Optional[str] = None, now: Optional[float] = None) -> list[str]:
    """Paths of this user's socket directories under ``base`` (``TMPDIR``) whose maker, in
    this pid namespace, is gone, and that hold a socket or are older than
    :data:`EMPTY_DIR_GRACE_S` (pure but for the file system and ``kill(pid, 0)``)."""
    base = base or tempfile.gettempdir()
    now = time.time() if now is None else now
    ns = _pid_namespace()
    out: list[str] = []
    if not ns:  # no /proc: pids of other namespaces cannot be told apart, judge nothing
        return out
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        owner = _owner(name)
        if owner is None or owner[0] != ns:
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        # Whose and what it is first: anyone can make an entry with such a name.
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or _alive(owner[1]):
            continue
        if not os.path.lexists(os.path.join(path, SOCKET_NAME)) and now - st.st_mtime < EMPTY_DIR_GRACE_S:
            continue
        out.append(path)
    return out


def sweep_stale_socket_dirs(base: Optional[str] = None) -> int:
    """Removes :func:`stale_socket_dirs` (a supervisor, at start). Returns how many."""
    n = 0
    for path in stale_socket_dirs(base):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if remove_socket_dir(SocketDir(path, st.st_dev, st.st_ino)):
            n += 1
    if n:
        log.info("removed %d data-socket director%s left by killed nodes", n, "y" if n == 1 else "ies")
    return n


def peer_is_node(sock: socket.socket, node_pid: int) -> Optional[str]:
    """Checks who listens on a connected Unix-domain socket, before anything is sent.

    The directory's mode keeps other users from connecting to a node, but not from binding
    the same path after the node's directory was removed: the listener must be this user's
    process, and the node's own TF process when its pid is known.

    Returns:
        None when it is the node, else why not (for the log).
    """
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        return f"the socket's listener runs as uid {uid}, not as this user ({os.getuid()})"
    if node_pid and pid != node_pid:
        return f"the socket's listener is pid {pid}, not the node's TF process (pid {node_pid})"
    return None


def _proc_net_address(text: str, v6: bool) -> str:
    """The address of a ``/proc/net/tcp[6]`` entry (``HEXIP:HEXPORT``) as text (pure)."""
    ip_hex = text.split(":")[0]
    raw = bytes.fromhex(ip_hex)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # four 32-bit words, each in host (little-endian) order
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def tcp_listener_uid(host: str, port: int, proc_net: str = "/proc/net") -> Optional[int]:
    """The uid owning the socket that listens on ``host:port`` in this host's network
    namespace, from ``/proc/net/tcp`` and ``tcp6`` (readable by every user), or None
    when nothing listens there or the files cannot be read (a feed task naming the process
    that took a node's released port)."""
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(os.path.join(proc_net, name)) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8 or fields[3] != "0A":  # 0A: LISTEN
                continue
            try:
                addr_port = fields[1]
                if int(addr_port.rsplit(":", 1)[1], 16) != port:
                    continue
                addr = _proc_net_address(addr_port, v6)
            except (ValueError, IndexError, OSError):
                continue
            if addr in (host, "0.0.0.0", "::") or addr.endswith(f":{host}"):  # ::ffff:a.b.c.d
                return int(fields[7])
    return None


def describe_connection(sock: socket.socket) -> str:
    """A connected TCP socket's endpoints, and the uid (and user name) of the process
    listening at the remote end when it is on this host, e.g. ``connection 127.0.0.1:51234
    -> 127.0.0.1:40123, listener uid 1001 (mallory)``; "" for other sockets or on error."""
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return ""
        local, remote = sock.getsockname(), sock.getpeername()
    except OSError:
        return ""
    text = f"connection {local[0]}:{local[1]} -> {remote[0]}:{remote[1]}"
    uid = tcp_listener_uid(remote[0], remote[1])
    if uid is not None:
        try:
            import pwd

            user = pwd.getpwuid(uid).pw_name
        except (ImportError, KeyError):
            user = "?"
        text += f", listener uid {uid} ({user})"
    return text


def open_listener(socket_dir: Optional[SocketDir], node_name: str) -> Optional[tuple]:
    """A node's Unix-domain data listener on ``<socket_dir>/s`` (same-host feed tasks; TF
    process); without ``socket_dir``, in a 0700 directory of its own that the caller removes.

    A Unix-domain connection moves a frame with about half the kernel CPU of a loopback TCP
    connection (``scripts/bench_frame_hop.py``). It changes nothing else: the handshake and
    the frame tags are the same as over TCP, the directory's mode keeps other users from
    connecting, and feed tasks check that the listener is the node's TF process
    (:func:`peer_is_node`).

    Returns:
        ``(listening socket, its path, the directory made here or None, (st_dev, st_ino) of
        the socket file or None)``, or None without one (no ``SO_PEERCRED``, a temp dir path
        too long for ``sun_path``, bind refused): the node then serves TCP only.
    """
    own = socket_dir is None
    sd = make_socket_dir() if own else socket_dir
    if sd is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(sd.socket_path)
        sock.listen(listen_backlog(1024))  # the node's feed gate empties it on every turn
    except OSError as exc:
        sock.close()
        log.info("node %s: no Unix-domain data socket (%s); same-host feed tasks use TCP", node_name, exc)
        if own:
            remove_socket_dir(sd)
        return None
    try:
        st = os.lstat(sd.socket_path)
        sock_id: Optional[tuple[int, int]] = (st.st_dev, st.st_ino)
    except OSError:
        sock_id = None
    return sock, sd.socket_path, (sd if own else None), sock_id
