"""The graphs an expert server keeps between a forward and its backward (``moe/saved_graphs.py``):
bounded per calling peer, in total and in time, whether or not their backwards ever come.

32 forwards of 4096 x 256 that asked for gradients, and whose backwards never came, held +1.3 GB:
the server kept the graphs of the last 32 forwards of each expert, whatever they held. The same
thing scaled down, measured in the bytes the store says it holds (the graph's tensors' storages).
"""

from __future__ import annotations

import pytest
import torch
import trio

import moe.saved_graphs
from moe.experts import ExpertBackend
from moe.protocol import pack_tensors
from moe.saved_graphs import SavedGraphs
from moe.server import ExpertServer
from peer import PeerID, Request, Router
from peer.worker_threads import inline_blocking_work

HIDDEN, BATCH = 32, 64
GRAPH = 40 * HIDDEN * BATCH  # an FFN's graph: inputs, 4x hidden twice (before and after GELU), outputs


def test_a_graph_costs_what_autograd_saved_for_it_and_not_the_parameters():
    backend = ExpertBackend.create("ffn", HIDDEN, device="cpu", seed=0)
    outputs, graph = backend.forward_keeping_graph(torch.randn(BATCH, HIDDEN))
    assert graph.nbytes == GRAPH and outputs.shape == (BATCH, HIDDEN) and not outputs.requires_grad
    [grad] = backend.backward_per_caller(graph.inputs, torch.ones(BATCH, HIDDEN), [BATCH], graph)
    assert grad.shape == (BATCH, HIDDEN)


def test_budgets_evict_the_callers_own_oldest_graphs_first_then_anyones():
    graphs = SavedGraphs(per_peer=3 * GRAPH, total=5 * GRAPH, lifetime=10.0)
    for token in range(8):
        assert graphs.keep(("a", token), "a", "e", f"a{token}", GRAPH, now=0.0)
    assert graphs.held_by("a") == 3 * GRAPH and graphs.pop(("a", 4)) is None  # its 5 oldest went
    for token in range(3):
        graphs.keep(("b", token), "b", "e", f"b{token}", GRAPH, now=1.0)
    assert graphs.bytes_held == 5 * GRAPH and graphs.held_by("a") == 2 * GRAPH  # a's oldest made room
    assert not graphs.keep(("c", 0), "c", "e", "huge", 4 * GRAPH, now=1.0)  # over a caller's budget
    assert graphs.pop(("b", 2)) == "b2" and graphs.held_by("b") == 2 * GRAPH
    assert graphs.next_expiry() == 10.0 and graphs.expire(10.0) == 2  # a's: kept at 0, for 10 s
    graphs.drop_expert("e")  # its parameters changed: every graph of it is stale
    assert len(graphs) == 0 and graphs.bytes_held == 0 and graphs.next_expiry() is None


def test_even_a_tiny_graph_is_charged_a_floor():
    graphs = SavedGraphs(per_peer=4 * moe.saved_graphs.MIN_GRAPH_CHARGE)
    for token in range(100):
        graphs.keep(token, "a", "e", None, 1, now=0.0)
    assert len(graphs) == 4


async def test_forwards_whose_backwards_never_come_hold_their_budgets_then_nothing(autojump_clock, monkeypatch):
    monkeypatch.setattr(moe.saved_graphs, "GRAPH_BYTES_PER_PEER", 4 * GRAPH)
    monkeypatch.setattr(moe.saved_graphs, "GRAPH_BYTES", 6 * GRAPH)
    backend = ExpertBackend.create("ffn", HIDDEN, device="cpu", seed=0)
    forwards = []
    backend.module.register_forward_hook(lambda *_: forwards.append(1))
    server, router = ExpertServer({"ffn.0.0": backend}), Router()
    server.register(router)
    forward, backward = router.lookup("moe.forward", True), router.lookup("moe.backward", True)
    attacker, honest = PeerID(b"\x01" * 20), PeerID(b"\x02" * 20)
    inputs = torch.randn(BATCH, HIDDEN)

    def request(peer: PeerID, token: int, *tensors: torch.Tensor, grad: bool = True) -> Request:
        headers, payload = pack_tensors(list(tensors))
        body = {"uid": "ffn.0.0", "tensors": headers, "grad": grad, "token": token}
        return Request(peer, body, bytes(payload), None)

    # (the compute on the loop: under the virtual clock a compute thread's wait lets graphs expire)
    with inline_blocking_work():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run_expert, "ffn.0.0")
            nursery.start_soon(server.expire_graphs)
            for token in range(32):
                await forward(request(attacker, token, inputs))
            assert server.graphs.held_by(attacker) == 4 * GRAPH  # was 32 graphs, 32 x GRAPH
            for token in range(4):
                await forward(request(honest, token, inputs))
            assert server.graphs.bytes_held == 6 * GRAPH and server.graphs.held_by(honest) == 4 * GRAPH
            await trio.sleep(moe.saved_graphs.GRAPH_LIFETIME + 1)
            assert server.graphs.bytes_held == 0  # their lifetime is over: all dropped
            # A graph whose backward comes in time is used by it: the forward is not computed again.
            await forward(request(honest, 7, inputs))
            before = len(forwards)
            reply = await backward(request(honest, 7, inputs, torch.ones(BATCH, HIDDEN), grad=False))
            assert len(forwards) == before and reply.body["tensors"][0]["shape"] == [BATCH, HIDDEN]
            assert server.graphs.bytes_held == 0  # the step made every other graph of the expert stale
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("grad", [False, True])
async def test_a_forward_keeps_a_graph_only_when_it_asks_for_gradients(grad: bool):
    backend = ExpertBackend.create("ffn", HIDDEN, device="cpu", seed=0)
    server, router = ExpertServer({"ffn.0.0": backend}), Router()
    server.register(router)
    headers, payload = pack_tensors([torch.randn(BATCH, HIDDEN)])
    body = {"uid": "ffn.0.0", "tensors": headers, "grad": grad, "token": 1}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run_expert, "ffn.0.0")
        await router.lookup("moe.forward", True)(Request(PeerID(b"\x01" * 20), body, bytes(payload), None))
        assert server.graphs.bytes_held == (GRAPH if grad else 0)
        nursery.cancel_scope.cancel()
