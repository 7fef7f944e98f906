"""The bookkeeping of one call on a connection, and of its leaving (``rpc_protocol.py`` owns these),
sans I/O."""

from __future__ import annotations

__all__ = ["CallState", "GoAway", "MAX_STREAM_MESSAGE", "STREAM_WINDOW"]

# Per-direction stream window: 16 MiB keeps a loopback pipe of 1 MiB records full (measured) while
# bounding what a slow reader makes the sender's peer buffer.
STREAM_WINDOW = 16 << 20
# The largest stream message (payload bytes) a side accepts unless it says otherwise: one window.
# A larger one is accepted only where its receiver expects it (a state download's tensors), not
# merely because the window is empty: four 250 MiB messages unread on live streams held +514 MB.
MAX_STREAM_MESSAGE = STREAM_WINDOW
# A single message's raw payload may span many records; 256 MiB bounds what one hostile message
# can make us allocate, while a 64M-parameter float32 tensor still fits in one message.
MAX_PAYLOAD = 256 << 20


class CallState:
    __slots__ = (
        "local",
        "unary",
        "sent_done",
        "received_done",
        "send_credit",
        "receive_credit",
        "unacked",
        "unread",
        "max_receive",
        "max_send",
    )
    # A call the peer opened ends when we send END/RESULT/ERROR or it sends CANCEL; a call we opened
    # ends when the peer sends END/RESULT/ERROR or we cancel it.

    def __init__(self, local: bool, window: int):
        self.local = local  # True if we opened it
        self.unary = False  # we opened it as a unary call: only RESULT or ERROR may answer it
        self.sent_done = False
        self.received_done = False
        self.send_credit = window
        self.receive_credit = window
        self.unacked = 0  # bytes the application consumed but we have not re-granted yet
        self.unread = 0  # bytes delivered to the application and not yet consumed
        self.max_receive = MAX_STREAM_MESSAGE  # the largest message payload we accept on it
        self.max_send = MAX_PAYLOAD  # the largest the other side accepts (what its OPEN said)


class GoAway:
    """Who has said GOAWAY on a connection: we (``sent``), the peer (``received``)."""

    __slots__ = ("sent", "received")

    def __init__(self) -> None:
        self.sent = False
        self.received = False
