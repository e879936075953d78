"""Key files: how a process of the driver's user finds the key of an authenticated endpoint
on the driver host from its ``(host, port)`` alone (runs anywhere; pure file I/O).

The streaming stop endpoint (the cluster's control server, see docs/streaming.md "Asking a
streaming cluster to stop from outside") and TFoS's reservation servers write one; ``python
-m tfos.streaming stop HOST PORT`` and TFoS's ``reservation.Client((host, port))`` read it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Tuple

from tfos.errors import ConfigurationError

__all__ = ["ServerAddress", "TFOS_KEY_DIR", "write_key_file", "read_key_file", "remove_key_file", "key_path"]

log = logging.getLogger(__name__)


class ServerAddress(tuple):
    """``(host, port)`` of an authenticated endpoint, also carrying its key and id (never in
    repr).

    It indexes and unpacks like TFoS's tuple and pickles with its key, so it can be shipped
    to Spark tasks in a closure (as TFoS's ``cluster_meta['server_addr']`` was).
    """

    key: bytes
    server_id: str

    def __new__(cls, addr: Any, key: bytes = b"", server_id: str = "") -> "ServerAddress":
        obj = super().__new__(cls, addr)
        obj.key = key
        obj.server_id = server_id
        return obj


#: Environment variable naming the directory of the stop-endpoint key files
#: (default ``~/.tfos/keys``).
TFOS_KEY_DIR = "TFOS_KEY_DIR"


def key_dir() -> str:
    return os.environ.get(TFOS_KEY_DIR) or os.path.join(os.path.expanduser("~"), ".tfos", "keys")


def key_path(host: str, port: int) -> str:
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in str(host))
    return os.path.join(key_dir(), f"{safe}_{int(port)}.key")


def _private_key_dir(create: bool) -> str:
    """The key directory, checked: a real directory (not a symlink) owned by this user that
    no other user can enter. A directory of this user with a wider mode is narrowed to 0700
    (INFO); one owned by another user is refused.

    Raises:
        ConfigurationError: The directory is a symlink, not a directory, or owned by another
            user (names the directory and the fix).
        OSError: The directory cannot be created.
    """
    import stat

    path = key_dir()
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigurationError(f"key directory {path} is not a directory (a symlink or a file): set {TFOS_KEY_DIR} to a directory of your own")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise ConfigurationError(
            f"key directory {path} is owned by uid {st.st_uid}, not by this user ({os.getuid()}): another user could "
            f"read or replace the stop key; set {TFOS_KEY_DIR} to a directory of your own"
        )
    if st.st_mode & 0o077:
        log.info("key directory %s had mode %o; narrowing it to 0700", path, stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)
    return path


def write_key_file(addr: ServerAddress) -> str:
    """Writes the key and id of the server at ``addr`` to a file only this user can read
    (directory mode 0700, file mode 0600), so that a :class:`Client` given a plain
    ``(host, port)`` in another process of this user finds it (driver).

    The key is written to a new file with a random name (``O_EXCL``: never into a file, FIFO
    or symlink somebody else placed), then renamed over ``<host>_<port>.key``.

    Returns:
        The key file's path (the key itself is never logged).

    Raises:
        ConfigurationError: The key directory is not this user's own (see ``TFOS_KEY_DIR``).
        OSError: The directory or file cannot be written.
    """
    import json
    import tempfile

    path = key_path(addr[0], addr[1])
    directory = _private_key_dir(create=True)
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=directory)  # mode 0600, O_EXCL
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"key": addr.key.hex(), "server_id": addr.server_id}, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def remove_key_file(addr: Any) -> None:
    """Removes the key file of ``addr`` (no error when it is gone)."""
    try:
        os.unlink(key_path(addr[0], addr[1]))
    except FileNotFoundError:
        pass


def read_key_file(host: str, port: int) -> Optional[Tuple[bytes, str]]:
    """``(key, server_id)`` from the key file of ``host:port``, or None when there is none,
    or when it or its directory could be read or replaced by another user, or it is not a
    regular file (then a WARNING names the file)."""
    import json
    import stat

    path = key_path(host, port)
    try:
        _private_key_dir(create=False)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                log.warning("ignoring key file %s: not a regular file", path)
                return None
            if hasattr(os, "getuid") and st.st_uid != os.getuid():
                log.warning("ignoring key file %s: owned by uid %d, not by this user", path, st.st_uid)
                return None
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                log.warning("ignoring key file %s: readable by other users (chmod 600 it)", path)
                return None
            data = json.load(f)
        return bytes.fromhex(data["key"]), str(data["server_id"])
    except FileNotFoundError:
        return None
    except ConfigurationError as exc:
        log.warning("ignoring key file %s: %s", path, exc)
        return None
    except (OSError, ValueError, KeyError) as exc:
        log.warning("cannot read key file %s: %s", path, exc)
        return None
