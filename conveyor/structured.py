"""Structured output: a ``Structured`` constraint as an llguidance grammar, checked in the frontend and enforced
in the worker.

The frontend checks that the engine can enforce a spec (``validate``: keywords it cannot enforce, a bad regex, a
grammar that does not parse are refused, never ignored) without a tokenizer. The worker keeps one matcher per
constrained sequence (``Constraints``): built from the grammar (a compiled one is copied, not rebuilt, for
a spec seen before), fed the sequence's output tokens, asked for the mask of the tokens allowed next.
Grammar state is a function of (spec, output tokens) alone, so a sequence registered again (after a
preemption, a restart, an engine takeover) replays its output into a fresh matcher and is where it was.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict

from conveyor.params import Limits, Structured
from conveyor.params import check as _check

# Between JSON tokens: a few spaces or newlines. Unbounded whitespace (JSON allows it) lets a small model emit
# newlines until max_tokens, as vLLM's users saw; 16 still allows any indentation a model would write.
DEFAULT_WHITESPACE = r"[\x20\x0A]{0,16}"
MATCHER_CACHE = 128  # compiled matchers kept per worker, by spec (a copy of one costs ~1 us, a build ~1-15 ms)


def grammar(s: Structured) -> str:
    """llguidance's grammar text for ``s``."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if s.kind in ("json_schema", "json_object"):
        options = ({"whitespace_flexible": False} if s.whitespace_pattern == "" else
                   {"whitespace_pattern": s.whitespace_pattern or DEFAULT_WHITESPACE})
        return LLMatcher.grammar_from_json_schema(s.spec or '{"type":"object"}', defaults=options)
    if s.kind == "regex":
        return LLMatcher.grammar_from_regex(s.spec)
    if s.kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(s.spec)))
    if s.kind == "gbnf":
        return LLMatcher.grammar_from_lark(gbnf_to_lark(s.spec))
    return LLMatcher.grammar_from_lark(s.spec)


def parser_limits():
    """llguidance's limits on a grammar's work (its defaults: a grammar past them is refused at once, and one
    mask costs at most a few milliseconds)."""
    from llguidance import LLParserLimits

    return LLParserLimits()


def validate(s: Structured, limits: Limits, name: str) -> None:
    """``InvalidArgument`` naming ``name`` unless the engine can enforce ``s``: its size, then the grammar
    compiled and validated as the worker will build it (without the tokenizer: ~0.3 ms for a small schema,
    tens of ms for a 40 KB one; a spec seen before is answered from a cache, as agents repeat theirs)."""
    s.check(limits, name)
    problem = _problem(s)
    _check(problem is None, name, problem or "")


@functools.lru_cache(maxsize=256)
def _problem(s: Structured) -> str | None:
    """Why the engine cannot enforce ``s`` (None: it can)."""
    from llguidance import LLMatcher

    try:
        text = grammar(s)
    except Exception as exc:  # noqa: BLE001 - a spec the converter cannot read: the user's
        return f"cannot be read: {exc}"
    failed, messages = LLMatcher.validate_grammar_with_warnings(text, None, limits=parser_limits())
    return (messages[0].strip() if messages else "is not a grammar the engine can enforce") if failed else None


class Constraint:
    """One sequence's matcher: ``consumed`` output tokens fed so far."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.consumed = 0

    def catch_up(self, output_ids: list[int]) -> str | None:
        """Feed the output tokens the matcher has not seen (the last sampled one, or a whole replay); the
        error when one is refused. Once the grammar is complete nothing more is fed (only eos is allowed)."""
        for token in output_ids[self.consumed :]:
            if not self.matcher.is_stopped() and not self.matcher.consume_token(token):
                return f"the output broke its constraint at token {self.consumed}: {self.matcher.get_error()}"
            self.consumed += 1
        return self.error()

    def error(self) -> str | None:
        return f"the constraint failed: {self.matcher.get_error()}" if self.matcher.is_error() else None


class Constraints:
    """The worker's matchers: its tokenizer as llguidance sees it (built once, on the first constrained
    sequence: ~0.5 s for a 49k vocabulary), compiled matchers by spec (``new`` runs on the step's thread
    alone), and their masks."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer_json, self.vocab_size, self.eos = tokenizer_json, vocab_size, list(eos_token_ids)
        self.compiled: OrderedDict[Structured, object] = OrderedDict()
        self._tokenizer = None

    def _llg(self):
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            self._tokenizer = LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos)
        return self._tokenizer

    def new(self, s: Structured) -> Constraint:
        """A fresh matcher for ``s`` (a copy of the compiled one). A spec the matcher refuses gives a
        matcher in its error state: the sequence's first sample reports it."""
        from llguidance import LLMatcher

        base = self.compiled.get(s)
        if base is None:
            base = LLMatcher(self._llg(), grammar(s), limits=parser_limits(), log_level=0)
            self.compiled[s] = base
            if len(self.compiled) > MATCHER_CACHE:
                self.compiled.popitem(last=False)
        else:
            self.compiled.move_to_end(s)
        return Constraint(base.deep_copy())

    def masks(self, constraint: Constraint, drafts: list[int]) -> list:
        """The masks of a verify chunk's rows (speculation): row r's after the first r ``drafts``, each consumed
        for its mask and all rolled back after (only what the model confirms is fed, by ``catch_up``). From the
        first draft the grammar refuses on, the rows reuse the last mask: that row refuses the draft, so nothing
        after it is confirmed."""
        valid = constraint.matcher.validate_tokens(drafts) if drafts else 0
        out = [self.mask(constraint)]
        for token in drafts[:valid]:
            constraint.matcher.consume_token(token)
            out.append(self.mask(constraint))
        if valid:
            constraint.matcher.rollback(valid)
        return out + [out[-1]] * (len(drafts) - valid)

    def mask(self, constraint: Constraint):
        """The tokens ``constraint`` allows next, as a bitmask (int32 words, bit j of word w: token 32w + j).
        llguidance drops the GIL while it computes (call it off the step's thread to overlap the forward). One
        matcher at a time: a mask costs microseconds, so its parallel executor is not needed (and with it the
        one-stream gap measured in the note did not change). Not through ``llguidance.torch``: importing it
        compiles a kernel (~5 s)."""
        import torch

        bitmask = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        constraint.matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        return bitmask
