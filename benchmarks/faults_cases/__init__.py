"""Member processes for ``benchmarks/faults.py``: each runs inside a lab namespace, takes one
command per round on stdin and prints one JSON line per round on stdout."""
