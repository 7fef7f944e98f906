"""The pieces of ``benchmarks/hostile.py``, a catalogue of attacks against a real ``peerd join``.

``target`` starts and watches the process under attack, ``attacker`` holds the attacker's
hand-written connection and DHT record helpers, ``bench`` the run's settings, a case's outcome and
the shared targets; the cases live in ``crash``, ``memory``, ``pins``, ``admission``, ``records``,
``contacts``, ``averaging`` and ``sybil``.
"""
