"""Text from token ids, one step at a time: never half a character, never a stop string.

``IncrementalDetokenizer`` keeps two offsets into the token list (TGI's and vLLM's method): the
text of ``tokens[prefix:read]`` was already returned; decoding ``tokens[prefix:]`` and cutting that
prefix off gives the new text. While the result ends in U+FFFD (a character whose bytes span
tokens not all here yet: byte fallback, multi-token emoji), nothing is returned and the offsets
wait, but for at most ``MAX_PENDING`` tokens (a character has at most 4 bytes): output that keeps
ending in broken bytes would otherwise be decoded again from the same offset at every token, which
is quadratic. Decoding from ``prefix`` rather than from the new token alone keeps the context some
tokenizers need (a leading space that depends on the previous token); the offsets start at the
prompt's last few tokens (``context``), so the first output token has that context too (a
SentencePiece tokenizer drops the leading space of a text's first word: ``▁Paris`` alone decodes
to ``Paris``, after the prompt to `` Paris``).

``StopMatcher`` holds back the end of the text while it could still be the beginning of a stop
string, so a stop string split over tokens never reaches the client.
"""

from __future__ import annotations

from conveyor.tokenizer import ModelTokenizer

REPLACEMENT = "\ufffd"
MAX_PENDING = 6  # tokens held back for an incomplete character before its bytes are let out as U+FFFD
CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (as vLLM does)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: ModelTokenizer, skip_special_tokens: bool = True, context: list[int] = ()):
        """``context``: the prompt's last tokens; their text is never returned."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(context[-CONTEXT_TOKENS:]) if context else []
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append a token; returns the text it completes (often "", sometimes several characters)."""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        complete = not full_text.endswith(REPLACEMENT) or len(self.tokens) - self.read_offset >= MAX_PENDING
        if len(full_text) > len(prefix_text) and complete:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still pending, incomplete bytes shown as U+FFFD."""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Feeds text in, lets out only what can no longer become part of a stop string.

    Only the text not yet let out is kept (a stop string can only start there), so each piece costs
    time in its own length and the stop strings', not in the length of the output so far."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self.pending = ""  # fed but not let out yet
        self.emitted = 0  # characters let out

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text to emit now, whether a stop string matched: the text ends there)."""
        self.pending += piece
        if not self.stops:
            return self._emit(len(self.pending)), False
        match = self._earliest_match()
        if match is not None:
            start, stop = match
            return self._emit(start + (len(stop) if self.include_stop else 0)), True
        return self._emit(len(self.pending) - self._held_back()), False

    def release(self) -> str:
        """At the end (no stop string matched): the held-back tail."""
        return self._emit(len(self.pending))

    def _emit(self, n: int) -> str:
        out, self.pending = self.pending[:n], self.pending[n:]
        self.emitted += len(out)
        return out

    def _earliest_match(self) -> tuple[int, str] | None:
        # The emitted text never ends with the beginning of a stop string (that part is held back).
        found = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        return min(found, key=lambda m: m[0]) if found else None

    def _held_back(self) -> int:
        """Length of the longest pending suffix that is a proper prefix of some stop string."""
        tail = self.pending
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:n]):
                    longest = n
                    break
        return longest
