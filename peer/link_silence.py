"""Telling a dead link from a slow peer, sans I/O.

A TCP connection whose path goes down (a cable pulled, a router rebooted, a laptop's Wi-Fi gone, a
NAT that forgot its mapping) does not close: our kernel retransmits for up to ~15 minutes, with a
timeout that doubles each time, so calls on it time out one after another, and when the path comes
back the connection may stay silent for as long again as it was down, waiting for its next
retransmission. A new connection would work at once.

So each connection watches its socket (``SecureChannel.link_progress``: bytes the peer's kernel
acknowledged, bytes that arrived) whenever a call times out. A peer that is merely slow or busy
still has its kernel acknowledge what we send, so the counts move; a link that is down moves
neither. When calls have timed out with the counts frozen since a request that was waiting for
``DEAD_LINK_SILENCE`` seconds, the link is taken for dead and the connection closed; the next call
dials again.

Through a relay the relay's kernel acknowledges our bytes, so only a silence of the relay itself is
seen there.

Only what we sent counts against the link (``SecureChannel.in_flight``): a peer that stops reading
(its process stopped, or too busy) closes its receive window, our bytes wait unsent in our own
queue, and its kernel still answers. If the path goes down while the window is closed, nothing is
in flight; the kernel's window probes then go unanswered (``SecureChannel.unanswered_probes``), and
UNANSWERED_PROBES of them in a row count against the link as bytes in flight do.
"""

from __future__ import annotations

__all__ = ["DEAD_LINK_SILENCE", "LinkSilence", "UNANSWERED_PROBES"]

# Longer than any live path leaves a request unacknowledged: TCP retransmits a lost segment after
# about 0.2-1 s and again after twice that, so even two losses in a row are acknowledged within ~7 s.
DEAD_LINK_SILENCE = 10.0
# A live peer's kernel answers window probes but may leave one answer out (out-of-window replies
# are rate limited to one per 500 ms, and the first probes go 200-400 ms apart); none leaves two.
UNANSWERED_PROBES = 2

Progress = tuple[int, int]


class LinkSilence:
    """Counts how long a connection's link has said nothing while calls waited on it."""

    def __init__(self, limit: float = DEAD_LINK_SILENCE):
        self.limit = limit
        self._silent_since: tuple[float, Progress] | None = None  # (when a silent call was sent, progress then)

    def answered(self) -> None:
        """A call got its answer: the link works."""
        self._silent_since = None

    def call_timed_out(self, sent_at: float, progress_at_send: Progress, progress_now: Progress, now: float) -> bool:
        """A call sent at ``sent_at`` timed out at ``now``; True when the link is to be taken for
        dead (silent for ``limit`` seconds, across this call and any silent ones before it).
        The counts only grow, so counts equal to those of the silence already noted mean nothing
        moved since then, whatever this call saw: a long call sent before the link went down
        does not restart the count."""
        if self._silent_since is not None and self._silent_since[1] == progress_now:
            return now - self._silent_since[0] >= self.limit
        if progress_now != progress_at_send:
            self._silent_since = None  # the peer's kernel acknowledged or sent something: alive
            return False
        # the first silent call, or something moved between the last silent call and this one
        self._silent_since = (sent_at, progress_at_send)
        return now - sent_at >= self.limit
