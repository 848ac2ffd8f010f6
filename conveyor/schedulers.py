"""Reaching an engine's scheduler over gRPC, by the engine's name in the registry (``conveyor.engines``,
which stays free of gRPC: a scheduler imports it)."""

from __future__ import annotations

from conveyor import grpc_util
from conveyor.engines import Registry
from conveyor.errors import Unavailable
from conveyor.v1 import scheduler_pb2_grpc


class Schedulers:
    """The schedulers' gRPC stubs by engine name, from the registry (addresses re-read at most every
    ``refresh`` seconds; channels kept per address)."""

    def __init__(self, registry: Registry, refresh: float = 0.5):
        self.registry = registry
        self.refresh = refresh
        self._stubs: dict[str, scheduler_pb2_grpc.SchedulerStub] = {}

    def _address(self, name: str) -> str | None:
        for max_age in (self.refresh, 0.0):  # an engine not in a recent read: read again before giving up
            address = next((e.address for e in self.registry.live(max_age) if e.name == name), None)
            if address is not None:
                return address
        return None

    def stub(self, name: str) -> scheduler_pb2_grpc.SchedulerStub:
        """The scheduler of engine ``name``; raises ``Unavailable`` while it is not registered."""
        address = self._address(name)
        if address is None:
            raise Unavailable(f"engine {name!r} is not registered (it is down, or restarting)")
        if address not in self._stubs:
            self._stubs[address] = scheduler_pb2_grpc.SchedulerStub(grpc_util.internal_channel(address))
        return self._stubs[address]

    def of_request(self, request_id: str) -> scheduler_pb2_grpc.SchedulerStub | None:
        """The scheduler of the engine holding a request; None when it has no record."""
        name = self.registry.engine_of(request_id)
        return None if name is None else self.stub(name)
