"""What an adapter learned, for review: the signals it trained on, and answers of the base
model, its parent and the adapter itself to a few of those prompts, side by side.

Boundary: reads turns, signals and adapter rows; generates through ServedModel.complete as
background engine work (it yields to user requests and is never logged as a turn). Loading
an adapter into the engine is the registry's job (adapters.py).
"""

from __future__ import annotations

import logging

from clawd.engines.base import SamplingParams
from clawd.errors import Busy, Preempted
from clawd.miner import last_user_text
from clawd.protocol import Message
from clawd.served import ServedModel
from clawd.store import adapters as adapter_rows
from clawd.store import signals, turns
from clawd.store.db import Database

log = logging.getLogger(__name__)
QUIET_BEFORE_RETRY_S = 1.0  # after a user request preempted us, let their next one come first
MAX_PREEMPTIONS = 50


async def learned_from(db: Database, rec: adapter_rows.AdapterRecord) -> list[dict]:
    """The adapter's training and held-out signals, each with its prompt and the reply it judged.
    Turns deleted since (a forgotten session) are listed with `missing: true`."""
    out = []
    for turn_id, held_out in [(t, False) for t in rec.signals] + [(t, True) for t in rec.holdout]:
        turn = await turns.get_turn(db, turn_id)
        sig = await signals.get(db, turn_id)
        if turn is None:
            out.append({"turn_id": turn_id, "held_out": held_out, "missing": True})
            continue
        out.append(
            {
                "turn_id": turn_id,
                "held_out": held_out,
                "missing": False,
                "session_id": turn.session_id,
                "prompt": last_user_text(turn.request.get("messages", [])),
                "response": turn.response_text,
                "reward": sig.reward if sig else None,
                "reward_source": sig.reward_source if sig else None,
                "hint": sig.hint if sig else None,
                "next_state": sig.next_state if sig else None,
                "vetoed": sig.vetoed if sig else False,
            }
        )
    return out


async def side_by_side(
    db: Database, model: ServedModel, registry, adapter_id: str, *, n: int = 3, max_tokens: int = 96
) -> dict:
    """Greedy answers of base / previous (the adapter it continued from) / this adapter to the
    first `n` prompts it trained on. `registry` is a clawd.adapters.Registry."""
    rec = await registry.ensure_loaded(adapter_id)
    columns = [{"name": "base", "adapter": None}]
    if rec.parent_id is not None:
        parent = await adapter_rows.get(db, rec.parent_id)
        if parent is not None and not parent.forgotten:
            await registry.ensure_loaded(parent.id)
            columns.append({"name": "previous", "adapter": parent.id})
    columns.append({"name": "this", "adapter": rec.id})
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompts = []
    for turn_id in rec.signals:
        if len(prompts) >= n:
            break
        turn = await turns.get_turn(db, turn_id)
        if turn is None:
            continue
        raw = turn.request.get("messages", [])
        messages = [Message.model_validate(m) for m in raw]
        answers = {c["name"]: await _complete(model, messages, params, c["adapter"]) for c in columns}
        prompts.append(
            {"turn_id": turn_id, "prompt": last_user_text(raw), "logged": turn.response_text, "answers": answers}
        )
    return {
        "adapter_id": rec.id,
        "parent_id": rec.parent_id,
        "columns": columns,
        "prompts": prompts,
        "max_tokens": max_tokens,
    }


async def _complete(model: ServedModel, messages: list[Message], params: SamplingParams, adapter: str | None) -> str:
    """One background completion, retried after each user request that preempts it."""
    for _ in range(MAX_PREEMPTIONS):
        try:
            return await model.complete(messages, params, adapter=adapter, background=True)
        except Preempted:
            await model.runner.wait_quiet(QUIET_BEFORE_RETRY_S)
    raise Busy("the model is busy serving requests: try the comparison again in a moment")
