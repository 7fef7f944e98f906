"""Kademlia DHT over the peer RPC (see issue: DHT)."""
