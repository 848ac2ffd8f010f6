"""``python -m conveyor.healthcheck HOST:PORT [SERVICE]``: exit 0 when the service reports SERVING.

Used as the docker-compose health check of every service (no grpc_health_probe binary needed).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conveyor import grpc_util


def check(address: str, service: str = "", timeout: float = 3.0) -> bool:
    with grpc_util.internal_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if check(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else "") else 1)
