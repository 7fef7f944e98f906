"""A remote expert as an ``nn.Module``: forward and backward both run on the expert's server.

The autograd graph has one node per remote call (``_RemoteExpertCall``). Its forward sends the
inputs; its backward sends the inputs with the output gradients and gets input gradients back,
while the server applies its own optimizer step to the expert's parameters. A dummy input that
requires grad makes autograd call that backward even when the inputs themselves need no gradient,
so the expert still trains (Hivemind's trick).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from peer import PeerAddress

from .client import DEFAULT_TIMEOUT, MoEClient, call_backward, call_forward, next_token

__all__ = ["RemoteExpert", "DUMMY"]

# Shared by every call; never updated (its gradient is discarded).
DUMMY = torch.empty(0, requires_grad=True)


class RemoteExpert(nn.Module):
    """Expert ``uid`` served at ``address``, called through ``client``.

    Call it from a thread that is not the client's trio loop (any thread of a plain script, or a
    ``trio.to_thread.run_sync`` worker in trio code). Raises the RPC error of a failed call
    (``RemoteError``, ``BadRequestError``, ``CallTimeoutError``, ``ConnectError``).
    """

    def __init__(self, uid: str, address: PeerAddress | str, client: MoEClient, *, timeout: float = DEFAULT_TIMEOUT):
        super().__init__()
        self.uid = uid
        self.address = PeerAddress.parse(address) if isinstance(address, str) else address
        self.client = client
        self.timeout = timeout

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return _RemoteExpertCall.apply(DUMMY, self, torch.is_grad_enabled(), inputs)

    def extra_repr(self) -> str:
        return f"uid={self.uid!r}, address={str(self.address)!r}"


class _RemoteExpertCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dummy: torch.Tensor, expert: RemoteExpert, keep_graph: bool, inputs: torch.Tensor) -> torch.Tensor:
        token = next_token()
        client = expert.client
        outputs = client.run(
            _forward, client, expert.address, expert.uid, inputs.detach(), keep_graph, token, expert.timeout
        )
        ctx.expert, ctx.token = expert, token
        ctx.save_for_backward(inputs)
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_outputs: torch.Tensor):
        (inputs,) = ctx.saved_tensors
        expert: RemoteExpert = ctx.expert
        client = expert.client
        grad_inputs = client.run(
            _backward, client, expert.address, expert.uid, inputs, grad_outputs, ctx.token, expert.timeout
        )
        return None, None, None, grad_inputs


async def _forward(client, address, uid, inputs, keep_graph, token, timeout) -> torch.Tensor:
    return await call_forward(client.host, address, uid, inputs, keep_graph=keep_graph, token=token, timeout=timeout)


async def _backward(client, address, uid, inputs, grad_outputs, token, timeout) -> torch.Tensor:
    return await call_backward(
        client.host, address, uid, inputs, grad_outputs.contiguous(), token=token, timeout=timeout
    )
