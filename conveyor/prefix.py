"""Keys of token prefixes, shared by the scheduler's prefix cache and the frontends' engine routing.

A block of tokens is keyed by a hash of its tokens chained with the key of the block before it (the
first with a root naming the model), so one key names one whole prefix, never a block's tokens alone.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def root_key(model: str) -> bytes:
    """The key the first block of every prefix chains with: KV depends on the model's weights."""
    return hashlib.blake2b(model.encode(), digest_size=16).digest()


def scoped(root: bytes, scope: str) -> bytes:
    """The root of the prefixes of one cache scope (a request's ``RequestParams.cache_scope``: its API key's,
    with its ``cache_salt``): prefixes of two scopes never share a key, so one tenant can neither reuse nor time
    another's cached prefix. The empty scope is ``root`` itself (a cache shared by everyone)."""
    return hashlib.blake2b(root + b"\0" + scope.encode(), digest_size=16).digest() if scope else root


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block with ``tokens`` after the prefix keyed ``parent``."""
    return hashlib.blake2b(parent + array("I", tokens).tobytes(), digest_size=16).digest()
