"""Signal datasets (`clawd export signals`): the mined, non-vetoed, ready signals as files other
trainers read.

Boundary: reads clawd's SQLite database directly, read-only, and writes JSON Lines. It
never writes the database and never talks to the daemon or an engine.

Why the database and not the daemon's HTTP API (which the other CLI commands use):
- it works whether or not the daemon runs (export on a laptop whose daemon is stopped,
  or copy `clawd.db` to a cluster and export there);
- SQLite in WAL mode lets a reader take a consistent snapshot while the daemon keeps
  writing, without blocking it, and `mode=ro` makes a write impossible, so each table keeps
  its one writer module (the store decoders are reused, not copied);
- a dataset can be large (teacher arrays are n x k floats per turn): rows stream to the
  file one by one, instead of through one huge JSON response held in the daemon's memory
  while it serves the user.

Formats (one JSON object per line):
- `trl`: TRL's conversational prompt-completion / unpaired-preference columns
  (`prompt`, `completion`, `label`) plus `reward`, `hint`, `teacher_prompt` and the
  token-level arrays (see `trl_row`).
- `jsonl`: the raw form, `{"signal": {...}, "turn": {...}}` with every stored field.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import IO, Any

import numpy as np

from clawd.errors import ClawdError
from clawd.protocol import Message
from clawd.served import teacher_messages
from clawd.store import signals, turns
from clawd.store.migrations import latest_id

FORMATS = ("trl", "jsonl")
_SIGNALS_MIGRATION = 2  # m002 created the signals table


class ExportError(ClawdError):
    code = "export_failed"


def _open_read_only(db_file: Path) -> sqlite3.Connection:
    if not db_file.is_file():
        raise ExportError(
            f"no clawd database at {db_file}: nothing has been logged yet "
            "(chat through `clawd serve` first, or set CLAWD_HOME)"
        )
    try:
        conn = sqlite3.connect(db_file.resolve().as_uri() + "?mode=ro", uri=True, timeout=5.0)
        conn.row_factory = sqlite3.Row
        rows = conn.execute("SELECT MAX(id) FROM migrations").fetchall()
    except sqlite3.Error as e:
        raise ExportError(
            f"cannot read {db_file} as a clawd database ({e}): check the file, or point CLAWD_HOME at the right home"
        ) from e
    level = rows[0][0] or 0
    if level > latest_id():
        conn.close()
        raise ExportError(
            f"{db_file} was written by a newer clawd (schema {level}, this clawd knows {latest_id()}): upgrade clawd"
        )
    if level < _SIGNALS_MIGRATION:
        conn.close()
        raise ExportError(f"{db_file} predates training signals: run `clawd serve` once to upgrade it")
    return conn


def _list(a: np.ndarray | None) -> list | None:
    # float32 -> Python float is exact, and JSON's shortest repr reads back to the same float32.
    # NaN means "not measured" (an upstream engine's end token): JSON has no NaN, so null.
    if a is None:
        return None
    if a.dtype.kind == "f" and np.isnan(a).any():
        return np.where(np.isnan(a), None, a.astype(object)).tolist()
    return a.tolist()


def _chat_messages(messages: list[dict]) -> list[dict]:
    """Request messages with list-of-parts content joined to a string, as chat templates
    (and TRL) expect; tool calls and ids are kept."""
    out = []
    for m in messages:
        msg = Message.model_validate(m)
        d = msg.model_dump(exclude_none=True)
        if msg.content is not None:
            d["content"] = msg.text()
        out.append(d)
    return out


def trl_row(sig: signals.Signal, turn: turns.TurnRecord) -> dict[str, Any]:
    """One training example in TRL's conversational format, with clawd's signals beside it.

    - prompt: the request messages; completion: the assistant's reply as one message.
    - label: KTO's unpaired-preference label, True for reward +1, False for -1, None for 0
      (a hint-only example: filter it out for KTO, keep it for distillation).
    - reward: +1 / -1 / 0 (METHOD §2); reward_source says what decided it.
    - hint / teacher_prompt: the selected hindsight hint, and the prompt the teacher saw
      (the last user message + the hint); None when the turn has no hint.
    - completion_ids: the sampled token ids the user received (not a stop string's; the
      end-of-turn token when the turn ended with one); every array below is aligned with them.
    - teacher_logprobs (n): the teacher's log-prob of each sampled token.
    - student_top_ids / student_top_logprobs (n, top_k): the served policy's top-k tokens and
      log-probs at each position; teacher_top_logprobs (n, top_k): the teacher's log-probs
      of those same tokens. All None when no hint was scored.
    """
    reward = sig.reward or 0
    messages = turn.request["messages"]
    n = len(turn.response_ids) if turn.response_seen is None else turn.response_seen

    def head(arr):
        return None if arr is None else _list(arr[:n])

    return {
        "prompt": _chat_messages(messages),
        "completion": [{"role": "assistant", "content": turn.response_text}],
        "tools": turn.request.get("tools"),
        "label": None if reward == 0 else reward > 0,
        "reward": reward,
        "reward_source": sig.reward_source,
        "hint": sig.hint,
        "teacher_prompt": _chat_messages(
            [m.model_dump(exclude_none=True) for m in teacher_messages(messages, sig.hint)]
        )
        if sig.hint
        else None,
        "prompt_ids": turn.prompt_ids,
        "completion_ids": turn.response_ids[:n],
        "completion_logprobs": head(turn.response_logprobs),
        "teacher_logprobs": head(sig.teacher_logprobs),
        "top_k": sig.top_k,
        "student_top_ids": head(sig.student_top_ids),
        "student_top_logprobs": head(sig.student_top_logprobs),
        "teacher_top_logprobs": head(sig.teacher_top_logprobs),
        "turn_id": turn.id,
        "session_id": turn.session_id,
        "model": turn.model,
        "engine": turn.engine,
        "chat_format": turn.chat_format,
        "adapter_id": turn.adapter_id,
        "created_at": turn.created_at,
    }


def raw_row(sig: signals.Signal, turn: turns.TurnRecord) -> dict[str, Any]:
    """Every stored field of the signal and its turn, arrays as (nested) lists."""

    def plain(obj) -> dict:
        return {k: _list(v) if isinstance(v, np.ndarray) else v for k, v in obj.__dict__.items()}

    return {"signal": plain(sig), "turn": plain(turn)}


def iter_examples(db_file: Path, fmt: str) -> Iterator[dict[str, Any]]:
    """The exportable signals of the database at `db_file`, oldest first, as rows of `fmt`.

    Raises:
        ExportError: no database, not a clawd database, or an unknown format.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    make = trl_row if fmt == "trl" else raw_row
    with closing(_open_read_only(db_file)) as conn:
        # One read transaction: a consistent snapshot even while the daemon writes.
        conn.execute("BEGIN")
        for srow in conn.execute(signals.TRAINABLE_SQL, (-1,)):  # LIMIT -1: no limit
            sig = signals.from_row(srow)
            trow = conn.execute("SELECT * FROM turns WHERE id = ?", (sig.turn_id,)).fetchone()
            if trow is not None:  # cascade-deleted with its signal; never half a pair
                yield make(sig, turns.from_row(trow))
        conn.rollback()


def export_signals(db_file: Path, fmt: str, out: IO[str] | None = None) -> int:
    """Write the exportable signals as JSON Lines to `out` (stdout by default).

    Returns: the number of examples written.
    """
    out = out or sys.stdout
    n = 0
    for row in iter_examples(db_file, fmt):
        out.write(json.dumps(row, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n")
        n += 1
    return n
