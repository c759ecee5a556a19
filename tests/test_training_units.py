"""Fast unit tests of the pieces around the trainer: the overnight window, the stable holdout
split, sample fitting, the live check's verdicts, and the adapter rows' invariants."""

from __future__ import annotations

import sqlite3
from datetime import datetime

import numpy as np
import pytest

from clawd.adapters import live_check
from clawd.errors import InvalidRequest
from clawd.scheduler import in_window
from clawd.store import adapters as rows
from clawd.store.db import Database
from clawd.training.data import fit, is_holdout


@pytest.mark.parametrize("window,hhmm,inside", [
    ("01:00-06:00", "03:00", True), ("01:00-06:00", "06:00", False), ("01:00-06:00", "00:59", False),
    ("22:30-05:00", "23:00", True), ("22:30-05:00", "04:59", True), ("22:30-05:00", "12:00", False),
    ("", "03:00", False),
])
def test_window(window, hhmm, inside):
    assert in_window(window, datetime.strptime(f"2026-12-02 {hhmm}", "%Y-%m-%d %H:%M")) is inside


def test_bad_window_is_a_clear_error():
    with pytest.raises(InvalidRequest, match="01:00-06:00"):
        in_window("3am", datetime.now())


def test_holdout_split_is_stable_and_near_its_fraction():
    ids = [f"chatcmpl-{i}" for i in range(2000)]
    first = [is_holdout(t, 0.2) for t in ids]
    assert first == [is_holdout(t, 0.2) for t in ids]
    assert 0.17 < sum(first) / len(ids) < 0.23
    assert not any(is_holdout(t, 0.0) for t in ids)


def test_fit_cuts_old_prompt_tokens_first_and_keeps_bos():
    prompt, response = list(range(100)), list(range(1000, 1020))
    p, r = fit(prompt, response, 50, keep_first=True)
    assert r == response and len(p) + len(r) == 50
    assert p[0] == 0 and p[1:] == prompt[-29:]
    p, r = fit(prompt, list(range(1000, 1100)), 50, keep_first=False)
    assert len(p) + len(r) == 50 and r == list(range(1000, 1042))
    assert fit([1, 2], [3], 50, keep_first=True) == ([1, 2], [3])


def test_live_check_verdicts():
    rng = np.random.default_rng(0)
    predicted = rng.normal(0, 0.3, 40)
    probe = {"delta": predicted.tolist()}
    ok, info = live_check(probe, predicted + rng.normal(0, 0.05, 40))  # served tracks MLX (Q4 noise)
    assert ok and info["corr"] > 0.9
    ok, _ = live_check(probe, np.zeros(40))  # a silent no-op adapter
    assert not ok
    ok, _ = live_check(probe, -predicted)  # moves, but the wrong way (e.g. a transposed matrix)
    assert not ok
    ok, _ = live_check(probe, 20 * predicted)  # scale applied 20x (the alpha pitfall)
    assert ok is True  # correlated: the direction is right; gate metrics catch size separately


async def test_at_most_one_active_adapter_and_rollback_target(tmp_path):
    db = await Database.open(tmp_path / "c.db")
    try:
        for i in range(3):
            await rows.insert(db, rows.AdapterRecord(id=f"a{i}", path=str(tmp_path / f"a{i}"), model="m",
                                                     signals=[f"t{i}"]))
        await rows.activate(db, "a0", previous_id=None)
        await rows.activate(db, "a1", previous_id="a0", note="replaced by a1")
        assert (await rows.active(db)).id == "a1"
        assert (await rows.active(db)).previous_id == "a0"
        a0 = await rows.get(db, "a0")
        assert a0.status == "retired" and a0.note == "replaced by a1"
        with pytest.raises(sqlite3.IntegrityError):  # the schema itself refuses a second active row
            await db.conn.execute("UPDATE adapters SET status = 'active' WHERE id = 'a2'")
        await rows.set_status(db, "a2", "rejected", "failed the eval gate")
        assert await rows.trained_turns(db) == {"t0", "t1"}  # a rejected run frees its signals
        await rows.activate(db, None, previous_id=None)
        assert await rows.active(db) is None
        with pytest.raises(KeyError):
            await rows.activate(db, "nope", previous_id=None)
    finally:
        await db.close()
