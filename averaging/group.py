"""Who averages together: the group a leader announces, and the peer modes.

A group description travels over the network (leader -> followers), so ``GroupInfo.from_wire``
validates every field: a follower never trusts a leader's message further than its shape.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from peer import PeerAddress, PeerID

__all__ = ["AveragingMode", "GroupMember", "GroupInfo", "MAX_GROUP_SIZE", "MAX_BANDWIDTH", "MAX_COUNTER", "is_counter"]

# Butterfly all-reduce opens (n-1) streams per peer; beyond ~64 peers the per-part overhead
# dominates and a Moshpit round of smaller groups averages faster anyway.
MAX_GROUP_SIZE = 64
# Bandwidths are relative shares (bytes/s by convention); 1e12 is a terabyte per second. Larger
# values only serve to overflow the shard arithmetic (total * bandwidth became inf).
MAX_BANDWIDTH = 1e12
# Epochs, rounds, versions and sample counts that other peers claim: 2**53 is a step per
# microsecond for 285 years, keeps float conversions exact, and leaves +1 far from the 2**64 that
# msgpack cannot pack (a claimed 2**64 - 1, adopted and incremented, broke every later store).
MAX_COUNTER = 1 << 53


def is_counter(value: Any) -> bool:
    """A plain int in 0..MAX_COUNTER (not a bool, not a float)."""
    return type(value) is int and 0 <= value <= MAX_COUNTER


class AveragingMode(str, enum.Enum):
    NODE = "node"  # contributes tensors and reduces a shard
    CLIENT = "client"  # contributes tensors, accepts no connections, reduces nothing
    AUX = "aux"  # reduces a shard, contributes no tensors (a helper with bandwidth to spare)

    @property
    def sends(self) -> bool:
        return self is not AveragingMode.AUX

    @property
    def reduces(self) -> bool:
        return self is not AveragingMode.CLIENT


@dataclass(frozen=True)
class GroupMember:
    peer_id: PeerID
    address: PeerAddress | None  # None for client-mode peers
    bandwidth: float
    mode: AveragingMode

    def to_wire(self) -> list:
        return [self.peer_id.to_bytes(), str(self.address) if self.address else None, self.bandwidth, self.mode.value]

    @classmethod
    def from_wire(cls, item: Any) -> GroupMember:
        if not (isinstance(item, list) and len(item) == 4):
            raise ValueError("group member must be [peer_id, address, bandwidth, mode]")
        raw_id, address, bandwidth, mode = item
        if not isinstance(raw_id, bytes):
            raise ValueError("peer ID must be bytes")
        peer_id = PeerID(raw_id)
        parsed = PeerAddress.parse(address) if isinstance(address, str) else None
        if address is not None and parsed is None:
            raise ValueError("address must be a string or null")
        if parsed is not None and parsed.peer_id != peer_id:
            raise ValueError("a member's address must pin the member's own peer ID")
        if not (isinstance(bandwidth, (int, float)) and math.isfinite(bandwidth) and 0 <= bandwidth <= MAX_BANDWIDTH):
            raise ValueError(f"bandwidth must be a number in 0..{MAX_BANDWIDTH:g}")
        member = cls(peer_id, parsed, float(bandwidth), AveragingMode(mode))
        if member.mode.reduces and member.address is None:
            raise ValueError("a reducing member needs an address")
        return member


@dataclass(frozen=True)
class GroupInfo:
    group_id: bytes
    members: tuple[GroupMember, ...]

    @property
    def reducers(self) -> list[GroupMember]:
        """Members that reduce a shard, in group order (client peers and zero bandwidth excluded)."""
        return [m for m in self.members if m.mode.reduces and m.bandwidth > 0]

    @property
    def senders(self) -> list[GroupMember]:
        return [m for m in self.members if m.mode.sends]

    def member(self, peer_id: PeerID) -> GroupMember | None:
        return next((m for m in self.members if m.peer_id == peer_id), None)

    def to_wire(self) -> dict:
        return {"group_id": self.group_id, "members": [m.to_wire() for m in self.members]}

    @classmethod
    def from_wire(cls, body: Any) -> GroupInfo:
        if not (isinstance(body, dict) and isinstance(body.get("group_id"), bytes)):
            raise ValueError("group description must carry a bytes group_id")
        members = body.get("members")
        if not (isinstance(members, list) and 1 <= len(members) <= MAX_GROUP_SIZE):
            raise ValueError(f"a group has 1..{MAX_GROUP_SIZE} members")
        parsed = tuple(GroupMember.from_wire(item) for item in members)
        if len({m.peer_id for m in parsed}) != len(parsed):
            raise ValueError("a peer appears twice in the group")
        if not any(m.mode.reduces and m.bandwidth > 0 for m in parsed):
            raise ValueError("a group needs at least one reducer")
        if len(body["group_id"]) > 64:
            raise ValueError("group_id too long")
        return cls(body["group_id"], parsed)
