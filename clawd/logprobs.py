"""OpenAI's log-prob shapes, built from a turn's sampled tokens.

Chat completions (`logprobs: true`, `top_logprobs: N`): `choices[].logprobs.content` holds one
entry per sampled token, `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`.
Legacy completions (`logprobs: N`): `{tokens, token_logprobs, top_logprobs, text_offset}`, where
each `top_logprobs` entry maps token text to log-prob for the N most likely tokens plus the
sampled one (so up to N + 1 keys, as OpenAI documents).

The numbers are the ones stored with the turn: the raw model's distribution at temperature 1
(engines/base.py SampledToken), whatever temperature sampled it. The end-of-generation token
is no text, so it is left out here, as OpenAI leaves it out; the turn row keeps it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from clawd.engines.base import Alternative, SampledToken

# JSON has no -inf (a masked token) or NaN (an upstream that sent none); OpenAI itself
# reports "practically impossible" as -9999.0.
NO_LOGPROB = -9999.0


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else NO_LOGPROB


def _text(piece: bytes) -> str:
    """A token's text; a token holding part of a UTF-8 character shows U+FFFD (its `bytes`
    field has the exact bytes, which is why OpenAI sends both)."""
    return piece.decode("utf-8", "replace")


def _entry(t: SampledToken | Alternative) -> dict:
    return {"token": _text(t.piece), "logprob": _finite(t.logprob), "bytes": list(t.piece)}


def chat_logprobs(tokens: Sequence[SampledToken]) -> dict:
    """`choices[].logprobs` of a chat completion (or of one stream chunk's tokens)."""
    content = [{**_entry(t), "top_logprobs": [_entry(a) for a in t.top]} for t in tokens if not t.is_end]
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: Sequence[SampledToken], offset: int) -> tuple[dict, int]:
    """`choices[].logprobs` of a legacy completion, and the text offset after these tokens.
    `offset` counts characters from the start of the prompt, as OpenAI's `text_offset` does."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        if t.is_end:
            continue
        text = _text(t.piece)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(t.logprob))
        out["top_logprobs"].append({**{_text(a.piece): _finite(a.logprob) for a in t.top}, text: _finite(t.logprob)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset
