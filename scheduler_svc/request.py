"""A request as the scheduler tracks it: a small state machine over its token history."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.params import RequestParams
from conveyor.state import RequestRecord


class Status(enum.Enum):
    WAITING = "waiting"  # queued: new, or preempted (its KV was freed; it will be recomputed)
    RUNNING = "running"  # holds KV blocks and is scheduled every step the budget allows
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request as its scheduler holds it. Equal only to itself: with the fields compared, finding one in the
    running list (to drop it when it ends) compared every field of the requests before it, ~0.1 ms a finish at 128
    running."""

    request_id: str
    prompt_ids: list[int]
    params: RequestParams
    stop_ids: tuple[int, ...]  # eos (unless ignore_eos) and the request's stop token ids
    arrival: float
    output_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # one entry per output token when asked
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens of prompt + output scheduled (sent to the worker to compute)
    samples_in_flight: int = 0  # sampling chunks sent whose token has not come back yet
    drafts_in_flight: int = 0  # speculation: tokens those chunks may draft (their confirmed ones extend the KV)
    # speculation's acceptance: drafts confirmed and drafts judged (each confirmed one, and the one refused that
    # ended a run), each verify step weighing as much as all before it; a prior of one confirmed in one
    spec_confirmed: float = 1.0
    spec_judged: float = 1.0
    spec_pause: int = 0  # decodes left without drafting (its drafts kept being refused)
    spec_next_pause: int = 0  # the pause after the next misses (0: the first)
    epoch: int = 0  # +1 at each preemption: results of chunks sent before it are stale
    first_token_time: float | None = None  # Unix time (recorded in Redis)
    finish_reason: str | None = None
    # monotonic timestamps for the latency metrics
    queued_at: float = 0.0  # last entered the waiting queue (submitted, or preempted)
    admitted_at: float | None = None  # first admitted to the running set
    first_token_at: float | None = None
    stopped_by_token: bool = False
    frontend: str = ""  # kept to rewrite the Redis record whole if Redis loses it
    owner: str = ""
    client_id: str = ""
    error: str | None = None  # with finish_reason "error": what failed
    # isolating a request that makes the worker fail (see ``Scheduler.step_failed``)
    suspect: bool = False  # was in a failed step: runs in steps of its own until it gets a token
    failures: int = 0  # failed steps this request is known to have caused
    engine: str = ""  # the engine holding it (kept to rewrite the Redis record whole)
    order: int = 0  # when the scheduler added it, among the requests it holds (ties of arrival)
    # prompt_logprobs: one entry per prompt token from the second, (token id, logprob, rank, alternatives);
    # filled as the chunks are computed, written to Redis with the first output token
    prompt_logprobs: list | None = None
    cached_tokens: int = 0  # tokens the prefix cache held when it was last admitted

    @classmethod
    def from_record(cls, record: RequestRecord, eos_token_ids: tuple[int, ...]) -> Request:
        """From Redis: a new request, or one in flight before a restart (recomputed from its tokens)."""
        return cls(
            record.request_id, record.prompt_ids, record.params, record.params.stop.stop_ids(eos_token_ids),
            record.arrival, output_ids=list(record.output_ids), first_token_time=record.first_token,
            frontend=record.frontend, owner=record.owner, client_id=record.client_id, engine=record.engine,
            prompt_logprobs=record.prompt_logprobs, cached_tokens=record.cached_tokens,
        )

    def to_record(self, now: float) -> RequestRecord:
        """The whole Redis record as this scheduler knows it (to restore one Redis lost)."""
        finished = self.status is Status.FINISHED
        return RequestRecord(self.request_id, self.prompt_ids, self.params, frontend=self.frontend,
                             arrival=self.arrival, status=self.status.value, num_output=len(self.output_ids),
                             first_token=self.first_token_time, finish=now if finished else None,
                             finish_reason=self.finish_reason, stopped_by_token=self.stopped_by_token, owner=self.owner,
                             output_ids=list(self.output_ids), client_id=self.client_id, error=self.error,
                             engine=self.engine, prompt_logprobs=self.prompt_logprobs if self.output_ids else None,
                             cached_tokens=self.cached_tokens)

    @property
    def scores_prompt(self) -> bool:
        """It asked for prompt_logprobs and has none yet (once the first token is out they were written)."""
        return self.params.sampling.prompt_logprobs is not None and not self.output_ids

    def keep_scores(self, first_position: int, entries: list) -> None:
        """Prompt tokens the worker scored, from ``first_position`` (a recompute scores the same ones again)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * (len(self.prompt_ids) - 1)
        self.prompt_logprobs[first_position - 1 : first_position - 1 + len(entries)] = entries

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def num_tokens(self) -> int:
        """Prompt + output: every token whose KV the worker needs before sampling the next one."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Known tokens not yet scheduled (the prompt's rest, a recompute, or the last sampled token)."""
        return self.num_tokens - self.num_computed

    def reach(self, n: int) -> int:
        """Positions this request's blocks must cover to compute ``n`` more tokens: after the ones scheduled,
        and after every draft in flight (the worker places a decode_last after the confirmed ones)."""
        return self.num_computed + n + self.drafts_in_flight

    @property
    def spec_rate(self) -> float:
        """The chance its next draft is confirmed, given the drafts before it in the step were."""
        return self.spec_confirmed / self.spec_judged

    def judge(self, drafted: int, confirmed: int) -> None:
        """A verify step's outcome into the acceptance rate: ``confirmed`` of ``drafted`` drafts, the first
        refused one (if any) ending the run."""
        self.spec_confirmed = self.spec_confirmed / 2 + confirmed
        self.spec_judged = self.spec_judged / 2 + confirmed + (confirmed < drafted)

    def forget_rate(self) -> None:
        self.spec_confirmed = self.spec_judged = 1.0

    def may_extend(self, max_model_len: int) -> bool:
        """Whether one more token can follow the ones in flight (else a decode_last would be wasted, or, after
        confirmed drafts, past the max model length)."""
        ahead = self.num_tokens + self.samples_in_flight + self.drafts_in_flight
        return len(self.output_ids) + self.samples_in_flight < self.params.stop.max_tokens and ahead < max_model_len

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end] if start < n else self.output_ids[start - n : end - n]

    def finish_check(self, max_model_len: int) -> str | None:
        """After a new token: "stop", "length" or None (the worker masks stop ids before min_tokens)."""
        if self.output_ids[-1] in self.stop_ids and len(self.output_ids) >= self.params.stop.min_tokens:
            self.stopped_by_token = True
            return "stop"
        if len(self.output_ids) >= self.params.stop.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
