"""The trainer child process: `python -m clawd.training.run JOB_DIR --cache CACHE_DIR --out ADAPTERS_DIR`.

Boundary: reads JOB_DIR/job.json (clawd/training/data.py), trains one LoRA adapter with the
hybrid objective, measures the eval gate, and writes ADAPTERS_DIR/<job id>/ atomically (a temp
dir renamed into place: mlx-lm files, meta.json, and adapter.gguf when the base is a GGUF
file), so a kill at any moment leaves the whole adapter or none. It never touches the
database or the served model: it reports to the daemon as JSON lines on stdout
({"event": ...}), and a crash or OOM here cannot take serving down.

Stopping: SIGTERM asks for a stop at the next optimizer step (or, after the last one, before
or between the gate's measurements); the run saves a checkpoint (LoRA weights, optimizer
state, step, history) in JOB_DIR and exits with STOPPED. Started again on the same JOB_DIR it
resumes from there (a checkpoint after the last step goes straight to the gate); π_old and
teacher log-probs are kept in JOB_DIR too, so a resumed run optimizes exactly the same objective.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from clawd.training import blas
from clawd.training.data import STOPPED, Sample
from clawd.training.parent import die_with_parent

LORA_KEYS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, "time": time.time(), **fields}), flush=True)


class StopRequested(Exception):
    pass


class StopFlag:
    """Set by SIGTERM; checked between optimizer steps and the gate's measurements."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, *_):
        self.requested = True


def lora_keys(targets: str) -> list[str]:
    names = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [n for n in names if n not in LORA_KEYS]
    if unknown:
        raise SystemExit(f"training.targets: unknown projection(s) {unknown}; choose from {sorted(LORA_KEYS)}")
    return [LORA_KEYS[n] for n in names]


def attach_lora(lm, settings, parent_path: str | None) -> str | None:
    """LoRA on every block; continue from the parent's weights when its shape matches.
    Returns a note when the parent could not be continued."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from clawd.training.export import load_mlx_adapter

    lm.model.freeze()
    keys = lora_keys(settings.targets)
    scale = settings.alpha / settings.rank
    if parent_path:
        cfg = json.loads((Path(parent_path) / "adapter_config.json").read_text())
        lp = cfg.get("lora_parameters", {})
        if lp.get("rank") == settings.rank and sorted(lp.get("keys", [])) == sorted(keys) and lp.get("scale") == scale:
            load_mlx_adapter(lm.model, Path(parent_path))
            return None
        note = "parent adapter has another rank/targets/scale: trained from the base model"
    else:
        note = None
    linear_to_lora_layers(
        lm.model, len(lm.model.layers), {"rank": settings.rank, "scale": scale, "dropout": 0.0, "keys": keys}
    )
    return note


VIEWS = ("ids", "old", "teacher", "mask")  # evaluate.sample_views' arrays (teacher, mask: may be None)


def prepare(
    lm,
    samples,
    k: int,
    cache: Path,
    progress: Callable[[int, int], None],
    teacher="base",
    support: str = "student",
) -> list[dict]:
    """π_old (the current LoRA = the parent) at the sampled tokens and the OPD support (its
    top-k, or with support "union" its top-k ∪ the teacher's), and the teacher (training.teacher
    + hint, see evaluate.scoring_teacher) on that support, for every sample: recomputed in MLX
    so no ratio mixes engines (STACK.md); the teacher's top-k comes from the same teacher the
    loss uses. Cached in the job dir for resumes."""
    import numpy as np

    from clawd.training.evaluate import sample_views

    if cache.exists():
        with np.load(cache) as z:
            return [
                {name: z[f"{name}{i}"] if f"{name}{i}" in z else None for name in VIEWS} for i in range(len(samples))
            ]
    out = []
    for i, s in enumerate(samples):
        out.append(sample_views(lm, s, k, teacher, support))
        progress(i + 1, len(samples))
    arrays = {f"{name}{i}": p[name] for i, p in enumerate(out) for name in VIEWS if p[name] is not None}
    tmp = cache.with_name(cache.stem + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, cache)
    return out


def load_teacher(job, cache_dir: Path):
    """What scores as the teacher in this run (evaluate.scoring_teacher): training.teacher's
    "base" or "policy" as is, or for "model:NAME" that model, loaded from the GGUF the daemon
    resolved and checked (job.teacher_model_path) as float32 MLX weights, like the student.

    Why here and not in the miner's llama.cpp, which scores faster in less memory (measured by
    benchmarks/teacher_placement.py, 1.5B over 0.5B: 4.4-5.1 s and 1.9 GB per signal there,
    7.6-8.1 s and 7.0 GB here): the miner would score every hint candidate (up to
    mining.max_hints) and store the arrays per signal; here the chosen hint is scored once, in
    the engine that ranks the student's top-k (the union support needs the teacher's own top-k
    at those positions), and a teacher set after a signal was mined still scores it."""
    teacher = job.settings.teacher
    if not teacher.startswith("model:"):
        return teacher
    if not job.teacher_model_path:
        raise ValueError(f"training.teacher is {teacher!r} but the job names no teacher model file")
    from clawd.training.weights import load_model

    emit("phase", phase="load_teacher", model=job.teacher_model_path)
    return load_model(Path(job.teacher_model_path), cache_dir=cache_dir)


def prepare_all(
    lm, job, job_dir: Path, cache_dir: Path, progress
) -> tuple[list[Sample], list[dict], list[dict] | None]:
    """The samples to train on (job.train, with training.teacher_answers each hinted one
    followed by the hinted teacher's own answer, and with training.teacher_endings each hinted
    one whose turn ended followed, after its answer if any, by the teacher's continuation of it:
    clawd/training/teacher_answers.py), run.prepare's views of them, and with a teacher model
    those of the held-out ones too (None otherwise: the gate computes them itself). All are
    taken under the parent's weights, as the gate would, so a teacher model is needed only
    here: it is loaded for this phase (when a resume has not cached its views, answers and
    endings already) and freed before training, and training's peak memory is the student's
    alone."""
    cfg, k = job.settings, job.top_k
    train_cache, held_cache = job_dir / "prepared.npz", job_dir / "prepared-holdout.npz"
    teacher = cfg.teacher
    separate = teacher.startswith("model:")
    answers, endings = job_dir / "teacher-answers.json", job_dir / "teacher-endings.json"
    # Answers and endings carry the OPD term alone: with w_opd = 0, or weighted 0, they would
    # train nothing.
    teaching = cfg.w_opd != 0 and cfg.teacher_answers_weight > 0
    answering, ending = teaching and cfg.teacher_answers > 0, teaching and cfg.teacher_endings > 0
    if separate:
        from clawd.training.teacher_answers import endings_pending, pending

        prepared = train_cache.exists() and (held_cache.exists() or not job.holdout)
        if (
            not prepared
            or (answering and pending(job.train, answers))
            or (ending and endings_pending(lm, job.train, endings))
        ):
            teacher = load_teacher(job, cache_dir)
    samples = job.train
    stops = job.turn_end.stops if job.turn_end else []
    if answering:
        from clawd.training.teacher_answers import with_teacher_answers

        emit("phase", phase="teacher_answers")
        samples = with_teacher_answers(
            lm, job.train, teacher, cfg.teacher_answers, stops, answers, cfg.max_tokens, progress
        )
        emit("teacher_answers", added=len(samples) - len(job.train))
    if ending:
        from clawd.training.teacher_answers import with_teacher_endings

        emit("phase", phase="teacher_endings")
        before = len(samples)
        samples = with_teacher_endings(
            lm, samples, teacher, cfg.teacher_endings, stops, endings, cfg.max_tokens, progress
        )
        emit("teacher_endings", added=len(samples) - before)
    emit("phase", phase="prepare", samples=len(samples) + (len(job.holdout) if separate else 0))
    prep = prepare(lm, samples, k, train_cache, progress, teacher, cfg.opd_support)
    held = None
    if separate and job.holdout:
        total = len(samples) + len(job.holdout)  # one count over both, as the prepare phase announced
        held = prepare(
            lm, job.holdout, k, held_cache, lambda i, _n: progress(len(samples) + i, total), teacher, cfg.opd_support
        )
    if not isinstance(teacher, str):
        import mlx.core as mx

        del teacher  # its last use: give its weights back before training
        gc.collect()
        mx.clear_cache()
    return samples, prep, held


def prepare_anchors(lm, job, job_dir: Path, progress) -> tuple[list[Sample], list[dict]]:
    """training.w_kl_base's anchors (clawd/training/kl_anchor.py): the base's answers to the
    job's everyday prompts and run.prepare's views of them taken under the base, whose top-k
    and log-probs are the term's target. ([], []) when the term is off."""
    if job.settings.w_kl_base <= 0:
        return [], []
    if not job.anchor:  # a job file written before jobs carried them
        emit("note", message="training.w_kl_base is set but the job has no anchor prompts: no KL term")
        return [], []
    from clawd.training.evaluate import base_model
    from clawd.training.kl_anchor import base_answers

    emit("phase", phase="anchors", samples=len(job.anchor))
    stops = job.turn_end.stops if job.turn_end else []
    anchors = base_answers(lm, job.anchor, stops, job_dir / "anchor-answers.json", job.settings.max_tokens)
    if not anchors:
        emit("note", message="the base answered none of the anchor prompts within training.max_tokens: no KL term")
    with base_model(lm.model):
        views = prepare(lm, anchors, job.top_k, job_dir / "prepared-anchor.npz", progress)
    return anchors, views


def anchor_loss(lm, sample, prep, weight: float, share: int):
    """One anchor's part of its step's KL term: weight · (its token-mean coarse KL to the base)
    / share, the step's anchor count, so a step adds weight × the anchors' mean KL. Its
    n_samples is 0 and `added` 1: `train` adds it to the step's mean over signals, it is not
    one more sample in that mean (that would shrink the signals' own step)."""
    import mlx.core as mx

    from clawd.training.evaluate import tokens
    from clawd.training.loss import coarse_kl, response_logprobs

    ids, n_prompt = tokens(sample)
    top = response_logprobs(lm, ids, n_prompt, mx.array(prep["ids"][:, 1:]))
    kl = coarse_kl(mx.array(prep["old"][:, 1:]), top).mean()
    return weight * kl / share, {"kl_base": mx.stop_gradient(kl), "n_samples": mx.array(0.0), "added": 1.0}


def sample_loss(lm, sample, prep, weights):
    """The hybrid loss of one sample (a batch of one: variable lengths need no padding)."""
    import mlx.core as mx

    from clawd.training.evaluate import tokens
    from clawd.training.loss import hybrid_loss, response_logprobs

    ids, n_prompt = tokens(sample)
    lp = response_logprobs(lm, ids, n_prompt, mx.array(prep["ids"]))
    old = mx.array(prep["old"])
    n, k = prep["ids"].shape[0], prep["ids"].shape[1] - 1
    teacher, support = prep["teacher"], prep.get("mask")
    return hybrid_loss(
        lp[None, :, 0],
        old[None, :, 0],
        mx.array([float(sample.reward)]),
        lp[None, :, 1:],
        old[None, :, 1:],
        mx.array(teacher)[None] if teacher is not None else mx.zeros((1, n, k)),
        mx.array([teacher is not None]),
        mx.ones((1, n)),
        weights,
        None if support is None else mx.array(support)[None],
    )


def weighted(loss_and_metrics, w: float):
    """One sample's (loss, metrics) counted w times in its batch: its loss, and so its
    gradient, times w, and its n_samples times w, so `train`'s mean over the batch is
    Σ w_i g_i / Σ w_i (w = 0 is the batch without the sample, not a zero that dilutes it).
    training.teacher_answers_weight gives the teacher's answers a smaller step than the signals."""
    if w == 1.0:
        return loss_and_metrics
    loss, metrics = loss_and_metrics
    return loss * w, {**metrics, "n_samples": metrics["n_samples"] * w}


def batches(n: int, batch_size: int) -> list[list[int]]:
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


def metric_counts(sample, k: int, weights, support=None) -> dict[str, float]:
    """What each of one sample's metrics is a mean over (METHOD §5): the samples, tokens or
    (token, v) pairs where its term exists; 0 = the term is absent (no r, no hint, weight 0).
    `support`: the sample's union-support mask (its real (token, v) pairs), if it has one."""
    n = len(sample.response_ids)
    pairs = n * k if support is None else float(support.sum())
    rl = float(n > 0 and bool(sample.reward) and weights.rl != 0)
    opd = float(n > 0 and sample.teacher_prompt_ids is not None and weights.opd != 0)
    return {
        "rl": rl,
        "reward_mean": rl,
        "ratio_mean": rl * n,
        "rl_clip_frac": rl * n,
        "opd": opd,
        "opd_clip_frac": opd * pairs,
    }


def step_metrics(rows: list[tuple[dict[str, float], dict[str, float]]]) -> dict[str, float]:
    """One step's metrics from its samples' (metrics, counts): each metric pooled over the
    samples/tokens where it is defined (a missing count is 1), so a sample without a term
    does not dilute that term's mean with a 0. The loss is a mean over the samples carrying
    a term, Σ loss / Σ n_samples, as the gradient is (a sample's loss is already a sum over its
    n_samples, which `weighted` scales alike); n_samples is their number."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for metrics, counts in rows:
        counts = {"loss": 1.0, **counts}
        for key, v in metrics.items():
            c = counts.get(key, 1.0)
            num[key] = num.get(key, 0.0) + v * c
            den[key] = den.get(key, 0.0) + (metrics.get("n_samples", 1.0) if key == "loss" else c)
    out = {key: num[key] / den[key] if den[key] else 0.0 for key in num}
    if "n_samples" in num:
        out["n_samples"] = sum(m["n_samples"] for m, _ in rows)
    return out


def train(
    model,
    steps: Iterator[list[int]],
    loss_fn,
    optimizer,
    grad_clip: float,
    on_step: Callable[[int, dict], bool],
    counts: Callable[[int], dict[str, float]] | None = None,
) -> int:
    """The training loop: one optimizer update per item of `steps` (a list of sample indices,
    gradients averaged over them). `loss_fn(i)` gives (loss, metrics) for sample i; a sample
    whose metrics say `added` (a training.w_kl_base anchor, anchor_loss) is no member of that
    mean: its gradient and loss are added to the step's as they are, after the step's own
    samples, and only if one of those carries a term (a step with nothing to learn does not
    move: the pull alone would only undo earlier lessons). `counts(i)` gives
    what each metric of sample i is a mean over (see step_metrics); `on_step` gets (step,
    metrics) after each update and returns False to stop. Returns steps done."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_map

    grad_of = nn.value_and_grad(model, lambda _m, i: loss_fn(i))
    done = 0
    for indices in steps:
        t0 = time.perf_counter()
        total, extra, extra_loss, rows = None, None, 0.0, []
        for i in indices:
            (loss, metrics), grads = grad_of(model, i)
            if metrics.pop("added", 0):  # a term added to the step as is (anchor_loss)
                if not sum(m.get("n_samples", 1) for m, _ in rows):
                    continue  # the step's samples carry no term: nothing to learn, so no pull either
                extra = grads if extra is None else tree_map(mx.add, extra, grads)
                mx.eval(extra, loss)
                extra_loss += float(loss)
                rows.append(({key: float(v) for key, v in metrics.items()}, counts(i) if counts else {}))
                continue
            total = grads if total is None else tree_map(mx.add, total, grads)
            mx.eval(total, loss)
            rows.append(({key: float(v) for key, v in {"loss": loss, **metrics}.items()}, counts(i) if counts else {}))
        # Mean over the samples that carry a term, each counted as `weighted` says (a batch
        # emptied by an ablation weight of 0 has a zero gradient: divide by 1, not 0).
        counted = sum(m.get("n_samples", 1) for m, _ in rows)
        if total is not None:
            total = tree_map(lambda g: g / (counted if counted > 0 else 1), total)
        if extra is not None:
            total = extra if total is None else tree_map(mx.add, total, extra)
        summary = step_metrics(rows)
        if extra is not None:
            summary["loss"] = summary.get("loss", 0.0) + extra_loss
        if grad_clip > 0:
            total, norm = optim.clip_grad_norm(total, grad_clip)
            summary["grad_norm"] = float(norm)
        optimizer.update(model, total)
        mx.eval(model.trainable_parameters(), optimizer.state)
        done += 1
        summary["seconds"] = time.perf_counter() - t0
        if not on_step(done, summary):
            break
    return done


def base_qa_file(cache_dir: Path, job) -> Path | None:
    """Where the base model's QA-canary results are kept: the base never changes, so a run
    from the base asks only its candidate after the first. Keyed by the model file (path, size,
    mtime) and the questions' fingerprint; None for a job without one."""
    import hashlib

    if not job.qa_fingerprint:
        return None
    try:
        st = Path(job.model_path).stat()
    except OSError:
        return None
    key = f"{job.model_path}|{st.st_size}|{st.st_mtime_ns}|{job.qa_fingerprint}"
    return cache_dir / "qa-base" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def read_base_qa(path: Path) -> list[bool] | None:
    try:
        right = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # missing or damaged: the base is asked again
    return [bool(r) for r in right] if isinstance(right, list) else None


def write_base_qa(path: Path, right: list[bool]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(right))
    os.replace(tmp, path)


def save_checkpoint(path: Path, model, optimizer, step: int, history: list[dict]) -> None:
    """Weights, optimizer state, step and history written as one dir renamed into place; the
    previous checkpoint is set aside, not deleted, until the new one is in (no moment without one)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    mx.save_safetensors(str(tmp / "lora.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (tmp / "history.json").write_text(json.dumps(history))
    (tmp / "step.json").write_text(json.dumps({"step": step}))
    if path.exists():  # else .old (if any) is the only checkpoint: keep it until tmp is in
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(path: Path) -> Path | None:
    """The checkpoint dir, or the set-aside previous one when a kill hit between the renames."""
    for p in (path, path.with_name(path.name + ".old")):
        if (p / "step.json").is_file():
            return p
    return None


def load_checkpoint(path: Path, model, optimizer) -> tuple[int, list[dict]]:
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    model.update(tree_unflatten(list(mx.load(str(path / "lora.safetensors")).items())))
    optimizer.state = tree_unflatten(list(mx.load(str(path / "optimizer.safetensors")).items()))
    step = json.loads((path / "step.json").read_text())["step"]
    try:  # the history only reports: a missing or damaged one starts afresh, never fails the run
        history = json.loads((path / "history.json").read_text())
    except (OSError, ValueError):
        history = []
    if not isinstance(history, list):
        history = []
    return step, history


def run(job_dir: Path, cache_dir: Path, out_dir: Path, *, stock_blas: bool = False) -> int:
    choice = blas.enable(cache_dir, stock=stock_blas)
    emit("start", blas=choice.name, blas_detail=choice.detail, pid=os.getpid())
    stop = StopFlag()

    import mlx.core as mx
    import mlx.optimizers as optim

    from clawd.training import evaluate
    from clawd.training.data import read_job
    from clawd.training.export import mlx_to_gguf, save_mlx_adapter
    from clawd.training.kl_anchor import step_anchors, with_anchors
    from clawd.training.loss import LossWeights
    from clawd.training.teacher_answers import ANSWER_SUFFIX, ENDING_SUFFIX, is_teacher_answer
    from clawd.training.weights import load_model

    job = read_job(job_dir / "job.json")
    cfg = job.settings
    final = out_dir / job.id
    if final.exists():
        emit("done", adapter_id=job.id, path=str(final), already=True)
        return 0
    mx.random.seed(0)
    emit("phase", phase="load", model=job.model_path)
    lm = load_model(Path(job.model_path), cache_dir=cache_dir)
    note = attach_lora(lm, cfg, job.parent_path)
    active = evaluate.lora_params(lm.model)  # the parent's weights = π_old
    k = job.top_k  # mining.top_k, carried by the job

    def prepared(i: int, n: int) -> None:
        emit("prepare", done=i, total=n)
        if stop.requested:  # nothing to checkpoint yet: the next run prepares again
            raise StopRequested

    try:
        samples, prep, held = prepare_all(lm, job, job_dir, cache_dir, prepared)
        anchors, anchor_prep = prepare_anchors(lm, job, job_dir, prepared)
    except StopRequested:
        emit("stopped", step=0, total=0)
        return STOPPED

    weights = LossWeights(rl=cfg.w_rl, opd=cfg.w_opd, opd_weighting=cfg.opd_weighting)
    optimizer = optim.AdamW(learning_rate=cfg.learning_rate, betas=[0.9, 0.98], weight_decay=cfg.weight_decay)
    plan = [b for b in batches(len(samples), cfg.batch_size) for _ in range(cfg.epochs)]
    ckpt = job_dir / "checkpoint"
    found = find_checkpoint(ckpt)
    start, history = load_checkpoint(found, lm.model, optimizer) if found else (0, [])

    def on_step(step: int, m: dict) -> bool:
        m["step"] = start + step
        history.append(m)
        emit("step", total=len(plan), tokens=sum(len(samples[i].response_ids) for i in plan[start + step - 1]), **m)
        return not stop.requested

    def stopped(step: int) -> int:
        save_checkpoint(ckpt, lm.model, optimizer, step, history)
        emit("stopped", step=step, total=len(plan))
        return STOPPED

    # training.w_kl_base: each step also takes its turn of the anchors, indexed after the samples.
    n = len(samples)
    steps = with_anchors(plan, start, n, len(anchors))
    share = len(step_anchors(0, len(anchors))) or 1

    def loss_of(i: int):
        if i >= n:
            return anchor_loss(lm, anchors[i - n], anchor_prep[i - n], cfg.w_kl_base, share)
        return weighted(
            sample_loss(lm, samples[i], prep[i], weights),
            cfg.teacher_answers_weight if is_teacher_answer(samples[i]) else 1.0,
        )

    emit("phase", phase="train", steps=len(plan), resumed_at=start)
    done = train(
        lm.model,
        iter(steps),
        loss_of,
        optimizer,
        cfg.grad_clip,
        on_step,
        counts=lambda i: {"kl_base": 1.0} if i >= n else metric_counts(samples[i], k, weights, prep[i]["mask"]),
    )
    # A stop during the last step counts too: checkpoint at len(plan), and a resume goes
    # straight to the gate (the daemon SIGKILLs a trainer that ignores SIGTERM).
    if start + done < len(plan) or stop.requested:
        return stopped(start + done)

    emit("phase", phase="gate", holdout=len(job.holdout))
    candidate = evaluate.lora_params(lm.model)
    judged_on = "holdout" if job.holdout else "train"  # no held-out signal yet: say so
    gate = evaluate.direction(
        lm,
        job.holdout or job.train,
        active,
        candidate,
        k,
        weights.delta_clip,
        cfg.teacher,
        # Judged on the training signals: reuse their views (the teacher's answers are no signals).
        prepared=held if job.holdout else [p for s, p in zip(samples, prep) if not is_teacher_answer(s)],
        support=cfg.opd_support,
        weighting=cfg.opd_weighting,
    )
    if stop.requested:  # direction() leaves the candidate's weights in place
        return stopped(len(plan))
    gate.update(judged_on=judged_on, kl_to_base=evaluate.kl_to_base(lm, job.canary), kl_bound=cfg.kl_bound)
    if stop.requested:
        return stopped(len(plan))
    if job.turn_end is not None and job.canary:
        gate["turn_end"] = evaluate.turn_end_check(lm, job.canary, active, candidate, job.turn_end)
    if job.qa and job.turn_end is not None:
        t_qa = time.perf_counter()
        base_file = base_qa_file(cache_dir, job) if job.parent_id is None else None
        known = job.parent_qa if base_file is None else read_base_qa(base_file)
        gate["qa"] = evaluate.qa_check(lm, job.qa, active, candidate, job.turn_end, known)
        gate["qa"].update(seconds=round(time.perf_counter() - t_qa, 3), fingerprint=job.qa_fingerprint)
        if base_file is not None and known is None:
            write_base_qa(base_file, gate["qa"]["right_parent"])
    if stop.requested:
        return stopped(len(plan))
    gate["refused"] = evaluate.refusals(gate, cfg.kl_bound, cfg.qa_max_drop)
    gate["passed"] = not gate["refused"]
    probe = evaluate.probe(lm, job.train[0] if job.train else job.canary[0])
    if stop.requested:
        return stopped(len(plan))

    metrics = {
        "steps": len(plan),
        "samples": len(job.train),
        "teacher_answers": sum(t.turn_id.endswith(ANSWER_SUFFIX) for t in samples),
        "teacher_endings": sum(t.turn_id.endswith(ENDING_SUFFIX) for t in samples),
        "anchors": len(anchors),
        "history": history,
        "final": history[-1] if history else {},
        "note": note,
        "teacher": {"setting": cfg.teacher, "model_path": job.teacher_model_path},
    }
    meta = {
        "id": job.id,
        "parent_id": job.parent_id,
        "model": job.model,
        "created_at": time.time(),
        "signals": [s.turn_id for s in job.train],
        "holdout": [s.turn_id for s in job.holdout],
        "metrics": metrics,
        "gate": gate,
        "probe": probe,
    }
    tmp = out_dir / f".tmp-{job.id}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_mlx_adapter(
        lm.model,
        tmp,
        rank=cfg.rank,
        scale=cfg.alpha / cfg.rank,
        num_layers=len(lm.model.layers),
        keys=lora_keys(cfg.targets),
        extra={"clawd_base_model": job.model},
    )
    if Path(job.model_path).is_file():
        # The GGUF LoRA is checked against, and served on, a GGUF base. An MLX/HF directory base
        # has none: the mlx engine serves the mlx-lm files, and `export --format peft` covers the rest.
        mlx_to_gguf(tmp, lm, tmp / "adapter.gguf")
    (tmp / "meta.json").write_text(json.dumps(meta))
    os.replace(tmp, final)  # the adapter appears whole, or not at all
    emit("done", adapter_id=job.id, path=str(final), gate=gate, final=metrics["final"])
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m clawd.training.run", description=__doc__.splitlines()[0])
    p.add_argument("job_dir", type=Path)
    p.add_argument("--cache", type=Path, required=True, help="clawd's cache dir (dequantized weights, BLAS shim)")
    p.add_argument("--out", type=Path, required=True, help="the adapters dir")
    p.add_argument("--stock-blas", action="store_true", help="keep MLX's bundled reference BLAS (benchmarks)")
    p.add_argument("--parent", type=int, help="the daemon's pid: this trainer ends when that process does")
    a = p.parse_args(argv)
    if a.parent is not None:
        die_with_parent(a.parent)  # first, before the slow imports: a dead daemon's trainer must not run on
    try:
        sys.exit(run(a.job_dir, a.cache, a.out, stock_blas=a.stock_blas))
    except Exception as e:  # the daemon shows this line; the traceback goes to stderr (the log)
        import traceback

        traceback.print_exc()
        emit("error", message=f"{type(e).__name__}: {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()
