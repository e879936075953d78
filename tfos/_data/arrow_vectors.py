"""Spark ML vector columns of Arrow chunks, without the row-by-row ``VectorUDT.deserialize``
(pure; TF process): as ``DenseVector``/``SparseVector`` rows (:func:`vector_values`) or as
one ``(n, size)`` float64 view (:func:`arrow_vector_ndarray`)."""

from __future__ import annotations

import functools
import json
from typing import Any, Optional

from tfos._data.arrow_views import SPARK_SCHEMA_KEY, arrow_ndarray, equal_steps, numeric_view, valid_list

__all__ = ["VECTOR_FIELDS", "arrow_vector_ndarray", "vector_values"]

VECTOR_FIELDS = ("type", "size", "indices", "values")


def vector_values(arr: Any, udt: Any) -> Optional[list]:
    """A column of Spark ML vectors as ``DenseVector``/``SparseVector`` objects, or None (pure).

    The values ``udt.deserialize`` gives row by row (the generic path), built from one
    float64 (and one int32 indices) copy of the chunk's vector values: each vector's array
    is a slice of that copy (writable, not a view of the received chunk). None (use the
    generic path) when the UDT is not ``pyspark.ml.linalg.VectorUDT``, the Arrow type is
    not its struct, or a value is not what Spark writes for a valid vector (a null field
    of a vector, a null element, an unknown type code, sparse indices not strictly
    increasing within ``[0, size)``, index and value counts that differ): the generic
    path then gives (or raises) what ``deserialize`` does.
    """
    import numpy as np
    import pyarrow as pa

    cls = type(udt)
    if cls.__name__ != "VectorUDT" or cls.__module__ != "pyspark.ml.linalg":
        return None
    t = arr.type
    if not pa.types.is_struct(t) or tuple(t.field(i).name for i in range(t.num_fields)) != VECTOR_FIELDS:
        return None
    kinds_a, sizes_a, idx_a, vals_a = arr.flatten()
    if not (pa.types.is_integer(kinds_a.type) and pa.types.is_integer(sizes_a.type)
            and pa.types.is_list(idx_a.type) and pa.types.is_list(vals_a.type)
            and pa.types.is_int32(idx_a.type.value_type) and pa.types.is_float64(vals_a.type.value_type)):
        return None
    n = len(arr)
    valid = valid_list(arr)
    kinds = kinds_a.to_pylist()
    sizes = sizes_a.to_pylist()
    vals_ok = valid_list(vals_a)
    idx_ok = valid_list(idx_a)
    voffs = numeric_view(vals_a.offsets, 0, n + 1)
    ioffs = numeric_view(idx_a.offsets, 0, n + 1)
    vleaf, ileaf = vals_a.values, idx_a.values
    if voffs is None or ioffs is None or vleaf.null_count or ileaf.null_count:
        return None
    vlo, vhi, ilo, ihi = int(voffs[0]), int(voffs[-1]), int(ioffs[0]), int(ioffs[-1])
    vflat = np.array(numeric_view(vleaf, vlo, vhi))  # one writable copy per chunk
    iflat = np.array(numeric_view(ileaf, ilo, ihi))
    from pyspark.ml.linalg import DenseVector, SparseVector

    new_dense, new_sparse = DenseVector.__new__, SparseVector.__new__
    kind_view = numeric_view(kinds_a, 0, n)
    if (valid is None and vals_ok is None and not len(iflat) and kind_view is not None
            and bool((kind_view == 1).all()) and n and equal_steps(voffs)):
        # Only dense vectors of one size (VectorAssembler's output): rows of one matrix.
        dense: list = []
        for row in vflat.reshape(n, (vhi - vlo) // n):
            dv = new_dense(DenseVector)
            dv.array = row
            dense.append(dv)
        return dense
    vo = (voffs - vlo).tolist()
    io = (ioffs - ilo).tolist()
    is_sparse = _sparse_rows(n, valid, kinds, sizes, vals_ok, idx_ok, io, vo, iflat)
    if is_sparse is None:
        return None
    # The attributes DenseVector(values) and SparseVector(size, indices, values) set (the
    # float64 and int32 arrays they would keep as given), from the checked slices.
    out: list = []
    append = out.append
    for i in range(n):
        if valid is not None and not valid[i]:
            append(None)
        elif is_sparse[i]:
            sv = new_sparse(SparseVector)
            sv.size = int(sizes[i])
            sv.indices = iflat[io[i] : io[i + 1]]
            sv.values = vflat[vo[i] : vo[i + 1]]
            append(sv)
        else:
            dv = new_dense(DenseVector)
            dv.array = vflat[vo[i] : vo[i + 1]]
            append(dv)
    return out


def arrow_vector_ndarray(arr: Any, schema: Any, index: int) -> Any:
    """A zero-copy ``(n, size)`` float64 view of a column of dense Spark ML vectors, or None (pure).

    Args:
        arr: Column ``index`` of an Arrow chunk: the ``VectorUDT`` struct
            ``{type, size, indices, values}`` Spark sends.
        schema: The chunk's Arrow schema; its metadata (:data:`SPARK_SCHEMA_KEY`) must name
            the column's type ``pyspark.ml.linalg.VectorUDT``.
        index: The column's index.

    Returns:
        The view, or None when the column is not a vector column, or holds a null, a sparse
        vector or vectors of different sizes.
    """
    import numpy as np
    import pyarrow as pa

    if not pa.types.is_struct(arr.type) or arr.null_count or len(arr) == 0:
        return None
    text = (schema.metadata or {}).get(SPARK_SCHEMA_KEY)
    if not text:
        return None
    classes = _udt_classes(bytes(text))
    if index >= len(classes) or classes[index] != "pyspark.ml.linalg.VectorUDT":
        return None
    kinds, _size, _indices, values = arr.flatten()
    kind = numeric_view(kinds, 0, len(kinds))
    if kind is None or not bool((kind == 1).all()):
        return None
    view = arrow_ndarray(values)
    return None if view is None or view.dtype != np.float64 else view


@functools.lru_cache(maxsize=32)
def _udt_classes(text: bytes) -> tuple:
    """The ``pyClass`` of each top-level column's UDT in a Spark schema JSON (None for
    other types); cached per JSON text, at most 32 kept (pure)."""
    out = []
    for field in json.loads(text).get("fields", []):
        ftype = field.get("type") if isinstance(field, dict) else None
        out.append(ftype.get("pyClass") if isinstance(ftype, dict) else None)
    return tuple(out)


def _sparse_rows(n: int, valid: Optional[list], kinds: list, sizes: list, vals_ok: Optional[list],
                 idx_ok: Optional[list], io: list, vo: list, iflat: Any) -> Any:
    """Which of the ``n`` vectors are sparse (a bool array), or None when a value is not
    what Spark writes for a valid vector (see :func:`vector_values`) (pure)."""
    import numpy as np

    # Which rows are dense, sparse or null; anything else goes to the generic path.
    is_sparse = np.zeros(n, dtype=bool)
    for i in range(n):
        if valid is not None and not valid[i]:
            continue
        k = kinds[i]
        if k == 1:
            if vals_ok is not None and not vals_ok[i]:
                return None
        elif k == 0:
            if sizes[i] is None or (vals_ok is not None and not vals_ok[i]) or (idx_ok is not None and not idx_ok[i]):
                return None
            if io[i + 1] - io[i] != vo[i + 1] - vo[i]:
                return None
            is_sparse[i] = True
        else:
            return None
    if len(iflat):
        # Every index belongs to a sparse row, lies in [0, size) and exceeds its predecessor in the row.
        lengths = np.diff(np.asarray(io))
        row_of = np.repeat(np.arange(n), lengths)
        if not is_sparse[row_of].all():
            return None
        size_of = np.asarray([s if s is not None else 0 for s in sizes], dtype=np.int64)[row_of]
        if (iflat < 0).any() or (iflat >= size_of).any():
            return None
        if len(iflat) > 1 and ((np.diff(iflat) <= 0) & (row_of[1:] == row_of[:-1])).any():
            return None
    return is_sparse
