"""How a node's TF server takes over the port the node reserved (TF process).

Each tfos node reserves its port at start-up with a socket
(``ctx.reserved_port_socket``) that has ``SO_REUSEADDR`` and ``SO_REUSEPORT``
set and is bound but NOT listening. Measured with TensorFlow 2.21: TF's gRPC
server binds its listening socket with ``SO_REUSEADDR`` but *without*
``SO_REUSEPORT`` (a second ``SO_REUSEPORT`` listener cannot join it). Linux
nevertheless lets it bind, because both sockets carry ``SO_REUSEADDR`` and the
reservation is not in the LISTEN state. So the server is started while the
reservation is still held and the reservation is released right afterwards:
there is no window in which another process could grab the port. A
reservation that is listening or lacks ``SO_REUSEADDR`` would block gRPC, so
such a socket is released first and replaced by a short-lived compatible
placeholder of our own (which also serves as a bind test).

When the port is taken by someone else, TF 2.21 does not abort the process: the
``tf.distribute.Server`` constructor raises ``tf.errors.UnknownError("Could
not start gRPC server")`` and a later attempt in the same process can succeed.
This module still test-binds the port in Python first, so a taken port yields
a clear :class:`PortUnavailableError` instead of that cryptic TF error.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from tfos.errors import PortUnavailableError, ProtocolUnavailableError, TFServerError

__all__ = ["create_server", "reservation_compatible", "split_host_port"]

logger = logging.getLogger(__name__)


def _node_address(ctx: Any) -> str:
    return ctx.cluster_spec[ctx.job_name][ctx.task_index]


def split_host_port(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` or ``"[v6]:port"`` into host and integer port.

    Raises:
        ValueError: If the address has no valid port.
    """
    host, sep, port_s = address.rpartition(":")
    if not sep or not port_s.isdigit():
        raise ValueError(f"tfos: cluster address {address!r} is not of the form 'host:port'.")
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"tfos: cluster address {address!r} has an invalid port {port}.")
    return host.strip("[]"), port



def reservation_compatible(sock: socket.socket | None) -> bool:
    """Tell whether gRPC can bind a port while ``sock`` still holds it.

    gRPC (as built into TF 2.21) binds with ``SO_REUSEADDR`` only, which Linux
    accepts next to an existing socket only if that socket also has
    ``SO_REUSEADDR`` and is not listening.

    Args:
        sock: The node's reservation socket, or ``None``.

    Returns:
        ``True`` if the server can be started while ``sock`` stays open.
    """
    if sock is None:
        return False
    try:
        if sock.fileno() < 0:
            return False
        reuse_addr = sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
    return bool(reuse_addr) and not listening


def _release(ctx: Any) -> None:
    release = getattr(ctx, "release_port", None)
    if callable(release):
        release()


def _placeholder_socket(port: int) -> socket.socket:
    """Bind (without listening) a socket that gRPC can bind next to.

    This doubles as a test-bind: it fails exactly when gRPC's own bind of
    ``0.0.0.0:port`` would fail because a listener (or a socket without
    ``SO_REUSEADDR``) holds the port.

    Raises:
        OSError: If the port is in use.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", port))
    except OSError:
        sock.close()
        raise
    return sock


def create_server(
    ctx: Any,
    cluster: Any,
    protocol: str,
    config: Any,
    max_attempts: int,
    retry_backoff_s: float,
) -> Any:
    """Create and start the node's server, handing the port over race-free.

    Args:
        ctx: The tfos node context.
        cluster: Cluster spec to serve.
        protocol: ``'grpc'`` or ``'grpc+verbs'``.
        config: Optional ``tf.compat.v1.ConfigProto`` used as the server's
            default session config.
        max_attempts: Bind attempts before giving up (>= 1).
        retry_backoff_s: Sleep before the 2nd attempt in seconds; doubled for
            each further attempt.

    Returns:
        The started server.

    Raises:
        PortUnavailableError: If the port stays taken for all attempts.
        ProtocolUnavailableError: If ``protocol`` is not built into TF.
        TFServerError: For any other server creation failure.
    """
    if max_attempts < 1:
        raise ValueError(f"tfos: max_attempts must be >= 1, got {max_attempts}.")
    address = _node_address(ctx)
    _, port = split_host_port(address)
    last_error: BaseException | None = None
    for attempt in range(1, max_attempts + 1):
        if attempt > 1:
            delay = retry_backoff_s * (2 ** (attempt - 2))
            logger.warning(
                "port %d of %s:%d busy (attempt %d/%d failed: %s); retrying in %.2f s",
                port, ctx.job_name, ctx.task_index, attempt - 1, max_attempts, last_error, delay,
            )
            time.sleep(delay)
        placeholder: socket.socket | None = None
        reserved = getattr(ctx, "reserved_port_socket", None)
        try:
            if attempt == 1 and reservation_compatible(reserved):
                logger.debug("starting server on port %d while the reservation is held", port)
            else:
                # Not shareable with gRPC (or already released): swap in a
                # compatible placeholder, which also test-binds the port.
                _release(ctx)
                try:
                    placeholder = _placeholder_socket(port)
                except OSError as exc:
                    last_error = exc
                    continue
            server = _start_server(ctx, cluster, protocol, config, address)
            if isinstance(server, BaseException):
                last_error = server  # gRPC could not bind the port (TF raises, it does not abort)
                continue
        finally:
            if placeholder is not None:
                placeholder.close()
        # The server owns the port now: drop the reservation right away.
        _release(ctx)
        logger.info(
            "started %s server for %s:%d at %s (target %s)",
            protocol, ctx.job_name, ctx.task_index, address, server.target,
        )
        return server
    _release(ctx)
    raise PortUnavailableError(
        f"tfos: could not bind port {port} for {ctx.job_name}:{ctx.task_index} ({address}) "
        f"after {max_attempts} attempt(s): {last_error}. Another process is listening on it; "
        "check for a leftover TF process of an earlier run on this host."
    )


def _start_server(ctx: Any, cluster: Any, protocol: str, config: Any, address: str) -> Any:
    """One ``tf.distribute.Server`` start: the server, or the TF error when the port was taken.

    Raises:
        ProtocolUnavailableError: ``protocol`` is not built into TF.
        TFServerError: Any other server creation failure.
    """
    import tensorflow as tf

    kwargs: dict[str, Any] = {"protocol": protocol, "start": True}
    if config is not None:
        kwargs["config"] = config
    try:
        return tf.distribute.Server(cluster, job_name=ctx.job_name, task_index=ctx.task_index, **kwargs)
    except tf.errors.NotFoundError as exc:
        message = str(exc)
        if "server factor" in message:
            available = message.rpartition("available server factories are:")[2].strip()
            raise ProtocolUnavailableError(
                f"tfos: protocol {protocol!r} is not available in TensorFlow "
                f"{tf.__version__} (registered server factories: {available or '?'}). "
                "Stock TF 2.x builds have no RDMA 'grpc+verbs' support: use "
                "rdma=False, or a TF build that registers a verbs server."
            ) from exc
        raise TFServerError(f"tfos: could not create the TF server: {message}") from exc
    except tf.errors.UnknownError as exc:
        if "Could not start gRPC server" not in str(exc):
            raise TFServerError(
                f"tfos: could not create the TF server for {ctx.job_name}:"
                f"{ctx.task_index} at {address}: {exc.message}"
            ) from exc
        return exc
    except tf.errors.OpError as exc:
        raise TFServerError(
            f"tfos: could not create the TF server for {ctx.job_name}:{ctx.task_index} "
            f"at {address}: {exc.message}"
        ) from exc
