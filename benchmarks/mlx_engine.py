"""The mlx engine on the embedded Gemma 3 270M: generation speed and adapter swap time.

Anchor: clawd's llama.cpp engine on the same GGUF file in the same process (the engine the mlx
one replaces on a Mac; same contract, so the same work per token: the sampled token's log-prob
from the full 262k-vocabulary distribution). Subject: the mlx engine on that file through
clawd's GGUF -> MLX bridge (float32 weights). Same prompts, greedy, alternating anchor /
subject per prompt so machine noise hits both alike.

Adapter swap: a random rank-8 LoRA on every linear layer of every block (what the trainer
writes), swapped in place by the mlx engine; anchors: mlx-lm's way (build the model again and
attach the adapter with mlx-lm's `load_adapters`, what `mlx_lm.server` does on an adapter
change) and llama.cpp's runtime switch of the same adapter exported to GGUF.

Last, why decode is what it is: MLX's CPU one-row projection speed per weight format and the
decode ceiling it sets (weights read per token / measured float32 read speed).

Usage: python benchmarks/mlx_engine.py [--max-tokens 64] [--rounds 2] [--home DIR]
(--home keeps clawd's cache, so the one-off ~25 s GGUF dequantization is not paid again).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clawd.paths import ensure_dirs, resolve_paths  # noqa: E402
from clawd.training import blas  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Count from 1 to 100, separated by commas.",
    "Explain what a CPU does in simple terms.",
    "List the letters of the alphabet, one per line.",
]
PREAMBLE = "The following is a conversation between a helpful assistant and a user.\n\n"


def timed_generation(engine, prompt_ids: list[int], max_tokens: int) -> dict:
    """Greedy, no stop string: both engines produce max_tokens unless the model ends."""
    from clawd.engines.base import SamplingParams

    engine.score(prompt_ids[:1], prompt_ids[1:2], reuse_cache=False, slot=0)  # an empty cache for both
    t0 = time.perf_counter()
    stamps = [
        time.perf_counter() for _ in engine.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0))
    ]
    first, n = stamps[0] - t0, len(stamps)
    return {"prefill_s": first, "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0, "n": n}


def per_call_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1000


def switch_cost_ms(engine, ids: list[int], adapters: list[str | None], repeats: int = 30) -> tuple[float, float]:
    """(ms per 1-token score that changes adapter, ms per one that keeps it): the difference is
    what a switch costs through the public API (the 1-token forward is recomputed either way)."""
    cycle = iter(adapters * repeats * 2)
    switching = per_call_ms(lambda: engine.score(ids[:1], ids[1:2], adapter=next(cycle), reuse_cache=False), repeats)
    same = per_call_ms(lambda: engine.score(ids[:1], ids[1:2], adapter=adapters[0], reuse_cache=False), repeats)
    return switching, same


def bind_ms(engine, adapters: list[str | None], repeats: int = 300) -> float:
    """The in-place switch alone (rebinding every wrapped layer's LoRA arrays). Timed directly
    because on 2 shared cores it is far below the noise of any forward pass around it."""
    t0 = time.perf_counter()
    for i in range(repeats):
        engine._bind(adapters[i % len(adapters)])
    return (time.perf_counter() - t0) / repeats * 1000


def one_row_matmul(rows: int = 65536, cols: int = 640, repeats: int = 20) -> dict[str, float]:
    """ms of one token's projection through a (rows x cols) weight, per weight format MLX's CPU
    backend offers, and the float32 read speed in GB/s. Decoding one token reads every weight
    once, so this bounds decode speed whatever the engine does around it."""
    import mlx.core as mx

    w = mx.random.normal((rows, cols))
    x = mx.random.normal((1, cols))
    wb, xb = w.astype(mx.bfloat16), x.astype(mx.bfloat16)
    q = {bits: mx.quantize(w, group_size=64, bits=bits) for bits in (4, 8)}
    mx.eval(w, wb, *[a for t in q.values() for a in t])

    def ms(f) -> float:
        return per_call_ms(lambda: mx.eval(f()), repeats)

    out = {"float32": ms(lambda: x @ w.T), "bfloat16": ms(lambda: xb @ wb.T)}
    for bits, (wq, scales, biases) in q.items():
        out[f"{bits}-bit"] = ms(
            lambda wq=wq, s=scales, b=biases, bits=bits: mx.quantized_matmul(
                x, wq, s, b, transpose=True, group_size=64, bits=bits
            )
        )
    out["float32_gb_s"] = rows * cols * 4 / (out["float32"] / 1000) / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--adapters-only", action="store_true", help="skip the generation comparison")
    ap.add_argument("--home", type=Path, help="CLAWD_HOME to use (default: a fresh temporary one)")
    args = ap.parse_args()

    home = args.home or Path(tempfile.mkdtemp(prefix="clawd-bench-mlx-"))
    paths = resolve_paths({**os.environ, "CLAWD_HOME": str(home)})
    ensure_dirs(paths)
    choice = blas.enable(paths.cache_dir)  # before the first `import mlx`

    from clawd.engines.llamacpp import Engine as LlamaCpp
    from clawd.engines.mlx import Engine as Mlx
    from clawd.models import ensure_embedded_model
    from clawd.training.export import mlx_to_gguf
    from clawd.training.weights import load_model
    from tests.tiny_mlx import build_tiny_mlx_adapter

    gguf = ensure_embedded_model(paths)
    threads = os.cpu_count() or 2
    print(f"model {gguf.name}, {threads} cores, MLX BLAS: {choice.name} ({choice.detail})")
    t0 = time.perf_counter()
    anchor = LlamaCpp(gguf, n_ctx=1024, n_threads=threads)
    t_anchor = time.perf_counter() - t0
    t0 = time.perf_counter()
    subject = Mlx(gguf, n_ctx=1024, cache_dir=paths.cache_dir)
    t_subject = time.perf_counter() - t0
    print(f"load: llama.cpp {t_anchor:.2f} s, mlx {t_subject:.2f} s (first mlx load dequantizes and caches)")

    # ---- generation --------------------------------------------------------------------------
    rows = {"llamacpp": [], "mlx": []}
    for rnd in range(0 if args.adapters_only else args.rounds):
        for i, question in enumerate(PROMPTS):
            text = f"{PREAMBLE}User: {question}\nAssistant:"
            ids = anchor.tokenize(text, add_bos=True)
            order = [("llamacpp", anchor), ("mlx", subject)]
            for name, engine in order if (rnd + i) % 2 == 0 else order[::-1]:
                r = timed_generation(engine, ids, args.max_tokens)
                rows[name].append({**r, "prompt_tokens": len(ids)})
            a, m = rows["llamacpp"][-1], rows["mlx"][-1]
            print(
                f"round {rnd} prompt {i} ({len(ids)} tok): llama.cpp {a['decode_tok_s']:5.1f} tok/s, prefill "
                f"{a['prefill_s'] * 1000:6.0f} ms | mlx {m['decode_tok_s']:5.1f} tok/s, prefill "
                f"{m['prefill_s'] * 1000:6.0f} ms ({m['n']} tokens)"
            )

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    def prefill_tok_s(name: str) -> float:
        return sum(r["prompt_tokens"] for r in rows[name]) / sum(r["prefill_s"] for r in rows[name])

    # ---- adapter swap ------------------------------------------------------------------------
    adir = home / "bench-adapters"
    keys = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
    made = {
        name: build_tiny_mlx_adapter(
            adir / name, gguf, seed=seed, rank=8, scale=2.0, keys=keys, cache_dir=paths.cache_dir
        )
        for name, seed in (("A", 1), ("B", 2))
    }
    t0 = time.perf_counter()
    subject.load_adapter("A", made["A"])
    t_load_mlx = (time.perf_counter() - t0) * 1000
    subject.load_adapter("B", made["B"])
    ids = anchor.tokenize(PREAMBLE, add_bos=True)
    mlx_switch, mlx_same = switch_cost_ms(subject, ids, ["A", "B", None])
    mlx_bind = bind_ms(subject, ["A", "B", None])

    lm = load_model(gguf, cache_dir=paths.cache_dir)
    for name in made:
        mlx_to_gguf(made[name], lm, made[name] / "adapter.gguf")
    del lm
    t0 = time.perf_counter()
    anchor.load_adapter("A", made["A"] / "adapter.gguf")
    t_load_lc = (time.perf_counter() - t0) * 1000
    anchor.load_adapter("B", made["B"] / "adapter.gguf")
    lc_switch, lc_same = switch_cost_ms(anchor, ids, ["A", "B", None])

    from mlx_lm.tuner.utils import load_adapters

    t0 = time.perf_counter()
    rebuilt = load_model(gguf, cache_dir=paths.cache_dir).model  # from clawd's weight cache: no dequantizing
    load_adapters(rebuilt, str(made["B"]))
    t_reload = (time.perf_counter() - t0) * 1000
    del rebuilt

    swap_mlx = max(mlx_switch - mlx_same, 0.0)
    swap_lc = max(lc_switch - lc_same, 0.0)
    if rows["mlx"]:
        a_dec, m_dec = med("llamacpp", "decode_tok_s"), med("mlx", "decode_tok_s")
        a_pre, m_pre = prefill_tok_s("llamacpp"), prefill_tok_s("mlx")
    print()
    print(
        f"Gemma 3 270M (GGUF Q4_K_M; mlx runs its float32 dequantization), greedy, {args.max_tokens} tokens, "
        f"{len(rows['mlx'])} generations each, {threads} cores"
    )
    print("| | llama.cpp engine (anchor) | mlx engine | mlx / anchor |")
    print("|---|---|---|---|")
    if rows["mlx"]:
        print(f"| decode tok/s (median) | {a_dec:.1f} | {m_dec:.1f} | {m_dec / a_dec:.2f} |")
        print(f"| prefill tok/s (pooled) | {a_pre:.0f} | {m_pre:.0f} | {m_pre / a_pre:.2f} |")
    print(f"| adapter load from disk, ms | {t_load_lc:.1f} | {t_load_mlx:.1f} | {t_load_mlx / t_load_lc:.2f} |")
    print(
        f"| adapter switch, ms (switching - same-adapter 1-token score) | {swap_lc:.2f} | {swap_mlx:.2f} | "
        f"{swap_mlx / swap_lc if swap_lc > 0 else float('nan'):.2f} |"
    )
    print(
        f"| 1-token score, same adapter / switching each call, ms | {lc_same:.1f} / {lc_switch:.1f} | "
        f"{mlx_same:.1f} / {mlx_switch:.1f} | |"
    )
    print(f"mlx in-place switch alone (rebind {len(subject._switch._wrapped)} LoRA layers): {mlx_bind:.3f} ms")
    print(
        f"mlx-lm's way to change adapter (rebuild the model from clawd's cached weights + load_adapters): "
        f"{t_reload:.0f} ms = {t_reload / mlx_bind:.0f}x the in-place switch"
    )

    # ---- why decode is what it is: one token reads every weight once --------------------------
    from mlx.utils import tree_flatten

    weight_bytes = sum(a.nbytes for _, a in tree_flatten(subject._model.parameters()))
    mv = one_row_matmul()
    ceiling = mv["float32_gb_s"] * 1e9 / weight_bytes
    print(
        "one-row projection 65536x640 on MLX's CPU backend, ms: "
        + ", ".join(f"{k} {v:.2f}" for k, v in mv.items() if k != "float32_gb_s")
        + f"; float32 reads {mv['float32_gb_s']:.1f} GB/s"
    )
    print(
        f"mlx weights {weight_bytes / 1e9:.2f} GB read per decoded token -> decode ceiling {ceiling:.1f} tok/s"
        + (f"; measured {m_dec:.1f} tok/s = {m_dec / ceiling:.0%} of it" if rows["mlx"] else "")
    )
    anchor.close()
    subject.close()


if __name__ == "__main__":
    main()
