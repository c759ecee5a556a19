"""Saved prompt prefixes: KV states in host memory, per adapter, least recently used first out.

Agents resend a long system prompt and tool list with every request, and a daemon serves
several sessions: the one live KV sequence per slot only helps the conversation that used it
last. Before an engine drops a slot's K/V (another session's prompt, an adapter switch, a
full cache) it parks the state here; a later prompt that shares a longer prefix with an
entry than with the live slot gets that entry back (a memcpy, not a prefill).

Engine-neutral: a state is an opaque buffer and its size; the engine says how far back an
entry may be cut (`floor`). A sliding-window (SWA) cache saves only the last window of its
SWA layers, so such a state is only valid as the whole prefix (floor = its length); a plain
cache can be cut anywhere (floor 0).

Entries are keyed by adapter: K/V computed under adapter A is never handed to B or the base.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass
class Entry:
    adapter: str | None
    tokens: np.ndarray  # int32: the prefix whose K/V `state` holds
    state: object  # the engine's saved state (e.g. a ctypes byte buffer)
    nbytes: int
    floor: int  # the shortest prefix of `tokens` this state may be cut back to

    def usable(self, common: int) -> bool:
        return common > 0 and common >= self.floor


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    saved: int = 0
    evicted: int = 0


class PrefixCache:
    """At most `max_bytes` of saved states; the least recently used go first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # oldest first
        self._next_key = 0
        self.nbytes = 0
        self.stats = CacheStats()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        """Oldest (next to be evicted) first."""
        return list(self._entries.values())

    def covers(self, adapter: str | None, tokens: Sequence[int], floor: int) -> bool:
        """Whether an entry already serves every prompt a state of `tokens` would serve
        (then saving it is a wasted copy). Counts as a use of that entry."""
        toks = np.asarray(tokens, np.int32)
        for key, e in self._entries.items():
            if e.adapter == adapter and len(e.tokens) >= len(toks) and e.floor <= floor:
                if common_prefix(e.tokens, toks) == len(toks):
                    self._entries.move_to_end(key)
                    return True
        return False

    def put(self, adapter: str | None, tokens: Sequence[int], state: object, nbytes: int, floor: int) -> bool:
        """Save a state; returns False when it can never fit. Entries it makes redundant (a
        prefix of it, under the same adapter, cut no further back) are dropped."""
        if nbytes > self.max_bytes or not len(tokens):
            return False
        toks = np.asarray(tokens, np.int32)
        for key, e in list(self._entries.items()):
            if e.adapter == adapter and len(e.tokens) <= len(toks) and floor <= e.floor:
                if common_prefix(e.tokens, toks) == len(e.tokens):
                    self._remove(key)
        while self.nbytes + nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evicted += 1
        self._entries[self._next_key] = Entry(adapter, toks, state, nbytes, floor)
        self._next_key += 1
        self.nbytes += nbytes
        self.stats.saved += 1
        return True

    def best(
        self, adapter: str | None, tokens: Sequence[int], limit: int, better_than: int = 0
    ) -> tuple[Entry | None, int]:
        """The entry sharing the longest usable prefix with tokens[:limit], longer than
        `better_than` (what the caller has already), and that length; (None, 0) when there is
        none. The entry becomes the most recently used."""
        toks = np.asarray(tokens[:limit], np.int32)
        found, found_key, longest = None, None, better_than
        for key, e in self._entries.items():
            if e.adapter != adapter:
                continue
            common = common_prefix(e.tokens, toks)
            if e.usable(common) and common > longest:
                found, found_key, longest = e, key, common
        if found is None:
            self.stats.misses += 1
            return None, 0
        self._entries.move_to_end(found_key)
        self.stats.hits += 1
        return found, longest

    def drop_adapter(self, adapter: str | None) -> None:
        """Forget every state computed under `adapter` (its weights were replaced or freed)."""
        for key in [k for k, e in self._entries.items() if e.adapter == adapter]:
            self._remove(key)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _remove(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
