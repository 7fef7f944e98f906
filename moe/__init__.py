"""Mixture of experts over the swarm: expert servers and remote experts (planned)."""
