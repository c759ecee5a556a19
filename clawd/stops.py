"""Stop strings over a token stream, the same for every engine.

Text is released as soon as it cannot be the start of a stop string, so streaming stays
per-token while a stop split across tokens is still caught and never shown.
"""

from __future__ import annotations

import bisect


class StopMatcher:
    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was hit).
        After a hit, the text before the stop is returned and the rest is dropped."""
        buf = self._held + text
        hit_at = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if hit_at >= 0:
            self._held = ""
            return buf[:hit_at], True
        hold = self._longest_partial(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """The held-back tail, once the stream ended without a stop."""
        rest, self._held = self._held, ""
        return rest

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best


def tokens_received(text_ends: list[int], received: int, end_token: bool) -> int:
    """How many of a turn's sampled tokens the user received: those whose text lies wholly
    inside the `received` characters shown (a stop string's tokens, and a token that only
    partly precedes it, were never shown), plus the end-of-turn token when the turn ended with
    one (the user saw the turn end there). `text_ends[i]`: characters decoded after token i."""
    return bisect.bisect_right(text_ends, received) + (1 if end_token else 0)
