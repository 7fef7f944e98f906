"""Processes for ``benchmarks/wan.py``: each runs inside a lab namespace and prints JSON lines."""
