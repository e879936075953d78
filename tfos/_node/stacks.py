"""The Python stacks of every thread of the TF process, as text for the driver (TF process).

The driver asks for them when a node stalls (docs/status.md "Where is it stuck?") and for
``cluster.stacks()``; the TF process's event loop answers with :func:`thread_stacks`.
``main_fun``'s thread comes first, as :func:`tfos._node.tf_process.main_fun_stack`
trims it; the other threads follow, innermost call last, tfos's own idle threads
(event loop, data server) summed up in one line each.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

__all__ = ["thread_stacks", "STACK_FRAMES"]

#: Innermost frames kept per thread.
STACK_FRAMES = 25


def _tfos_idle(frames: list) -> bool:
    """True for a thread whose innermost frame is tfos's own code or threading's waits
    inside it (the event loop, the data server's accept/read loops)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    return any(os.path.abspath(f.filename).startswith(package) for f in frames)


def thread_stacks(node_name: str, main_thread: threading.Thread, main_text: str) -> str:
    """Every thread's stack of this process, as text (TF process).

    Args:
        node_name: The node, e.g. ``worker:1``, for the header.
        main_thread: The thread running ``main_fun``.
        main_text: ``main_fun``'s stack as ``main_fun_stack`` formats it ('' when
            ``main_fun`` has returned).

    Returns:
        A header line, ``main_fun``'s stack, then one block per other thread (its name,
        daemon flag and innermost :data:`STACK_FRAMES` frames); tfos's own threads get
        one line naming their innermost call.
    """
    frames_of = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    parts = [f"Threads of the TF process on {node_name} (pid {os.getpid()}), innermost call last:"]
    parts.append(main_text if main_text else f"main_fun's thread ({main_thread.name}): main_fun has returned")
    ours: list[str] = []
    for ident, frame in sorted(frames_of.items(), key=lambda kv: (threads[kv[0]].name if kv[0] in threads else "")):
        if ident in (main_thread.ident, me):
            continue
        t = threads.get(ident)
        name = t.name if t is not None else f"thread {ident}"
        stack = list(traceback.extract_stack(frame))
        if not stack:
            continue
        inner = stack[-1]
        if t is not None and name.startswith("tfos-") and _tfos_idle(stack[-3:]):
            ours.append(f"{name} at {os.path.basename(inner.filename)}:{inner.lineno} in {inner.name}")
            continue
        left_out = max(0, len(stack) - STACK_FRAMES)
        head = f"Thread {name}{' (daemon)' if t is not None and t.daemon else ''}:"
        body = "".join(traceback.format_list(stack[left_out:])).rstrip("\n")
        parts.append(head + (f"\n  ... {left_out} outer frames left out ..." if left_out else "") + "\n" + body)
    del frames_of
    if ours:
        parts.append("tfos threads: " + "; ".join(ours))
    return "\n".join(parts)
