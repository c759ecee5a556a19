"""Training-step speed and memory: clawd's hybrid step vs an mlx-lm LoRA SFT step, same model,
same tokens, same LoRA, same optimizer, all measured in this run (DESIGN rule 11).

Model: the embedded Gemma 3 270M through clawd's GGUF -> MLX bridge (float32). Tokens: a fixed
English text, tokenized by the model's own tokenizer and cut to 256 and to 512 tokens, half
prompt and half response. LoRA: clawd's defaults (rank 16, alpha 32, q,k,v,o,gate,up,down, via
mlx-lm's `linear_to_lora_layers`); optimizer: AdamW as clawd's trainer builds it.

1. Step speed, in one child process on the fast BLAS:
   - clawd: one optimizer step of `clawd.training.run.train` on `run.sample_loss` (the hybrid
     loss with r = +1 and a hint, so both the RL and the OPD term are live), with π_old,
     top-k and teacher log-probs precomputed by `run.prepare` exactly as the trainer does;
     once as the trainer runs it (`response_logprobs(checkpoint=False)`) and once with
     `checkpoint=True`.
   - anchor: `mlx_lm.tuner.trainer.default_loss` (cross-entropy over the response part) under
     `nn.value_and_grad`, then the same AdamW update. Uncompiled, like clawd's step.
   Both share one model with one set of LoRA layers; each has its own optimizer. Each step is
   warmed up once, then the variants alternate per round so drift hits them alike; the median
   of the rounds is reported. tokens/s = sequence tokens (prompt + response) / step seconds.
   Ratio clawd / mlx-lm > 1 means clawd's step is faster (goal >= 1.0x).
2. BLAS: one clawd step at 256 tokens in a child on the wheel's stock (reference) BLAS, and the
   same in a child on the BLAS clawd picks (`clawd.training.blas.enable`, before mlx is
   imported). Each child warms up on a 32-token step first. Ratio stock seconds / clawd-BLAS
   seconds (goal >= 10x).
3. Peak RSS (ru_maxrss of the child: load + prepare + warm-up + one step) of a clawd step at 256
   tokens (the BLAS child above) and at 512 tokens (its own child).

Prints a table and one JSON line with every number. Takes ~6 min on 2 cores (~3 min of it the
stock-BLAS step); the first run also dequantizes the GGUF (~25 s, cached under --home). Usage:
    python benchmarks/train.py [--rounds 3] [--home DIR] [--skip-stock] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clawd.paths import ensure_dirs, resolve_paths  # noqa: E402

LENGTHS = (256, 512)
WARMUP_TOKENS = 32
TOP_K = 4  # the trainer's k
TEXT = (
    "The following is a conversation between a helpful assistant and a user.\n\n"
    "User: What is the capital of France?\nAssistant: The capital of France is Paris. Paris is known for "
    "the Eiffel Tower, the Louvre museum and its cafes. The city sits on the river Seine.\n"
    "User: Tell me about photosynthesis.\nAssistant: Photosynthesis is the process by which green plants "
    "use sunlight, water and carbon dioxide to make glucose and oxygen. It happens mostly in the leaves, "
    "inside chloroplasts that contain chlorophyll. The light reactions capture energy, and the Calvin "
    "cycle fixes carbon into sugars that the plant uses to grow.\n"
    "User: Who wrote Romeo and Juliet?\nAssistant: William Shakespeare wrote Romeo and Juliet, a tragedy "
    "about two young lovers from feuding families in Verona.\n"
)
HINT = "(Hint from the user: answer in one short sentence and name your source.)\n"


# ---- child side: everything that imports mlx --------------------------------------------------


class Bench:
    """The model with clawd's LoRA attached, the samples and their prepared log-probs."""

    def __init__(self, model_path: Path, cache_dir: Path, lengths: list[int]):
        import mlx.core as mx

        from clawd.config import TrainingSettings
        from clawd.training.data import Sample
        from clawd.training.run import attach_lora, prepare
        from clawd.training.weights import load_model

        mx.random.seed(0)
        self.settings = TrainingSettings()
        t0 = time.perf_counter()
        self.lm = load_model(model_path, cache_dir=cache_dir)
        self.load_s = time.perf_counter() - t0
        attach_lora(self.lm, self.settings, None)
        tok = self.lm.tokenizer
        ids = tok.encode(TEXT * (1 + max(lengths) // 100), add_bos=True)
        hint = tok.encode(HINT, add_bos=False)
        self.samples, self.prep = {}, {}
        t0 = time.perf_counter()
        for n in lengths:
            prompt, response = ids[: n // 2], ids[n // 2 : n]
            self.samples[n] = Sample(
                f"bench-{n}", prompt, response, reward=1, teacher_prompt_ids=prompt[:1] + hint + prompt[1:]
            )
            # The trainer's own preparation (π_old, top-k, teacher), cached like a job dir's.
            cache = cache_dir / "bench-train" / f"prepared-{n}.npz"
            cache.parent.mkdir(parents=True, exist_ok=True)
            self.prep[n] = prepare(self.lm, [self.samples[n]], TOP_K, cache, lambda *_: None)[0]
        self.prepare_s = time.perf_counter() - t0

    def optimizer(self):
        import mlx.optimizers as optim

        s = self.settings  # as clawd.training.run.run builds it
        return optim.AdamW(learning_rate=s.learning_rate, betas=[0.9, 0.98], weight_decay=s.weight_decay)

    def clawd_step(self, n: int, optimizer, checkpoint: bool = False) -> float:
        """Seconds of one trainer step (forward + backward of the hybrid loss, clip, AdamW)."""
        from clawd.training import loss
        from clawd.training.loss import LossWeights
        from clawd.training.run import sample_loss, train

        weights = LossWeights(rl=self.settings.w_rl, opd=self.settings.w_opd)
        with _response_logprobs(loss, checkpoint=checkpoint):
            t0 = time.perf_counter()
            train(
                self.lm.model,
                iter([[0]]),
                lambda _: sample_loss(self.lm, self.samples[n], self.prep[n], weights),
                optimizer,
                self.settings.grad_clip,
                lambda *_: True,
            )
            return time.perf_counter() - t0

    def mlx_lm_step(self, n: int, optimizer) -> float:
        """Seconds of one mlx-lm SFT step: default_loss over the response, value_and_grad, AdamW."""
        import mlx.core as mx
        import mlx.nn as nn
        from mlx_lm.tuner.trainer import default_loss

        s = self.samples[n]
        batch = mx.array([s.prompt_ids + s.response_ids], dtype=mx.int32)
        lengths = mx.array([[len(s.prompt_ids), n - 1]])  # mask targets n_prompt .. n-1 = the response
        model = self.lm.model
        t0 = time.perf_counter()
        (loss, ntoks), grads = nn.value_and_grad(model, default_loss)(model, batch, lengths)
        optimizer.update(model, grads)
        mx.eval(loss, ntoks, model.trainable_parameters(), optimizer.state)
        return time.perf_counter() - t0


@contextmanager
def _response_logprobs(loss_module, *, checkpoint: bool):
    """Run `run.sample_loss` with `response_logprobs(..., checkpoint=...)`: sample_loss looks the
    function up in clawd.training.loss at call time, so patching the module attribute reaches it."""
    original = loss_module.response_logprobs
    if checkpoint:
        loss_module.response_logprobs = functools.partial(original, checkpoint=True)
    try:
        yield
    finally:
        loss_module.response_logprobs = original


def _versions(choice) -> dict:
    from importlib.metadata import version

    import mlx.core as mx

    from clawd.training.blas import matmul_gflops

    return {
        "blas": choice.name,
        "blas_detail": choice.detail,
        "matmul_gflops": round(matmul_gflops(), 1),
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "numpy": version("numpy"),
        "scipy_openblas32": version("scipy-openblas32") if choice.name == "openblas" else None,
        "python": platform.python_version(),
    }


def child_compare(model: Path, cache: Path, rounds: int) -> dict:
    """Part 1: clawd (checkpoint off / on) vs mlx-lm, per length, median of `rounds`."""
    from clawd.training import blas

    choice = blas.enable(cache)
    bench = Bench(model, cache, list(LENGTHS))
    variants = {
        "clawd": lambda n, o: bench.clawd_step(n, o),
        "clawd_ckpt": lambda n, o: bench.clawd_step(n, o, checkpoint=True),
        "mlx_lm": bench.mlx_lm_step,
    }
    out = {"env": _versions(choice), "load_s": bench.load_s, "prepare_s": bench.prepare_s, "lengths": {}}
    for n in LENGTHS:
        opts = {name: bench.optimizer() for name in variants}
        for name, step in variants.items():  # warm-up: first-call allocations, optimizer state
            step(n, opts[name])
        times = {name: [] for name in variants}
        for _ in range(rounds):
            for name, step in variants.items():
                times[name].append(step(n, opts[name]))
        out["lengths"][n] = {
            name: {"median_s": statistics.median(t), "runs_s": t, "tok_s": n / statistics.median(t)}
            for name, t in times.items()
        }
        print(
            json.dumps({"progress": n, **{k: round(v["median_s"], 2) for k, v in out["lengths"][n].items()}}),
            file=sys.stderr,
            flush=True,
        )
    return out


def child_step(model: Path, cache: Path, n: int, stock: bool) -> dict:
    """Parts 2 and 3: one clawd step at n tokens after a short warm-up step; peak RSS."""
    from clawd.training import blas

    choice = blas.enable(cache, stock=stock)
    bench = Bench(model, cache, [WARMUP_TOKENS, n])
    opt = bench.optimizer()
    warmup_s = bench.clawd_step(WARMUP_TOKENS, opt)
    step_s = bench.clawd_step(n, opt)
    return {
        "env": _versions(choice),
        "tokens": n,
        "step_s": step_s,
        "warmup_s": warmup_s,
        "load_s": bench.load_s,
        "prepare_s": bench.prepare_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# ---- parent side: no mlx here; each configuration in its own process ----------------------------


def run_child(*args: str, timeout: float = 900) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )
    if proc.returncode != 0:
        raise SystemExit(f"child {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per variant and length (median)")
    ap.add_argument("--home", type=Path, help="CLAWD_HOME to use and keep (default: a temp dir, removed)")
    ap.add_argument("--skip-stock", action="store_true", help="leave out the stock-BLAS step (~3 min)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # internal: MODE MODEL CACHE [ARG]
    args = ap.parse_args()

    if args.child:
        mode, model, cache = args.child[0], Path(args.child[1]), Path(args.child[2])
        if mode == "compare":
            res = child_compare(model, cache, int(args.child[3]))
        else:  # step-fast N | step-stock N
            res = child_step(model, cache, int(args.child[3]), stock=mode == "step-stock")
        print(json.dumps(res))
        return

    from clawd.models import ensure_embedded_model

    home = args.home or Path(tempfile.mkdtemp(prefix="clawd-bench-train-"))
    try:
        paths = resolve_paths({"CLAWD_HOME": str(home)})
        ensure_dirs(paths)
        model, cache = str(ensure_embedded_model(paths)), str(paths.cache_dir)
        t0 = time.perf_counter()
        # The first child dequantizes the GGUF and writes the prepared log-probs; the rest reuse both.
        compare = run_child("compare", model, cache, str(args.rounds))
        fast = run_child("step-fast", model, cache, "256")
        stock = None if args.skip_stock else run_child("step-stock", model, cache, "256")
        big = run_child("step-fast", model, cache, "512")
        total_s = time.perf_counter() - t0
    finally:
        if args.home is None:
            shutil.rmtree(home, ignore_errors=True)
    report(compare, fast, stock, big, total_s, args)


def report(compare: dict, fast: dict, stock: dict | None, big: dict, total_s: float, args) -> None:
    env = compare["env"]
    summary: dict = {"env": env, "rounds": args.rounds, "total_s": round(total_s, 1), "lengths": {}}
    print(
        f"mlx {env['mlx']}, mlx-lm {env['mlx_lm']}, numpy {env['numpy']}, python {env['python']}; "
        f"BLAS {env['blas']} ({env['blas_detail']}), {env['matmul_gflops']} GFLOP/s"
    )
    print(f"median of {args.rounds} steps after one warm-up; tok/s = prompt+response tokens / step s")
    print()
    print("| tokens | mlx-lm SFT (anchor) | clawd hybrid | ratio | clawd, checkpoint=True | ratio | goal |")
    print("|---|---|---|---|---|---|---|")
    for n, r in compare["lengths"].items():
        a, c, k = r["mlx_lm"], r["clawd"], r["clawd_ckpt"]
        row = {
            "mlx_lm_s": a["median_s"],
            "clawd_s": c["median_s"],
            "clawd_ckpt_s": k["median_s"],
            "mlx_lm_tok_s": a["tok_s"],
            "clawd_tok_s": c["tok_s"],
            "clawd_ckpt_tok_s": k["tok_s"],
            "ratio": c["tok_s"] / a["tok_s"],
            "ratio_ckpt": k["tok_s"] / a["tok_s"],
            "runs_s": {name: v["runs_s"] for name, v in r.items()},
        }
        summary["lengths"][n] = row
        print(
            f"| {n} | {a['tok_s']:.1f} tok/s ({a['median_s']:.2f} s) | {c['tok_s']:.1f} tok/s ({c['median_s']:.2f} s) "
            f"| {row['ratio']:.2f}x | {k['tok_s']:.1f} tok/s ({k['median_s']:.2f} s) | {row['ratio_ckpt']:.2f}x "
            f"| >= 1.0x |"
        )
    print()
    summary["step_256_fast_s"] = fast["step_s"]
    if stock is not None:
        summary["step_256_stock_s"] = stock["step_s"]
        summary["blas_ratio"] = stock["step_s"] / fast["step_s"]
        summary["stock_gflops"] = stock["env"]["matmul_gflops"]
        print("| clawd step, 256 tokens | stock BLAS | clawd's BLAS | ratio | goal |")
        print("|---|---|---|---|---|")
        print(
            f"| one step after a {WARMUP_TOKENS}-token warm-up | {stock['step_s']:.1f} s "
            f"({stock['env']['matmul_gflops']} GFLOP/s) | {fast['step_s']:.2f} s ({fast['env']['matmul_gflops']} GFLOP/s) "
            f"| {summary['blas_ratio']:.1f}x | >= 10x |"
        )
        print()
    summary["peak_rss_mb"] = {256: fast["peak_rss_mb"], 512: big["peak_rss_mb"]}
    print(
        f"peak RSS of a clawd training child (load + prepare + step): 256 tokens {fast['peak_rss_mb']:.0f} MB, "
        f"512 tokens {big['peak_rss_mb']:.0f} MB"
    )
    summary["children"] = {"compare": compare, "step_fast_256": fast, "step_stock_256": stock, "step_fast_512": big}
    print(f"total {total_s:.0f} s")
    line = json.dumps(summary)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
