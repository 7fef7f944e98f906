"""A remote expert behaves like the same module called locally, and the server rejects bad calls."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import trio
import trio.testing

from moe.client import MoEClient
from moe.experts import ExpertBackend
from moe.protocol import pack_tensors
from moe.remote import RemoteExpert
from moe.server import ExpertServer, open_expert_server
from peer import BadRequestError, BusyError, Identity, PeerID, RemoteError, Request, Router, open_peer_host

HIDDEN = 16


def make_backend(kind: str = "ffn", seed: int = 0, lr: float = 0.1) -> ExpertBackend:
    # Clipping far above these gradients' norms: the tests compare with an unclipped local module.
    return ExpertBackend.create(
        kind,
        HIDDEN,
        optimizer=lambda params: torch.optim.SGD(params, lr=lr),
        device="cpu",
        seed=seed,
        clip_grad_norm=1e6,
    )


@pytest.mark.parametrize("kind", ["ffn", "transformer"])
async def test_remote_expert_matches_local_module(kind: str) -> None:
    backend = make_backend(kind)
    local = copy.deepcopy(backend.module)
    async with open_peer_host(Identity.generate()) as server_host, open_peer_host(Identity.generate()) as client_host:
        async with open_expert_server(server_host, {"ffn.0.0": backend}, max_batch_size=64):
            client = MoEClient.current(client_host)
            expert = RemoteExpert("ffn.0.0", server_host.listen_address, client, timeout=10)
            shape = (5, HIDDEN) if kind == "ffn" else (3, 4, HIDDEN)
            x = torch.randn(*shape)

            def remote_step():
                xr = x.clone().requires_grad_(True)
                out = expert(xr)
                (out * out).sum().backward()
                return out.detach(), xr.grad

            out_remote, grad_remote = await trio.to_thread.run_sync(remote_step)

    xl = x.clone().requires_grad_(True)
    out_local = local(xl)
    (out_local * out_local).sum().backward()
    torch.testing.assert_close(out_remote, out_local.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(grad_remote, xl.grad, atol=1e-5, rtol=0)
    # The server applied one SGD step with the same parameter gradients the local module got.
    for remote_param, local_param in zip(backend.module.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(
            remote_param.detach(), local_param.detach() - 0.1 * local_param.grad, atol=1e-5, rtol=0
        )
    assert backend.steps == 1


async def test_inference_does_not_train() -> None:
    backend = make_backend()
    before = copy.deepcopy(backend.module.state_dict())
    async with open_peer_host(Identity.generate()) as server_host, open_peer_host(Identity.generate()) as client_host:
        async with open_expert_server(server_host, {"ffn.0.0": backend}):
            expert = RemoteExpert("ffn.0.0", server_host.listen_address, MoEClient.current(client_host))

            def infer():
                with torch.no_grad():
                    return expert(torch.randn(3, HIDDEN))

            out = await trio.to_thread.run_sync(infer)
    assert out.shape == (3, HIDDEN)
    assert backend.steps == 0
    assert all(torch.equal(before[name], value) for name, value in backend.module.state_dict().items())


async def test_malformed_requests_get_clear_errors_and_server_keeps_serving() -> None:
    backend = make_backend()
    async with open_peer_host(Identity.generate()) as server_host, open_peer_host(Identity.generate()) as client_host:
        async with open_expert_server(server_host, {"ffn.0.0": backend}, max_batch_size=8):
            address = server_host.listen_address

            async def forward(uid: str, tensor: torch.Tensor, **extra):
                headers, payload = pack_tensors([tensor])
                body = {"uid": uid, "tensors": headers, **extra}
                return await client_host.call(address, "moe.forward", body, payload=payload, timeout=5)

            cases = [
                ("ffn.0.0", torch.randn(2, HIDDEN + 1), "shape [batch, 16]"),
                ("ffn.0.0", torch.randn(2, 2, HIDDEN), "shape [batch, 16]"),
                ("ffn.0.0", torch.randn(2, HIDDEN, dtype=torch.float64), "must be float32"),
                ("ffn.0.0", torch.randint(0, 5, (2, HIDDEN)), "must be float32"),
                ("ffn.0.0", torch.randn(9, HIDDEN), "exceeds max_batch_size 8"),
                ("ffn.9.9", torch.randn(2, HIDDEN), "unknown expert 'ffn.9.9'"),
            ]
            for uid, tensor, expected in cases:
                with pytest.raises(BadRequestError, match=expected.replace("[", r"\[").replace("]", r"\]")):
                    await forward(uid, tensor)
            # Garbage bodies and payloads.
            with pytest.raises(BadRequestError, match="body must be a map"):
                await client_host.call(address, "moe.forward", [1, 2], timeout=5)
            with pytest.raises(BadRequestError, match="payload has"):
                headers, _ = pack_tensors([torch.randn(2, HIDDEN)])
                await client_host.call(
                    address, "moe.forward", {"uid": "ffn.0.0", "tensors": headers}, payload=b"x" * 7, timeout=5
                )
            with pytest.raises(BadRequestError, match="expected 2 tensor"):
                headers, payload = pack_tensors([torch.randn(2, HIDDEN)])
                await client_host.call(
                    address, "moe.backward", {"uid": "ffn.0.0", "tensors": headers}, payload=payload, timeout=5
                )
            with pytest.raises(BadRequestError, match="grad_outputs shape"):
                headers, payload = pack_tensors([torch.randn(2, HIDDEN), torch.randn(3, HIDDEN)])
                await client_host.call(
                    address, "moe.backward", {"uid": "ffn.0.0", "tensors": headers}, payload=payload, timeout=5
                )
            # Still serving: a good call succeeds.
            reply = await forward("ffn.0.0", torch.randn(2, HIDDEN))
            assert reply.body["tensors"][0]["shape"] == [2, HIDDEN]
            info = await client_host.call(address, "moe.info", {"uid": "ffn.0.0"}, timeout=5)
            assert info.body["sample_shape"] == [HIDDEN] and info.body["max_batch_size"] == 8


async def test_concurrent_requests_are_batched() -> None:
    backend = make_backend()
    async with open_peer_host(Identity.generate()) as server_host, open_peer_host(Identity.generate()) as client_host:
        async with open_expert_server(server_host, {"ffn.0.0": backend}, max_batch_size=32) as server:
            address = server_host.listen_address
            inputs = [torch.randn(i + 1, HIDDEN) for i in range(6)]  # 21 samples in 6 requests
            outputs: dict[int, torch.Tensor] = {}

            async def forward(i: int) -> None:
                headers, payload = pack_tensors([inputs[i]])
                reply = await client_host.call(
                    address, "moe.forward", {"uid": "ffn.0.0", "tensors": headers}, payload=payload, timeout=10
                )
                outputs[i] = torch.frombuffer(bytearray(reply.payload), dtype=torch.float32).view(i + 1, HIDDEN)

            async with trio.open_nursery() as nursery:
                # Hold the compute slot until every request is queued: the expert then takes them
                # all as one batch (the same happens naturally while another batch is computing).
                async with server.compute_limiter:
                    for i in range(len(inputs)):
                        nursery.start_soon(forward, i)
                    with trio.fail_after(5):
                        while len(server.queues["ffn.0.0"]) < len(inputs):
                            await trio.sleep(0.001)
        assert server.stats == {"requests": 6, "batches": 1, "samples": 21}
    with torch.no_grad():
        for i, x in enumerate(inputs):
            torch.testing.assert_close(outputs[i], backend.module(x), atol=1e-5, rtol=0)


async def test_expert_failure_is_reported_and_server_survives() -> None:
    class Fragile(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            if (x > 100).any():
                raise RuntimeError("input out of range")
            return self.linear(x)

    backend = ExpertBackend(Fragile(), sample_shape=(HIDDEN,), device="cpu")
    async with open_peer_host(Identity.generate()) as server_host, open_peer_host(Identity.generate()) as client_host:
        async with open_expert_server(server_host, {"x.0": backend}):
            expert = RemoteExpert("x.0", server_host.listen_address, MoEClient.current(client_host), timeout=5)
            with pytest.raises(RemoteError, match="input out of range"):
                await trio.to_thread.run_sync(lambda: expert(torch.full((1, HIDDEN), 1000.0)))
            out = await trio.to_thread.run_sync(lambda: expert(torch.zeros(1, HIDDEN)))
            assert out.shape == (1, HIDDEN)


async def test_checkpoints_are_saved_and_reloaded(tmp_path) -> None:
    backend = make_backend()
    async with open_peer_host(Identity.generate()) as server_host, open_peer_host(Identity.generate()) as client_host:
        async with open_expert_server(server_host, {"ffn.0.0": backend}, checkpoint_dir=tmp_path):
            expert = RemoteExpert("ffn.0.0", server_host.listen_address, MoEClient.current(client_host))
            await trio.to_thread.run_sync(lambda: expert(torch.randn(4, HIDDEN)).sum().backward())
    assert (tmp_path / "ffn.0.0.pt").exists() and backend.steps == 1
    fresh = make_backend(seed=123)
    async with open_peer_host(Identity.generate()) as server_host:
        async with open_expert_server(server_host, {"ffn.0.0": fresh}, checkpoint_dir=tmp_path):
            pass
    assert fresh.steps == 1
    for name, value in backend.module.state_dict().items():
        assert torch.equal(fresh.module.state_dict()[name], value)


async def test_one_caller_cannot_queue_more_than_its_share_of_samples() -> None:
    """Queued requests hold their tensors until computed: beyond a few batches per caller the
    server answers Busy at once instead of holding more."""
    async with open_peer_host(Identity.generate()) as server_host, open_peer_host(Identity.generate()) as client_host:
        async with open_expert_server(server_host, {"ffn.0.0": make_backend()}, max_batch_size=4) as server:
            connection = await client_host.connect(server_host.listen_address)
            headers, payload = pack_tensors([torch.randn(4, HIDDEN)])
            outcomes: list[str] = []

            async def call() -> None:
                try:
                    await connection.call("moe.forward", {"uid": "ffn.0.0", "tensors": headers}, payload=payload)
                    outcomes.append("done")
                except BusyError:
                    outcomes.append("busy")

            calls = server.max_pending_per_peer // 4 + 2
            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    async with server.compute_limiter:  # nothing computes: every request waits queued
                        for _ in range(calls):
                            nursery.start_soon(call)
                        while outcomes.count("busy") < 2:
                            await trio.sleep(0.01)
            assert outcomes.count("busy") == 2 and outcomes.count("done") == calls - 2


async def test_a_backward_is_answered_before_the_step_and_the_next_batch_sees_the_step() -> None:
    """The caller needs only its input gradients: the server answers, then steps. A forward that
    comes meanwhile waits for the step and computes with the parameters it made."""
    release = threading.Event()

    class HeldSGD(torch.optim.SGD):
        def step(self, closure=None):
            assert release.wait(10), "the step was never released"
            return super().step(closure)

    backend = ExpertBackend.create(
        "ffn", HIDDEN, optimizer=lambda params: HeldSGD(params, lr=0.5), device="cpu", seed=0, clip_grad_norm=1e6
    )
    before = copy.deepcopy(backend.module)
    x = torch.randn(3, HIDDEN)
    async with open_peer_host(Identity.generate()) as server_host, open_peer_host(Identity.generate()) as client_host:
        async with open_expert_server(server_host, {"ffn.0.0": backend}) as server:
            address = server_host.listen_address
            headers, payload = pack_tensors([torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)])
            with trio.fail_after(5):  # held forever if the reply waited for the step
                reply = await client_host.call(
                    address, "moe.backward", {"uid": "ffn.0.0", "tensors": headers}, payload=payload, timeout=5
                )
            assert reply.body["tensors"][0]["shape"] == [4, HIDDEN] and backend.steps == 0
            outputs = []

            async def forward() -> None:
                headers, payload = pack_tensors([x])
                reply = await client_host.call(
                    address, "moe.forward", {"uid": "ffn.0.0", "tensors": headers}, payload=payload, timeout=5
                )
                outputs.append(torch.frombuffer(bytearray(reply.payload), dtype=torch.float32).view(3, HIDDEN))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(forward)
                with trio.fail_after(5):
                    while len(server.queues["ffn.0.0"]) < 1:  # queued behind the held step
                        await trio.sleep(0.001)
                release.set()
    assert backend.steps == 1
    with torch.no_grad():
        torch.testing.assert_close(outputs[0], backend.module(x), atol=1e-6, rtol=0)
        assert not torch.allclose(outputs[0], before(x), atol=1e-3)


async def test_the_server_computes_one_sample_and_a_batch_and_steps_on_one_thread_off_its_loop() -> None:
    """Only one thread of the server starts PyTorch's parallel work: OpenMP keeps a team of helper
    threads per thread that does, and a second team slows every parallel region of both
    (``peer.worker_threads.ComputeThread``)."""
    backend = make_backend()
    computed_on: list[tuple[str, int]] = []
    backend.module.register_forward_pre_hook(lambda *_: computed_on.append(("forward", threading.get_ident())))
    backend.module.register_full_backward_pre_hook(lambda *_: computed_on.append(("backward", threading.get_ident())))
    backend.optimizer.register_step_pre_hook(lambda *_: computed_on.append(("step", threading.get_ident())))
    async with open_peer_host(Identity.generate()) as server_host, open_peer_host(Identity.generate()) as client_host:
        async with open_expert_server(server_host, {"ffn.0.0": backend}, max_batch_size=512) as server:
            expert = RemoteExpert("ffn.0.0", server_host.listen_address, MoEClient.current(client_host), timeout=10)

            def calls() -> None:
                with torch.no_grad():
                    expert(torch.randn(1, HIDDEN))  # one sample: the cheapest call there is
                batch = torch.randn(512, HIDDEN, requires_grad=True)
                expert(batch).sum().backward()

            await trio.to_thread.run_sync(calls)
            async with server.compute_limiter:  # (the step after the backward's reply is done)
                pass
    assert [kind for kind, _ in computed_on] == ["forward", "forward", "backward", "step"]
    threads = {thread for _, thread in computed_on}
    assert len(threads) == 1 and threads != {threading.get_ident()}


async def test_a_server_closing_during_a_backward_still_answers_it_and_steps() -> None:
    """The batch's gradient was taken: its callers get their answer and the step is applied (a
    checkpoint written as the server closes holds it)."""
    backend = make_backend()
    entered, release = threading.Event(), threading.Event()
    gradients = backend.input_gradients_per_caller

    def held(*args, **kwargs):
        entered.set()
        release.wait(10)
        return gradients(*args, **kwargs)

    backend.input_gradients_per_caller = held
    server, router = ExpertServer({"ffn.0.0": backend}), Router()
    server.register(router)
    headers, payload = pack_tensors([torch.randn(128, HIDDEN), torch.ones(128, HIDDEN)])
    body = {"uid": "ffn.0.0", "tensors": headers, "token": 1}
    replies = []

    async def call() -> None:
        with trio.fail_after(10):
            replies.append(
                await router.lookup("moe.backward", True)(Request(PeerID(b"\x01" * 20), body, payload, None))
            )

    async with trio.open_nursery() as callers:
        callers.start_soon(call)
        async with trio.open_nursery() as runners:
            runners.start_soon(server.run_expert, "ffn.0.0")
            await trio.to_thread.run_sync(entered.wait, 10)
            runners.cancel_scope.cancel()  # the server closes mid-batch
            release.set()
    assert replies[0].body["tensors"][0]["shape"] == [128, HIDDEN]
    assert backend.steps == 1 and not backend.step_pending


async def test_a_server_closing_as_a_batch_gets_the_compute_slot_leaves_the_batch_queued() -> None:
    """A batch is taken from its queue only once it will be computed: one taken and then dropped
    as the server closes would leave its callers unanswered and lose a backward's kept graph."""
    server, router = ExpertServer({"ffn.0.0": make_backend()}), Router()
    server.register(router)
    headers, payload = pack_tensors([torch.randn(4, HIDDEN)])
    body = {"uid": "ffn.0.0", "tensors": headers, "token": 1}

    async def call() -> None:
        await router.lookup("moe.forward", True)(Request(PeerID(b"\x01" * 20), body, payload, None))

    async with trio.open_nursery() as callers:
        await server.compute_limiter.acquire()  # (a batch computes: the next one waits for the slot)
        callers.start_soon(call)
        async with trio.open_nursery() as runners:
            runners.start_soon(server.run_expert, "ffn.0.0")
            await trio.testing.wait_all_tasks_blocked()
            server.compute_limiter.release()  # the slot passes to the runner as the server closes
            runners.cancel_scope.cancel()
        assert len(server.queues["ffn.0.0"]) == 1 and server.stats["batches"] == 0
        callers.cancel_scope.cancel()
