"""Mixture of experts over the swarm: expert servers, remote experts and fault-tolerant mixtures.

Server side: ``ExpertBackend`` (one expert: module, optimizer, accepted input) and
``open_expert_server`` (batching, forward/backward RPCs, checkpoints, DHT heartbeat). Client side:
``MoEClient`` (where the RPCs run), ``RemoteExpert`` (one expert as an ``nn.Module``),
``RemoteMixtureOfExperts`` and ``RemoteSwitchMixtureOfExperts`` (gated mixtures over a grid of
experts found by beam search in the DHT).
"""

import importlib
from typing import Any

# Attributes load on first use (PEP 562): ``peerd`` imports ``moe.hosting`` to build its argument
# parser, and importing torch for ``peerd --version`` would cost seconds.
_LAZY = {
    "GridBeamSearch": "beam_search",
    "find_best_experts": "beam_search",
    "ExpertCallError": "client",
    "MoEClient": "client",
    "BLOCK_TYPES": "experts",
    "ExpertBackend": "experts",
    "MixtureError": "mixture",
    "RemoteMixtureOfExperts": "mixture",
    "RemoteSwitchMixtureOfExperts": "mixture",
    "RemoteExpert": "remote",
    "ExpertServer": "server",
    "open_expert_server": "server",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'moe' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)


__all__ = [
    "BLOCK_TYPES",
    "ExpertBackend",
    "ExpertServer",
    "open_expert_server",
    "MoEClient",
    "ExpertCallError",
    "RemoteExpert",
    "RemoteMixtureOfExperts",
    "RemoteSwitchMixtureOfExperts",
    "MixtureError",
    "GridBeamSearch",
    "find_best_experts",
]
