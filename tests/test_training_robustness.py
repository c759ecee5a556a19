"""What a long-running trainer must survive (tiny real model, real MLX child): two starts at
once, a stopped job that no longer fits the world, a refused run that must not be retried on
the same signals, a daemon that died between training and promotion, broken adapter files at
start-up, and exports. The daemon must start, and serve, whatever the adapters dir holds."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from clawd.errors import Busy
from clawd.store import adapters as adapter_rows
from tests.test_training_loop import make_ready_signals, training, wait_for, wait_run

# Every test here trains (or stops) a real run to the end: minutes in all, so they are `slow`.
pytestmark = pytest.mark.slow


def test_two_starts_at_once_make_one_run(train_daemon):
    d = train_daemon
    make_ready_signals(d, 2)
    sched = d.state.scheduler

    async def both():
        return await asyncio.gather(sched.run_now(), sched.run_now(), return_exceptions=True)

    results = d.run(both())
    assert sum(isinstance(r, str) for r in results) == 1, results
    assert sum(isinstance(r, Busy) for r in results) == 1, results
    assert wait_run(d)["result"]["promoted"]


@pytest.mark.parametrize("change", ["settings", "model_path"])
def test_a_stopped_job_is_dropped_when_settings_or_the_served_weights_changed(train_daemon, change):
    d = train_daemon
    sched = d.state.scheduler
    make_ready_signals(d, 4)
    first = training(d, "POST")["job_id"]
    wait_for(d, lambda s: s["phase"] == "train" and s["step"] >= 1)
    training(d, "POST", "/clawd/training/stop")
    assert wait_run(d)["result"]["resumable"]
    if change == "settings":  # the user changed a training knob: the checkpoint belongs to another config
        sched.settings = dataclasses.replace(sched.settings, learning_rate=sched.settings.learning_rate / 2)
    else:  # same model name, other weights (model.path moved): the checkpoint trained those
        job_file = sched.jobs_dir / first / "job.json"
        job_file.write_text(
            job_file.read_text().replace(
                json.dumps(str(d.state.model.runner.engine.info.path)), json.dumps("/elsewhere/model.gguf")
            )
        )
        assert "/elsewhere/model.gguf" in job_file.read_text()
    second = training(d, "POST")["job_id"]
    assert second != first and not (sched.jobs_dir / first).exists()
    assert wait_run(d)["result"]["promoted"]


def test_a_refused_run_waits_for_new_signals(train_daemon):
    d = train_daemon
    sched = d.state.scheduler
    sched.settings = dataclasses.replace(sched.settings, kl_bound=0.0, auto=True, min_signals=2, idle_minutes=0)
    make_ready_signals(d, 3)
    training(d, "POST")
    res = wait_run(d)["result"]
    assert not res["promoted"] and "refused" in res["note"], res
    go, why = d.run(sched.should_train())
    assert not go and "waiting for 2 more" in why, why
    make_ready_signals(d, 2)
    go, why = d.run(sched.should_train())
    assert go, why


def test_start_up_finishes_an_interrupted_promotion_and_survives_broken_files(train_daemon):
    d = train_daemon
    reg = d.state.registry
    make_ready_signals(d, 2)
    training(d, "POST")
    first = wait_run(d)["result"]["adapter_id"]
    make_ready_signals(d, 2)
    training(d, "POST")
    second = wait_run(d)["result"]["adapter_id"]
    assert d.state.model.active_adapter == second

    # As if the daemon had died after the trainer wrote `second` but before recording it.
    d.run(reg.rollback())
    assert d.state.model.active_adapter == first
    d.run(d.state.db.conn.execute("DELETE FROM adapters WHERE id = ?", (second,)))
    d.run(d.state.db.conn.commit())
    # Junk beside it: unreadable metadata, and a dir without weights.
    junk = reg.dir / "ad-junk"
    shutil.copytree(Path(d.run(adapter_rows.get(d.state.db, first)).path), junk)
    (junk / "meta.json").write_text("{not json")
    (reg.dir / "ad-empty").mkdir()
    (reg.dir / "ad-empty" / "meta.json").write_text(json.dumps({"id": "ad-empty"}))

    d.run(reg.restore())
    assert d.state.model.active_adapter == second  # promoted: it continued from the active one
    rec = d.run(adapter_rows.get(d.state.db, second))
    assert rec.status == "active" and rec.previous_id == first and rec.gate["live_check"]["corr"] > 0.5
    assert d.run(adapter_rows.get(d.state.db, "ad-junk")) is None

    # The active adapter's files break: start-up falls back down the rollback chain.
    (Path(rec.path) / "adapter.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    d.state.model.runner.engine.unload_adapter(second)
    d.run(reg.restore())
    assert d.state.model.active_adapter == first
    assert d.run(adapter_rows.get(d.state.db, second)).status == "rejected"


def test_a_stop_that_times_out_keeps_the_job(train_daemon):
    """A trainer that does not reach its checkpoint in time is killed, but its job (and any
    checkpoint) stays for the next run: a stop is never a reason to lose work."""
    d = train_daemon
    sched = d.state.scheduler
    make_ready_signals(d, 4)
    first = training(d, "POST")["job_id"]
    wait_for(d, lambda s: s["phase"] == "train")
    d.run(sched.stop_run(timeout_s=0.0))  # no time to checkpoint: killed at once
    res = wait_run(d)["result"]
    assert res["resumable"] and (sched.jobs_dir / first / "job.json").is_file(), res
    assert training(d, "POST")["job_id"] == first
    assert wait_run(d)["result"]["promoted"]


def test_export_goes_under_exports_and_the_cli_moves_it_on(train_daemon, tmp_path, monkeypatch, capsys):
    from clawd import cli

    d = train_daemon
    make_ready_signals(d, 2)
    training(d, "POST")
    aid = wait_run(d)["result"]["adapter_id"]
    exports = Path(d.state.exports_dir)
    with d.client() as c:
        r = c.post(f"/clawd/adapters/{aid}/export", json={"name": "ok.gguf"})  # default: gguf
        assert r.status_code == 200 and r.json()["format"] == "gguf", r.text
        assert r.json()["path"] == str(exports / "ok.gguf") and (exports / "ok.gguf").stat().st_size > 0
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CLAWD_HOME", str(d.home))
    monkeypatch.setenv("CLAWD_SERVER_PORT", str(d.state.port))
    capsys.readouterr()
    assert cli.main(["adapters", "export", aid, "--out", str(blocker / "x.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pick a writable --out path" in err, err
    assert sorted(p.name for p in exports.iterdir()) == ["ok.gguf"]  # the CLI's copy is not left behind


@pytest.mark.parametrize("train_base", ["dir"])
def test_a_dir_base_adapter_exports_as_mlx_and_peft_but_not_gguf(train_daemon, tmp_path, monkeypatch, capsys):
    """Trained on an MLX directory there is no GGUF base, so no GGUF LoRA: asking for one is a
    one-line 400 (and CLI error) that names the formats that work; mlx and peft give the weights."""
    from safetensors.numpy import load_file

    from clawd import cli

    d = train_daemon
    make_ready_signals(d, 2)
    training(d, "POST")
    aid = wait_run(d)["result"]["adapter_id"]
    src = Path(d.run(adapter_rows.get(d.state.db, aid)).path)
    exports = Path(d.state.exports_dir)
    with d.client() as c:
        r = c.post(f"/clawd/adapters/{aid}/export", json={"format": "gguf", "name": "x.gguf"})
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "no GGUF form" in msg and "MLX model directory" in msg and "--format peft" in msg, msg
        assert "\n" not in msg and not (exports / "x.gguf").exists()
        r = c.post(f"/clawd/adapters/{aid}/export", json={"format": "mlx", "name": "mlx"})
        assert r.status_code == 200, r.text
        # mlx-lm runs it on the served directory itself: nothing copied, and the command says so
        served_dir = str(d.state.model.runner.engine.info.path)
        assert r.json()["mlx_model"] == served_dir and not (exports / "mlx" / "base").exists()
        assert r.json()["command"].startswith(f"mlx_lm.generate --model {served_dir} --adapter-path {exports / 'mlx'}")
        r = c.post(f"/clawd/adapters/{aid}/export", json={"format": "peft", "name": "peft"})
        assert r.status_code == 200, r.text
    for name in ("adapters.safetensors", "adapter_config.json"):
        assert (exports / "mlx" / name).read_bytes() == (src / name).read_bytes()
    mlx_w = load_file(str(src / "adapters.safetensors"))
    peft_w = load_file(str(exports / "peft" / "adapter_model.safetensors"))
    assert len(peft_w) == len(mlx_w) > 0
    for name, a in mlx_w.items():
        module, leaf = name.rsplit(".", 1)
        peft_name = f"base_model.model.{module}.lora_{leaf[-1].upper()}.weight"
        np.testing.assert_array_equal(peft_w[peft_name], a.T)
    peft_cfg = json.loads((exports / "peft" / "adapter_config.json").read_text())
    assert peft_cfg["r"] == 4 and peft_cfg["lora_alpha"] == 8.0  # TRAIN_ENV: rank 4, alpha 8

    monkeypatch.setenv("CLAWD_HOME", str(d.home))
    monkeypatch.setenv("CLAWD_SERVER_PORT", str(d.state.port))
    capsys.readouterr()
    assert cli.main(["adapters", "export", aid, "--format", "gguf", "--out", str(tmp_path / "y.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no GGUF form" in err, err
    assert cli.main(["adapters", "export", aid, "--out", str(tmp_path / "default")]) == 0  # no GGUF: mlx
    out = capsys.readouterr().out
    assert out.startswith(f"exported {aid} as mlx to ") and "(the MLX directory clawd serves; nothing copied)" in out
    assert (tmp_path / "default" / "adapters.safetensors").read_bytes() == (src / "adapters.safetensors").read_bytes()
