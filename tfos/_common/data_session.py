"""Encryption and authentication of data-connection frames (pure; runs anywhere).

A data connection's frames are sealed with AES-256-GCM under per-connection,
per-direction session keys that :func:`tfos._common.wire.server_handshake` derives
(:class:`DataSession`); the frame layout is in :mod:`tfos._data.framing`. A frame's clear
header (type and length) carries its own 16-byte tag, checked before the receiver
allocates anything for the announced length (docs/reliability.md, "Threat model").
"""

from __future__ import annotations

import struct
from typing import Any, Optional, Union

from tfos.errors import ControlProtocolError

__all__ = ["DataAuthError", "DataRelayError", "DataSession"]


class DataAuthError(ControlProtocolError):
    """The peer of a data connection did not prove it holds the cluster key.

    Raised on the feed-task side when the *node* fails to authenticate (a process without
    the key listening on a released data port, or a relay), and on the node side when the
    feed task fails. The message never contains key material.

    Attributes:
        address: Where a feed task reached the failing peer (a Unix socket path or
            ``host:port``), "" when not known.
        connection: The feed task's connection to it (``local -> remote`` endpoints, and
            the listener's owner when it is on the task's host), "" when not known.
    """

    address: str = ""
    connection: str = ""


class DataRelayError(DataAuthError):
    """The process at a node's data address passed the feed task's handshake on to another
    node of the cluster (a relay without the key), which refused it: raised on the feed-task
    side. Nothing but a nonce and a proof was sent.

    Attributes:
        reached: The name of the node the handshake was relayed to.
    """

    reached: str = ""



def _gcm() -> Any:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM


_IN_PLACE: Optional[bool] = None


def _in_place_ok() -> bool:
    """Whether ``AESGCM.decrypt_into`` may write the plaintext over its own ciphertext
    (checked once per process on a known answer; without it, a frame is decrypted into a
    second buffer)."""
    global _IN_PLACE
    if _IN_PLACE is None:
        try:
            aead = _gcm()(bytes(range(32)))
            nonce, text = bytes(12), bytes(range(200)) * 3
            buf = bytearray(aead.encrypt(nonce, text, b"h"))
            view = memoryview(buf)
            aead.decrypt_into(nonce, view, b"h", view[: len(text)])
            _IN_PLACE = bytes(buf[: len(text)]) == text
        except Exception:  # noqa: BLE001 - any failure: decrypt into a second buffer
            _IN_PLACE = False
    return _IN_PLACE


class DataSession:
    """Per-connection, per-direction encryption and authentication of a data connection
    (pure).

    Every data frame's payload is encrypted with AES-256-GCM, and its 9-byte header (type
    and length) is authenticated with it as associated data: no byte of a row can be read on
    the wire, and a frame whose header, payload or tag was altered is refused before
    anything acts on it. The 96-bit GCM nonce is ``sequence number (uint64) || frame type
    || three zero bytes``: each direction has its own session key and its own counter, so
    a nonce is never reused under one key, a frame's type is bound to it, and a replayed,
    dropped, reordered or reflected frame fails the check.

    The session keys are derived from the cluster key, both sides' handshake nonces and
    the node's identity (:func:`server_handshake`), so they are fresh for every connection.

    Cost: encrypting plus decrypting with AES-GCM (AES-NI and carry-less multiply) runs at
    about 10 GB/s of CPU time on the project's machine, against 0.8 GB/s for HMAC-SHA256
    tags alone (``scripts/bench_frame_tags.py``); the payload is encrypted straight from
    the sender's buffers (several parts are gathered by the encryption itself) into one
    send buffer that the session reuses, and decrypted in place in the receive buffer.

    Args:
        send_key: 32-byte key of frames this side sends.
        recv_key: 32-byte key of frames this side receives.
    """

    TAG_BYTES = 16
    #: Send buffers up to this size are kept for the next frame.
    _KEEP_BYTES = 8 << 20

    def __init__(self, send_key: bytes, recv_key: bytes):
        aead = _gcm()
        self._tx = aead(send_key)
        self._tx_key = send_key
        self._rx = aead(recv_key)
        self._tx_seq = 0
        self._rx_seq = 0
        self._out = bytearray()

    def _out_view(self, n: int) -> memoryview:
        if n <= self._KEEP_BYTES:
            if len(self._out) < n:
                self._out = bytearray(n)
            return memoryview(self._out)[:n]
        return memoryview(bytearray(n))

    def _next_nonce(self, ftype: int) -> bytes:
        self._tx_seq += 1
        return _NONCE.pack(self._tx_seq, ftype)

    def seal(self, ftype: int, head: bytes, payload: Union[bytes, bytearray, memoryview]) -> memoryview:
        """The ciphertext and tag of the next outgoing frame (call in send order, one
        thread at a time).

        Args:
            ftype: The frame type byte.
            head: The frame's header (authenticated, sent in clear).
            payload: The plaintext.

        Returns:
            The payload's size in bytes plus ``TAG_BYTES`` in the session's send buffer:
            send them before the next call.
        """
        data = _byte_view(payload)
        out = self._out_view((len(data) if data is not None else 0) + self.TAG_BYTES)
        self._tx.encrypt_into(self._next_nonce(ftype), data if data is not None else b"", head, out)
        return out

    def seal_parts(self, ftype: int, head: bytes, parts: Any, n: int) -> memoryview:
        """As :meth:`seal` for a payload that is the concatenation of ``parts`` (``n``
        bytes in all): the parts are encrypted one after the other into the send buffer,
        never joined first. The receiver decrypts the frame as one payload.

        Args:
            parts: Bytes-like objects, in payload order (the Arrow buffers of a record
                batch, PySpark's batches and their length prefixes).
        """
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        out = self._out_view(n + self.TAG_BYTES)
        enc = Cipher(algorithms.AES(self._tx_key), modes.GCM(self._next_nonce(ftype))).encryptor()
        enc.authenticate_additional_data(head)
        at = 0
        for part in parts:
            view = _byte_view(part)
            if view is not None:
                at += enc.update_into(view, out[at:])
        if at != n:
            raise ValueError(f"the parts hold {at} bytes, not the {n} announced")
        enc.finalize()
        out[n:] = enc.tag
        return out

    def seal_head(self, ftype: int, head: bytes) -> bytes:
        """The 16-byte tag of the next outgoing frame's header (call right before
        :meth:`seal` or :meth:`seal_parts` of the same frame: it is bound to that frame's
        sequence number, type and header).

        The receiver checks it (:meth:`check_head`) before it allocates a buffer for the
        length the header announces.
        """
        return self._tx.encrypt(_HEAD_NONCE.pack(self._tx_seq + 1, ftype, _HEAD_MARK), b"", head)

    def check_head(self, ftype: int, head: bytes, tag: Union[bytes, bytearray]) -> None:
        """Verifies the header tag of the next incoming frame (before :meth:`open` of the
        same frame; nothing is advanced).

        Raises:
            DataAuthError: The header (type or length) was forged or altered, or the frame
                is replayed, reordered or reflected.
        """
        from cryptography.exceptions import InvalidTag

        try:
            self._rx.decrypt(_HEAD_NONCE.pack(self._rx_seq + 1, ftype, _HEAD_MARK), bytes(tag), head)
        except InvalidTag:
            raise DataAuthError(
                f"the header of data frame {self._rx_seq + 1} failed authentication (a forged or altered type "
                "or length, or a replayed, reordered or reflected frame): nothing was allocated for it"
            ) from None

    def open(self, ftype: int, head: bytes, buf: bytearray) -> None:
        """Decrypts and verifies the next incoming frame in place.

        Args:
            ftype: The frame type byte.
            head: The frame's header as received.
            buf: Ciphertext and tag as received; on return it holds the plaintext only
                (truncated by :data:`TAG_BYTES`).

        Raises:
            DataAuthError: Wrong tag: a tampered, injected, replayed, reordered or
                reflected frame, or another key. ``buf`` then holds nothing usable.
        """
        from cryptography.exceptions import InvalidTag

        self._rx_seq += 1
        nonce = _NONCE.pack(self._rx_seq, ftype)
        n = len(buf) - self.TAG_BYTES
        if n < 0:
            raise DataAuthError(f"data frame {self._rx_seq} is shorter than its tag")
        try:
            view = memoryview(buf)
            if _in_place_ok():
                self._rx.decrypt_into(nonce, view, head, view[:n])
                del view
            else:
                plain = bytearray(n)
                self._rx.decrypt_into(nonce, view, head, plain)
                del view
                buf[:n] = plain
        except InvalidTag:
            raise DataAuthError(
                f"data frame {self._rx_seq} failed authentication (tampered, injected, replayed or reordered)"
            ) from None
        del buf[n:]  # truncating a bytearray in place does not copy the payload


def _byte_view(payload: Any) -> Any:
    """``payload`` as something ``cryptography`` reads without a copy (None when empty).

    Buffers exported with another format than unsigned bytes (a ``pyarrow.Buffer`` exports
    signed chars, numpy arrays their dtype) are recast, which copies nothing.
    """
    if not len(payload):
        return None
    if isinstance(payload, (bytes, bytearray)):
        return payload
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


_NONCE = struct.Struct(">QB3x")
#: Nonce of a header's own tag: the frame's sequence number and type, then 0x000001 (a
#: payload's nonce ends in three zero bytes, so the two never coincide under one key).
_HEAD_NONCE = struct.Struct(">QB2xB")
_HEAD_MARK = 1
