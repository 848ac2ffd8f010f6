"""Reaching an engine's scheduler over gRPC, by the engine's name in the registry (``conveyor.engines``,
which stays free of gRPC: a scheduler imports it)."""

from __future__ import annotations

from collections.abc import Callable

from conveyor import grpc_util
from conveyor.engines import Registry
from conveyor.errors import Unavailable
from conveyor.state import Steps, op
from conveyor.v1 import scheduler_pb2_grpc


class Schedulers:
    """The schedulers' gRPC stubs by engine name, from the registry (addresses re-read at most every
    ``refresh`` seconds; channels kept per address). ``channel``: how a channel is opened, a blocking one
    (``grpc_util.internal_channel``) or one on the event loop (``grpc_util.internal_aio_channel``); its
    lookups run as the registry's store runs them."""

    def __init__(self, registry: Registry, refresh: float = 0.5,
                 channel: Callable[[str], object] = grpc_util.internal_channel):
        self.registry = registry
        self.drive = registry.drive
        self.refresh = refresh
        self.channel = channel
        self._stubs: dict[str, scheduler_pb2_grpc.SchedulerStub] = {}

    def _address(self, name: str) -> Steps[str | None]:
        for max_age in (self.refresh, 0.0):  # an engine not in a recent read: read again before giving up
            live = yield from self.registry.live.steps(self.registry, max_age)
            address = next((e.address for e in live if e.name == name), None)
            if address is not None:
                return address
        return None

    @op
    def stub(self, name: str) -> Steps[scheduler_pb2_grpc.SchedulerStub]:
        """The scheduler of engine ``name``; raises ``Unavailable`` while it is not registered."""
        address = yield from self._address(name)
        if address is None:
            raise Unavailable(f"engine {name!r} is not registered (it is down, or restarting)")
        if address not in self._stubs:
            self._stubs[address] = scheduler_pb2_grpc.SchedulerStub(self.channel(address))
        return self._stubs[address]

    @op
    def of_request(self, request_id: str) -> Steps[scheduler_pb2_grpc.SchedulerStub | None]:
        """The scheduler of the engine holding a request; None when it has no record."""
        name = yield from self.registry.engine_of.steps(self.registry, request_id)
        return None if name is None else (yield from self.stub.steps(self, name))
