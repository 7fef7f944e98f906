"""Suite-wide pytest hooks: slow soak/scale tests run only with ``--run-slow``, and the heap that
collection loaded is frozen before the first test (see ``pytest_collection_finish``); every
``peerd`` process a test starts runs at the local node-ID difficulty, as the in-process peers do,
and default key files land in a data directory of the test run's own, never the user's. The
``netlab`` and ``nat_netlab`` fixtures give a test its own network of namespaces (tests/support/netlab.py)."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer import LOCAL_DIFFICULTY
from tests.support.netlab import Lab, lab_unavailable, remove_leftovers

# A public run's default (2**24 hashes, ~10 s per fresh key) would make each process start slow,
# and a peer of another difficulty could not talk to the tests' own (LOCAL_DIFFICULTY) peers.
os.environ.setdefault("PEERD_NODE_ID_DIFFICULTY", str(LOCAL_DIFFICULTY))
# Commands that fall back to default key paths ($XDG_DATA_HOME/peerd/...) must not write into the
# home directory of whoever runs the tests.
_DATA_HOME = tempfile.mkdtemp(prefix="peerd-tests-data-")
os.environ["XDG_DATA_HOME"] = _DATA_HOME
atexit.register(shutil.rmtree, _DATA_HOME, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run soak and scale tests marked slow")


# Tests that build network-lab namespaces: the suite runs on two workers (pyproject's addopts), and
# these all go to one of them, one lab at a time, because a lab's five shaped peers already take both
# cores of a CI machine. Those using a lab fixture are found here; a test whose benchmark subprocess
# builds the lab carries ``LAB_GROUP`` itself (tests/benchmarks).
LAB_FIXTURES = {"netlab", "nat_netlab"}
LAB_GROUP = pytest.mark.xdist_group("netlab")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if set(getattr(item, "fixturenames", ())) & LAB_FIXTURES:
            item.add_marker(LAB_GROUP)
    if config.getoption("--run-slow"):
        return
    skip_slow = pytest.mark.skip(reason="slow soak/scale test: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection loaded (every test module, torch, ...), as ``peerd join`` freezes
    its start-up heap: otherwise each full garbage collection walks all of it, ~0.1-0.3 s with
    every event loop in the process stopped, and timing tests fail for reasons outside the code
    they test."""
    gc.collect()
    gc.freeze()


def _open_lab(request: pytest.FixtureRequest, tmp_path: Path, nat: bool) -> Iterator[Lab]:
    reason = lab_unavailable(nat=nat)
    if reason is not None:
        # CI runs as root with the tools installed: there a lab test that would skip is a failure
        if os.environ.get("PEERD_REQUIRE_NETLAB") == "1":
            pytest.fail(f"PEERD_REQUIRE_NETLAB=1 but {reason}")
        pytest.skip(reason)
    remove_leftovers()  # namespaces of an interrupted earlier run
    tag = "".join(char for char in request.node.name.removeprefix("test_") if char.isalnum())[:16] or "lab"
    with Lab(tmp_path, tag=tag) as lab:
        yield lab


@pytest.fixture
def netlab(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Lab]:
    """A private network of namespaces (needs root, ip and tc), removed after the test."""
    yield from _open_lab(request, tmp_path, nat=False)


@pytest.fixture
def nat_netlab(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Lab]:
    """``netlab`` that can also build NAT routers (needs nft as well)."""
    yield from _open_lab(request, tmp_path, nat=True)
