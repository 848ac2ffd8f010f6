"""One engine step: validate the scheduler's batch, run one forward over it, sample.

The worker keeps a little state per sequence (its token history, prompt length, sampling
parameters and block table) so that each step only carries what changed: the new tokens and the
blocks appended since the last step. A sequence is registered by a chunk that starts at position
0 (a new request, or a recompute after preemption), or by one that names the tokens of a prefix
whose KV is already in its first blocks (``cached_token_ids``: the scheduler's prefix cache found
them), and forgotten when its id is in ``free``.

A malformed step raises ``InvalidStep`` before anything is computed or changed, so the cache and
state of every other sequence stay as they were.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field, replace

import torch

from conveyor.errors import InvalidArgument
from conveyor.params import SamplingParams, StopParams, Structured
from conveyor.structured import Constraint, Constraints
from worker_svc import backends
from worker_svc.attention import BlockTable
from worker_svc.backends import StepBatch
from worker_svc.graphs import Graph
from worker_svc.kv_cache import KVCache
from worker_svc.model import LlamaModel
from worker_svc.sampling import Sampled, SampleRow, Scored, sample, score
from worker_svc.speculative import NgramIndex


class InvalidStep(InvalidArgument):
    """The step names a block, position, token or sequence the worker cannot accept. ``seq_id``: the
    sequence at fault, when one is (the scheduler then blames that request alone)."""

    def __init__(self, message: str, seq_id: str | None = None):
        super().__init__(message)
        self.seq_id = seq_id


@dataclass
class SeqChunk:
    """One sequence's share of a step."""

    seq_id: str
    token_ids: list[int]  # new tokens to compute, at positions start_pos, start_pos + 1, ...
    start_pos: int
    _: KW_ONLY
    new_block_ids: list[int] = field(default_factory=list)  # appended to the block table first
    sample: bool = False  # sample a token after the last of token_ids
    sampling: SamplingParams | None = None  # required when the chunk registers the sequence
    num_prompt_tokens: int = 0  # with sampling: the original prompt length (later tokens are output)
    decode_last: bool = False  # token_ids empty: compute the token sampled for it in the previous step
    cached_token_ids: list[int] = field(default_factory=list)  # registers: positions [0, start_pos) hold KV
    stop: StopParams = field(default_factory=StopParams)  # with sampling: every stop id, masked before min_tokens
    structured: Structured | None = None  # with sampling: the output's constraint
    # a decode that samples: the worker may append up to this many drafted tokens (prompt lookup) to verify
    # in this step, as far as the sequence's blocks reach; it answers every one the model confirms
    max_drafts: int = 0

    @property
    def registers(self) -> bool:
        return self.start_pos == 0 or bool(self.cached_token_ids)


@dataclass
class StepInput:
    chunks: list[SeqChunk]
    free_seq_ids: list[str] = field(default_factory=list)  # dropped before the chunks run
    free_all: bool = False  # drop every sequence first (the scheduler restarted)


@dataclass
class StepResult:
    """One sequence's answer: its sampled token (None for a chunk that samples nothing), and the prompt tokens
    this chunk scored (``prompt_logprobs``): (the first one's position, the scores)."""

    seq_id: str
    sampled: Sampled | None
    prompt: tuple[int, list[Scored]] | None = None
    accepted: list[Sampled] = field(default_factory=list)  # tokens after ``sampled`` the drafts confirmed, in order
    drafted: int = 0  # tokens drafted for this sequence this step

    @property
    def tokens(self) -> list[Sampled]:
        """Every token this step emitted for the sequence, in order (``sampled``, then the ``accepted``)."""
        return ([self.sampled] if self.sampled is not None else []) + self.accepted


@dataclass
class SeqState:
    params: SamplingParams
    num_prompt_tokens: int
    tokens: list[int] = field(default_factory=list)  # every token fed so far (KV computed)
    block_table: BlockTable = field(default_factory=BlockTable)
    last_sampled: int | None = None  # for a decode_last chunk of the next step
    # prompt_logprobs: the hidden state of the last position computed, while the prompt goes on in the next chunk
    # (it scores that chunk's first token)
    pending_hidden: torch.Tensor | None = None
    stop: StopParams = field(default_factory=StopParams)
    constraint: Constraint | None = None  # structured output: its matcher, fed the output tokens
    drafts: NgramIndex | None = None  # its history's n-grams, made when it first drafts
    accepted_last: int = 0  # drafts its last step confirmed: a decode_last sent before that answer starts after them


@dataclass
class Undo:
    """How to undo a step's changes to a sequence's state: its lengths and the fields the step sets, as they were."""

    state: SeqState
    tokens: int
    blocks: int
    last_sampled: int | None
    accepted_last: int
    pending_hidden: torch.Tensor | None


def roll_back(undo: list[Undo]) -> None:
    for u in reversed(undo):
        del u.state.tokens[u.tokens :]
        u.state.block_table.truncate(u.blocks)
        u.state.last_sampled, u.state.accepted_last, u.state.pending_hidden = (u.last_sampled, u.accepted_last,
                                                                               u.pending_hidden)


class ModelRunner:
    """Owns the model, the KV cache and the per-sequence state; ``step`` runs one engine step."""

    def __init__(self, model: LlamaModel, cache: KVCache, max_model_len: int, seed: int | None = None,
                 fail_on_token: int = -1, threads: tuple[int, int] | None = None, attention: str = "auto",
                 compile_attention: bool | None = None, graphs: Callable[[], Graph] | None = None,
                 max_graph_batch: int = 256, constraints: Constraints | None = None, ngram: tuple[int, int] = (3, 5)):
        """``threads``: (CPU threads for a step, for a step of one token); None leaves PyTorch's setting.
        ``attention``: the backend (``worker_svc.backends.choose``: auto is native when the CPU kernels can run
        the model, else flex on a GPU and sdpa on a CPU); ``compile_attention``, ``graphs``, ``max_graph_batch``:
        flex's (``backends.make``). ``constraints``: the matchers of structured output (None: a constrained
        sequence is refused). ``ngram``: the n-gram lengths drafts are looked up by (``max_drafts``)."""
        self.constraints = constraints
        self.ngram = ngram
        self.mask_seconds: float | None = None  # the last step's grammar work (None: no constrained sequence)
        self.grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar") if constraints else None
        self.fail_on_token = fail_on_token  # fault injection (--fail-on-token): -1 off
        self.threads = threads
        self.model = model
        self.cache = cache
        self.max_model_len = max_model_len
        self.vocab_size = model.cfg.vocab_size
        self.device = model.norm.weight.device
        self.backend = backends.make(attention, model, cache, max_model_len, compile_attention, graphs,
                                     max_graph_batch)
        self.attention = self.backend.name
        self.graphs = self.backend.graphs
        self.seqs: dict[str, SeqState] = {}
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed if seed is not None else torch.seed())

    # ------------------------------------------------------------ validation

    def _check(self, step: StepInput) -> None:
        ids = [c.seq_id for c in step.chunks]
        if len(set(ids)) != len(ids):
            raise InvalidStep("a sequence appears twice in one step")
        freed = set(self.seqs) if step.free_all else set(step.free_seq_ids)
        for i, c in enumerate(step.chunks):
            known = c.seq_id in self.seqs and c.seq_id not in freed
            if c.decode_last:
                step.chunks[i] = c = self._with_last_sampled(c, known)
            self._check_chunk(c, known)

    def _with_last_sampled(self, c: SeqChunk, known: bool) -> SeqChunk:
        where = f"sequence {c.seq_id!r}"
        if c.token_ids:
            raise InvalidStep(f"{where}: decode_last takes no token_ids", c.seq_id)
        state = self.seqs[c.seq_id] if known else None
        if state is None or state.last_sampled is None:
            raise InvalidStep(f"{where}: decode_last but nothing was sampled for it in the previous step", c.seq_id)
        # sent before the previous step's answer: its start_pos counts one token for that step. Resolved in place
        # (the step's input is its own): dataclasses.replace cost ~10 % of the worker's Python at 128 decodes
        c.token_ids, c.start_pos, c.decode_last = [state.last_sampled], c.start_pos + state.accepted_last, False
        return c

    def _check_chunk(self, c: SeqChunk, known: bool) -> None:
        where = f"sequence {c.seq_id!r}"
        if not c.token_ids:
            raise InvalidStep(f"{where}: token_ids is empty", c.seq_id)
        bad = [t for t in c.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidStep(f"{where}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", c.seq_id)
        if c.registers:
            if c.sampling is None:
                raise InvalidStep(f"{where}: a chunk that registers a sequence must carry sampling parameters", c.seq_id)
            if c.num_prompt_tokens < 1:
                raise InvalidStep(f"{where}: num_prompt_tokens must be >= 1", c.seq_id)
            if c.structured is not None and self.constraints is None:
                raise InvalidStep(f"{where}: constrained, but this runner has no constraints (structured output)",
                                  c.seq_id)
            if len(c.cached_token_ids) != c.start_pos:
                raise InvalidStep(f"{where}: start_pos {c.start_pos} but {len(c.cached_token_ids)} cached tokens",
                                  c.seq_id)
            bad = [t for t in c.cached_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidStep(f"{where}: cached token id {bad[0]} is outside the vocabulary", c.seq_id)
            table: list[int] = []
        elif not known:
            raise InvalidStep(f"{where}: unknown sequence (it must start at position 0)", c.seq_id)
        else:
            state = self.seqs[c.seq_id]
            if c.start_pos != len(state.tokens):
                raise InvalidStep(f"{where}: start_pos {c.start_pos} but {len(state.tokens)} tokens are computed", c.seq_id)
            table = state.block_table
        end = c.start_pos + len(c.token_ids)
        if end > self.max_model_len:
            raise InvalidStep(f"{where}: position {end - 1} is past the max model length {self.max_model_len}", c.seq_id)
        bad = [b for b in c.new_block_ids if not 0 <= b < self.cache.num_blocks]
        if bad:
            raise InvalidStep(f"{where}: block id {bad[0]} is out of range [0, {self.cache.num_blocks})", c.seq_id)
        have = (len(table) + len(c.new_block_ids)) * self.cache.block_size
        if have < end:
            raise InvalidStep(f"{where}: blocks hold {have} tokens but positions up to {end - 1} are needed", c.seq_id)

    # ------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self, step: StepInput) -> list[StepResult]:
        self._check(step)
        if self.fail_on_token >= 0 and any(self.fail_on_token in c.token_ids for c in step.chunks):
            raise RuntimeError(f"injected fault: this step computes token {self.fail_on_token} (--fail-on-token)")
        if step.free_all:
            self.seqs.clear()
        for seq_id in step.free_seq_ids:
            self.seqs.pop(seq_id, None)
        undo: list[Undo] = []
        try:  # staging too: a registration's state (its constraint's matcher) is built after others were extended
            staged = {c.seq_id: self._staged_state(c, undo) for c in step.chunks}
            drafts = self._draft(step.chunks, staged)
            self._set_threads(sum(len(c.token_ids) for c in step.chunks))
            # decode tokens first (one query each), then prefill chunks
            order = sorted(step.chunks, key=lambda c: len(c.token_ids) > 1)
            results = self._forward_and_sample(order, staged, drafts) if order else []
            for r in results:
                if r.sampled is not None:
                    s = staged[r.seq_id]
                    s.last_sampled, s.accepted_last = r.tokens[-1].token_id, len(r.accepted)
                    if r.drafted > len(r.accepted):  # the rejected drafts' KV is junk, overwritten later
                        del s.tokens[len(s.tokens) - (r.drafted - len(r.accepted)) :]
        except BaseException:
            roll_back(undo)  # a step that fails leaves every sequence as it was
            raise
        self.seqs.update(staged)  # registrations join only after the forward succeeded
        position = {c.seq_id: i for i, c in enumerate(step.chunks)}
        return sorted(results, key=lambda r: position[r.seq_id])  # request order

    def _draft(self, chunks: list[SeqChunk], staged: dict[str, SeqState]) -> dict[str, list[int]]:
        """Append drafted tokens to the decodes that may draft (``max_drafts``), in place: as many as their blocks
        and the max model length leave room for. Returns each drafting sequence's drafts (a constrained
        sequence's are judged by its grammar, row by row: ``_start_masks``)."""
        drafts = {}
        for i, c in enumerate(chunks):
            s = staged[c.seq_id]
            if c.max_drafts <= 0 or not c.sample or len(c.token_ids) != 1 or c.registers:
                continue
            end = c.start_pos + 1
            room = min(c.max_drafts, len(s.block_table) * self.cache.block_size - end, self.max_model_len - end)
            if s.drafts is None:
                s.drafts = NgramIndex(*self.ngram)
            guess = s.drafts.propose(s.tokens, room)
            if guess:
                chunks[i] = replace(c, token_ids=c.token_ids + guess)
                s.tokens += guess  # computed this step; the rejected ones are cut off after it
                drafts[c.seq_id] = guess
        return drafts

    @torch.inference_mode()
    def verify_cost(self, max_drafts: int = 8, context: int = 64, repeat: int = 2) -> list[float]:
        """Speculation's cost model on this device: element d is the time of a lone decode verifying d drafts
        over that of one verifying none, for d in [0, ``max_drafts``]. Timed at 0, 1, 2, 4, 8, ... drafts (the
        best of ``repeat`` after a warm-up) and interpolated between; each try runs the step's own forward,
        thread count and sampling on a scratch sequence of ``context`` tokens in the cache's first blocks, which
        is then forgotten: call it before serving, while no sequence holds blocks. [] when the cache or the
        max model length is too small to measure in."""
        if self.seqs:
            raise RuntimeError(f"verify_cost needs a free cache ({len(self.seqs)} sequences are held)")
        needed = -(-(context + max_drafts + 1) // self.cache.block_size)
        if needed > self.cache.num_blocks or context + max_drafts + 1 > self.max_model_len:
            return []
        seq_id, ids = "\0measure", [t % self.vocab_size for t in range(100, 101 + context + max_drafts)]
        greedy = SamplingParams(temperature=0.0)
        self.step(StepInput([SeqChunk(seq_id, ids[:context], 0, new_block_ids=list(range(needed)), sampling=greedy,
                                      num_prompt_tokens=context)]))
        timed = sorted({0, max_drafts, *(2**i // 2 for i in range(max_drafts.bit_length()))})  # 0, 1, 2, 4, ...
        seconds = {}
        try:
            for d in timed:
                chunk = SeqChunk(seq_id, ids[context : context + d + 1], context, sample=True)
                undo: list[Undo] = []
                best = float("inf")
                try:
                    staged = {seq_id: self._staged_state(chunk, undo)}  # rolled back: each try computes the same rows
                    self._set_threads(1 + d)
                    for _ in range(repeat + 1):
                        start = time.perf_counter()
                        self._forward_and_sample([chunk], staged, {seq_id: chunk.token_ids[1:]} if d else {})
                        best = min(best, time.perf_counter() - start)
                finally:
                    roll_back(undo)
                seconds[d] = best
        finally:
            self.seqs.pop(seq_id, None)
        cost = []
        for d in range(max_drafts + 1):
            low = max(t for t in timed if t <= d)
            high = min(t for t in timed if t >= d)
            at = seconds[low] if high == low else seconds[low] + (seconds[high] - seconds[low]) * (d - low) / (high - low)
            cost.append(max(at / seconds[0], cost[-1] if cost else 1.0))  # never cheaper than fewer drafts
        return cost

    def _set_threads(self, num_tokens: int) -> None:
        """A step of one token runs on fewer CPU threads (``--small-step-threads``). On a machine with
        few cores the other processes of the pipeline run between every two tokens of a lone stream;
        given no core of their own they preempt a model thread mid-step, and every barrier of the
        step waits for it (the served token took twice the bare step on 2 cores). Bigger steps
        amortize that work and take every thread."""
        if self.threads is None or self.device.type != "cpu":
            return
        want = self.threads[1] if num_tokens <= 1 else self.threads[0]
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    @torch.inference_mode()
    def score(self, token_ids: list[int], block_ids: list[int]) -> torch.Tensor:
        """Logits (n, vocab) at every position of ``token_ids``, computed in the blocks given.

        Nothing is registered: the blocks are scratch space the caller owns for this call
        (prompt log-probabilities, and checking the model against a reference).
        """
        chunk = SeqChunk("\0score", list(token_ids), 0, new_block_ids=list(block_ids), sample=False,
                         sampling=SamplingParams(), num_prompt_tokens=len(token_ids))
        self._check_chunk(chunk, known=False)
        batch = self._batch([chunk], {chunk.seq_id: self._staged_state(chunk, [])})
        return self.model.logits(self.backend.run(batch))

    def _staged_state(self, c: SeqChunk, undo: list[Undo]) -> SeqState:
        """The sequence's state with ``c`` applied: a new one for a chunk that registers (it joins ``seqs`` once the
        step succeeds), else its own, extended in place (a copy cost O(context) per sequence and step), with what
        undoes that added to ``undo``."""
        if c.registers:
            constraint = self.constraints.new(c.structured) if c.structured is not None else None
            return SeqState(c.sampling, c.num_prompt_tokens, c.cached_token_ids + c.token_ids,
                            BlockTable(c.new_block_ids), stop=c.stop, constraint=constraint)
        state = self.seqs[c.seq_id]
        undo.append(Undo(state, len(state.tokens), len(state.block_table), state.last_sampled, state.accepted_last,
                         state.pending_hidden))
        state.tokens += c.token_ids
        state.block_table.extend(c.new_block_ids)
        state.last_sampled, state.accepted_last = None, 0
        return state

    def _forward_and_sample(self, order: list[SeqChunk], staged: dict[str, SeqState],
                            drafts: dict[str, list[int]]) -> list[StepResult]:
        sampled = [c for c in order if c.sample]
        # the grammar work overlaps the forward
        masks = self._start_masks([(staged[c.seq_id], drafts.get(c.seq_id, [])) for c in sampled])
        batch = self._batch(order, staged)
        hidden = self.backend.run(batch)
        last_rows = dict(zip((c.seq_id for c in order), batch.last_rows()))
        scored = {c.seq_id: self._score_prompt(c, staged[c.seq_id], hidden, last_rows[c.seq_id]) for c in order
                  if staged[c.seq_id].params.prompt_logprobs is not None}
        results = []
        if sampled:
            rows, sample_rows, spans = [], [], []
            errors, bitmasks = masks.result() if masks is not None else ({}, {})
            for i, c in enumerate(sampled):
                s, guess = staged[c.seq_id], drafts.get(c.seq_id, [])
                last = last_rows[c.seq_id]
                computed = len(s.tokens) - len(guess)  # the history each row is sampled after: row r's, plus r drafts
                spans.append((len(sample_rows), len(guess)))
                for r in range(len(guess) + 1):
                    rows.append(last - len(guess) + r)
                    sample_rows.append(SampleRow(s.params, s.tokens, s.num_prompt_tokens, computed + r, s.stop,
                                                 bitmasks[i][r] if i in bitmasks else None))
            # a step of decodes alone samples every row in order: no gather
            picked = hidden if rows == list(range(hidden.shape[0])) else hidden[torch.tensor(rows, device=self.device)]
            logits = self.model.logits(picked)
            drawn = sample(logits, sample_rows, self.generator)
            for i, error in errors.items():
                drawn[spans[i][0]].error = error
            for c, (at, n) in zip(sampled, spans):
                guess, picks = drafts.get(c.seq_id, []), drawn[at : at + n + 1]
                kept = next((j for j in range(n) if picks[j].token_id != guess[j]), n)  # drafts confirmed
                results.append(StepResult(c.seq_id, picks[0], scored.pop(c.seq_id, None), picks[1 : kept + 1], n))
        return results + [StepResult(seq_id, None, prompt) for seq_id, prompt in scored.items() if prompt is not None]

    def _start_masks(self, states: list[tuple[SeqState, list[int]]]):
        """On the grammar thread: feed each constrained sequence the output tokens its matcher has not seen (up
        to its drafts), then fill the masks of what may come next: one per row, row r's after the first r drafts
        (consumed for the mask, then rolled back: only what the model confirms is fed, by the next step). A
        draft the grammar refuses ends that: its row's mask refuses it, so it and the drafts after it are never
        confirmed, and the rows after it reuse the last mask. A future of ({sampled index: error}, {sampled
        index: [bitmask per row]}), or None."""
        self.mask_seconds = None
        if not any(s.constraint is not None for s, _ in states):
            return None

        def work():
            start = time.perf_counter()
            errors, masks = {}, {}
            for i, (s, guess) in enumerate(states):
                if s.constraint is None:
                    continue
                error = s.constraint.catch_up(s.tokens[s.num_prompt_tokens : len(s.tokens) - len(guess)])
                if error is None:
                    masks[i] = self.constraints.masks(s.constraint, guess)
                else:
                    errors[i] = error
            self.mask_seconds = time.perf_counter() - start
            return errors, masks

        return self.grammar_thread.submit(work)

    def _score_prompt(self, c: SeqChunk, s: SeqState, hidden: torch.Tensor, last_row: int
                      ) -> tuple[int, list[Scored]] | None:
        """The prompt tokens this chunk computes, scored (prompt_logprobs): the row of position p predicts the
        token at p + 1, so a chunk's first token is scored by the previous chunk's last row (kept in
        ``pending_hidden``), and position 0 is never scored."""
        end = c.start_pos + len(c.token_ids)
        carried = c.start_pos >= 1 and s.pending_hidden is not None  # the row predicting this chunk's first token
        first = c.start_pos if carried else c.start_pos + 1
        last = min(end, s.num_prompt_tokens)  # positions [first, last) are scored, by rows [first - 1, last - 1)
        at = last_row - (end - 1)  # hidden[at + p] is the row of position p (p in this chunk)
        result = None
        if first < last:
            rows = hidden[at + c.start_pos : at + last - 1]  # positions start_pos .. last - 2
            if carried:
                rows = torch.cat([s.pending_hidden.unsqueeze(0), rows])
            result = (first, score(self.model.logits, rows, s.tokens[first:last], s.params.prompt_logprobs))
        s.pending_hidden = hidden[last_row].clone() if end < s.num_prompt_tokens else None
        return result

    def _batch(self, order: list[SeqChunk], staged: dict[str, SeqState]) -> StepBatch:
        return StepBatch.of([(c.token_ids, c.start_pos, staged[c.seq_id].block_table,
                              staged[c.seq_id].num_prompt_tokens) for c in order], self.cache.block_size)
