"""Processes without the cluster key that the data-plane security tests put in a feed
task's way (run as a separate process: ``python intruders.py squat|relay ...``).

* ``squat``: takes a node's data port once the node released it and answers every
  connection like a node would, with a made-up handshake, proof and frames (a "status ok",
  an "ack" and "results" holding a pickle whose unpickling would write ``--marker``); logs
  how many bytes each connection sent it.
* ``relay``: listens on ``--listen`` (port 0: any; printed on stdout) or takes a released
  port, passes every connection on to ``--to`` (another node's data port) and keeps a copy
  of every byte it forwards (``<capture>.to-node`` and ``<capture>.to-task``), logging
  ``conn <peer>`` per connection in ``<capture>.log``.

* ``flood``: floods ``--listen`` (``host:port``, several separated by commas; a port not
  yet listening is tried again) with ``--hold`` connections that send half of a first
  message and stall (reopened when closed), ``--hold`` silent ones (the same), and connects
  and closes as fast as it can in between; appends its counts to ``--log``.

All stop when ``--stop`` exists or after ``--wait-s`` seconds.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import struct
import sys
import threading
import time


def _bind_when_free(host: str, port: int, stop: str, end: float) -> socket.socket:
    """A listening socket on ``host:port``, bound as soon as the port is free."""
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    while time.monotonic() < end and not (stop and os.path.exists(stop)):
        try:
            lst.bind((host, port))
            break
        except OSError:
            time.sleep(0.005)
    else:
        sys.exit(0)
    lst.listen(64)
    lst.settimeout(0.2)
    return lst


def _append(path: str, data: bytes, lock: threading.Lock) -> None:
    with lock, open(path, "ab") as f:
        f.write(data)


class _Boom:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _squat(conn: socket.socket, args: argparse.Namespace, lock: threading.Lock) -> None:
    evil = pickle.dumps([_Boom(args.marker)])
    got = 0
    try:
        conn.settimeout(5)
        conn.sendall(args.magic.encode() + os.urandom(32))
        while True:
            b = conn.recv(65536)
            if not b:
                break
            got += len(b)
            if got >= 52 + 68:  # the task's proof of the key, then its nonce and bound proof
                # a made-up proof, then a "status ok", an "ack" and "results" frames
                conn.sendall(os.urandom(32))
                for t, p in ((b"S", b'{"state":"ok"}'), (b"A", b'{"rows":1000}'), (b"R", evil)):
                    conn.sendall(t + struct.pack(">Q", len(p)) + p + os.urandom(16))
    except OSError:
        pass
    finally:
        conn.close()
        _append(args.log, f"conn {got}\n".encode(), lock)


def _pump(src: socket.socket, dst: socket.socket, path: str, lock: threading.Lock) -> None:
    while True:
        try:
            data = src.recv(65536)
        except OSError:
            data = b""
        if not data:
            for s in (dst, src):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            return
        _append(path, data, lock)
        try:
            dst.sendall(data)
        except OSError:
            return


def _flood(targets: list, args: argparse.Namespace) -> None:
    """Holds half-sent and silent connections to every target, reopening each one closed,
    and churns connections in between (one process, one thread)."""
    import select

    end = time.monotonic() + args.wait_s
    held: dict = {}  # fd -> (socket, target, half)
    poller = select.poll()
    opened = churned = 0

    def open_one(target: tuple, half: bool) -> None:
        nonlocal opened
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(target)
            if half:
                s.sendall(b"TFO1" + struct.pack(">I", 200) + os.urandom(18))
            s.setblocking(False)
        except OSError:
            s.close()
            return
        held[s.fileno()] = (s, target, half)
        poller.register(s, select.POLLIN)
        opened += 1

    while not (args.stop and os.path.exists(args.stop)) and time.monotonic() < end:
        for target in targets:
            for half in (True, False):
                have = sum(1 for _, t, h in held.values() if t == target and h == half)
                for _ in range(max(0, args.hold - have)):
                    open_one(target, half)
        for fd, _ in poller.poll(20):
            s, _, _ = held.pop(fd)
            poller.unregister(fd)
            s.close()
        for target in targets:  # churn: connect and close at once
            for _ in range(20):
                c = socket.socket()
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.settimeout(0.2)
                try:
                    c.connect(target)
                    churned += 1
                except OSError:
                    pass
                c.close()
    if args.log:
        _append(args.log, f"flood opened {opened} churned {churned}\n".encode(), threading.Lock())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("squat", "relay", "flood"))
    ap.add_argument("--listen", required=True, help="host:port (port 0: any, printed)")
    ap.add_argument("--to", type=int, default=0, help="relay: the port connections are passed on to")
    ap.add_argument("--capture", default="", help="relay: prefix of the files it writes")
    ap.add_argument("--log", default="", help="squat: its log")
    ap.add_argument("--marker", default="", help="squat: written when its pickle is unpickled")
    ap.add_argument("--magic", default="", help="squat: the handshake magic to send")
    ap.add_argument("--hold", type=int, default=70, help="flood: connections of each kind held per target")
    ap.add_argument("--stop", default="")
    ap.add_argument("--wait-s", type=float, default=240.0)
    args = ap.parse_args()
    if args.mode == "flood":
        _flood([(h, int(p)) for h, p in (t.rsplit(":", 1) for t in args.listen.split(","))], args)
        return 0
    host, port = args.listen.rsplit(":", 1)
    end = time.monotonic() + args.wait_s
    lst = _bind_when_free(host, int(port), args.stop, end)
    print(lst.getsockname()[1], flush=True)
    lock = threading.Lock()
    log = args.log if args.mode == "squat" else args.capture + ".log"
    _append(log, b"bound\n", lock)
    while not (args.stop and os.path.exists(args.stop)) and time.monotonic() < end:
        try:
            conn, peer = lst.accept()
        except socket.timeout:
            continue
        if args.mode == "squat":
            threading.Thread(target=_squat, args=(conn, args, lock), daemon=True).start()
            continue
        up = socket.create_connection((host, args.to))
        _append(log, f"conn {peer[0]}:{peer[1]}\n".encode(), lock)
        threading.Thread(target=_pump, args=(conn, up, args.capture + ".to-node", lock), daemon=True).start()
        threading.Thread(target=_pump, args=(up, conn, args.capture + ".to-task", lock), daemon=True).start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
