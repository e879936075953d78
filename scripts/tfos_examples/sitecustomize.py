"""Restores ``numpy.int`` (removed in numpy 1.24) for TFoS's mnist_inference.py, which calls
``np.int``. Used only by scripts/run_tfos_examples.sh; see the comment there."""

try:
    import numpy as _np

    if not hasattr(_np, "int"):
        _np.int = int  # type: ignore[attr-defined]
except ImportError:
    pass
