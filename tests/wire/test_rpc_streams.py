"""A stream needs only ``StreamTransport`` from its connection: here a recording fake stands in
for the connection, and the headers it is handed are fed to a peer's ``RPCProtocol``."""

from __future__ import annotations

import trio

from peer import Identity
from peer.rpc_protocol import RPCProtocol, StreamData, StreamEnd
from peer.rpc_streams import ClientStream, PendingCall


class RecordingTransport:
    def __init__(self, protocol: RPCProtocol):
        self.remote_peer_id = Identity.generate().peer_id
        self.protocol = protocol
        self.sent: list[tuple[bytes, bytes | None]] = []
        self.granted: list[tuple[int, int]] = []

    def enqueue(self, header, payload=None, encrypted=None) -> None:
        self.sent.append((header, bytes(payload) if payload is not None else None))
        if encrypted is not None:
            encrypted.set()  # "encrypted" at once: the stream may return

    def grant(self, call_id: int, nbytes: int, drained: bool = False) -> None:
        self.granted.append((call_id, nbytes))


def deliver(receiver: RPCProtocol, header: bytes, payload: bytes | None) -> list:
    events = receiver.receive_header(header)
    if payload:
        receiver.payload_target()[:] = payload
        events = receiver.payload_received(len(payload))
    return events


async def test_a_client_stream_sends_receives_and_ends_through_its_transport_only():
    client, server = RPCProtocol(initiator=True), RPCProtocol(initiator=False)
    call_id, header = client.open_stream("echo", None)
    deliver(server, header, None)
    transport = RecordingTransport(client)
    state = PendingCall("echo")
    stream = ClientStream(transport, call_id, "echo", state)
    assert stream.peer == transport.remote_peer_id

    await stream.send({"n": 1}, b"abc")
    [(data_header, payload)] = transport.sent
    [data] = deliver(server, data_header, payload)
    assert isinstance(data, StreamData) and data.body == {"n": 1} and data.payload == b"abc"

    [reply] = deliver(client, server.send_data(call_id, "reply", 0), None)
    state.queue.append(reply)  # as the connection's reader would
    with trio.fail_after(1):
        message = await stream.receive()
    assert message.body == "reply" and transport.granted == [(call_id, reply.cost)]

    await stream.end()
    assert deliver(server, transport.sent[-1][0], None) == [StreamEnd(call_id)]
