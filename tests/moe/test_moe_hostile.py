"""An expert shared with callers it cannot trust: NaN and huge gradients, and a hijacked announcement.

One backward call with a NaN gradient used to make a shared expert return NaN for every caller from
then on, and one with 1e30 gradients filled Adam's second moment and froze it.
"""

from __future__ import annotations

import time

import pytest
import torch
import trio

from dht.node import DHTNode
from dht.peer_dictionary import peer_subkey
from dht.records import DHTRecord, pack
from dht.validation import SignatureValidator
from moe.announce import get_expert_addresses
from moe.client import MoEClient
from moe.experts import ExpertBackend
from moe.protocol import pack_tensors
from moe.remote import RemoteExpert
from moe.server import open_expert_server
from peer import BadRequestError, Identity, PeerAddress, open_peer_host

HIDDEN = 8


def adam_backend(**options) -> ExpertBackend:
    return ExpertBackend.create("ffn", HIDDEN, device="cpu", seed=0, **options)


async def backward_call(host, address, inputs: torch.Tensor, grads: torch.Tensor):
    headers, payload = pack_tensors([inputs, grads])
    body = {"uid": "ffn.0.0", "tensors": headers}
    return await host.call(address, "moe.backward", body, payload=payload, timeout=10)


def flat(backend: ExpertBackend) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in backend.module.parameters()]).clone()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
async def test_a_non_finite_gradient_is_refused_to_its_caller_and_the_expert_serves_on(poison: float) -> None:
    backend = adam_backend()
    before = flat(backend)
    async with open_peer_host(Identity.generate()) as server, open_peer_host(Identity.generate()) as client:
        async with open_expert_server(server, {"ffn.0.0": backend}):
            address = server.listen_address
            grads = torch.randn(4, HIDDEN)
            grads[1, 2] = poison
            with pytest.raises(BadRequestError, match="grad_outputs contain NaN or Inf"):
                await backward_call(client, address, torch.randn(4, HIDDEN), grads)
            inputs = torch.randn(4, HIDDEN)
            inputs[0, 0] = poison
            with pytest.raises(BadRequestError, match="inputs contain NaN or Inf"):
                await backward_call(client, address, inputs, torch.randn(4, HIDDEN))
            assert torch.equal(flat(backend), before)  # nothing of either call was learned
            # Everyone else is served finite results, and training goes on.
            expert = RemoteExpert("ffn.0.0", address, MoEClient.current(client), timeout=10)
            out = await trio.to_thread.run_sync(lambda: expert(torch.randn(3, HIDDEN)))
            assert torch.isfinite(out).all()
            reply = await backward_call(client, address, torch.randn(4, HIDDEN), torch.randn(4, HIDDEN))
            assert reply.body["tensors"][0]["shape"] == [4, HIDDEN]
    assert backend.steps == 1 and torch.isfinite(flat(backend)).all() and not torch.equal(flat(backend), before)


async def test_a_huge_gradient_moves_the_expert_one_clipped_step_and_does_not_freeze_it() -> None:
    backend = adam_backend()
    async with open_peer_host(Identity.generate()) as server, open_peer_host(Identity.generate()) as client:
        async with open_expert_server(server, {"ffn.0.0": backend}) as expert_server:
            address = server.listen_address
            await backward_call(client, address, torch.randn(4, HIDDEN), torch.full((4, HIDDEN), 1e30))
            async with expert_server.compute_limiter:  # the step runs after the reply, holding it
                pass
            second_moments = [s["exp_avg_sq"] for s in backend.optimizer.state.values()]
            assert all(torch.isfinite(m).all() and m.max() <= 1.0 for m in second_moments)
            # An honest caller's gradients still move the expert by about a learning rate per step
            # (frozen, Adam's steps would be ~1e-30 / sqrt(1e60) = 0).
            for _ in range(3):
                before = flat(backend)
                await backward_call(client, address, torch.randn(4, HIDDEN), torch.randn(4, HIDDEN))
                async with expert_server.compute_limiter:
                    pass
                assert (flat(backend) - before).abs().max() > 1e-4
    assert torch.isfinite(flat(backend)).all()


def test_one_caller_in_a_batch_cannot_take_over_the_step_or_the_others_gradients() -> None:
    """Per-caller clipping: in a batch of two callers, one sending 1e20 gradients moves the expert by
    at most one clipped step, and the other's input gradient is what it would get alone."""
    backend = ExpertBackend.create(
        "ffn", HIDDEN, optimizer=lambda params: torch.optim.SGD(params, lr=1.0), device="cpu", seed=0
    )
    alone = ExpertBackend.create("ffn", HIDDEN, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), device="cpu", seed=0)
    honest_x, honest_g = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    hostile_x, hostile_g = torch.randn(2, HIDDEN), torch.full((2, HIDDEN), 1e20)
    before = flat(backend)
    hostile, honest = backend.backward_per_caller(
        torch.cat([hostile_x, honest_x]), torch.cat([hostile_g, honest_g]), [2, 3]
    )
    assert float((flat(backend) - before).norm()) <= backend.clip_grad_norm * 1.0001  # lr 1: step = clipped gradient
    torch.testing.assert_close(honest, alone.backward(honest_x, honest_g), atol=1e-5, rtol=1e-5)
    assert hostile.shape == hostile_x.shape and backend.steps == 1


async def test_an_expert_announcement_cannot_be_hijacked() -> None:
    """An attacker stores the owner's announcement of ``ffn.0.0`` with its own address (signed with
    its own key, or not at all): every node refuses it, and clients call the owner."""
    attacker = Identity.generate()
    async with DHTNode.open() as storage, DHTNode.open(initial_peers=[storage.address]) as owner_node:
        async with open_expert_server(owner_node.host, {"ffn.0.0": adam_backend()}, dht=owner_node):
            expiration = time.time() + 3600
            forged_value = pack(str(PeerAddress("127.0.0.66", 9, attacker.peer_id)))
            for key, coordinate in (("ffn.", 0), ("ffn.0.", 0)):
                owned = pack([coordinate, peer_subkey(owner_node.host.identity.public_key)])
                attackers = pack([coordinate, peer_subkey(attacker.public_key)])
                signed = SignatureValidator(attacker).sign(DHTRecord(pack(key), attackers, forged_value, expiration))
                async with open_peer_host(attacker, listen=None) as host:
                    for node in (storage, owner_node):
                        for value in (signed, forged_value):
                            connection = await host.connect(node.address)
                            reply = await connection.call(
                                "dht.store", [[pack(key), owned, value, expiration]], timeout=10
                            )
                            assert reply.body == [False]
            async with DHTNode.open(initial_peers=[storage.address], client_mode=True) as reader:
                with trio.fail_after(10):
                    found = await get_expert_addresses(reader, ["ffn.0.0"])
            assert found["ffn.0.0"] is not None and found["ffn.0.0"].peer_id == owner_node.peer_id


def test_many_small_requests_from_one_peer_cost_one_backward_pass_not_one_each() -> None:
    """Clipping is per calling peer: one peer's 64 one-row requests in a batch are one caller (one
    pass through the batch's graph), another peer's requests a second; each still gets its rows."""
    from moe.batching import Job
    from moe.server import Work, compute_batch
    from peer import PeerID

    backend = adam_backend()
    passes = []
    per_caller = backend.input_gradients_per_caller

    def counting(inputs, grads, sizes, saved=None):
        passes.append(len(sizes))
        return per_caller(inputs, grads, sizes, saved)

    backend.input_gradients_per_caller = counting
    spammer, other = PeerID(b"\x01" * 20), PeerID(b"\x02" * 20)
    rows = [(spammer, 1)] * 64 + [(other, 3)] + [(spammer, 1)] * 8
    batch = [
        Job("backward", size, Work([torch.randn(size, HIDDEN), torch.randn(size, HIDDEN)], None, False, None, caller))
        for caller, size in rows
    ]
    results, _ = compute_batch(backend, batch)
    assert passes == [2]  # two peers, two passes (was 73)
    assert [r.shape[0] for r in results] == [size for _, size in rows]
    assert backend.step() and backend.steps == 1
