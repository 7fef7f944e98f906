"""Kademlia DHT over the peer RPC: expiring, dictionary, signed and lifetime-capped records (ARCHITECTURE.md, "DHT").

Trio code: ``async with DHTNode.open(...) as node: await node.store(...); await node.get(...)``.
Scripts: ``DHT(initial_peers=[...], start=True)`` runs the node in the shared background loop.
"""

from .facade import DHT
from .lifetimes import TTLCap
from .node import DHTBootstrapError, DHTConfig, DHTError, DHTNode
from .records import DHTValue
from .validation import CompositeValidator, RecordValidator, SchemaValidator, SignatureValidator, owner_marker

__all__ = [
    "DHT",
    "DHTNode",
    "DHTConfig",
    "DHTError",
    "DHTBootstrapError",
    "DHTValue",
    "RecordValidator",
    "SignatureValidator",
    "SchemaValidator",
    "CompositeValidator",
    "TTLCap",
    "owner_marker",
]
