"""Continuous batching: what each engine step computes, and what its results change.

Each step has two limits: ``max_num_batched_tokens`` (tokens one forward may process) and the
free KV blocks; ``max_num_seqs`` caps the running set. Requests carry a priority (lower first, as
vLLM); the waiting queue and the running set are both ordered by (priority, arrival). A step goes
through the priority classes best first, and in each (vLLM v1's order within one class):

1. Its running requests, oldest first: one decode token each, or the next chunk of a prompt that is
   still being prefilled. A request that needs a block when none is free makes the *last* running
   request (the lowest priority, the newest) give up its blocks (preemption: it goes back to the
   queue in its place by priority and arrival, and is recomputed from prompt + tokens so far when
   readmitted; its full blocks stay in the prefix cache). A request the token budget cannot reach
   this step simply sits out and keeps its blocks.
2. Its waiting requests, first come first served, while budget, sequence cap and blocks allow; a
   request that lacks blocks or a sequence slot preempts running requests of a *worse* priority
   (last first) to get them, so a burst of low-priority work delays a high-priority request by one
   step at most. Admission stops at the first request that cannot be admitted (no overtaking within
   a class, so equal priorities cannot starve) and in a step that had to preempt to grow. A long
   prompt is admitted with its first chunk; its cached prefix (``block_manager``) is not computed.

Finished, aborted and preempted requests free their blocks at once; the worker is told to forget
them in the next step. Nothing here does I/O.

Steps may be scheduled before the results of the previous one are back (the engine keeps the
worker's queue one step ahead): tokens count as computed when scheduled, and a request whose
sample is still in flight decodes "the token the worker sampled last" (``decode_last``). When the
results come back, a request that has meanwhile finished, been aborted or preempted (its
``epoch`` moved on) has them dropped.

Speculation (``spec_tokens``): a decode may let the worker draft up to that many tokens and verify them
(``Chunk.max_drafts``); the answer brings the sampled token and the drafts the model confirmed, each the
token plain decoding would have produced. They go through the stop checks one by one (what follows a stop
is dropped), and the confirmed drafts' KV counts as computed once the answer is back. Until then a
request's blocks must reach as far as its drafts in flight could take it (``drafts_in_flight``); the room
for new drafts is only taken when free blocks allow it without preempting anyone. A step with more
running requests than ``spec_max_batch`` does not draft (a verify row then costs more than it saves), nor
does a request that opted out (``RequestParams.speculative``). Otherwise a decode drafts as many tokens as pay
for their rows: with ``rate`` the chance the request's next draft is confirmed (given the ones before it
were; a moving estimate over its verify steps), ``d`` drafts yield ``1 + rate + ... + rate**d`` tokens for
``verify_cost[d]`` times a plain decode's time (the worker measures that table at start-up), and the ``d``
with the most tokens per unit of time wins. When no ``d`` beats plain decoding (output that does not repeat
its context) the request pauses drafting for a while, twice as long each time, and then tries again.
"""

from __future__ import annotations

import time
from bisect import insort
from dataclasses import dataclass, field, replace

from conveyor.errors import ResourceExhausted
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.request import Request, Status


@dataclass(slots=True)
class Chunk:
    """One request's share of a step (becomes a worker SequenceChunk)."""

    request: Request
    token_ids: list[int]  # empty with decode_last
    start_pos: int
    new_blocks: list[int]
    sample: bool
    decode_last: bool = False  # the token is the one the worker samples in the step before
    epoch: int = 0  # the request's epoch when scheduled
    registers: bool = False  # the request's first chunk since admission (always at position 0): the worker learns of it
    cached_ids: list[int] = field(default_factory=list)  # registers after a prefix cache hit: its tokens
    max_drafts: int = 0  # speculation: tokens the worker may draft after this decode's token


@dataclass
class StepPlan:
    step: int
    chunks: list[Chunk]
    free_ids: list[str]  # the worker forgets these first
    free_all: bool = False
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.chunks or self.free_ids or self.free_all)


@dataclass
class Output:
    """What one request got in one step (new tokens and/or its end)."""

    request: Request
    first_index: int
    token_ids: list[int]
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    trim: bool = False  # output was cut back (a stop string matched): Redis must drop the tail

    @property
    def end(self) -> int:
        """The request's output length right after this Output, as it was when decided (the live list may
        have been cut back since, by a stop string: what a step writes must not read it)."""
        return self.first_index + len(self.token_ids)


@dataclass
class Answer:
    """The worker's answer to a step. ``sampled``: request id -> (token id, (logprob, alternatives) or None);
    ``scored``: request id -> (position of the first, [(token id, logprob, rank, alternatives)]), the prompt
    tokens scored for requests that asked for prompt_logprobs; ``failed``: request id -> why the worker could
    not sample it (its constraint allows no token): that request ends with the error, alone; ``accepted``:
    request id -> the drafts confirmed after its sampled token, as ``sampled``'s values; ``drafted``: request
    id -> tokens drafted for it."""

    sampled: dict[str, tuple[int, object]]
    scored: dict[str, tuple[int, list]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    accepted: dict[str, list[tuple[int, object]]] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)


SPEC_PAUSE = (4, 64)  # decodes a request then goes without drafting: the first pause, the longest (doubling)
SPEC_SKIPS = ("batch", "paused", "blocks")  # why a decode that could draft did not (Counters.spec_skipped)
# speculation's cost model when the worker measured none (a cache too small to): each drafted row costs half
# a decode, between a compute-bound CPU step (nearly a decode) and a memory-bound GPU one (nearly nothing)
DEFAULT_VERIFY_COST = (1.0, 1.5)


def extend_cost(cost: list[float], drafts: int) -> list[float]:
    """``cost`` (a verify cost table, ``cost[0] == 1``) to at least ``drafts + 1`` entries, along its last slope."""
    step = cost[-1] - cost[-2] if len(cost) > 1 else 1.0
    return cost + [cost[-1] + step * i for i in range(1, drafts + 2 - len(cost))]


def best_drafts(rate: float, cost: list[float], most: int) -> int:
    """The drafts (at most ``most``) that give the most tokens per unit of step time, when each is confirmed
    with chance ``rate`` given the ones before it were: ``d`` drafts yield ``1 + rate + ... + rate**d`` tokens for
    ``cost[d]`` times a plain decode's time. 0 when none beats plain decoding."""
    best, best_gain, expected = 0, 1.0, 1.0
    for d in range(1, most + 1):
        expected += rate**d
        if expected / cost[d] > best_gain:
            best, best_gain = d, expected / cost[d]
    return best


@dataclass
class Counters:
    steps: int = 0
    preemptions: int = 0
    aborts: int = 0
    finished: int = 0
    drafted: int = 0  # tokens drafted for verification (speculation)
    verifies: int = 0  # decodes that verified drafts
    accepted: int = 0  # of them, confirmed by the model and emitted
    spec_skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPEC_SKIPS, 0))  # decodes, by why

    def copy(self) -> Counters:
        return replace(self, spec_skipped=dict(self.spec_skipped))


class Scheduler:
    def __init__(self, blocks: BlockManager, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
                 max_waiting: int, max_step_failures: int = 3, spec_tokens: int = 0, spec_max_batch: int = 8,
                 verify_cost: list[float] | None = None):
        self.max_step_failures = max_step_failures
        self.spec_tokens = spec_tokens  # drafts a decode may verify (0: no speculation)
        self.spec_max_batch = spec_max_batch  # no drafting in a step with more running requests
        # verify_cost[d]: a decode verifying d drafts over one verifying none (the worker's Info), extended to
        # spec_tokens along its last slope
        self.verify_cost = extend_cost(list(verify_cost or DEFAULT_VERIFY_COST), spec_tokens)
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.waiting: list[Request] = []  # ordered by ``_rank``
        self.running: list[Request] = []  # ordered by ``_rank``: the last is preempted first
        self.requests: dict[str, Request] = {}
        self.to_free: list[str] = []  # told to the worker in the next step
        self.free_all = False
        self.preempted: list[Request] = []  # since the last plan (their Redis status goes back to waiting)
        self.admitted: list[Request] = []  # since the last plan (for the queue-time metric)
        self.counters = Counters()
        self._solo_turn = True  # with suspects: every other step runs one of them alone
        self._arrivals = 0  # requests added so far: breaks ties between equal arrival times

    # ------------------------------------------------------------ arrivals and departures

    def add(self, request: Request, force: bool = False) -> bool:
        """Queue a request; False if the id is already held. ``force`` skips the queue bound (recovery)."""
        if request.request_id in self.requests:
            return False
        if not force and len(self.waiting) >= self.max_waiting:
            raise ResourceExhausted(f"the waiting queue is full ({self.max_waiting} requests; --max-waiting)")
        self.requests[request.request_id] = request
        request.queued_at = time.monotonic()
        self._arrivals += 1
        request.order = self._arrivals
        insort(self.waiting, request, key=_rank)
        return True

    def abort(self, request_id: str) -> Output | None:
        """End a request now and free its blocks; its Output is for Redis and the detokenizer."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.counters.aborts += 1
        return self._finish(request, "abort")

    def forget(self, request_id: str) -> None:
        """Drop a request another engine now holds: its blocks are freed, nothing is reported."""
        request = self.requests.get(request_id)
        if request is not None:
            request.status = Status.FINISHED
            self._drop(request)

    def finish_at(self, request_id: str, num_tokens: int) -> Output | None:
        """A stop string matched after ``num_tokens`` output tokens: end the request there."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        trimmed = len(request.output_ids) > num_tokens
        del request.output_ids[num_tokens:]
        del request.logprobs[num_tokens:]
        output = self._finish(request, "stop")
        output.trim = trimmed
        return output

    def _finish(self, request: Request, reason: str) -> Output:
        request.status = Status.FINISHED
        request.finish_reason = reason
        self._drop(request)
        self.counters.finished += 1
        return Output(request, len(request.output_ids), [], finish_reason=reason)

    def _drop(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._keep_prefix(request)
        if self.blocks.release(request.request_id):  # it holds blocks: the worker knows it
            self.to_free.append(request.request_id)

    def _keep_prefix(self, request: Request) -> None:
        """Before a request's blocks are released: its full blocks stay in the prefix cache (a preempted
        request finds its own again; a conversation's next turn finds this one's)."""
        self.blocks.fill(request.request_id, request.tokens, min(request.num_computed, request.num_tokens), now=True,
                         scope=request.params.cache_scope)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._keep_prefix(request)
        self.blocks.release(request.request_id)
        self.to_free.append(request.request_id)
        request.status = Status.WAITING
        request.num_computed = 0
        request.samples_in_flight = request.drafts_in_flight = 0
        request.epoch += 1
        request.queued_at = time.monotonic()
        insort(self.waiting, request, key=_rank)
        self.preempted.append(request)
        self.counters.preemptions += 1

    def reset_worker(self) -> None:
        """The worker lost its state (restarted, or a step failed): recompute everything running."""
        for request in reversed(self.running[:]):
            self._preempt(request)
        self.blocks.clear()
        self.to_free.clear()
        self.free_all = True

    def step_failed(self, plan: StepPlan, culprit: str | None, error: str, fatal: bool = False) -> list[Output]:
        """The worker failed ``plan`` (call before ``reset_worker``). ``culprit``: the sequence the worker
        named, when it could. A request is blamed when named, or when it was alone in the step; unnamed,
        everyone in the step becomes a suspect and runs in steps of its own (``schedule``) until it gets
        a token, which finds the culprit without holding the others back. A request blamed
        ``max_step_failures`` times ends with "error"; its Output is returned. ``fatal``: the culprit's
        own data broke the step (it could not be sent): it ends at once."""
        if fatal and culprit is not None and (request := self.requests.get(culprit)) is not None:
            request.error = f"this request's data could not be sent to the worker ({error})"
            return [self._finish(request, "error")]
        involved = [c.request for c in plan.chunks if self.requests.get(c.request.request_id) is c.request]
        if culprit is not None:
            involved = [r for r in involved if r.request_id == culprit]
        blamed = involved if culprit is not None or len(involved) == 1 else []
        for request in involved:
            request.suspect = True
        failed = []
        for request in blamed:
            request.failures += 1
            if request.failures >= self.max_step_failures:
                request.error = (f"the worker failed {request.failures} steps that computed this request, the last "
                                 f"with it alone ({error}); it was stopped so the others can go on "
                                 f"(--max-step-failures {self.max_step_failures})")
                failed.append(self._finish(request, "error"))
        return failed

    def resize(self, blocks: BlockManager, max_model_len: int) -> list[Output]:
        """Use another worker's KV cache (after ``reset_worker``: no request holds blocks). Requests that
        no longer fit (their tokens so far plus one) end with "length"; their Outputs are returned."""
        if self.blocks.num_used:
            raise RuntimeError("resize with blocks in use; call reset_worker first")
        self.blocks = blocks
        self.max_model_len = max_model_len
        too_long = [r for r in self.waiting if r.num_tokens >= max_model_len]
        return [self._finish(r, "length") for r in too_long]

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.to_free or self.free_all)

    # ------------------------------------------------------------ one step

    def schedule(self) -> StepPlan:
        """Running requests first (decodes and prefill chunks), then new ones from the queue, under the
        token budget; preempts the newest when blocks run out. While some requests are suspects (they
        were in a step that failed), every other step runs one of them alone and the steps between
        leave them out."""
        suspects = [r for r in (*self.running, *self.waiting) if r.suspect]
        suspect = min(suspects, key=lambda r: r.failures) if suspects else None  # the least blamed first
        self._solo_turn = not self._solo_turn
        chunks: list[Chunk] = []
        if suspect is not None and self._solo_turn:
            chunks = self._schedule_alone(suspect)
        if not chunks:
            chunks = self._schedule_batch(self.max_num_batched_tokens)
        if not chunks and suspect is not None and not self._solo_turn:  # nothing else to run: no need to wait
            chunks = self._schedule_alone(suspect)
        self.blocks.publish()
        plan = StepPlan(self.counters.steps + 1, chunks, self.to_free, self.free_all, self.preempted, self.admitted)
        if not plan.empty:
            self.counters.steps += 1
        self.to_free, self.free_all, self.preempted, self.admitted = [], False, [], []
        return plan

    def _schedule_batch(self, budget: int) -> list[Chunk]:
        chunks: list[Chunk] = []
        admitting = True  # until a waiting request cannot be admitted, or a running one had to preempt
        for priority in sorted({r.priority for r in (*self.running, *self.waiting)}):
            for request in [r for r in self.running if r.priority == priority]:
                if budget == 0:
                    break
                if request.status is not Status.RUNNING or request.suspect:
                    continue  # preempted in this step (it was last), or running alone
                n = self._wants(request, budget)
                if not n:
                    continue
                while not self.blocks.can_grow(request.request_id, request.reach(n)):
                    victim = self.running[-1]
                    self._preempt(victim)
                    admitting = False
                    if victim is request:
                        break
                if request.status is Status.RUNNING:
                    chunks.append(self._chunk(request, n))
                    budget -= n
            for request in [r for r in self.waiting if r.priority == priority]:
                if not admitting or budget <= 0:
                    break
                if request.suspect:
                    continue
                chunk = self._admit(request, budget, make_room=True)
                if chunk is None:
                    admitting = False
                    break
                chunks.append(chunk)
                budget -= len(chunk.token_ids)
        return chunks

    def _schedule_alone(self, request: Request) -> list[Chunk]:
        """One step of ``request`` alone (it may have caused a failed step); [] when it cannot run now."""
        budget = self.max_num_batched_tokens
        if request.status is Status.RUNNING:
            n = self._wants(request, budget)
            if not n or not self.blocks.can_grow(request.request_id, request.reach(n)):
                return []
            return [self._chunk(request, n)]
        chunk = self._admit(request, budget)
        return [chunk] if chunk is not None else []

    def _wants(self, request: Request, budget: int) -> int:
        """Tokens a running request would compute this step (0: none until its sampled token is back)."""
        if request.num_pending:
            return min(request.num_pending, budget)
        if request.samples_in_flight and request.may_extend(self.max_model_len):
            return 1  # decode the token still on its way back
        return 0

    def _admit(self, request: Request, budget: int, make_room: bool = False) -> Chunk | None:
        """Move a waiting request to the running set with its first chunk, if a sequence slot and blocks
        for it are free; ``make_room``: preempt running requests of a worse priority (the last first) until
        they are. Its longest cached prefix is taken from the prefix cache, not computed (nor counted in
        ``budget``)."""
        # a request that scores its prompt computes all of it: cached blocks would skip the positions it scores
        hits = [] if request.scores_prompt else self.blocks.match(request.tokens, request.num_tokens,
                                                                   request.params.cache_scope)
        cached = len(hits) * self.blocks.block_size
        n = min(request.num_tokens - cached, budget)

        def fits() -> bool:
            return len(self.running) < self.max_num_seqs and self.blocks.can_allocate(hits, cached + n)

        while not fits():
            if not (make_room and self.running and self.running[-1].priority > request.priority):
                return None
            self._preempt(self.running[-1])
        self.blocks.allocate(request.request_id, hits, cached + n)
        self.waiting.remove(request)
        request.status = Status.RUNNING
        request.num_computed = request.cached_tokens = cached
        self.admitted.append(request)
        insort(self.running, request, key=_rank)
        return self._chunk(request, n, registers=True)

    def _drafts(self, request: Request, n: int, registers: bool) -> int:
        """Tokens a decode of ``request`` may draft this step: none for a prompt chunk or a request that opted
        out, nor in a step with more than ``spec_max_batch`` running, nor while the request pauses
        drafting; else as many as pay for their rows at its acceptance rate (``best_drafts``), never past its
        max_tokens or the max model length."""
        if not self.spec_tokens:
            return 0
        decode = n == 1 and request.num_pending <= 1 and not registers
        params = request.params
        if not (decode and params.speculative):
            return 0
        if len(self.running) > self.spec_max_batch:
            self.counters.spec_skipped["batch"] += 1
            return 0
        if request.spec_pause:
            request.spec_pause -= 1
            self.counters.spec_skipped["paused"] += 1
            return 0
        ahead = request.samples_in_flight + request.drafts_in_flight + 1  # the most tokens in flight, and this one
        left = min(params.stop.max_tokens - len(request.output_ids), self.max_model_len - request.num_tokens) - ahead
        return best_drafts(request.spec_rate, self.verify_cost, min(self.spec_tokens, left))

    def _judge_drafts(self, request: Request, drafted: int, confirmed: int) -> None:
        """After a verify step: the request's acceptance rate takes it in (``Request.judge``). When no number of
        drafts pays at that rate, it pauses drafting, twice as long as last time, and comes back with its rate
        forgotten (on probation: one more step as bad pauses it again); a step that confirmed every draft makes
        the next pause start short again."""
        if not drafted:
            return
        request.judge(drafted, confirmed)
        if confirmed == drafted:
            request.spec_next_pause = SPEC_PAUSE[0]
        if best_drafts(request.spec_rate, self.verify_cost, self.spec_tokens):
            return
        request.spec_pause = request.spec_next_pause or SPEC_PAUSE[0]
        request.spec_next_pause = min(2 * request.spec_pause, SPEC_PAUSE[1])
        request.forget_rate()

    def _chunk(self, request: Request, n: int, registers: bool = False) -> Chunk:
        start = request.num_computed
        registers = registers or start == 0  # a request's first chunk always is
        drafts = self._drafts(request, n, registers)
        if drafts and not self.blocks.can_grow(request.request_id, request.reach(n) + drafts):
            drafts = 0  # room for drafts only from free blocks: speculation never preempts
            self.counters.spec_skipped["blocks"] += 1
        new_blocks = self.blocks.grow(request.request_id, request.reach(n) + drafts)
        if registers:
            new_blocks = list(self.blocks.table(request.request_id))
        if request.num_pending == 0:  # everything known is computed: the next token is in flight
            chunk = Chunk(request, [], start, new_blocks, sample=True, decode_last=True, epoch=request.epoch,
                          registers=registers, max_drafts=drafts)
        else:
            chunk = Chunk(request, request.tokens(start, start + n), start, new_blocks,
                          sample=start + n == request.num_tokens, epoch=request.epoch, registers=registers,
                          cached_ids=request.tokens(0, start) if registers and start else [], max_drafts=drafts)
        request.num_computed = start + n
        request.samples_in_flight += chunk.sample
        request.drafts_in_flight += drafts
        # key the blocks that filled up for the prefix cache (a token still in flight has no key yet)
        self.blocks.fill(request.request_id, request.tokens, min(request.num_computed, request.num_tokens),
                         scope=request.params.cache_scope)
        return chunk

    def update(self, plan: StepPlan, sampled: dict[str, tuple[int, object]], now: float | None = None,
               scored: dict[str, tuple[int, list]] | None = None, failed: dict[str, str] | None = None,
               accepted: dict[str, list[tuple[int, object]]] | None = None,
               drafted: dict[str, int] | None = None) -> list[Output]:
        """Apply a step's results: ``sampled`` maps request id -> (token id, logprobs or None); ``scored``: the
        prompt tokens scored (``Answer.scored``), kept until they are written with the first token; ``failed``:
        the requests the worker could not sample (``Answer.failed``), ended with their error; ``accepted`` and
        ``drafted``: speculation's confirmed drafts and drafted counts (``Answer``).

        Requests aborted or finished while the step ran are skipped (their results are dropped)."""
        now = time.time() if now is None else now
        outputs = []
        requests, running, accepted, drafted = self.requests, Status.RUNNING, accepted or {}, drafted or {}
        for chunk in plan.chunks:
            request = chunk.request
            rid = request.request_id
            if chunk.epoch != request.epoch or requests.get(rid) is not request or request.status is not running:
                continue  # stale: preempted, aborted or finished meanwhile
            if scored and rid in scored:
                request.keep_scores(*scored[rid])
            if not chunk.sample:
                continue
            request.samples_in_flight -= 1
            request.drafts_in_flight -= chunk.max_drafts
            request.suspect = False  # a step that held it succeeded
            if failed and rid in failed:
                request.error = failed[rid]
                outputs.append(self._finish(request, "error"))
                continue
            confirmed, tried = accepted.get(rid, ()), drafted.get(rid, 0)
            if tried or confirmed:  # speculation's (nothing to count for a plain decode)
                self.counters.drafted += tried
                self.counters.verifies += tried > 0
                self.counters.accepted += len(confirmed)
                self._judge_drafts(request, tried, len(confirmed))
                request.num_computed += len(confirmed)  # the worker computed their KV, verifying them
            if request.first_token_time is None:
                request.first_token_time = now
                request.first_token_at = time.monotonic()
            output = Output(request, len(request.output_ids), [])
            for token, logprobs in (sampled[rid], *confirmed):
                request.output_ids.append(token)
                output.token_ids.append(token)
                if logprobs is not None:
                    request.logprobs.append(logprobs)
                    output.logprobs.append(logprobs)
                reason = request.finish_check(self.max_model_len)
                if reason is not None:  # what followed the stop is dropped
                    self._finish(request, reason)
                    output.finish_reason = reason
                    break
            outputs.append(output)
        return outputs


def _rank(request: Request) -> tuple[int, float, int]:
    """The order of the waiting queue and the running set: priority, then arrival (then order added)."""
    return request.priority, request.arrival, request.order
