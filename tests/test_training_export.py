"""clawd.training.export: an MLX LoRA adapter as mlx-lm, GGUF (served by llama.cpp) and PEFT files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx.utils import tree_flatten  # noqa: E402

from clawd.errors import AdapterError  # noqa: E402
from clawd.training import weights  # noqa: E402
from clawd.training.export import (  # noqa: E402
    check_gguf_lora,
    load_mlx_adapter,
    mlx_to_gguf,
    mlx_to_peft,
    save_mlx_adapter,
)
from clawd.training.weights import load_model  # noqa: E402
from tests.test_training_weights import mlx_logprobs, random_ids, tiny, tiny_dir  # noqa: E402,F401
from tests.tiny_models import build_tiny_gguf, build_tiny_lora  # noqa: E402

KEYS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]
RANK, SCALE = 4, 2.0


def lora_model(path: Path, *, keys=KEYS, num_layers: int | None = None, seed: int = 0):
    """The model at `path` with LoRA whose B is random: mlx initialises B = 0, and a no-op
    adapter would pass every parity check."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    lm = load_model(path)
    lm.model.freeze()
    n = len(lm.model.layers) if num_layers is None else num_layers
    linear_to_lora_layers(lm.model, n, {"rank": RANK, "scale": SCALE, "dropout": 0.0, "keys": keys})
    rng = np.random.default_rng(seed)
    update = {
        k: mx.array((0.5 * rng.standard_normal(v.shape) / np.sqrt(RANK)).astype(np.float32))
        for k, v in tree_flatten(lm.model.trainable_parameters())
        if k.endswith("lora_b")
    }
    lm.model.load_weights(list(update.items()), strict=False)
    return lm, n


def saved(lm, n: int, out: Path, keys=KEYS) -> Path:
    save_mlx_adapter(lm.model, out, rank=RANK, scale=SCALE, num_layers=n, keys=keys, extra={"note": "test"})
    return out


def engine_logprobs(eng, ids: list[int], n_vocab: int, adapter: str | None) -> np.ndarray:
    n = len(ids) - 1
    res = eng.score(ids[:1], ids[1:], at_ids=np.tile(np.arange(n_vocab), (n, 1)), adapter=adapter)
    return res.at_logprobs


# ---- (a) parity: MLX + adapter == llama.cpp + exported GGUF adapter ---------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_gguf_adapter_in_llamacpp_matches_mlx(tiny_dir, tmp_path, arch, monkeypatch):
    from clawd.engines.llamacpp import Engine

    base = tiny(tiny_dir, arch)
    lm, n = lora_model(base)
    gguf_path = mlx_to_gguf(saved(lm, n, tmp_path / "mlx"), lm, tmp_path / "adapter.gguf")
    assert check_gguf_lora(gguf_path, base) == []
    V = lm.model.args.vocab_size
    ids = random_ids(V)
    ours = mlx_logprobs(lm, ids)

    eng = Engine(base, n_ctx=256, n_threads=1)
    try:
        eng.load_adapter("a", gguf_path)
        plain = engine_logprobs(eng, ids, V, None)
        served = engine_logprobs(eng, ids, V, "a")
        d = np.abs(ours - served)
        top1 = float((ours.argmax(-1) == served.argmax(-1)).mean())
        shift = float(np.abs(served - plain).max())
        msg = f"{arch}: max |Δ| {d.max():.2e}, mean {d.mean():.2e}, top-1 {top1:.3f}; adapter shift {shift:.2f}"
        print(msg)
        # engine keeps K/V in F16 (~3e-3 on these models); the adapter moves log-probs by nats
        assert d.max() < 1e-2 and top1 >= 0.99 and shift > 0.5, msg

        if arch == "llama":  # without the q/k row permutation llama.cpp's adapter is wrong
            monkeypatch.setattr(weights, "permute_rows", lambda w, n_head: w)
            mlx_to_gguf(tmp_path / "mlx", lm, tmp_path / "unpermuted.gguf")
            eng.load_adapter("u", tmp_path / "unpermuted.gguf")
            assert np.abs(ours - engine_logprobs(eng, ids, V, "u")).max() > 0.05
    finally:
        eng.close()


def test_gguf_export_of_the_last_layers_only(tiny_dir, tmp_path):
    """num_layers < all: only the last blocks get LoRA, and the GGUF names those blocks."""
    import gguf

    base = tiny(tiny_dir, "qwen2")
    lm, n = lora_model(base, keys=["self_attn.v_proj"], num_layers=1)
    out = mlx_to_gguf(saved(lm, n, tmp_path / "mlx", ["self_attn.v_proj"]), lm, tmp_path / "a.gguf")
    r = gguf.GGUFReader(str(out))
    assert sorted(t.name for t in r.tensors) == ["blk.1.attn_v.weight.lora_a", "blk.1.attn_v.weight.lora_b"]
    assert r.get_field("adapter.lora.alpha").contents() == pytest.approx(SCALE * RANK)
    assert r.get_field("general.type").contents() == "adapter"
    assert r.get_field("general.architecture").contents() == "qwen2"
    assert [list(t.data.shape) for t in r.tensors] == [[RANK, 64], [32, RANK]]  # A (r, in), B (out, r)


# ---- mlx-lm directory --------------------------------------------------------------------------


def test_mlx_adapter_dir_is_what_mlx_lm_loads(tiny_dir, tmp_path):
    from mlx_lm.tuner.utils import load_adapters

    base = tiny(tiny_dir, "gemma3")
    lm, n = lora_model(base)
    d = saved(lm, n, tmp_path / "mlx")
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert list(cfg) == sorted(cfg)
    assert cfg["fine_tune_type"] == "lora" and cfg["num_layers"] == n and cfg["note"] == "test"
    assert cfg["lora_parameters"] == {"rank": RANK, "scale": SCALE, "dropout": 0.0, "keys": KEYS}
    names = set(mx.load(str(d / "adapters.safetensors")))
    assert "model.layers.1.self_attn.q_proj.lora_a" in names
    assert all(k.endswith((".lora_a", ".lora_b")) for k in names) and len(names) == 2 * 7 * n
    assert {p.name for p in d.iterdir()} == {"adapters.safetensors", "adapter_config.json"}  # no temp files left

    ids = mx.array([random_ids(lm.model.args.vocab_size, 40)])
    want = lm.model(ids)
    theirs = load_model(base).model
    load_adapters(theirs, str(d))
    assert mx.allclose(theirs(ids), want, atol=1e-5).item()
    ours = load_model(base)
    ours.model.freeze()
    assert load_mlx_adapter(ours.model, d)["lora_parameters"]["rank"] == RANK
    assert mx.allclose(ours.model(ids), want, atol=1e-5).item()
    # the loaded LoRA is trainable, the base is not
    trainable = [k for k, _ in tree_flatten(ours.model.trainable_parameters())]
    assert trainable and all(k.endswith(("lora_a", "lora_b")) for k in trainable)


def test_load_mlx_adapter_lists_every_mismatch(tiny_dir, tmp_path):
    lm, n = lora_model(tiny(tiny_dir, "llama"), keys=["self_attn.q_proj", "self_attn.v_proj"])
    d = saved(lm, n, tmp_path / "mlx", ["self_attn.q_proj", "self_attn.v_proj"])

    smaller = load_model(build_tiny_gguf(tmp_path / "small.gguf", arch="llama", n_embd=32, n_ff=64))
    with pytest.raises(AdapterError) as e:
        load_mlx_adapter(smaller.model, d)
    msg = str(e.value)
    for layer in (0, 1):
        for proj in ("q_proj", "v_proj"):
            assert f"model.layers.{layer}.self_attn.{proj}.lora_a: shape (64, 4) != model's (32, 4)" in msg, msg

    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["lora_parameters"]["keys"] = ["self_attn.q_proj", "self_attn.k_proj"]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError) as e:
        load_mlx_adapter(load_model(tiny(tiny_dir, "llama")).model, d)
    msg = str(e.value)
    assert "model.layers.0.self_attn.v_proj.lora_a: not a LoRA parameter of the model" in msg
    assert "model.layers.1.self_attn.k_proj.lora_b: missing from the adapter" in msg

    with pytest.raises(AdapterError, match="not a readable mlx-lm adapter"):
        load_mlx_adapter(lm.model, tmp_path / "nowhere")


# ---- PEFT ----------------------------------------------------------------------------------------


def test_peft_export(tiny_dir, tmp_path):
    lm, n = lora_model(tiny(tiny_dir, "llama"))
    d = saved(lm, n, tmp_path / "mlx")
    out = mlx_to_peft(d, tmp_path / "peft", base_model="org/tiny-llama")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["bias"] == "none"
    assert cfg["r"] == RANK and cfg["lora_alpha"] == SCALE * RANK and cfg["lora_dropout"] == 0.0
    assert cfg["target_modules"] == sorted(k.split(".")[-1] for k in KEYS)
    assert cfg["layers_to_transform"] == [0, 1]
    assert cfg["use_rslora"] is False and cfg["use_dora"] is False
    assert cfg["base_model_name_or_path"] == "org/tiny-llama"

    peft, meta = mx.load(str(out / "adapter_model.safetensors"), return_metadata=True)
    assert meta.get("format") == "pt"
    mlx_w = dict(tree_flatten(lm.model.parameters()))
    assert len(peft) == 2 * 7 * n
    for name, arr in peft.items():
        assert name.startswith("base_model.model.model.layers.") and name.endswith((".lora_A.weight", ".lora_B.weight"))
        module = name.removeprefix("base_model.model.").rsplit(".", 2)[0]
        leaf = "lora_a" if ".lora_A." in name else "lora_b"
        src = mlx_w[f"{module}.{leaf}"]
        assert mx.array_equal(arr, src.T).item(), name  # unpermuted: PEFT speaks HF layouts
    q_a = peft["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    q_b = peft["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert q_a.shape == (RANK, 64) and q_b.shape == (64, RANK)  # (r, in), (out, r)


# ---- check_gguf_lora -------------------------------------------------------------------------------


def write_lora(path: Path, arch: str, tensors: dict[str, np.ndarray], *, alpha: float | None = 8.0) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    if alpha is not None:
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, arr in tensors.items():
        w.add_tensor(name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_check_gguf_lora_names_each_mismatch(tiny_dir, tmp_path):
    from clawd.engines.llamacpp import Engine

    llama, qwen = tiny(tiny_dir, "llama"), tiny(tiny_dir, "qwen2")
    assert check_gguf_lora(build_tiny_lora(tmp_path / "ok.gguf", llama), llama) == []
    lm, n = lora_model(llama, keys=["self_attn.q_proj", "mlp.down_proj"])
    good = mlx_to_gguf(saved(lm, n, tmp_path / "mlx", ["self_attn.q_proj", "mlp.down_proj"]), lm, tmp_path / "g.gguf")
    assert check_gguf_lora(good, llama) == []

    one_layer = build_tiny_gguf(tmp_path / "one-layer.gguf", arch="llama", n_layer=1)
    small = build_tiny_gguf(tmp_path / "small.gguf", arch="llama", n_embd=32, n_ff=64)
    a, b = np.ones((4, 64)), np.ones((64, 4))
    bad = tmp_path / "bad"
    bad.mkdir()
    cases = {
        # adapter, base -> fragments every problem sentence must contain, one per problem
        "arch": (good, qwen, [["architecture mismatch", "'llama'", "'qwen2'"]]),
        "missing base tensor": (
            good,
            one_layer,
            [["blk.1.attn_q.weight", "no such tensor"], ["blk.1.ffn_down.weight", "no such tensor"]],
        ),
        "sizes": (
            good,
            small,
            [[f"blk.{i}.attn_q.weight", "A (4, 64)", "B (64, 4)", "tensor (32, 32)"] for i in (0, 1)]
            + [[f"blk.{i}.ffn_down.weight", "A (4, 128)", "B (64, 4)", "tensor (32, 64)"] for i in (0, 1)],
        ),
        "missing half": (
            write_lora(bad / "half.gguf", "llama", {"blk.0.attn_q.weight.lora_a": a}),
            llama,
            [["blk.0.attn_q.weight has lora_a but no lora_b"]],
        ),
        "rank": (
            write_lora(
                bad / "rank.gguf",
                "llama",
                {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": np.ones((64, 3))},
            ),
            llama,
            [["blk.0.attn_q.weight", "rank disagreement", "4", "3"]],
        ),
        "odd tensor": (
            write_lora(
                bad / "odd.gguf",
                "llama",
                {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b, "blk.0.attn_q.weight": b},
            ),
            llama,
            [["blk.0.attn_q.weight is neither"]],
        ),
        "no alpha": (
            write_lora(
                bad / "alpha.gguf",
                "llama",
                {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b},
                alpha=None,
            ),
            llama,
            [["adapter.lora.alpha is missing"]],
        ),
        "a model, not an adapter": (
            qwen,
            qwen,
            [
                ["not an adapter", "general.type is missing"],
                ["not a LoRA adapter", "adapter.type is missing"],
                ["no LoRA tensors"],
            ],
        ),
    }
    for what, (adapter, base, wanted) in cases.items():
        problems = check_gguf_lora(adapter, base)
        if what == "a model, not an adapter":  # ...plus one "neither" sentence per base tensor
            problems = [p for p in problems if "neither" not in p]
        assert len(problems) == len(wanted), (what, problems)
        for frags in wanted:
            assert any(all(f in p for f in frags) for p in problems), (what, frags, problems)
        if what != "no alpha":  # llama.cpp itself refuses all of these (and silently mis-scales that one)
            eng = Engine(base, n_ctx=64, n_threads=1)
            try:
                with pytest.raises(AdapterError):
                    eng.load_adapter("x", adapter)
            finally:
                eng.close()

    truncated = bad / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size - 100])
    garbage = bad / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    text = bad / "text.gguf"
    text.write_text("not a gguf")
    for path in (truncated, garbage, text, bad / "missing.gguf"):
        problems = check_gguf_lora(path, llama)
        assert len(problems) == 1 and problems[0].startswith(f"cannot read adapter {path}"), problems
    problems = check_gguf_lora(good, text)
    assert len(problems) == 1 and problems[0].startswith("cannot read base model"), problems


def test_checking_an_adapter_does_not_load_mlx(tiny_dir, tiny_mlx_dirs, tmp_path):
    """The daemon checks adapters before an engine loads them (a GGUF LoRA on a GGUF base, an
    mlx-lm dir on an MLX dir base, quantized too); that must not drag in MLX."""
    from tests.test_boundaries import loaded_after
    from tests.tiny_mlx import build_tiny_mlx_adapter

    base = tiny(tiny_dir, "llama")
    lora = build_tiny_lora(tmp_path / "ok.gguf", base)
    q4 = tiny_mlx_dirs["dir-q4"]
    mlx_lora = build_tiny_mlx_adapter(tmp_path / "mlx-lora", q4)
    mods = loaded_after(
        f"from clawd.training.export import check_gguf_lora, check_mlx_lora\n"
        f"assert check_gguf_lora({str(lora)!r}, {str(base)!r}) == []\n"
        f"assert check_mlx_lora({str(mlx_lora)!r}, {str(q4)!r}) == []"
    )
    assert mods.isdisjoint({"mlx", "mlx_lm", "llama_cpp"}), mods & {"mlx", "mlx_lm", "llama_cpp"}


def test_mlx_to_gguf_refuses_an_adapter_for_another_model(tiny_dir, tmp_path):
    """The export checks its result against the base GGUF: a mis-sized adapter never lands."""
    lm, n = lora_model(tiny(tiny_dir, "llama"), keys=["self_attn.q_proj"])
    d = saved(lm, n, tmp_path / "mlx", ["self_attn.q_proj"])
    small = load_model(build_tiny_gguf(tmp_path / "small.gguf", arch="llama", n_embd=32, n_ff=64))
    with pytest.raises(AdapterError, match="does not fit"):
        mlx_to_gguf(d, small, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".x.gguf*"))
