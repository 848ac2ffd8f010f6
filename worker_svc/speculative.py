"""Prompt-lookup drafts (n-gram speculation): guess a sequence's next tokens from its own history.

When the last ``n`` tokens appeared before, the tokens that followed them then are the guess (the longest
``n`` in [``min_n``, ``max_n``] that matches wins; of several earlier matches, the latest). Output that
repeats its input (quoting, summaries, code edits, answers from a retrieved passage) is guessed well; the
worker verifies the guesses in the next forward and keeps only what the model itself would have produced
(``ModelRunner``), so a wrong guess costs compute, never a different token.

The index is incremental: each token is indexed once, when the next one arrives, so proposing costs
``max_n - min_n + 1`` dictionary operations per new token, whatever the history's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """One sequence's n-grams: each maps to the position right after its latest earlier occurrence."""

    min_n: int = 3
    max_n: int = 5
    _after: dict[tuple[int, ...], int] = field(default_factory=dict)
    _indexed: int = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``tokens`` (the whole history so far; it only ever grows by
        tokens at its end between calls, or the index is rebuilt by a new ``NgramIndex``)."""
        end = len(tokens) - 1  # the suffix ending at the last token is looked up, not indexed (it is itself)
        for j in range(self._indexed, end):  # n-grams ending at j, followed by position j + 1
            for n in range(self.min_n, min(self.max_n, j + 1) + 1):
                self._after[tuple(tokens[j - n + 1 : j + 1])] = j + 1
        self._indexed = max(self._indexed, end)
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            at = self._after.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at : at + k]
        return []
