"""training.w_kl_base: a KL(base ‖ adapter) term on the base's answers to everyday prompts.

The coarse KL is checked against an independent NumPy computation from full softmaxes, its
step against MLX autodiff of each part alone, its prompts against the QA canary's, and a daemon
run that trains with it (the term is 0 at the base, where the first run starts, and rises as
the adapter leaves the base)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from clawd.training.kl_anchor import ANCHOR_PROMPTS, step_anchors
from clawd.training.loss import REST_FLOOR, coarse_kl
from tests.conftest import TRAIN_ENV, start_daemon
from tests.test_training_loop import make_ready_signals, training, wait_run
from tests.tiny_mlx import add_lora, tiny_lm


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def reference(base_logits: np.ndarray, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(coarse KL over the base's top-k + one rest bucket, full KL, the base's top-k ids), built
    from whole softmaxes: each bucket's mass is summed over the vocabulary, not taken as 1 − Σ."""
    p, q = np.exp(log_softmax(base_logits)), np.exp(log_softmax(logits))
    top = np.argsort(-p, axis=-1)[:, :k]
    coarse, full = [], []
    for row in range(p.shape[0]):
        rest = np.ones(p.shape[1], dtype=bool)
        rest[top[row]] = False
        pb = np.append(p[row, top[row]], p[row, rest].sum())
        qb = np.append(q[row, top[row]], q[row, rest].sum())
        coarse.append(float((pb * np.log(pb / qb)).sum()))
        full.append(float((p[row] * np.log(p[row] / q[row])).sum()))
    return np.array(coarse), np.array(full), top


@pytest.mark.parametrize("spread", [0.5, 2.0, 6.0])
def test_coarse_kl_matches_an_independent_reference_and_never_exceeds_the_full_kl(spread):
    rng = np.random.default_rng(7)
    base = rng.normal(0, spread, (9, 50))
    moved = base + rng.normal(0, 0.7, base.shape)
    want, full, top = reference(base, moved, 4)
    at = np.take_along_axis
    got = np.array(coarse_kl(mx.array(at(log_softmax(base), top, -1)), mx.array(at(log_softmax(moved), top, -1))))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert (got > 0).all() and (got <= full + 1e-6).all()


def test_coarse_kl_and_its_gradient_are_zero_at_the_base():
    rng = np.random.default_rng(8)
    lp = log_softmax(rng.normal(0, 2.0, (6, 40)))
    top = mx.array(np.sort(lp, axis=-1)[:, ::-1][:, :4].copy())
    assert np.abs(np.array(coarse_kl(top, top))).max() < 1e-6
    grad = mx.grad(lambda t: coarse_kl(top, t).sum())(top)
    assert np.abs(np.array(grad)).max() < 1e-6
    # ... and off the base it pushes each token back toward the base's probability
    lower = top - 0.3
    assert (np.array(mx.grad(lambda t: coarse_kl(top, t).sum())(lower)) < 0).all()


def test_a_step_adds_the_weighted_mean_anchor_kl_to_the_signals_mean(tmp_path):
    """One `train` step over [signal, signal, anchor, anchor] moves the LoRA by
    −(mean of the signals' gradients + β · mean of the anchors' KL gradients), each gradient
    taken alone by MLX autodiff: the anchors are added, not averaged in with the signals."""
    import mlx.optimizers as optim

    from clawd.training.data import Sample
    from clawd.training.evaluate import base_model
    from clawd.training.loss import LossWeights
    from clawd.training.run import anchor_loss, prepare, sample_loss, train

    lm = add_lora(tiny_lm(0))  # random lora_b: the adapter is off the base, so the KL pulls
    rng = np.random.default_rng(42)
    signals = [
        Sample(f"s{i}", rng.integers(0, 100, 5).tolist(), rng.integers(0, 100, 6).tolist(), -1) for i in range(2)
    ]
    anchors = [Sample(f"a{i}", rng.integers(0, 100, 4).tolist(), rng.integers(0, 100, 5).tolist()) for i in range(2)]
    prep = prepare(lm, signals, 4, tmp_path / "p.npz", lambda i, n: None)
    with base_model(lm.model):
        anchor_prep = prepare(lm, anchors, 4, tmp_path / "a.npz", lambda i, n: None)
    beta, weights = 0.7, LossWeights()

    def loss_of(i):
        if i >= 2:
            return anchor_loss(lm, anchors[i - 2], anchor_prep[i - 2], beta, 2)
        return sample_loss(lm, signals[i], prep[i], weights)

    def grad(i):
        g = nn.value_and_grad(lm.model, lambda _m: loss_of(i)[0])(lm.model)[1]
        return {k: np.array(v) for k, v in tree_flatten(g)}

    g = [grad(i) for i in range(4)]
    before = {k: np.array(v) for k, v in tree_flatten(lm.model.trainable_parameters())}
    seen = []
    train(lm.model, iter([[0, 1, 2, 3]]), loss_of, optim.SGD(learning_rate=1.0), 0.0, lambda s, m: seen.append(m))
    after = {k: np.array(v) for k, v in tree_flatten(lm.model.trainable_parameters())}
    key = "model.layers.0.self_attn.q_proj.lora_b"
    assert np.abs(g[2][key]).max() > 1e-5  # the anchors do pull
    for k in before:
        # anchor_loss already holds β / 2 per anchor: their sum is β × the mean
        want = -((g[0][k] + g[1][k]) / 2 + g[2][k] + g[3][k])
        np.testing.assert_allclose(after[k] - before[k], want, rtol=1e-4, atol=1e-6)
    (m,) = seen
    assert m["n_samples"] == 2 and m["kl_base"] > 0  # the anchors are no samples of the mean


def test_each_step_takes_its_turn_of_the_anchors():
    assert step_anchors(0, 16) == list(range(8)) and step_anchors(1, 16) == list(range(8, 16))
    assert step_anchors(2, 16) == list(range(8))
    assert step_anchors(1, 12) == [8, 9, 10, 11, 0, 1, 2, 3]
    assert step_anchors(5, 3) == [0, 1, 2] and step_anchors(0, 0) == []


def test_the_prompts_ask_nothing_the_qa_canary_asks():
    """The canary measures what the term protects: none of its questions, nor of their kinds."""
    from clawd.training.qa import QA_SET

    questions = {q.lower() for q, _ in QA_SET}
    assert len(set(ANCHOR_PROMPTS)) == len(ANCHOR_PROMPTS) == 16
    for prompt in ANCHOR_PROMPTS:
        low = prompt.lower()
        assert low not in questions
        assert not any(word in low for word in ("capital", "who wrote", "who painted", " + ", " times ", "how many"))
        for _, accepted in QA_SET:
            assert not any(f" {a.lower()} " in f" {low.rstrip('?.')} " for a in accepted), (prompt, accepted)


def test_a_daemon_run_trains_with_the_term(clawd_home, tiny_gguf):
    """Through the daemon: the job carries the prompts, the trainer has the base answer them, and
    each step logs the KL. The first run starts at the base (lora_b = 0): its first step's KL is 0
    and the second's is not."""
    from clawd.engines.llamacpp import Engine
    from clawd.store import adapters as adapter_rows

    engine = Engine(tiny_gguf, n_ctx=256, n_threads=1, model_id="tiny")
    d = start_daemon(clawd_home, engine, {**TRAIN_ENV, "CLAWD_TRAINING_W_KL_BASE": 0.5})
    try:
        make_ready_signals(d, 2)  # one batch: two steps (epochs 2)
        training(d, "POST")
        st = wait_run(d)
        assert st["state"] == "idle" and "adapter_id" in st["result"], st
        rec = d.run(adapter_rows.get(d.state.db, st["result"]["adapter_id"]))
        history = rec.metrics["history"]
        assert len(history) == 2
        assert history[0]["kl_base"] < 1e-6 < history[1]["kl_base"]
        assert history[1]["n_samples"] == 2  # the anchors are no signals
        # the step's loss: the signals' mean (a +1 sample with its RL term, a hinted −1 one with
        # both terms) plus β × the anchors' mean KL
        signals_mean = (2 * history[1]["rl"] + history[1]["opd"]) / 2
        assert history[1]["loss"] == pytest.approx(signals_mean + 0.5 * history[1]["kl_base"], rel=1e-5)
        assert rec.metrics["anchors"] == len(ANCHOR_PROMPTS)
    finally:
        d.stop()


def test_the_rest_bucket_floor_keeps_values_and_gradients_finite():
    """A confident answer: the top-k hold all but ~1e-9 of the mass under both, so both rest
    buckets sit at the floor; the term stays finite, ≥ 0 up to the floor, and its gradient too."""
    top = mx.array([[-1e-9, -22.0, -23.0, -24.0]])
    moved = mx.array([[-1e-10, -25.0, -21.0, -26.0]])
    for cur in (top, moved):
        value = coarse_kl(top, cur)
        grad = mx.grad(lambda t: coarse_kl(top, t).sum())(cur)
        assert np.isfinite(np.array(value)).all() and np.isfinite(np.array(grad)).all()
        assert float(value[0]) > -REST_FLOOR


def test_the_anchors_target_is_the_base_not_the_parent(tmp_path, monkeypatch):
    """run.prepare_anchors has the base answer (teacher "base") and takes π at the base: from a
    parent adapter (random lora_b) its views are the base's, the term is > 0 at the parent and
    0 under the base."""
    from clawd.config import TrainingSettings
    from clawd.training import teacher_answers
    from clawd.training.data import Job, Sample
    from clawd.training.evaluate import base_model, student_view
    from clawd.training.run import anchor_loss, prepare_anchors

    lm = add_lora(tiny_lm(0))
    rng = np.random.default_rng(43)
    prompts = [Sample(f"anchor-{i}", rng.integers(0, 100, 6).tolist(), []) for i in range(3)]
    settings = dataclasses.asdict(TrainingSettings(w_kl_base=0.5))
    job = Job("j", "m.gguf", "m", settings, anchor=prompts, top_k=4)
    asked = []

    def greedy(_lm, part, teacher, room, stops):
        asked.append(teacher)
        return [rng.integers(0, 100, 5).tolist() for _ in part]

    monkeypatch.setattr(teacher_answers, "generate", greedy)
    anchors, views = prepare_anchors(lm, job, tmp_path, lambda i, n: None)
    assert asked == ["base"] and len(anchors) == 3
    for anchor, view in zip(anchors, views):
        with base_model(lm.model):
            ids, lp = student_view(lm, anchor, 4)
        np.testing.assert_array_equal(view["ids"], ids)
        np.testing.assert_allclose(view["old"], lp, rtol=1e-5, atol=1e-6)
        kl = float(anchor_loss(lm, anchor, view, 1.0, 1)[1]["kl_base"])
        with base_model(lm.model):
            at_base = float(anchor_loss(lm, anchor, view, 1.0, 1)[1]["kl_base"])
        assert kl > 1e-4 and abs(at_base) < 1e-6
    again, _ = prepare_anchors(lm, job, tmp_path, lambda i, n: None)  # a resume: from the caches
    assert asked == ["base"] and [a.response_ids for a in again] == [a.response_ids for a in anchors]


def test_a_resumed_run_takes_the_same_anchors_at_each_step_as_a_whole_one():
    from clawd.training.kl_anchor import with_anchors

    plan = [[0, 1], [0, 1], [2], [2]]  # two batches, two epochs
    whole = with_anchors(plan, 0, 3, 16)
    assert whole[0] == [0, 1, *range(3, 11)] and whole[1] == [0, 1, *range(11, 19)] and whole[2] == [2, *range(3, 11)]
    assert with_anchors(plan, 2, 3, 16) == whole[2:]
    assert with_anchors(plan, 0, 3, 0) == plan


def test_a_step_whose_samples_carry_no_term_takes_no_pull_either(tmp_path):
    """An OPD-only run's batch with no hinted sample has nothing to learn: the anchors alone would
    only pull it back toward the base (undoing earlier lessons), so the step does not move."""
    import mlx.optimizers as optim

    from clawd.training.data import Sample
    from clawd.training.evaluate import base_model
    from clawd.training.loss import LossWeights
    from clawd.training.run import anchor_loss, prepare, sample_loss, train

    lm = add_lora(tiny_lm(0))
    rng = np.random.default_rng(44)
    plain = Sample("s", rng.integers(0, 100, 5).tolist(), rng.integers(0, 100, 6).tolist(), -1)  # no hint
    anchor = Sample("a", rng.integers(0, 100, 4).tolist(), rng.integers(0, 100, 5).tolist())
    (prep,) = prepare(lm, [plain], 4, tmp_path / "p.npz", lambda i, n: None)
    with base_model(lm.model):
        (anchor_prep,) = prepare(lm, [anchor], 4, tmp_path / "a.npz", lambda i, n: None)
    opd_only = LossWeights(rl=0.0)

    def loss_of(i):
        return anchor_loss(lm, anchor, anchor_prep, 1.0, 1) if i else sample_loss(lm, plain, prep, opd_only)

    assert float(loss_of(1)[1]["kl_base"]) > 1e-4  # off the base: the anchor alone would pull
    before = {k: np.array(v) for k, v in tree_flatten(lm.model.trainable_parameters())}
    seen = []
    train(lm.model, iter([[0, 1]]), loss_of, optim.SGD(learning_rate=1.0), 0.0, lambda s, m: seen.append(m))
    for k, v in tree_flatten(lm.model.trainable_parameters()):
        np.testing.assert_array_equal(np.array(v), before[k])
    assert seen[0]["n_samples"] == 0 and "kl_base" not in seen[0]
