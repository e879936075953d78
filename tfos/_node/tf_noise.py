"""TensorFlow's C++ start-up noise in a node's output, which tfos hides by default when it
chose the log level (pure; node supervisor)."""

from __future__ import annotations

import os
import re
from typing import Optional

__all__ = ["TF_LOG_LEVEL_DEFAULT", "has_nvidia_driver", "is_tf_noise", "tf_noise_level"]

#: The ``TF_CPP_MIN_LOG_LEVEL`` tfos sets in node processes when the user set none:
#: TensorFlow's C++ INFO lines are dropped, warnings and errors are kept.
TF_LOG_LEVEL_DEFAULT = "1"
_CXX_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [^\s\]]+:\d+\] ")
_CXX_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
_ABSL_PREINIT = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# The second line of TensorFlow's cpu_feature_guard INFO message.
_CXX_CONTINUATION = "To enable the following instructions:"


def has_nvidia_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia/version")


def is_tf_noise(line: str, min_level: int, nvidia_driver: bool, after_dropped: bool = False) -> bool:
    """Whether a node output line is TensorFlow C++ noise tfos hides by default (pure).

    Args:
        line: One output line, without its newline.
        min_level: ``TF_CPP_MIN_LOG_LEVEL`` in force (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL):
            C++ lines of a lower severity are noise. TensorFlow 2.21 prints some lines
            before absl's log initialisation, ignoring that variable; this catches them.
        nvidia_driver: Whether the host has an NVIDIA driver. Without one, TensorFlow's
            ``failed call to cuInit`` error only says that there is no GPU: noise. The
            warning that ``DataFeed.as_dataset``'s generator dataset "will not be
            optimized" is noise too (nothing the user can change).
        after_dropped: The previous line was dropped (for two-line messages).

    Returns:
        True to drop the line.
    """
    if line.startswith(_ABSL_PREINIT):
        return min_level > 0
    if after_dropped and line.startswith(_CXX_CONTINUATION):
        return True
    m = _CXX_LINE.match(line)
    if m is None:
        return False
    if _CXX_SEVERITY[m.group(1)] < min_level:
        return True
    if "Input of GeneratorDatasetOp::Dataset will not be optimized" in line:
        return True  # about DataFeed.as_dataset's own generator: nothing the user can change
    return not nvidia_driver and "failed call to cuInit" in line


def tf_noise_level(env_value: Optional[str]) -> Optional[int]:
    """The ``min_level`` of :func:`is_tf_noise` for a node's ``TF_CPP_MIN_LOG_LEVEL`` (pure).

    The filter follows the level in force, whoever set it: tfos's default (``1``) or the
    user's (``2`` must never show more than ``1``). ``0`` (every line asked for) turns it off.

    Args:
        env_value: ``TF_CPP_MIN_LOG_LEVEL`` of the TF process, or None when unset.

    Returns:
        The level (1-3), or None for no filtering.
    """
    try:
        level = int(env_value if env_value is not None else TF_LOG_LEVEL_DEFAULT)
    except ValueError:
        level = int(TF_LOG_LEVEL_DEFAULT)
    return min(level, 3) if level > 0 else None
