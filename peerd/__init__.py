"""The ``peerd`` program: command line, daemon, swarm launcher, trainer, tasks and status server.

It is the top floor: it composes the wire (``peer``), ``dht``, ``averaging`` and ``moe`` into one
trio process, and nothing below it imports it. Importing this package stays light (no torch): the
modules that train or host experts load torch inside the functions that need it.
"""
