"""`clawd adapters export --format mlx` on a GGUF base writes the base as an mlx-lm model folder
(clawd/training/mlx_model_dir.py): per architecture it is the trainer's model (same token ids,
logits within bfloat16 rounding); README's two commands, run as written there on a really
trained adapter, make mlx-lm generate, with the greedy tokens clawd's own MLX model picks."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from clawd import cli  # noqa: E402
from clawd.errors import ModelLoadError  # noqa: E402
from clawd.store import adapters as adapter_rows  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.test_training_loop import make_ready_signals, training, wait_run  # noqa: E402
from tests.test_training_weights import random_ids, tiny, tiny_dir  # noqa: E402,F401

PROBE = "Hello world, the capital of France is Paris. 1234 émoji 🎉"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_gguf_written_as_an_mlx_lm_folder_is_the_trainers_model(tiny_dir, tmp_path, arch):
    """mlx_lm.load reads the folder; its tokenizer gives llama.cpp's ids and its logits are the
    trainer's float32 model's up to bfloat16 rounding (llama's un-permuted q/k, Gemma's norms
    and sliding window all carried over: any of them wrong moves logits by whole units)."""
    from mlx_lm.utils import load

    from clawd.training.mlx_model_dir import write_mlx_model_dir
    from clawd.training.weights import load_model

    src = tiny(tiny_dir, arch)
    out = write_mlx_model_dir(src, tmp_path / "base")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # built aside, renamed into place
    model, tok = load(str(out))
    ours = load_model(src)
    assert tok.encode(PROBE) == ours.tokenizer.encode(PROBE, add_bos=True)
    assert set(tok.eos_token_ids) == set(ours.tokenizer.eos_ids)

    ids = mx.array([random_ids(ours.model.args.vocab_size, 150)])  # past gemma3's 64-token window
    theirs = np.array(nn_log_softmax(model(ids).astype(mx.float32)))[0]
    want = np.array(nn_log_softmax(ours.model(ids)))[0]
    err = np.abs(theirs - want)
    assert err.mean() < 0.05 and err.max() < 0.5, (err.mean(), err.max())
    assert (theirs.argmax(-1) == want.argmax(-1)).mean() > 0.95

    # written again (a re-export) it replaces the folder whole
    (out / "stale.txt").write_text("from an older export")
    write_mlx_model_dir(src, out)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()


def nn_log_softmax(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_rope_frequency_factors_are_refused_with_what_to_do_instead():
    """Llama 3.1+'s per-dimension rope factors have no mlx-lm config clawd writes: a clear
    refusal, not a folder that loads and silently generates with the wrong positions."""
    from clawd.training.mlx_model_dir import _config

    meta = {"args": {"model_type": "llama"}, "rope_factors": [1.0, 2.0]}
    with pytest.raises(ModelLoadError, match="--format peft"):
        _config("llama", meta, {}, [1], 0)


def readme_mlx_commands() -> tuple[str, str]:
    """The export line and the mlx-lm line of README's *Exporting an adapter* block."""
    section = (ROOT / "README.md").read_text().split("## Exporting an adapter", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "README's *Exporting an adapter* section lost its ```sh block"
    lines = [ln.strip() for ln in block.group(1).splitlines() if ln.strip()]
    export = [ln for ln in lines if ln.startswith("clawd adapters export ")]
    run = [ln for ln in lines if ln.startswith("mlx_lm.")]
    assert len(export) == 1 and len(run) == 1, lines
    return export[0], run[0]


def greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens by full recompute (tiny model: no cache to get wrong)."""
    ids = list(ids)
    for _ in range(n):
        logits = model(mx.array([ids]))[0, -1]
        ids.append(int(mx.argmax(logits).item()))
    return ids[-n:]


@pytest.mark.slow  # a real training run, then mlx-lm in a subprocess
def test_readme_mlx_lm_command_runs_an_exported_adapter_of_a_gguf_base(train_daemon, tmp_path, monkeypatch, capsys):
    from mlx_lm.utils import load

    from clawd.training.export import load_mlx_adapter
    from clawd.training.weights import load_model

    d = train_daemon
    make_ready_signals(d, 2)
    training(d, "POST")
    aid = wait_run(d)["result"]["adapter_id"]
    src = Path(d.run(adapter_rows.get(d.state.db, aid)).path)
    export_line, run_line = readme_mlx_commands()

    # README's export line, as written (ID filled in), from the folder the user is in
    monkeypatch.setenv("CLAWD_HOME", str(d.home))
    monkeypatch.setenv("CLAWD_SERVER_PORT", str(d.state.port))
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(export_line.replace(" ID ", f" {aid} "))
    assert argv[0] == "clawd" and aid in argv
    capsys.readouterr()
    assert cli.main(argv[1:]) == 0
    printed = capsys.readouterr().out
    out_dir = Path(argv[argv.index("--out") + 1]).resolve()
    base = out_dir / "base"
    assert f"exported {aid} as mlx to {out_dir}" in printed
    assert re.search(r"base model: .*/base \(\d+\.\d\d GB, bfloat16", printed), printed
    # the command printed is README's, with the absolute path the export went to
    assert printed.rstrip().endswith(run_line.replace("my-adapter", str(out_dir))), printed
    for name in ("adapters.safetensors", "adapter_config.json"):
        assert (out_dir / name).read_bytes() == (src / name).read_bytes()
    config = json.loads((base / "config.json").read_text())
    assert config["model_type"] == "llama" and config["torch_dtype"] == "bfloat16"
    assert not list(tmp_path.glob(".*tmp*")) and not list(out_dir.glob(".*tmp*"))  # no half-written folders

    # README's mlx-lm line, as written, in a shell, where the export was made
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(run_line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = re.search(r"==========\n(.*)\n==========\nPrompt: (\d+) tokens.*\nGeneration: (\d+) tokens", proc.stdout, re.S)
    assert m, proc.stdout
    text, n_gen = m.group(1), int(m.group(3))
    assert n_gen > 0 and text.strip(), proc.stdout

    # greedy, first tokens: mlx-lm on the exported folder + adapter == clawd's own MLX model + adapter
    model, tok = load(str(base), adapter_path=str(out_dir))
    ours = load_model(d.state.model.runner.engine.info.path)
    ours.model.freeze()
    load_mlx_adapter(ours.model, src)
    prompt = re.search(r'--prompt "([^"]*)"', run_line).group(1)
    ids = tok.encode(prompt)
    assert ids == ours.tokenizer.encode(prompt, add_bos=True)  # the rebuilt tokenizer is llama.cpp's
    theirs_ids, our_ids = greedy(model, ids, 8), greedy(ours.model, ids, 8)
    assert theirs_ids == our_ids
    # and the text mlx-lm printed starts with what those tokens spell
    assert text.startswith(tok.decode(theirs_ids[:4]).rstrip("\ufffd")), (text, tok.decode(theirs_ids))
