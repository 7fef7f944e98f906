"""Each library module's tests can be found from its name: ``tests/INDEX.md`` lists, for every
module, the test files that import it or name it, and it is kept current."""

from __future__ import annotations

from tests.support.module_index import INDEX, index, modules_of, render


def test_the_index_is_current():
    assert INDEX.read_text() == render(index()), "run: python -m tests.support.module_index"


def test_every_library_module_has_a_test():
    assert [module for module, tests in index().items() if not tests] == []


def test_imports_reexports_and_names_count():
    modules = {"peerd.tasks", "peerd.task_types", "peer.host", "dht.node"}
    exported = {"peerd.tasks": {"ShardSpec": "peerd.task_types"}, "peer": {"PeerHost": "peer.host"}}
    assert modules_of("from peerd.tasks import ShardSpec\n", modules, exported) == {"peerd.tasks", "peerd.task_types"}
    assert modules_of("from peer import PeerHost\n", modules, exported) == {"peer.host"}
    assert modules_of('"""Drives ``dht/node.py``."""\n', modules, exported) == {"dht.node"}
    assert modules_of("import torch\nfrom peer import Other\n", modules, exported) == set()
