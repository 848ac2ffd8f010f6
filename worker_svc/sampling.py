"""Turning one row of logits per sequence into one token per sequence.

Order of operations (vLLM's, so users get the same behaviour for the same parameters):
logit bias and ``min_tokens`` stop-token masking, then penalties, then a constraint's mask
(structured output: the tokens its grammar does not allow next), then greedy argmax or
temperature, min-p, top-k, top-p and a draw. Penalties, as vLLM documents them:

- repetition: for tokens in the prompt or the output so far, ``l / r`` when ``l > 0`` else ``l * r``;
- frequency: ``l -= f * count_in_output``;
- presence:  ``l -= p * (count_in_output > 0)``.

The draw is ``argmax(probs / q)`` with ``q ~ Exp(1)`` per token (the exponential race, a sample
from ``probs``). A request with a seed draws its ``q`` from a generator seeded with
``(seed, output index)``, so its tokens depend on nothing else in the batch and survive a recompute
after preemption. Returned logprobs are of the model's raw distribution (before any processing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from conveyor.params import SamplingParams, StopParams
from worker_svc import cpu_kernels

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) over the generator's seed space


@dataclass
class SampleRow:
    """One sequence to sample for: its parameters and its token history. The history is the sequence's own list,
    sliced only where a penalty reads it (a copy per row and step cost O(context) for every row)."""

    params: SamplingParams
    history: list[int]  # the original prompt, then the tokens generated so far (fed back to the model)
    num_prompt: int = 0  # the prompt's length
    end: int | None = None  # the history this row is sampled after ends here (None: all of it)
    stop: StopParams = field(default_factory=StopParams)  # stop_token_ids are masked before min_tokens
    mask: torch.Tensor | None = None  # a constraint's allowed tokens, a bitmask (int32 words, 32 tokens each)

    @property
    def num_output(self) -> int:
        return (len(self.history) if self.end is None else self.end) - self.num_prompt

    @property
    def prompt_ids(self) -> list[int]:
        return self.history[: self.num_prompt]

    @property
    def output_ids(self) -> list[int]:
        return self.history[self.num_prompt : self.end]


@dataclass
class Sampled:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    error: str | None = None  # the row could not be sampled (its constraint allows no token): token_id is void


@dataclass
class Scored:
    """A prompt token scored: its log-probability given the tokens before it, its rank there (1: the most
    likely), and the most likely alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]]


SCORE_ROWS = 512  # rows scored at a time: (rows, vocab) fp32 logits stay a few hundred MB at most


def score(logits_of, hidden: torch.Tensor, targets: list[int], top: int) -> list[Scored]:
    """Score ``targets[i]`` under the distribution of ``hidden[i]`` (``logits_of``: hidden -> fp32 logits), in
    slices of ``SCORE_ROWS`` rows, brought to the host in one copy per slice."""
    out: list[Scored] = []
    for at in range(0, len(targets), SCORE_ROWS):
        logp = torch.log_softmax(logits_of(hidden[at : at + SCORE_ROWS]), dim=-1)  # (m, V)
        want = torch.tensor(targets[at : at + SCORE_ROWS], device=logp.device).unsqueeze(1)
        chosen = logp.gather(1, want)  # (m, 1)
        parts = [chosen.flatten().double(), ((logp > chosen).sum(-1) + 1).double()]
        if top:
            best = torch.topk(logp, top, dim=-1)
            parts += [best.indices.flatten().double(), best.values.flatten().double()]
        host = torch.cat(parts).tolist()
        m = len(want)
        for i in range(m):
            at_top = 2 * m + i * top
            alternatives = [(int(t), v) for t, v in zip(host[at_top : at_top + top],
                                                         host[at_top + m * top : at_top + m * top + top])]
            out.append(Scored(targets[at + i], host[i], int(host[m + i]), alternatives))
    return out


def seed_for(seed: int, output_index: int) -> int:
    """Generator seed of the draw for output token ``output_index`` of a request seeded ``seed``."""
    return ((seed * _SEED_MIX) ^ (output_index + 1) * 0xBF58476D1CE4E5B9) & 0x7FFF_FFFF_FFFF_FFFF


def apply_bias_and_min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
        if _masks_stop_ids(row):
            logits[i, list(row.stop.stop_token_ids)] = float("-inf")


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place, for the rows that ask for any penalty (formulas in the module docstring)."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        out = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(row.prompt_ids, dtype=torch.long, device=logits.device)] = True
            rp = p.repetition_penalty
            l = logits[i]
            logits[i] = torch.where(seen, torch.where(l > 0, l / rp, l * rp), l)
        if p.frequency_penalty:
            logits[i] -= p.frequency_penalty * counts
        if p.presence_penalty:
            logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype)


def truncate(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Rows (R, V) after temperature, each with its own settings: -inf outside its min-p, top-k and top-p
    support, in that order; batched over the rows (the default settings, llama.cpp's top-k 40, top-p 0.95,
    min-p 0.05, truncate every request).

    Nothing here runs over the whole vocabulary but one ``topk``: min-p keeps the tokens whose probability is
    at least ``min_p`` times the largest, that is whose logit is at least the largest plus ``log(min_p)`` (no
    softmax), and the largest logit is among the top k, so with top-k on, min-p and top-p run over the k
    largest alone (``topk`` returns them sorted, largest first; the rows take one ``topk`` of the largest k
    among them, each cut at its own k). Rows without top-k but with top-p sort the whole row. A row's support
    depends on its own logits and settings alone, never on its neighbours (up to exactly tied values)."""
    vocab, device, inf = logits.shape[1], logits.device, float("-inf")
    limited = [i for i, k in enumerate(top_k) if 0 < k < vocab]
    rest = [i for i in range(len(top_k)) if not 0 < top_k[i] < vocab and (min_p[i] > 0.0 or top_p[i] < 1.0)]
    if not (limited or rest):
        return logits  # no row truncates
    floor = torch.tensor([math.log(p) if p > 0.0 else inf for p in min_p], device=device, dtype=logits.dtype)
    nucleus = torch.tensor(top_p, device=device, dtype=logits.dtype)
    every = len(limited) == len(top_k)
    out = torch.full_like(logits, inf) if every else logits.clone()
    if limited:
        ks = torch.tensor([top_k[i] for i in limited], device=device)
        values, order = torch.topk(logits if every else logits[limited], int(ks.max()))  # sorted, largest first
        drop = torch.arange(values.shape[1], device=device) >= ks.unsqueeze(1)
        drop |= values < values[:, :1] + floor[limited].unsqueeze(1)
        values = values.masked_fill(drop, inf)
        values = values.masked_fill(_beyond_top_p(values, nucleus[limited]), inf)
        if every:
            return out.scatter_(1, order, values)
        out[limited] = logits.new_full((len(limited), vocab), inf).scatter(1, order, values)
    if rest:
        x = logits[rest]
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + floor[rest].unsqueeze(1), inf)
        if bool((nucleus[rest] < 1.0).any()):
            values, order = torch.sort(x, dim=-1, descending=True)
            # scattered back, not indexed by the mask: a boolean index would wait for the device
            x = x.scatter(1, order, values.masked_fill(_beyond_top_p(values, nucleus[rest]), inf))
        out[rest] = x
    return out


def _beyond_top_p(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Of rows of logits sorted largest first: those past the smallest prefix whose probability reaches the
    row's top_p (none where top_p is 1)."""
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = torch.cumsum(probs, dim=-1) - probs >= top_p.unsqueeze(1)
    drop[:, 0] = False
    return drop & (top_p < 1.0).unsqueeze(1)


def _seeded_exponential(vocab: int, row: SampleRow, device) -> torch.Tensor:
    g = torch.Generator(device=device)
    g.manual_seed(seed_for(row.params.seed, row.num_output))
    return torch.empty(vocab, device=device).exponential_(generator=g)


def _masks_stop_ids(row: SampleRow) -> bool:
    return bool(row.stop.stop_token_ids) and row.num_output < row.stop.min_tokens


def _edits_logits(row: SampleRow) -> bool:
    """Bias, min_tokens or penalties change this row's logits (a constraint's mask is applied apart)."""
    return bool(row.params.logit_bias) or row.params.has_penalties or _masks_stop_ids(row)


_BITS = torch.arange(32, dtype=torch.int32)


def _allowed(rows: list[SampleRow], which: list[int], tokens: torch.Tensor) -> list[bool]:
    """Whether each row's token (``tokens[i]``) is one its constraint allows: one bit of its mask."""
    words = torch.stack([rows[i].mask for i in which]).to(tokens.device)
    picked = tokens[which]
    word = words.gather(1, (picked >> 5).unsqueeze(1)).squeeze(1)
    return ((word >> (picked & 31).to(torch.int32)) & 1).bool().tolist()


def apply_masks(logits: torch.Tensor, rows: list[SampleRow], masked: list[int]) -> list[int]:
    """In place: the ``masked`` rows' disallowed tokens to -inf. Returns the rows left with no token at all
    (a dead end: the constraint and min_tokens or the vocabulary disagree)."""
    if not masked:
        return []
    words = torch.stack([rows[i].mask for i in masked])
    allowed = ((words.unsqueeze(-1) >> _BITS) & 1).bool().view(len(masked), -1)[:, : logits.shape[1]]
    picked = logits[masked].masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits[masked] = picked
    dead = torch.isinf(picked).all(dim=1).nonzero().flatten().tolist()
    return [masked[j] for j in dead]


def _argmax(rows: torch.Tensor) -> torch.Tensor:
    """Each row's first largest index, as ``torch.argmax``: on a CPU with the native kernels their one pass a row
    (``cpu_kernels.argmax``: PyTorch's reduction cost ~45 us a row of a 49,152-token vocabulary and ~0.34 ms for 8
    rows on 2 threads, a few percent of a small decode step); else ``max``, which finds it 2.6x faster than
    ``argmax`` on a CPU."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.dim() == 2 and cpu_kernels.available()[0]:
        return cpu_kernels.argmax(rows)
    return rows.max(dim=-1).indices


def sample(logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator | None = None) -> list[Sampled]:
    """logits: (N, V) fp32, one row per entry of ``rows``. Returns one ``Sampled`` per row."""
    raw, dead = logits, []
    if any(_edits_logits(row) for row in rows):
        logits = logits.clone()
        apply_bias_and_min_tokens(logits, rows)
        apply_penalties(logits, rows)
    tokens = _argmax(logits)  # the answer for greedy rows
    masked = [i for i, row in enumerate(rows) if row.mask is not None]
    if masked:
        # a greedy row whose argmax its constraint allows needs no mask (exact: the argmax of the masked row is
        # the same token); the others are masked whole (llama.cpp's order)
        greedy = [i for i in masked if rows[i].params.greedy]
        fine = {i for i, ok in zip(greedy, _allowed(rows, greedy, tokens)) if ok} if greedy else set()
        masked = [i for i in masked if i not in fine]
        if masked:
            logits = logits.clone() if logits is raw else logits
            dead = apply_masks(logits, rows, masked)
            redo = [i for i in masked if rows[i].params.greedy]
            if redo:
                tokens[redo] = _argmax(logits[redo])
    vocab, device = logits.shape[1], logits.device
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if drawn:
        temps = torch.tensor([rows[i].params.temperature for i in drawn], device=device, dtype=logits.dtype)
        scaled = logits[drawn] / temps.unsqueeze(1)  # (R, V)
        q = torch.empty_like(scaled).exponential_(generator=generator)
        params = [rows[i].params for i in drawn]
        scaled = truncate(scaled, [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params])
        for j, i in enumerate(drawn):
            if rows[i].params.seed is not None:
                q[j] = _seeded_exponential(vocab, rows[i], device)
        tokens[drawn] = _argmax(torch.softmax(scaled, dim=-1) / q)
    sampled = _to_host(raw, tokens, rows)
    for i in dead:
        sampled[i].error = "the constraint allows no token here" + (
            " (min_tokens masks the end of sequence it allows)" if _masks_stop_ids(rows[i]) else "")
    return sampled


def _to_host(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow]) -> list[Sampled]:
    """The sampled tokens with their log-probabilities (and alternatives) for the rows that ask, brought to
    the host in one copy: on a GPU the step's one wait for the device. A log-softmax over the vocabulary is
    the most expensive part of sampling a greedy batch, so only the rows that ask pay for it."""
    asking = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not asking:
        return [Sampled(t, 0.0, []) for t in tokens.tolist()]
    want_top = max(rows[i].params.logprobs for i in asking)
    parts = [tokens.double()]  # ids are exact in float64; one tensor, one copy
    picked = raw[asking]
    # logprob = raw logit - log_norm, with a row's log_norm the same whatever else asks: PyTorch sums a lone row in
    # halves on two threads and each of several rows in one pass, which round differently (4 % of random rows of
    # 49,152), so a lone row is reduced as one of two (a view: no copy)
    log_norm = torch.logsumexp(picked if len(asking) > 1 else picked.expand(2, -1), dim=-1, keepdim=True)[: len(asking)]
    parts.append((picked.gather(1, tokens[asking].unsqueeze(1)) - log_norm).flatten().double())
    if want_top:
        top = torch.topk(picked, want_top, dim=-1)
        parts += [top.indices.flatten().double(), (top.values - log_norm).flatten().double()]
    host = torch.cat(parts).tolist()
    n, k = len(rows), len(asking)
    ids = [int(t) for t in host[:n]]
    logprob, alternatives = [0.0] * n, [[] for _ in rows]
    for j, i in enumerate(asking):
        logprob[i] = host[n + j]
        top = rows[i].params.logprobs
        at = n + k + j * want_top
        at_values = at + k * want_top
        alternatives[i] = [(int(t), v) for t, v in zip(host[at : at + top], host[at_values : at_values + top])]
    return [Sampled(t, lp, alt) for t, lp, alt in zip(ids, logprob, alternatives)]
