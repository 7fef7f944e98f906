"""Mixtures over expert servers found through the DHT: training, and surviving a dead server."""

from __future__ import annotations

import copy
from contextlib import asynccontextmanager

import torch
import trio

from dht.node import DHTNode
from moe.announce import get_expert_addresses
from moe.client import MoEClient
from moe.experts import ExpertBackend
from moe.mixture import RemoteMixtureOfExperts, RemoteSwitchMixtureOfExperts
from moe.protocol import expand_expert_pattern
from moe.server import open_expert_server

HIDDEN = 8


def backends(pattern: str, seed: int) -> dict[str, ExpertBackend]:
    return {
        uid: ExpertBackend.create(
            "ffn", HIDDEN, optimizer=lambda p: torch.optim.SGD(p, lr=0.05), device="cpu", seed=seed + i
        )
        for i, uid in enumerate(expand_expert_pattern(pattern))
    }


class ExpertServerTask:
    """An expert server with its own DHT node in its own task, so a test can kill it."""

    def __init__(self, experts: dict[str, ExpertBackend]):
        self.experts = experts
        self.scope = trio.CancelScope()
        self.stopped = trio.Event()
        self.node: DHTNode | None = None

    async def run(self, initial_peers, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self.scope:
                async with DHTNode.open(initial_peers=initial_peers) as node:
                    self.node = node
                    async with open_expert_server(node.host, self.experts, dht=node, heartbeat_period=30):
                        task_status.started(node.address)
                        await trio.sleep_forever()
        finally:
            self.stopped.set()

    async def kill(self) -> None:
        self.scope.cancel()
        await self.stopped.wait()


@asynccontextmanager
async def two_servers_and_a_client():
    first = ExpertServerTask(backends("ffn.[0:1].[0:2]", seed=0))
    second = ExpertServerTask(backends("ffn.[1:2].[0:2]", seed=10))
    async with trio.open_nursery() as nursery:
        address = await nursery.start(first.run, [])
        await nursery.start(second.run, [address])
        async with DHTNode.open(initial_peers=[address], client_mode=True) as client_node:
            client = MoEClient.current(client_node.host, dht=client_node)
            yield first, second, client
        nursery.cancel_scope.cancel()


def make_model(client: MoEClient, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    mixture = RemoteMixtureOfExperts(
        in_features=HIDDEN, grid_size=(2, 2), uid_prefix="ffn", client=client, forward_timeout=5, **options
    )
    return torch.nn.Sequential(torch.nn.Linear(4, HIDDEN), mixture, torch.nn.Linear(HIDDEN, 1))


async def test_experts_are_announced_in_the_dht() -> None:
    async with two_servers_and_a_client() as (first, second, client):
        found = await get_expert_addresses(client.dht, ["ffn.0.0", "ffn.0.1", "ffn.1.1", "ffn.3.3"])
    assert found["ffn.0.0"] == found["ffn.0.1"] == first.node.address
    assert found["ffn.1.1"] == second.node.address
    assert found["ffn.3.3"] is None


async def test_training_through_a_mixture_updates_experts_and_lowers_loss() -> None:
    torch.manual_seed(1)
    x = torch.randn(32, 4)
    y = x.sum(dim=1, keepdim=True).tanh()
    async with two_servers_and_a_client() as (first, second, client):
        experts = {**first.experts, **second.experts}
        before = {uid: copy.deepcopy(b.module.state_dict()) for uid, b in experts.items()}
        model = make_model(client, k_best=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

        def train(steps: int) -> list[float]:
            losses = []
            for _ in range(steps):
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            return losses

        losses = await trio.to_thread.run_sync(train, 8)
    assert losses[-1] < losses[0] * 0.9, losses
    changed = [
        uid
        for uid, backend in experts.items()
        if any(not torch.equal(before[uid][k], v) for k, v in backend.module.state_dict().items())
    ]
    assert len(changed) >= 2 and all(b.steps > 0 for uid, b in experts.items() if uid in changed)
    assert model[0].weight.grad is not None  # gradients flowed through the experts to the layer below


async def test_killing_one_server_mid_training_masks_its_experts() -> None:
    torch.manual_seed(2)
    x = torch.randn(16, 4)
    y = x.sum(dim=1, keepdim=True).tanh()
    async with two_servers_and_a_client() as (first, second, client):
        # k_best=3 of 4 experts: every sample always has at least one expert on each server.
        model = make_model(client, k_best=3, k_min=1, timeout_after_k_min=0.5)
        mixture: RemoteMixtureOfExperts = model[1]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

        def step() -> float:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss.item()

        for _ in range(2):
            await trio.to_thread.run_sync(step)
        assert bool(mixture.last_alive.all())
        await second.kill()  # its experts stay announced in the DHT until their TTL: calls to them fail

        def step_and_check() -> tuple[float, torch.Tensor]:
            hidden = model[0](x).detach()
            with torch.no_grad():
                out = mixture(hidden)
            alive, matches = mixture.last_alive, mixture.last_matches
            # Expected: the surviving experts' outputs, weighted by a softmax over their scores only.
            scores = list(mixture.proj(hidden).split((2, 2), dim=-1))
            expected = torch.zeros_like(out)
            for sample, row in enumerate(matches):
                live = [(m, i) for i, m in enumerate(row) if alive[sample, i]]
                assert live and all(m.uid.startswith("ffn.0.") for m, _ in live)
                logits = torch.stack([scores[0][sample, m.coords[0]] + scores[1][sample, m.coords[1]] for m, _ in live])
                weights = torch.softmax(logits, dim=0)
                for weight, (m, _) in zip(weights, live, strict=True):
                    expected[sample] += weight * first.experts[m.uid].module(hidden[sample : sample + 1])[0]
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
            return step(), alive

        loss, alive = await trio.to_thread.run_sync(step_and_check)
        assert not bool(alive.all())  # the dead server's experts were chosen and masked
        losses = [loss] + [await trio.to_thread.run_sync(step) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(losses)))


async def test_too_few_experts_is_a_clear_error() -> None:
    async with two_servers_and_a_client() as (first, second, client):
        model = make_model(client, k_best=4, k_min=4, timeout_after_k_min=0.2)
        await second.kill()

        def forward():
            return model(torch.randn(2, 4))

        try:
            await trio.to_thread.run_sync(forward)
        except RuntimeError as error:
            assert "fewer than k_min=4" in str(error)
        else:
            raise AssertionError("a mixture with dead experts below k_min must fail")


async def test_switch_mixture_trains_with_balancing_loss() -> None:
    torch.manual_seed(3)
    x = torch.randn(16, HIDDEN)
    async with two_servers_and_a_client() as (first, second, client):
        switch = RemoteSwitchMixtureOfExperts(
            in_features=HIDDEN, grid_size=(2, 2), uid_prefix="ffn", client=client, forward_timeout=5
        )

        def step():
            out, balancing = switch(x)
            (out.pow(2).mean() + 0.01 * balancing).backward()
            return out, balancing

        out, balancing = await trio.to_thread.run_sync(step)
    assert out.shape == x.shape
    # Perfect balance gives 1 per grid dimension; anything routed gives a positive, finite loss.
    assert 0 < balancing.item() <= 2 * 2 + 1e-6
    assert switch.proj.weight.grad is not None and switch.proj.weight.grad.abs().sum() > 0
    assert sum(b.steps for b in {**first.experts, **second.experts}.values()) >= 1
