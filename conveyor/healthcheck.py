"""``python -m conveyor.healthcheck HOST:PORT [SERVICE] [--public]``: exit 0 when the service reports SERVING.

Used as the docker-compose health check of every service (no grpc_health_probe binary needed). Internal
services are reached as their peers reach them (mutual TLS with ``CONVEYOR_INTERNAL_TLS_DIR``);
``--public``: the frontend's public port, plain gRPC.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conveyor import grpc_util


def check(address: str, service: str = "", timeout: float = 3.0, public: bool = False) -> bool:
    """Whether ``service`` at ``address`` reports SERVING on ``grpc.health.v1`` (``public``: a plain channel, not
    the internal TLS one)."""
    with grpc.insecure_channel(address) if public else grpc_util.internal_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--public"]
    if len(args) not in (1, 2):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if check(args[0], args[1] if len(args) == 2 else "", public="--public" in sys.argv) else 1)
