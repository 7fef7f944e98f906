"""argparse types shared by every ``peerd`` subcommand (the daemon's, the DHT's, the experts')."""

from __future__ import annotations

import argparse

from peer import PeerAddress

__all__ = ["peer_address", "peer_list", "listen_address", "positive_float", "positive_int"]


def peer_address(text: str) -> PeerAddress:
    """``HOST:PORT`` or ``HOST:PORT/PEERID``."""
    try:
        return PeerAddress.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def peer_list(text: str) -> list[PeerAddress]:
    """One or more peer addresses separated by commas or spaces (as ``PEERD_INITIAL_PEERS``
    takes them); use with ``action="extend"`` so that a flag may also be repeated."""
    peers = [peer_address(item) for item in text.replace(",", " ").split()]
    if not peers:
        raise argparse.ArgumentTypeError("expected HOST:PORT or HOST:PORT/PEERID, got nothing")
    return peers


def listen_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` to bind; port 0 lets the OS choose, an empty host means every interface."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"bad listen address {text!r}: expected HOST:PORT (port 0 = any free port)")
    return host.strip("[]") or "0.0.0.0", int(port)


def positive_float(text: str) -> float:
    """A finite number above 0 (a rate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value


def positive_int(text: str) -> int:
    """A whole number above 0 (a count)."""
    if not (text.strip().isascii() and text.strip().isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number above 0: {text!r}")
    return int(text)
