"""Adapters on a real llama.cpp daemon (tiny model, real GGUF LoRA files): the review routes
the TUI needs (what an adapter learned from, side-by-side answers, training curves) and the
Adapters screen's activate / roll back through the confirmation modal."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from clawd.store import turns as turn_rows
from tests.conftest import TEST_TOKEN, authed, start_daemon
from tests.test_tui_app import SIZE, notifications, until
from tui.app import ClawdApp
from tui.client import DaemonClient
from tui.screens.modals import ConfirmModal

ENV = {"CLAWD_TRAINING_AUTO": 0}


@pytest.fixture
def lora_daemon(clawd_home, tiny_gguf):
    from clawd.engines.llamacpp import Engine

    d = start_daemon(clawd_home, Engine(tiny_gguf, n_ctx=256, n_threads=1, model_id="tiny"), ENV)
    yield d
    d.stop()


def chat(d, text: str) -> str:
    r = authed.post(
        f"{d.url}/v1/chat/completions",
        timeout=60,
        headers={"X-Session-Id": "s-review"},
        json={"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8, "seed": 1},
    )
    assert r.status_code == 200, r.text
    return r.json()["id"]


def make_adapter(
    d,
    tmp_path,
    adapter_id: str,
    *,
    seed: int,
    parent_id: str | None,
    signals: list[str],
    history: list[dict] | None = None,
) -> None:
    """An adapter dir as the trainer writes it (real GGUF LoRA; a probe measured on this very
    engine, so the registry's live check passes), registered through the registry."""
    from tests.tiny_models import build_tiny_lora

    engine, runner, registry = d.state.model.runner.engine, d.state.model.runner, d.state.registry
    adir = registry.dir / adapter_id
    adir.mkdir(parents=True)
    build_tiny_lora(tmp_path / f"{adapter_id}.gguf", engine.info.path, seed=seed)
    shutil.copyfile(tmp_path / f"{adapter_id}.gguf", adir / "adapter.gguf")
    turn = d.run(turn_rows.get_turn(d.state.db, signals[0]))
    p, t = turn.prompt_ids, turn.response_ids[:4]
    d.run(runner.call(engine.load_adapter, "probe", adir / "adapter.gguf"))
    delta = (
        d.run(runner.call(engine.score, p, t, adapter="probe")).logprobs
        - d.run(runner.call(engine.score, p, t, adapter=None)).logprobs
    )
    d.run(runner.call(engine.unload_adapter, "probe"))
    meta = {
        "id": adapter_id,
        "parent_id": parent_id,
        "model": "tiny",
        "created_at": time.time(),
        "signals": signals,
        "holdout": [],
        "metrics": {"history": history or []},
        "gate": {"passed": True, "gain": 0.01, "kl_to_base": 0.001},
        "probe": {"prompt_ids": p, "response_ids": t, "delta": delta.tolist()},
    }
    (adir / "meta.json").write_text(json.dumps(meta))
    d.run(registry.register(adir))


@pytest.fixture
def two_adapters(lora_daemon, tmp_path):
    """ad-one (from the base model), then ad-two continued from it and active."""
    d = lora_daemon
    ids = [chat(d, f"question {i}?") for i in range(3)]
    make_adapter(
        d,
        tmp_path,
        "ad-one",
        seed=1,
        parent_id=None,
        signals=ids[:1],
        history=[{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}],
    )
    make_adapter(d, tmp_path, "ad-two", seed=2, parent_id="ad-one", signals=ids[1:])
    d.run(d.state.registry.activate("ad-one"))
    d.run(d.state.registry.activate("ad-two"))
    return d, ids


def test_adapter_signals_name_their_prompts(two_adapters):
    d, ids = two_adapters
    out = authed.get(f"{d.url}/clawd/adapters/ad-two/signals").json()
    assert [s["turn_id"] for s in out["signals"]] == ids[1:]
    assert [s["prompt"] for s in out["signals"]] == ["question 1?", "question 2?"]
    assert all(not s["held_out"] and not s["missing"] for s in out["signals"])
    assert authed.get(f"{d.url}/clawd/adapters/nope/signals").status_code == 404


def test_compare_answers_side_by_side_without_logging_turns(two_adapters):
    d, ids = two_adapters
    before = authed.get(f"{d.url}/clawd/status").json()["turns"]
    r = authed.post(f"{d.url}/clawd/adapters/ad-two/compare", params={"n": 2, "max_tokens": 12}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["name"] for c in out["columns"]] == ["base", "previous", "this"]
    assert [c["adapter"] for c in out["columns"]] == [None, "ad-one", "ad-two"]
    assert [p["turn_id"] for p in out["prompts"]] == ids[1:]
    answers = [p["answers"] for p in out["prompts"]]
    assert all(set(a) == {"base", "previous", "this"} for a in answers)
    # The adapters really are worn: some answer differs from the base model's (greedy, same prompt).
    assert any(a["this"] != a["base"] or a["previous"] != a["base"] for a in answers)
    again = authed.post(f"{d.url}/clawd/adapters/ad-two/compare", params={"n": 2, "max_tokens": 12}, timeout=120)
    assert [p["answers"] for p in again.json()["prompts"]] == answers  # greedy: reproducible
    assert authed.get(f"{d.url}/clawd/status").json()["turns"] == before  # nothing logged as a turn
    assert d.state.model.active_adapter == "ad-two"  # comparing never switches what is served
    bad = authed.post(f"{d.url}/clawd/adapters/ad-two/compare", params={"n": 0})
    assert bad.status_code == 400


def test_training_history_live_then_from_the_newest_adapter(two_adapters):
    d, _ = two_adapters
    # No run in this daemon's life yet: the newest adapter with a recorded curve.
    out = authed.get(f"{d.url}/clawd/training/history").json()
    assert out == {
        "job_id": "ad-one",
        "source": "adapter",
        "steps": [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}],
    }
    sched = d.state.scheduler
    for step in (1, 2, 3):  # the trainer child's step events, as the scheduler reads them
        sched._event(json.dumps({"event": "step", "time": 0, "step": step, "total": 3, "loss": 1.0 / step}).encode())
    out = authed.get(f"{d.url}/clawd/training/history").json()
    assert out["source"] == "live" and [s["step"] for s in out["steps"]] == [1, 2, 3]
    assert out["steps"][-1]["loss"] == pytest.approx(1 / 3)
    assert "history" not in authed.get(f"{d.url}/clawd/status").json()["training"]  # status stays small


async def test_rollback_and_activate_through_the_confirmation(two_adapters):
    d, _ = two_adapters
    app = ClawdApp(DaemonClient(d.url, token=TEST_TOKEN), poll_s=0.5)
    active = lambda: authed.get(f"{d.url}/clawd/status").json()["active_adapter"]  # noqa: E731
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await until(pilot, lambda: app.screen.adapters and app.screen.active == "ad-two", what="the adapters")

        await pilot.press("b")
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal), what="the confirmation")
        assert "ad-one" in app.screen.question
        await pilot.pause(0.2)
        await pilot.click("#cancel")
        await pilot.pause(0.3)
        assert active() == "ad-two"  # cancelled: nothing changed

        await pilot.press("b")
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal), what="the confirmation")
        await pilot.pause(0.2)
        await pilot.click("#confirm")
        await until(pilot, lambda: active() == "ad-one", timeout=60, what="the rollback")
        await until(pilot, lambda: app.screen.active == "ad-one", what="the table to follow")

        # The selected row is ad-two (newest first): activate it again, confirmed with `y`.
        assert app.screen.selected["id"] == "ad-two"
        await pilot.press("a")
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal), what="the confirmation")
        await pilot.press("y")
        await until(pilot, lambda: active() == "ad-two", timeout=60, what="the activation")

        # Side by side, generated by the daemon, shown under the adapter.
        await pilot.press("g")
        await until(pilot, lambda: app.screen.comparison is not None, timeout=120, what="the comparison")
        assert app.screen.comparison["adapter_id"] == "ad-two" and len(app.screen.comparison["prompts"]) == 2
        assert not [m for m in notifications(app) if "HTTP" in m]
