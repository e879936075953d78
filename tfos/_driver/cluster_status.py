"""``TFCluster.status()``, ``stacks()`` and ``summary()``: the status monitor's answers (driver).

A mixin of :class:`tfos._driver.cluster.TFCluster`; the monitor itself is
:mod:`tfos._driver.monitor` (one per cluster attempt, on its runtime). docs/status.md.
"""

from __future__ import annotations

from typing import Any, Optional

from tfos.errors import ConfigurationError

__all__ = ["StatusMethods"]


def _check_timeout(name: str, value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and 0 < float(value) < float("inf")
    if not ok:
        raise ConfigurationError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class StatusMethods:
    """The status part of ``TFCluster`` (needs its ``_ctl`` controller and ``attempt``/``state``)."""

    _ctl: Any

    def _monitor_or_none(self) -> Optional[Any]:
        runtime = getattr(self._ctl.backend, "runtime", None)
        return runtime.monitor if runtime is not None else None

    def _monitor(self, what: str) -> Any:
        monitor = self._monitor_or_none()
        if monitor is None:
            raise ConfigurationError(f"{what}: the nodes' figures are not kept under Spark Connect (docs/status.md)")
        return monitor

    def status(self) -> dict:
        """The nodes' live figures and the bottleneck verdict, as plain data (driver; safe
        to call from another thread while ``train()`` runs). Figures are at most one
        long-poll old (about 1 s); rates and shares cover each node's last 10 s.

        Returns:
            ``{"cluster_id", "attempt", "state", "elapsed_s", "verdict"`` ('producer',
            'feed', 'compute', 'skew' or 'none'), ``"verdict_nodes"`` (node names such
            as 'worker:1'), ``"verdict_text"``, ``"verdicts_held_s"`` ({verdict: seconds}),
            ``"last_stall"`` (the last stall report, '' before any), ``"nodes"``: one dict
            per node with node, executor_id, job_name, task_index, host, state, rows,
            rows_by_epoch ({epoch: {fed, trained, closed}} of the latest train()),
            rows_per_s, feed_wait_share (0..1), feed_waiting_s, queue_fill (0..1),
            steps and steps_per_s (Keras; None without), cpu_s, cpu_share (cores), rss_bytes,
            heartbeat_age_s, idle_s (seconds without progress), class (the node's own
            verdict), named}``. Window figures are None until a node sent 3 s of them.
            Fields and verdicts: docs/status.md.

        Raises:
            ConfigurationError: Under Spark Connect.
        """
        out = self._monitor("status()").status()
        out.update(attempt=self._ctl.attempt, state=self._ctl.state.value)
        return out

    def stacks(self, timeout_s: float = 5.0) -> dict[str, str]:
        """The Python stacks of every thread of every running node's TF process (driver).

        Args:
            timeout_s: Longest wait for each node's answer, in seconds (at most 10).

        Returns:
            ``{node name: text}`` (e.g. ``{"worker:1": "Threads of the TF process on
            worker:1 ..."}``); '' for a node that did not answer in time (e.g. a C call
            holding the GIL) or whose process ended.

        Raises:
            ConfigurationError: Under Spark Connect, or a ``timeout_s`` that is not > 0.
        """
        return self._monitor("stacks()").stacks(_check_timeout("stacks(): timeout_s", timeout_s))

    def summary(self) -> dict:
        """Per node over the last attempt: rows, rows/s, feed-wait share, Keras steps, CPU
        seconds; the verdict that held longest and the restarts (driver). Also logged at
        INFO by ``shutdown()``.

        Returns:
            ``{"cluster_id", "restarts", "elapsed_s", "verdict", "verdicts_held_s",
            "last_stall", "nodes": [{node, executor_id, rows, rows_per_s,
            feed_wait_share, steps, cpu_s, seconds}]}`` (docs/status.md "After the run").

        Raises:
            ConfigurationError: Under Spark Connect.
        """
        out = self._monitor("summary()").summary()
        out["restarts"] = self._ctl.attempt
        return out
