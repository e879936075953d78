"""The feed ledger of one cluster: which partitions were handed over, acknowledged, claimed
or skipped, per feed, and each node's latest checkpoint report (pure; runs in the control
host, driver or Connect executor 0).

No lock, no clock, no logging: :class:`tfos._control.registry.Registry` owns one and
routes the feed messages (``partition_sent``, ``partition_done``, ``claim_partition``,
``partition_skipped``, ``epoch_handover``, ``checkpoint``) to it; its host serialises
every call. See docs/reliability.md "Recovery" for how a restart uses it.
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = ["FeedLedger", "MAX_FEEDS_KEPT"]

#: Feeds whose per-partition record (claimed, skipped, acknowledged, handed over) the ledger
#: keeps; the oldest is forgotten when a newer one starts. train() calls run one after
#: another and read their record before they return, so only inference RDDs computed
#: after 64 newer feeds started lose their record (a re-run of one of their tasks is then
#: no longer refused).
MAX_FEEDS_KEPT = 64


class FeedLedger:
    """Per-feed partition records and checkpoint reports (pure)."""

    def __init__(self) -> None:
        #: feed id -> (partitions expected, partitions handed over) for end_of_feed feeds.
        self.sent: dict[str, tuple[int, set[int]]] = {}
        #: feed id -> job partition indices a node acknowledged (restarts resume after them).
        self.done: dict[str, set[int]] = {}
        self.claimed: dict[str, dict[int, str]] = {}  # feed id -> partition index -> node
        self.claim_tokens: dict[str, dict[int, str]] = {}  # feed id -> partition index -> the claim's token
        #: feed id -> partition indices whose feed task ended without handing them to a node
        #: (the node had terminated its queue or returned from main_fun).
        self.skipped: dict[str, set[int]] = {}
        #: Feed ids with a record, oldest first: only the newest :data:`MAX_FEEDS_KEPT` are
        #: kept (a streaming job feeds every micro-batch as a feed).
        self.feed_ids: dict[str, None] = {}
        #: Latest checkpoint report per executor id: epochs of the running train() it holds.
        self.checkpoints: dict[int, int] = {}

    def _record(self, feed_id: str) -> None:
        if feed_id in self.feed_ids:
            return
        self.feed_ids[feed_id] = None
        while len(self.feed_ids) > MAX_FEEDS_KEPT:
            old = next(iter(self.feed_ids))
            del self.feed_ids[old]
            for record in (self.sent, self.done, self.claimed, self.claim_tokens, self.skipped):
                record.pop(old, None)

    def close_when_sent(self, feed_id: str, total: int) -> None:
        """The feed ``feed_id`` ends once ``total`` of its partitions were handed over."""
        self._record(feed_id)
        self.sent[feed_id] = (total, set())

    def handed_over(self, feed_id: str, index: int) -> Optional[int]:
        """Partition ``index`` of ``feed_id`` reached a node; returns the feed's partition
        count once every one of them did (the feed of every node closes), else None."""
        entry = self.sent.get(feed_id)
        if entry is None:
            return None
        entry[1].add(index)
        return entry[0] if len(entry[1]) >= entry[0] else None

    def acknowledged(self, feed_id: str, index: int) -> None:
        """A node acknowledged partition ``index`` of ``feed_id`` (a restart skips it)."""
        self._record(feed_id)
        self.done.setdefault(feed_id, set()).add(index)

    def partitions_done(self, feed_id: str) -> set[int]:
        """Job partition indices of ``feed_id`` a node acknowledged (a copy)."""
        return set(self.done.get(feed_id, ()))

    def claim(self, feed_id: str, index: int, node: str, token: str) -> dict:
        """A feed task is about to stream partition ``index`` of ``feed_id`` to ``node``:
        granted once per (feed, index); a re-run task (retry, stage resubmission) is
        refused. ``token`` (one per claim a task makes) makes the claim idempotent: a claim
        resent after a broken connection is granted again, not taken for a re-run task.

        Returns:
            ``{"granted": True}`` or ``{"granted": False, "node": <node it went to>}``.
        """
        self._record(feed_id)
        claimed = self.claimed.setdefault(feed_id, {})
        tokens = self.claim_tokens.setdefault(feed_id, {})
        if index in claimed:
            if token and tokens.get(index) == token:
                return {"granted": True}
            return {"granted": False, "node": claimed[index]}
        claimed[index] = node
        tokens[index] = token
        return {"granted": True}

    def skip(self, feed_id: str, index: int) -> None:
        """A feed task ended without handing partition ``index`` of ``feed_id`` to a node."""
        self._record(feed_id)
        self.skipped.setdefault(feed_id, set()).add(index)

    def epoch_handover(self, feed_id: str, lo: int, hi: int, node: str) -> dict:
        """Whether the job partition indices ``lo..hi-1`` of ``feed_id`` (whole epochs) were
        all settled: claimed or skipped.

        Returns:
            ``{"settled": count, "mine": [indices claimed by node, ascending]}``; the node
            closes those epochs once ``settled == hi - lo`` and it has read every partition
            in ``mine`` (see tfos._data.tfdata.EpochOrder).
        """
        claimed = self.claimed.get(feed_id, {})
        skipped = self.skipped.get(feed_id, set())
        idx: Iterable[int]
        if hi - lo <= len(claimed) + len(skipped):
            idx = range(lo, hi)
        else:
            idx = sorted(i for i in set(claimed) | skipped if lo <= i < hi)
        settled = sum(1 for i in idx if i in claimed or i in skipped)
        mine = sorted(i for i in idx if claimed.get(i) == node)
        return {"settled": settled, "mine": mine}
