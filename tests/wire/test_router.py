"""Registration of RPC handlers: one handler per method name, shared services owned by the host."""

from __future__ import annotations

import pytest

from peer import Identity, Router, open_peer_host


async def _handler(_):
    return None


def test_a_method_name_has_one_handler_whatever_its_kind():
    router = Router()
    router.add_unary("m", _handler)
    with pytest.raises(ValueError, match="'m' is already registered"):
        router.add_unary("m", _handler)
    with pytest.raises(ValueError, match="'m' is already registered"):
        router.add_stream("m", _handler)
    assert router.lookup("m", unary=True) is _handler and router.methods == ["m"]


class EchoService:
    def __init__(self, host):
        self.host = host
        host.router.add_unary("echo", _handler)


async def test_a_host_makes_one_of_each_service_and_its_methods_register_once():
    async with open_peer_host(Identity.generate(), listen=None) as host:
        service = host.service(EchoService)
        assert host.service(EchoService) is service and service.host is host
        with pytest.raises(ValueError, match="'echo' is already registered"):
            EchoService(host)  # a second one made around the host, not through it
