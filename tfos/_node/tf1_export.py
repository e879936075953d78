"""TFoS's TF1 SavedModel export of a ``tf.compat.v1`` session (TF process).

Public as ``tfos.TFNode.export_saved_model`` and through ``ctx.export_saved_model(sess,
export_dir, tag_set, signatures)`` (:class:`tfos.node_context.TFNodeContext`); it lives here,
below both, so neither imports the other (docs/api.md "`tfos.TFNode` (TF process)").
"""

from __future__ import annotations

from typing import Any


def export_saved_model(sess: Any, export_dir: str, tag_set: Any, signatures: dict) -> None:
    """TF1-style SavedModel export of a ``tf.compat.v1`` session (TF process, chief only).

    Args:
        sess: A ``tf.compat.v1.Session`` holding the trained graph.
        export_dir: Target directory (must not exist).
        tag_set: Comma-separated tags (TFoS: ``"serve"`` or ``"serve,gpu"``) or a list of tags.
        signatures: ``{signature_key: {'inputs': {name: tensor}, 'outputs': {name: tensor},
            'method_name': optional}}`` (TFoS's format; the method defaults to
            ``tensorflow/serving/predict``, where TFoS put the signature key).

    Raises:
        ValueError: When ``signatures`` is empty, or a signature lacks its ``'inputs'`` or
            ``'outputs'`` dict (names the signature key).
    """
    if not signatures:
        raise ValueError("export_saved_model needs at least one signature")
    for key, sig in signatures.items():
        missing = [part for part in ("inputs", "outputs") if not isinstance(sig, dict) or not isinstance(sig.get(part), dict)]
        if missing:
            raise ValueError(f"export_saved_model: signature {key!r} needs {' and '.join(repr(m) for m in missing)} "
                             "as a dict {name: tensor}")
    import tensorflow as tf

    v1 = tf.compat.v1
    tags = [t.strip() for t in tag_set.split(",") if t.strip()] if isinstance(tag_set, str) else list(tag_set)
    graph = sess.graph
    if graph.finalized:  # MonitoredTrainingSession finalizes its graph; the builder adds ops
        graph._unsafe_unfinalize()
    builder = v1.saved_model.builder.SavedModelBuilder(export_dir)
    sig_defs = {}
    for key, sig in signatures.items():
        inputs = {k: v1.saved_model.utils.build_tensor_info(t) for k, t in sig["inputs"].items()}
        outputs = {k: v1.saved_model.utils.build_tensor_info(t) for k, t in sig["outputs"].items()}
        method = sig.get("method_name", v1.saved_model.signature_constants.PREDICT_METHOD_NAME)
        sig_defs[key] = v1.saved_model.signature_def_utils.build_signature_def(inputs, outputs, method)
    builder.add_meta_graph_and_variables(sess, tags, signature_def_map=sig_defs, clear_devices=True, strip_default_attrs=True)
    builder.save()
