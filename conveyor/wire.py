"""Small protobuf conversions more than one service needs (finish reasons, logprobs)."""

from __future__ import annotations

from conveyor.v1 import conveyor_pb2

FINISH_TO_PB = {
    None: conveyor_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": conveyor_pb2.FINISH_REASON_STOP,
    "length": conveyor_pb2.FINISH_REASON_LENGTH,
    "abort": conveyor_pb2.FINISH_REASON_ABORT,
    "error": conveyor_pb2.FINISH_REASON_ERROR,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


def logprobs_to_pb(token_id: int, entry) -> conveyor_pb2.TokenLogprobs:
    """``entry``: (logprob, [(token_id, logprob), ...])."""
    logprob, top = entry
    return conveyor_pb2.TokenLogprobs(
        token_id=token_id, logprob=logprob,
        top=[conveyor_pb2.TokenAlternative(token_id=t, logprob=lp) for t, lp in top],
    )
