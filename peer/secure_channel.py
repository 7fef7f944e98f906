"""The encrypted peer channel: Noise XX bound to Ed25519 identities, then AES-GCM records.

Handshake (``Noise_XX_25519_AESGCM_SHA256``, one record per Noise message):

    -> e
    <- e, ee, s, es, {responder identity}
    -> s, se, {initiator identity}

An identity payload is ``[ed25519_public_key, signature]`` where the signature covers the sender's
Noise static key, as libp2p's noise transport does: the static key is fresh per process, the
identity key proves who holds it. After the handshake each side sends one encrypted hello
(protocol version, run ID, advertised addresses, node-ID nonce and difficulty) and checks the
other's: versions, runs and node-ID difficulties must agree, and the peer's nonce must solve the
node-ID puzzle (``peer/node_id.py``) for its now authenticated peer ID at that difficulty, so every
connection knows the remote's verified DHT position. In a private swarm (``peer/access.py``) the
swarm key is mixed into the prologue, and a peer off the allowlist gets a refusal record, which
says why, in place of the hello.

Transport records use the keys and nonce format that Noise's ``Split()`` produces (AES-GCM, nonce =
4 zero bytes + 64-bit big-endian counter, no associated data) but allow 1 MiB of plaintext instead of
Noise's 64 KiB message cap, so that tensor streams pay one AEAD call and one syscall slice per MiB.
Records are strictly ordered, so a replayed, dropped or reordered record fails authentication.
"""

from __future__ import annotations

import fcntl
import math
import os
import socket
import struct
import termios

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from noise.connection import Keypair, NoiseConnection
from noise.exceptions import (
    NoiseHandshakeError,
    NoiseInvalidMessage,
    NoiseValidationError,
    NoiseValueError,
)

from .access import SwarmAccess
from .framing import AEAD_TAG_SIZE, HEADER, ProtocolError, RecordDecoder
from .hello import (
    MAX_HANDSHAKE_MESSAGE,
    AccessRefused,
    HandshakeError,
    Hello,
    HelloMismatch,
    NodeIDRefused,
    PeerIDMismatch,
    check_hello,
)
from .identity import Identity, PeerID, verify_signature
from .packing import packb, unpackb
from .receive_budget import ReceiveBudget, process_budget
from .record_cipher import TransportCipher
from .tcp_options import set_pacing_rate

__all__ = [
    "PROTOCOL_VERSION",
    "HandshakeError",
    "PeerIDMismatch",
    "HelloMismatch",
    "NodeIDRefused",
    "AccessRefused",
    "Hello",
    "SecureChannel",
    "TransportCipher",
    "secure_handshake",
]

# 2: hellos carry the node-ID proof and difficulty; DHT contacts carry nonces; records are signed
# in the new envelope. 3: a stream's OPEN says the largest message its caller accepts. 4: a DHT find
# may name the dictionary entries its asker holds; all-reduce parts may be split finer over slow
# links. 5: a side that finds a connection idle says GOAWAY (rpc_protocol.py) and both retire it.
# 6: a check's answer names the neighbour sets a centered-clip-mixed reducer mixed, and the
# matchmaking schema hash covers the reducers' rule. A peer of another version is told the
# versions differ instead of failing obscurely.
PROTOCOL_VERSION = 6
NOISE_PROTOCOL = b"Noise_XX_25519_AESGCM_SHA256"
PROLOGUE = b"peerd-noise-v1"
STATIC_KEY_CONTEXT = b"peerd-noise-static-key:"
# Long enough for a loaded volunteer machine across continents (three RTTs + key agreement),
# short enough that a connection that stalls mid-handshake frees its slot quickly.
HANDSHAKE_TIMEOUT = 10.0
# What noiseprotocol raises on garbage from the peer (it lets cryptography's and its own errors out).
_NOISE_FAILURES = (
    NoiseHandshakeError,
    NoiseInvalidMessage,
    NoiseValidationError,
    NoiseValueError,
    InvalidTag,
    ValueError,
    IndexError,
)
_INT = struct.Struct("i")  # what the queue-length ioctls fill in
_DIRECT_IO = os.name == "posix" and hasattr(os, "readv")
# Receive low-water marks while a large record is in flight (see SecureChannel.fill).
_MIN_LOW_WATER = 128 * 1024
_MAX_LOW_WATER = 512 * 1024


# Linux's SIOCOUTQNSD: bytes in the send queue not yet sent (TIOCOUTQ counts these too).
_SIOCOUTQNSD = 0x894B
# Offset of tcpi_probes (u8) in Linux's struct tcp_info: after state, ca_state, retransmits.
_TCPI_PROBES = 3


def _queued(fd: int, request: int) -> int:
    """A socket queue's length in bytes (``FIONREAD``: unread; ``TIOCOUTQ``: unacknowledged, sent
    or not; ``_SIOCOUTQNSD``: not yet sent)."""
    return _INT.unpack(fcntl.ioctl(fd, request, bytes(_INT.size)))[0]


class SecureChannel:
    """An authenticated, encrypted byte pipe of records over a trio stream.

    It alone holds the keys: every record that goes out is sealed by ``seal_into`` and every record
    that comes in is opened by ``open``/``open_into``, in the order they travel (their nonces are
    counters). Both work on the caller's buffers, so the RPC layer batches records into its send
    buffer and decrypts payloads straight into their destination without a copy."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        decoder: RecordDecoder,
        send_cipher: TransportCipher,
        receive_cipher: TransportCipher,
        remote_public_key: bytes,
        remote_hello: Hello,
        initiator: bool,
    ):
        self.stream = stream
        self.decoder = decoder
        self._send_cipher = send_cipher
        self._receive_cipher = receive_cipher
        self.remote_public_key = remote_public_key
        self.remote_peer_id = PeerID.from_public_key(remote_public_key)
        self.remote_hello = remote_hello
        self.initiator = initiator
        # With a real socket, bytes are read straight into the decoder's buffer and written
        # straight from the caller's, by plain non-blocking syscalls on the descriptor (see
        # send_all and fill); any other trio stream (tests) goes through the stream API.
        # (os.readv/os.write on a socket descriptor are POSIX only; elsewhere trio's API is used)
        self._socket = getattr(stream, "socket", None) if _DIRECT_IO else None
        # (a simulated connection tells what a socket's kernel would: ``SimStream.link_counts``)
        self._link_counts = getattr(stream, "link_counts", None)
        self._low_water = 1
        self._written = 0  # bytes handed to the kernel
        self._read = 0  # bytes taken from the kernel
        self._last_progress = (0, 0)

    # ------------------------------------------------------------------ records
    def seal_into(self, plaintext, out: memoryview) -> int:
        """Encrypt ``plaintext`` as the next outgoing record (length header + ciphertext) into the
        start of ``out``, which must hold ``len(plaintext) + HEADER.size + AEAD_TAG_SIZE`` bytes;
        return the record's size. The caller sends the records in the order they were sealed."""
        return self._send_cipher.seal_into(plaintext, out)

    def open(self, record) -> bytes:
        """The plaintext of the next incoming ``record`` (without its length header), in a new
        buffer; ProtocolError if it fails authentication (tampered, replayed or out of order)."""
        return self._receive_cipher.open(record)

    def open_into(self, record, out: memoryview) -> int:
        """Decrypt the next incoming ``record`` into the start of ``out``; return the plaintext's
        size. ProtocolError if it does not fit ``out`` or fails authentication."""
        return self._receive_cipher.open_into(record, out)

    # ------------------------------------------------------------------ the link
    def link_progress(self) -> tuple[int, int]:
        """``(delivered, arrived)``: bytes the peer's kernel has acknowledged, and bytes that
        have arrived from it (read, or waiting in our kernel's receive queue).

        Counted at the socket rather than by message: a message is only handed over whole, and a
        1 MiB record (or a 512 KiB receive low-water mark) takes seconds on a slow link, so a
        caller watching a slow peer's progress would see nothing for that long. Without a real
        socket (tests' in-memory streams) both are what passed through the stream API."""
        if self._socket is None:
            if self._link_counts is not None:
                delivered, arrived, _ = self._link_counts()
                return delivered, arrived
            return self._written, self._read
        try:
            fd = self._descriptor()
            unsent = _queued(fd, termios.TIOCOUTQ)  # not yet acknowledged by the peer
            unread = _queued(fd, termios.FIONREAD)
        except (OSError, trio.ClosedResourceError):
            # closed: the queues are gone with the socket, and what they held never moved; the
            # last counts stand (counting the unacknowledged bytes now would look like a burst)
            return self._last_progress
        self._last_progress = (max(0, self._written - unsent), self._read + unread)
        return self._last_progress

    def set_pacing_rate(self, bytes_per_s: float | None) -> bool:
        """Cap how fast the kernel sends this channel's bytes (None: no cap); False without a
        real socket (tests' in-memory streams). A relayed circuit has a TCP connection of its own
        to the relay (``relay.py``), so its cap holds for it alone."""
        if self._socket is None:
            return False
        return set_pacing_rate(self._socket, bytes_per_s)

    def in_flight(self) -> int:
        """Bytes sent on the wire that the peer's kernel has not acknowledged yet (0 without a
        real socket or a simulated connection, or once the socket is closed).

        Not the whole send queue: a peer that stops reading (its process stopped or busy) closes
        its receive window, and what we wrote then waits in our queue unsent while its kernel
        still acknowledges everything that was sent. Only bytes that went out and stay
        unacknowledged say that the path itself is down."""
        if self._socket is None:
            return self._link_counts()[2] if self._link_counts is not None else 0
        try:
            fd = self._descriptor()
            return max(0, _queued(fd, termios.TIOCOUTQ) - _queued(fd, _SIOCOUTQNSD))
        except (OSError, trio.ClosedResourceError):
            return 0

    def unanswered_probes(self) -> int:
        """Window (or keepalive) probes the kernel sent in a row that the peer's kernel left
        unanswered (``tcpi_probes``; 0 without a real socket, once it is closed, or off Linux).

        What tells a dead path from a stopped reader while nothing is in flight: the kernel keeps
        probing a closed receive window, and a live peer's kernel answers (though it may leave one
        answer out: out-of-window replies are rate limited), while a dead path answers none."""
        if self._socket is None or not hasattr(socket, "TCP_INFO"):
            return 0
        try:
            return self._socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_PROBES + 1)[_TCPI_PROBES]
        except (OSError, IndexError):
            return 0

    async def send_all(self, data: memoryview) -> None:
        """Send every byte of ``data``.

        trio's ``send_all`` passes through the scheduler after every partial write, and a bulk
        sender on loopback makes ~7 partial writes per MiB; writing until the kernel's buffer is
        full and only then waiting for it to drain saved ~6% of a bulk sender's CPU (measured,
        interleaved A/B runs). One scheduler pass per call remains, so other tasks still run."""
        if self._socket is None:
            await self.stream.send_all(data)
            self._written += len(data)
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while data:
            try:
                sent = os.write(self._descriptor(), data)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self._socket)
                waited = True
                continue
            self._written += sent
            data = data[sent:]
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()

    @property
    def can_send_now(self) -> bool:
        """Whether ``send_now`` can write at all (a real socket), so a caller may rely on it."""
        return self._socket is not None

    def send_now(self, data: memoryview) -> int:
        """Write what the kernel takes of ``data`` at once, without waiting or yielding; return how
        many bytes that was. 0 when nothing could be written: the socket buffer is full, there is
        no socket to write to directly, or the socket failed (the next ``send_all`` raises that
        error). Only for a caller that knows no ``send_all`` is in progress."""
        if self._socket is None:
            return 0
        try:
            sent = os.write(self._descriptor(), data)
        except (OSError, trio.ClosedResourceError):
            return 0
        self._written += sent  # link_progress counts these bytes like any others
        return sent

    async def fill(self, timeout: float = math.inf) -> bool:
        """Receive more bytes into the decoder; False at end of stream. Waits at most ``timeout``
        seconds for them (``trio.TooSlowError`` after that); the deadline is set up only if bytes
        are not already waiting, which in a bulk stream they are for about every other read."""
        view = self.decoder.writable()
        if self._socket is not None:
            # In the middle of a large record, ask the kernel not to wake us for every 64 KiB
            # segment: each wakeup costs an epoll round trip through trio, which dominated the
            # receive path of tensor streams. The mark is always <= what the record still needs,
            # so it can never make us wait for bytes that are not coming.
            # The mark moves in steps of _MIN_LOW_WATER rather than following ``missing`` exactly,
            # which changes it, at one setsockopt each, on fewer receives (measured on a bulk
            # stream: 6 in 10 receives instead of 7 in 10).
            missing = min(self.decoder.missing(), _MAX_LOW_WATER)
            low_water = missing - missing % _MIN_LOW_WATER or 1
            if low_water != self._low_water:
                self._low_water = low_water
                self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, low_water)
            nbytes = await self._read_into(view, timeout)
        else:
            with trio.fail_after(timeout):
                data = await self.stream.receive_some(len(view))
            nbytes = len(data)
            view[:nbytes] = data
        self.decoder.commit(nbytes)
        self._read += nbytes
        return nbytes > 0

    def _descriptor(self) -> int:
        # Asked for every time, never cached: a closed socket's number may already belong to
        # another file.
        fd = self._socket.fileno()
        if fd < 0:
            raise trio.ClosedResourceError("the connection's socket is closed")
        return fd

    async def _read_into(self, view: memoryview, timeout: float = math.inf) -> int:
        """One non-blocking read into ``view``, waiting only when nothing is there. Like send_all,
        this skips trio's scheduler pass per read (~10% of a bulk receiver's CPU, measured). It
        does not yield when bytes are waiting: the caller, which knows how much work the bytes
        made, must (``Connection._read_loop`` yields by records and bytes processed)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                return os.readv(self._descriptor(), [view])
            except BlockingIOError:
                if timeout == math.inf:
                    await trio.lowlevel.wait_readable(self._socket)
                else:
                    with trio.fail_after(timeout):
                        await trio.lowlevel.wait_readable(self._socket)

    async def send_record(self, plaintext: bytes) -> None:
        out = bytearray(HEADER.size + len(plaintext) + AEAD_TAG_SIZE)
        self._send_cipher.seal_into(plaintext, memoryview(out))
        await self.send_all(memoryview(out))

    async def receive_record(self) -> bytes:
        while (record := self.decoder.next_record()) is None:
            if not await self.fill():
                raise trio.EndOfChannel("peer closed the connection")
        return self._receive_cipher.open(record)

    async def aclose(self) -> None:
        self.decoder.release(closing=True)  # a partial record's memory goes back at once
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(self.stream)


async def _send_handshake_message(stream: trio.abc.Stream, message: bytes) -> None:
    await stream.send_all(HEADER.pack(len(message)) + message)


async def _receive_handshake_message(stream: trio.abc.Stream, decoder: RecordDecoder) -> bytes:
    while (record := decoder.next_record()) is None:
        data = await stream.receive_some(MAX_HANDSHAKE_MESSAGE)
        if not data:
            raise HandshakeError("peer closed the connection during the handshake")
        decoder.receive_data(data)
    return bytes(record)


def _identity_payload(identity: Identity, static_public: bytes) -> bytes:
    return packb([identity.public_key, identity.sign(STATIC_KEY_CONTEXT + static_public)])


def _verify_identity_payload(payload: bytes, remote_static: bytes) -> bytes:
    try:
        public_key, signature = unpackb(payload, max_size=MAX_HANDSHAKE_MESSAGE)
        valid = isinstance(public_key, bytes) and len(public_key) == 32 and isinstance(signature, bytes)
    except Exception:
        valid = False
    if not valid:
        raise HandshakeError("malformed identity in handshake")
    if not verify_signature(public_key, signature, STATIC_KEY_CONTEXT + remote_static):
        raise HandshakeError("peer's identity signature over its Noise key is invalid")
    return public_key


async def secure_handshake(
    stream: trio.abc.Stream,
    identity: Identity,
    hello: Hello,
    *,
    initiator: bool,
    expected_peer: PeerID | None = None,
    timeout: float = HANDSHAKE_TIMEOUT,
    budget: ReceiveBudget | None = None,
    access: SwarmAccess | None = None,
) -> SecureChannel:
    """Authenticate both ends and agree on keys; raise HandshakeError (or trio.TooSlowError).
    ``access``: a private swarm's allowlist and key (``peer/access.py``)."""
    access = access if access is not None else SwarmAccess()
    with trio.fail_after(timeout):
        noise, remote_key, leftover = await _noise_handshake(stream, identity, initiator, expected_peer, access)
        if PeerID.from_public_key(remote_key) == identity.peer_id:
            raise HandshakeError("connected to itself")
        decoder = RecordDecoder(budget=budget if budget is not None else process_budget())
        decoder.receive_data(leftover)
        channel = SecureChannel(
            stream,
            decoder,
            TransportCipher(noise.noise_protocol.cipher_state_encrypt.k),
            TransportCipher(noise.noise_protocol.cipher_state_decrypt.k),
            remote_key,
            hello,  # replaced below once the peer's hello arrives
            initiator,
        )
        channel.remote_hello = await _exchange_hellos(channel, hello, access)
        return channel


async def _noise_handshake(
    stream: trio.abc.Stream, identity: Identity, initiator: bool, expected_peer: PeerID | None, access: SwarmAccess
) -> tuple[NoiseConnection, bytes, bytes]:
    """The three Noise XX messages with their identity payloads: the finished Noise state, the
    peer's identity key, and whatever bytes arrived after the last handshake message."""
    noise = NoiseConnection.from_name(NOISE_PROTOCOL)
    if initiator:
        noise.set_as_initiator()
    else:
        noise.set_as_responder()
    static_private = AESGCM.generate_key(bit_length=256)  # 32 random bytes: a fresh X25519 secret
    noise.set_keypair_from_private_bytes(Keypair.STATIC, static_private)
    noise.set_prologue(access.prologue(PROLOGUE))
    noise.start_handshake()
    static_public = noise.noise_protocol.keypairs["s"].public_bytes
    # noiseprotocol drops its handshake state when the last message is processed; keep a reference
    # to read the remote static key afterwards.
    handshake_state = noise.noise_protocol.handshake_state
    our_payload = _identity_payload(identity, static_public)
    decoder = RecordDecoder(max_record_size=MAX_HANDSHAKE_MESSAGE, initial_size=2 * MAX_HANDSHAKE_MESSAGE)
    try:
        if initiator:
            await _send_handshake_message(stream, bytes(noise.write_message()))
            remote_payload = noise.read_message(await _receive_handshake_message(stream, decoder))
            remote_key = _verify_identity_payload(bytes(remote_payload), handshake_state.rs.public_bytes)
            remote_id = PeerID.from_public_key(remote_key)
            if expected_peer is not None and remote_id != expected_peer:
                raise PeerIDMismatch(
                    f"peer ID mismatch: expected {expected_peer}, but the peer is {remote_id}", remote_id
                )
            await _send_handshake_message(stream, bytes(noise.write_message(our_payload)))
        else:
            noise.read_message(await _receive_handshake_message(stream, decoder))
            await _send_handshake_message(stream, bytes(noise.write_message(our_payload)))
            remote_payload = noise.read_message(await _receive_handshake_message(stream, decoder))
            remote_key = _verify_identity_payload(bytes(remote_payload), handshake_state.rs.public_bytes)
    except _NOISE_FAILURES as error:
        hint = (
            "; the peer may not hold this swarm's key"
            if access.swarm_key is not None
            else "; the peer may be in a private swarm that needs a swarm key"
        )
        raise HandshakeError(f"Noise handshake failed: {error}{hint}") from None
    except ProtocolError as error:
        raise HandshakeError(f"bad handshake framing: {error}") from None
    assert noise.handshake_finished
    return noise, remote_key, decoder.take_buffered()


async def _exchange_hellos(channel: SecureChannel, hello: Hello, access: SwarmAccess) -> Hello:
    """Send our hello and return the peer's, checked against ours; or, to a peer that a private
    swarm's allowlist does not admit, send the refusal instead and raise AccessRefused."""
    remote_id = channel.remote_peer_id
    refusal = access.refusal(remote_id)
    if refusal is not None:
        await channel.send_record(packb({"refused": refusal}))
        # Read the peer's hello before closing: a socket closed with unread data sends a reset,
        # which can destroy the refusal before the peer reads it.
        with trio.move_on_after(1.0):
            try:
                await channel.receive_record()
            except (ProtocolError, trio.EndOfChannel, trio.BrokenResourceError):
                pass
        raise AccessRefused(f"refused peer {remote_id}: {refusal}")
    await channel.send_record(hello.encode())
    try:
        remote_hello = Hello.decode(await channel.receive_record())
    except (ProtocolError, trio.EndOfChannel) as error:
        raise HandshakeError(f"peer {remote_id} closed or garbled the hello: {error}") from None
    check_hello(hello, remote_hello, remote_id)
    return remote_hello
