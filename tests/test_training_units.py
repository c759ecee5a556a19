"""Fast unit tests of the pieces around the trainer: the overnight window, the stable holdout
split, sample fitting, the live check's verdicts, the adapter rows' invariants, and the
trainer's step metrics, checkpoints, stops, job eligibility and weight-cache sweep."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from clawd.adapters import live_check
from clawd.errors import InvalidRequest
from clawd.jobs import fit, is_holdout
from clawd.scheduler import in_window
from clawd.store import adapters as rows
from clawd.store.db import Database
from tests.conftest import authed


@pytest.mark.parametrize(
    "window,hhmm,inside",
    [
        ("01:00-06:00", "03:00", True),
        ("01:00-06:00", "06:00", False),
        ("01:00-06:00", "00:59", False),
        ("22:30-05:00", "23:00", True),
        ("22:30-05:00", "04:59", True),
        ("22:30-05:00", "12:00", False),
        ("", "03:00", False),
    ],
)
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
            await rows.insert(
                db, rows.AdapterRecord(id=f"a{i}", path=str(tmp_path / f"a{i}"), model="m", signals=[f"t{i}"])
            )
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


# --- trainer reporting, checkpoints, stops, job eligibility, weight cache ----------------------


def test_step_metrics_pool_each_term_over_the_samples_that_have_it():
    from clawd.training.run import step_metrics

    # An RL-only sample (no hint -> opd 0, opd_clip_frac 0) and an OPD-only one (r = 0): each
    # term is that one sample's value, not half of it; token-pooled metrics weigh by tokens.
    rl_only = (
        {
            "loss": 0.4,
            "rl": 0.4,
            "opd": 0.0,
            "reward_mean": 1.0,
            "ratio_mean": 1.2,
            "rl_clip_frac": 0.5,
            "opd_clip_frac": 0.0,
            "n_samples": 1.0,
        },
        {"rl": 1, "reward_mean": 1, "ratio_mean": 4, "rl_clip_frac": 4, "opd": 0, "opd_clip_frac": 0},
    )
    opd_only = (
        {
            "loss": 0.1,
            "rl": 0.0,
            "opd": 0.1,
            "reward_mean": 0.0,
            "ratio_mean": 0.0,
            "rl_clip_frac": 0.0,
            "opd_clip_frac": 0.25,
            "n_samples": 1.0,
        },
        {"rl": 0, "reward_mean": 0, "ratio_mean": 0, "rl_clip_frac": 0, "opd": 1, "opd_clip_frac": 12},
    )
    rl_short = (
        {
            "loss": -0.2,
            "rl": -0.2,
            "opd": 0.0,
            "reward_mean": -1.0,
            "ratio_mean": 0.9,
            "rl_clip_frac": 0.0,
            "opd_clip_frac": 0.0,
            "n_samples": 1.0,
        },
        {"rl": 1, "reward_mean": 1, "ratio_mean": 2, "rl_clip_frac": 2, "opd": 0, "opd_clip_frac": 0},
    )
    none = (
        {
            "loss": 0.0,
            "rl": 0.0,
            "opd": 0.0,
            "reward_mean": 0.0,
            "ratio_mean": 0.0,
            "rl_clip_frac": 0.0,
            "opd_clip_frac": 0.0,
            "n_samples": 0.0,
        },  # a weight-0 ablation emptied it
        {"rl": 0, "reward_mean": 0, "ratio_mean": 0, "rl_clip_frac": 0, "opd": 0, "opd_clip_frac": 0},
    )
    m = step_metrics([rl_only, opd_only, rl_short, none])
    assert m["opd"] == pytest.approx(0.1) and m["opd_clip_frac"] == pytest.approx(0.25)
    assert m["rl"] == pytest.approx(0.1) and m["reward_mean"] == pytest.approx(0.0)
    assert m["ratio_mean"] == pytest.approx((4 * 1.2 + 2 * 0.9) / 6)
    assert m["rl_clip_frac"] == pytest.approx(2 / 6)
    assert m["loss"] == pytest.approx(0.3 / 3) and m["n_samples"] == 3
    assert step_metrics([opd_only])["rl"] == 0.0  # a term no sample has reads 0, not NaN


def test_a_weighted_samples_loss_is_logged_as_the_objective():
    """training.teacher_answers_weight: a signal (loss 2) and an answer (loss 4) weighted 0.5 log
    (2 + 0.5·4) / 1.5, the weighted mean the gradient follows, not 0.5²."""
    from clawd.training.run import step_metrics, weighted

    signal = ({"loss": 2.0, "opd": 2.0, "n_samples": 1.0}, {"opd": 1})
    loss, metrics = weighted((4.0, {"opd": 4.0, "n_samples": 1.0}), 0.5)
    m = step_metrics([signal, ({"loss": loss, **metrics}, {"opd": 1})])
    assert m["loss"] == pytest.approx((2 + 0.5 * 4) / 1.5) and m["n_samples"] == 1.5


def test_step_metrics_match_the_loss_on_the_whole_batch():
    """train() runs one sample at a time; its step metrics must equal hybrid_loss's own pooled
    metrics over the same samples as one padded batch (METHOD §5 definitions)."""
    import mlx.core as mx

    from clawd.training.data import Sample
    from clawd.training.loss import LossWeights, hybrid_loss
    from clawd.training.run import metric_counts, step_metrics

    rng = np.random.default_rng(0)
    k, lens = 4, [5, 3, 7, 4]
    samples = [
        Sample("a", [1], [2] * lens[0], 1, None),
        Sample("b", [1], [2] * lens[1], 0, [1, 3]),
        Sample("c", [1], [2] * lens[2], -1, [1, 3]),
        Sample("d", [1], [2] * lens[3], 1, None),
    ]
    T = max(lens)
    lp_old = rng.normal(-2, 0.5, (4, T))
    lp_new = lp_old + rng.normal(0, 0.4, (4, T))
    top_old = rng.normal(-2, 0.5, (4, T, k))
    top_new = top_old + rng.normal(0, 0.4, (4, T, k))
    teacher = top_old + rng.normal(0, 1.0, (4, T, k))
    mask = np.array([[j < n for j in range(T)] for n in lens], np.float32)
    reward = np.array([s.reward for s in samples], np.float32)
    hint = np.array([s.teacher_prompt_ids is not None for s in samples])
    for w in (LossWeights(), LossWeights(rl=0.0), LossWeights(opd=0.0)):

        def call(rows):
            a = lambda x: mx.array(x[rows].astype(np.float32))  # noqa: E731
            loss, m = hybrid_loss(
                a(lp_new),
                a(lp_old),
                mx.array(reward[rows]),
                a(top_new),
                a(top_old),
                a(teacher),
                mx.array(hint[rows]),
                mx.array(mask[rows]),
                w,
            )
            return {"loss": float(loss), **{key: float(v) for key, v in m.items()}}

        per_sample = []
        for i, s in enumerate(samples):
            n = lens[i]
            one = lambda x: x[i : i + 1, :n]  # noqa: E731
            a = lambda x: mx.array(one(x).astype(np.float32))  # noqa: E731
            loss, m = hybrid_loss(
                a(lp_new),
                a(lp_old),
                mx.array(reward[i : i + 1]),
                a(top_new),
                a(top_old),
                a(teacher),
                mx.array(hint[i : i + 1]),
                mx.ones((1, n)),
                w,
            )
            per_sample.append(
                ({"loss": float(loss), **{key: float(v) for key, v in m.items()}}, metric_counts(s, k, w))
            )
        got, want = step_metrics(per_sample), call(np.arange(4))
        assert set(got) == set(want)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (w, key)


def _tiny_trainable():
    import mlx.core as mx
    import mlx.optimizers as optim

    from tests.tiny_mlx import add_lora, tiny_lm

    lm = add_lora(tiny_lm())
    opt = optim.AdamW(learning_rate=1e-2)
    opt.init(lm.model.trainable_parameters())
    mx.eval(opt.state)
    return lm, opt


def test_checkpoint_holds_its_history_and_survives_a_kill_between_renames(tmp_path):
    from clawd.training.run import find_checkpoint, load_checkpoint, save_checkpoint

    lm, opt = _tiny_trainable()
    ckpt = tmp_path / "checkpoint"
    assert find_checkpoint(ckpt) is None
    save_checkpoint(ckpt, lm.model, opt, 1, [{"step": 1}])
    save_checkpoint(ckpt, lm.model, opt, 2, [{"step": 1}, {"step": 2}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    assert load_checkpoint(find_checkpoint(ckpt), lm.model, opt) == (2, [{"step": 1}, {"step": 2}])

    # A kill after the old one was set aside and before the new one was renamed in: the old
    # one is still found, and the next save replaces it without a moment with none.
    ckpt.rename(tmp_path / "checkpoint.old")
    (tmp_path / "checkpoint.tmp").mkdir()  # the half-written new one
    assert find_checkpoint(ckpt) == tmp_path / "checkpoint.old"
    assert load_checkpoint(find_checkpoint(ckpt), lm.model, opt)[0] == 2
    save_checkpoint(ckpt, lm.model, opt, 3, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    assert find_checkpoint(ckpt) == ckpt

    # A missing or damaged history starts afresh instead of failing the resume.
    (ckpt / "history.json").write_text("{not json")
    assert load_checkpoint(ckpt, lm.model, opt) == (3, [])
    (ckpt / "history.json").unlink()
    assert load_checkpoint(ckpt, lm.model, opt) == (3, [])


def _tiny_job(tmp_path, model: Path):
    import dataclasses

    from clawd.config import TrainingSettings
    from clawd.training.data import Job, Sample, write_job

    settings = TrainingSettings(
        rank=4,
        alpha=8.0,
        batch_size=2,
        epochs=2,
        learning_rate=0.02,
        holdout=0.0,
        kl_bound=50.0,
        targets="q_proj,v_proj",
    )
    prompt = [0] + [ord(c) + 2 for c in "hello there"]
    job = Job(
        "ad-test",
        str(model),
        "tiny",
        dataclasses.asdict(settings),
        train=[
            Sample("t0", prompt, [ord(c) + 2 for c in " hi you"], 1, None),
            Sample("t1", prompt, [ord(c) + 2 for c in " yes no"], 0, prompt + [ord("!") + 2]),
        ],
        canary=[Sample("canary-0", prompt, [ord(c) + 2 for c in " ok"])],
    )
    job_dir = tmp_path / "jobs" / job.id
    job_dir.mkdir(parents=True)
    write_job(job, job_dir / "job.json")
    return job_dir


def test_stop_after_the_last_step_or_in_the_gate_checkpoints_and_resumes_at_the_gate(tmp_path, tiny_gguf, monkeypatch):
    import signal

    from clawd.training import run as trainer

    job_dir, cache, out = _tiny_job(tmp_path, tiny_gguf), tmp_path / "cache", tmp_path / "adapters"
    events: list[dict] = []
    stop_on = {"at": None}
    real_emit = trainer.emit

    def emit(event, **fields):
        real_emit(event, **fields)
        events.append({"event": event, **fields})
        if stop_on["at"] is not None and stop_on["at"](event, fields):
            os.kill(os.getpid(), signal.SIGTERM)  # what the scheduler's stop sends

    monkeypatch.setattr(trainer, "emit", emit)
    old_handler = signal.getsignal(signal.SIGTERM)
    try:
        # SIGTERM during the last of the 2 optimizer steps: honoured, checkpoint at len(plan).
        stop_on["at"] = lambda e, f: e == "step" and f["step"] == f["total"]
        assert trainer.run(job_dir, cache, out, stock_blas=True) == trainer.STOPPED
        assert json.loads((job_dir / "checkpoint" / "step.json").read_text())["step"] == 2
        assert [h["step"] for h in json.loads((job_dir / "checkpoint" / "history.json").read_text())] == [1, 2]
        assert not (out / "ad-test").exists()

        # Resumed: no step again, straight to the gate; SIGTERM there is honoured too.
        events.clear()
        stop_on["at"] = lambda e, f: e == "phase" and f["phase"] == "gate"
        assert trainer.run(job_dir, cache, out, stock_blas=True) == trainer.STOPPED
        assert not [e for e in events if e["event"] == "step"]
        assert json.loads((job_dir / "checkpoint" / "step.json").read_text())["step"] == 2

        events.clear()
        stop_on["at"] = None
        assert trainer.run(job_dir, cache, out, stock_blas=True) == 0
        assert not [e for e in events if e["event"] == "step"]
        meta = json.loads((out / "ad-test" / "meta.json").read_text())
        assert [h["step"] for h in meta["metrics"]["history"]] == [1, 2]
    finally:
        signal.signal(signal.SIGTERM, old_handler)


async def test_untrained_count_applies_the_job_builders_test(tmp_path, monkeypatch):
    """The scheduler's count and build_job agree on which signals a job can take: a signal whose
    turn is gone, has no sampled ids, or none the user received, is counted by neither."""
    from types import SimpleNamespace

    from clawd import jobs as data
    from clawd.config import TrainingSettings

    sigs = [SimpleNamespace(turn_id=t, reward=1, hint=None) for t in ("ok", "gone", "empty", "unseen")]
    sigs.append(SimpleNamespace(turn_id="nothing", reward=0, hint=None))
    turns_by_id = {
        "ok": SimpleNamespace(id="ok", response_ids=[5], response_seen=1),
        "empty": SimpleNamespace(id="empty", response_ids=[], response_seen=0),  # no sampled ids kept
        "unseen": SimpleNamespace(id="unseen", response_ids=[5, 6], response_seen=0),  # a stop at once
        "nothing": SimpleNamespace(id="nothing", response_ids=[5], response_seen=1),
    }

    async def trainable_ids(db, model=None, exclude=()):
        return [s.turn_id for s in sigs if s.turn_id not in exclude]

    async def get_many(db, ids):
        return [s for s in sigs if s.turn_id in ids]

    async def trained_turns(db):
        return set()

    async def get_turn(db, turn_id):
        return turns_by_id.get(turn_id)

    monkeypatch.setattr(data.signals, "trainable_ids", trainable_ids)
    monkeypatch.setattr(data.signals, "get_many", get_many)
    monkeypatch.setattr(data.adapter_rows, "trained_turns", trained_turns)
    monkeypatch.setattr(data.turns, "get_turn", get_turn)
    assert await data.untrained_count(None, "m", TrainingSettings(holdout=0.0)) == 1
    assert [s.turn_id for s in sigs if await data.usable_turn(None, s)] == ["ok"]


def test_stale_weight_cache_temp_dirs_are_swept(tmp_path, tiny_gguf):
    from clawd.training import weights

    cache = tmp_path / "cache"
    entry = weights._cache_entry(cache, tiny_gguf)
    entry.parent.mkdir(parents=True)
    stale, live = entry.parent / ".tmp-killed", entry.parent / ".tmp-writing"
    for d in (stale, live):
        d.mkdir()
        (d / "weights.safetensors").write_bytes(b"x" * 16)
    old = time.time() - 3600
    os.utime(stale / "weights.safetensors", (old, old))
    os.utime(stale, (old, old))
    weights.load_model(tiny_gguf, cache_dir=cache)
    assert not stale.exists()  # a killed writer's full-size copy
    assert live.exists()  # possibly another trainer writing right now
    assert (entry / "config.json").is_file()


def test_why_untrainable_reads_headers_only(tmp_path, tiny_gguf):
    """The daemon turns training off (with the reason) for a model the trainer cannot build,
    instead of starting a trainer that fails every run."""
    from clawd.modelfile import why_untrainable
    from tests.tiny_models import build_tiny_gguf

    assert why_untrainable(tiny_gguf) is None  # llama
    assert why_untrainable(build_tiny_gguf(tmp_path / "g.gguf", arch="gemma3")) is None
    model_dir = tmp_path / "phi"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert why_untrainable(model_dir) is None
    (model_dir / "config.json").write_text(json.dumps({"model_type": "phi3"}))
    assert why_untrainable(model_dir) == (
        "phi is a 'phi3' model, and clawd trains gemma3_text, llama, qwen2, qwen3 models only"
    )
    (model_dir / "config.json").write_text("{not json")
    assert why_untrainable(model_dir).startswith("cannot read phi's architecture")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    assert why_untrainable(bad).startswith("cannot read bad.gguf's architecture")


def test_without_training_the_api_says_why(fake_daemon):

    d = fake_daemon
    for path in ("/clawd/training", "/clawd/adapters/ad-1"):
        r = authed.get(d.url + path, headers={"Authorization": f"Bearer {d.state.token}"})
        assert r.status_code == 404, r.text
        assert "the fake engine has no local weights to train" in r.json()["error"]["message"]
