"""The parts of :mod:`tfos.pipeline` (Spark ML ``TFEstimator``/``TFModel``): ``params`` (the
Spark ML params and ``tf_args``), ``persist`` (save/load), ``runner`` (the SavedModel run in
Spark tasks)."""
