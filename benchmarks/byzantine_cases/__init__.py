"""The pieces of ``benchmarks/byzantine.py``: ``attacks`` (the update that each attack from the
literature sends, as tensor arithmetic), ``shards`` (iid and label-skewed data shards) and
``swarm`` (the in-process swarm that trains under attack, in gradient and local-updates mode)."""
