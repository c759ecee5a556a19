"""clawd/training/loss.py against METHOD §5.

- `reference_loss` below is an independent, deliberately plain NumPy (float64, loops) reading
  of METHOD §5; nothing from loss.py is used in it. hybrid_loss (MLX, float32) must agree on
  random batches, ablations, padding and the clip boundaries, metrics included.
- The whole pipeline (response_logprobs -> hybrid_loss) is differentiated through a tiny real
  MLX llama with LoRA and checked against central finite differences (float64).
- Gathering positions are checked against the plain full forward (the off-by-one trap).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from clawd.training.loss import LossWeights, hybrid_loss, response_logprobs, topk_logprobs
from tests.tiny_mlx import add_lora, lora_params, tiny_lm

# ---------------------------------------------------------------- the NumPy reference (§5)

RL_LO, RL_HI = 0.8, 1.28  # clip(ρ, 1−0.2, 1+0.28)
OPD_LO, OPD_HI = 0.8, 1.28
C = 1.0  # log-prob-difference clip
CLAMP = 20.0  # |ℓ_θ − ℓ_old| clamp inside exp


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def reference_loss(
    lp_new,
    lp_old,
    reward,
    top_new,
    top_old,
    top_teacher,
    has_hint,
    mask,
    w_rl=1.0,
    w_opd=1.0,
    top_mask=None,
    weighting="student",
):
    """Returns (loss, metrics) exactly as METHOD §5 reads, one sample and one token at a time.
    `top_mask[b][t][v]`: whether column v is in S_i (a union support of varying size); None = all.
    `weighting` "teacher": w_v is the softmax over S_i of the teacher's log-probs instead."""
    B, T, K = np.shape(top_new)
    per_sample, rl_terms, opd_terms, rewards, ratios = [], [], [], [], []
    rl_clipped = opd_clipped = opd_pairs = 0
    for b in range(B):
        tokens = [t for t in range(T) if mask[b][t]]
        r = float(reward[b])
        do_rl = r != 0 and w_rl != 0 and tokens
        do_opd = bool(has_hint[b]) and w_opd != 0 and tokens
        if not (do_rl or do_opd):
            continue  # no sample: it takes no slot in the mean
        total = 0.0
        if do_rl:
            terms = []
            for t in tokens:
                rho = math.exp(clip(lp_new[b][t] - lp_old[b][t], -CLAMP, CLAMP))
                plain, clipped = rho * r, clip(rho, RL_LO, RL_HI) * r
                terms.append(-min(plain, clipped))
                rl_clipped += clipped < plain
                ratios.append(rho)
            rl = sum(terms) / len(terms)
            rl_terms.append(rl)
            rewards.append(r)
            total += w_rl * rl
        if do_opd:
            terms = []
            for t in tokens:
                support = [v for v in range(K) if top_mask is None or top_mask[b][t][v]]
                old = {v: float(top_old[b][t][v]) for v in support}
                teacher = {v: float(top_teacher[b][t][v]) for v in support}
                # softmax over S_i (unshifted is fine here) of the student's, the teacher's or both
                sources = {"student": [old], "teacher": [teacher], "both": [old, teacher]}[weighting]
                weights = {v: 0.0 for v in support}
                for by in sources:
                    z = sum(math.exp(x) for x in by.values())
                    for v in support:
                        weights[v] += math.exp(by[v]) / z / len(sources)
                term = 0.0
                for v in support:
                    weight = weights[v]
                    delta = clip(top_teacher[b][t][v] - old[v], -C, C)
                    a = weight * delta
                    rho = math.exp(clip(top_new[b][t][v] - old[v], -CLAMP, CLAMP))
                    plain, clipped = a * rho, a * clip(rho, OPD_LO, OPD_HI)
                    term += -min(plain, clipped)
                    opd_clipped += clipped < plain
                    opd_pairs += 1
                terms.append(term)
            opd = sum(terms) / len(terms)
            opd_terms.append(opd)
            total += w_opd * opd
        per_sample.append(total)

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0

    return mean(per_sample), {
        "rl": mean(rl_terms),
        "opd": mean(opd_terms),
        "rl_clip_frac": rl_clipped / len(ratios) if ratios else 0.0,
        "opd_clip_frac": opd_clipped / opd_pairs if opd_pairs else 0.0,
        "reward_mean": mean(rewards),
        "ratio_mean": mean(ratios),
        "n_samples": len(per_sample),
    }


# ---------------------------------------------------------------- helpers


def random_batch(rng, B=6, T=9, K=4, spread=0.3):
    """Float32-representable inputs (the reference sees exactly what MLX sees)."""
    lp_old = -np.abs(rng.normal(2.0, 1.5, (B, T)))
    top_old = -np.abs(rng.normal(2.0, 1.5, (B, T, K)))
    f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)  # noqa: E731
    return dict(
        lp_new=f32(lp_old + rng.normal(0, spread, (B, T))),  # ρ spread across both clip edges
        lp_old=f32(lp_old),
        reward=rng.choice([-1.0, 0.0, 1.0], B),
        top_new=f32(top_old + rng.normal(0, spread, (B, T, K))),
        top_old=f32(top_old),
        top_teacher=f32(top_old + rng.normal(0, 1.5, (B, T, K))),  # Δ often beyond ±C
        has_hint=rng.random(B) < 0.5,
        mask=np.ones((B, T)),
    )


def run_mlx(batch, weights=LossWeights()):
    args = {k: mx.array(v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in batch.items()}
    loss, metrics = hybrid_loss(**args, weights=weights)
    mx.eval(loss, metrics)
    return float(loss), {k: float(v) for k, v in metrics.items()}


def assert_matches(batch, w_rl=1.0, w_opd=1.0, metrics=True, weighting="student"):
    want, want_m = reference_loss(**batch, w_rl=w_rl, w_opd=w_opd, weighting=weighting)
    got, got_m = run_mlx(batch, LossWeights(rl=w_rl, opd=w_opd, opd_weighting=weighting))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key in ("rl", "opd", "reward_mean", "ratio_mean", "n_samples"):
        np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-5, atol=1e-6, err_msg=key)
    if metrics:
        for key in ("rl_clip_frac", "opd_clip_frac"):
            np.testing.assert_allclose(got_m[key], want_m[key], atol=1e-6, err_msg=key)
    return want, want_m


# ---------------------------------------------------------------- loss vs reference


def test_constants_are_methods():
    w = LossWeights()
    assert (w.rl, w.opd, 1 - w.clip_low, 1 + w.clip_high) == (1.0, 1.0, RL_LO, RL_HI)
    assert (1 - w.opd_clip_low, 1 + w.opd_clip_high, w.delta_clip, w.ratio_log_clamp) == (OPD_LO, OPD_HI, C, CLAMP)


@pytest.mark.parametrize("case", ["rl_only", "hint_only", "both", "mixed"])
def test_matches_reference_random(case):
    rng = np.random.default_rng(hash(case) % 2**32)
    for _ in range(5):
        b = random_batch(rng)
        B = len(b["reward"])
        if case == "rl_only":
            b["reward"], b["has_hint"] = rng.choice([-1.0, 1.0], B), np.zeros(B, bool)
        elif case == "hint_only":
            b["reward"], b["has_hint"] = np.zeros(B), np.ones(B, bool)
        elif case == "both":
            b["reward"], b["has_hint"] = rng.choice([-1.0, 1.0], B), np.ones(B, bool)
        _, m = assert_matches(b)
        assert m["n_samples"] > 0


def test_sample_without_signal_takes_no_slot():
    rng = np.random.default_rng(1)
    b = random_batch(rng, B=3)
    b["reward"], b["has_hint"] = np.array([1.0, 0.0, -1.0]), np.array([False, False, True])
    loss, m = assert_matches(b)
    assert m["n_samples"] == 2
    # dropping the empty sample changes nothing: it was not a zero in the mean
    keep = {k: v[[0, 2]] for k, v in b.items()}
    assert run_mlx(keep)[0] == pytest.approx(loss, rel=1e-5)
    # a batch of nothing but empty samples: loss 0, no samples, no NaN
    b["reward"], b["has_hint"] = np.zeros(3), np.zeros(3, bool)
    assert run_mlx(b) == (0.0, {k: 0.0 for k in m})


def test_padding_is_ignored_even_if_garbage():
    rng = np.random.default_rng(2)
    b = random_batch(rng, B=5, T=8)
    lengths = [8, 3, 5, 1, 0]  # the last sample has no tokens at all: no sample
    b["mask"] = (np.arange(8)[None] < np.array(lengths)[:, None]).astype(np.float64)
    b["reward"], b["has_hint"] = np.array([1.0, -1.0, 0.0, 1.0, 1.0]), np.array([True, False, True, True, True])
    want, m = assert_matches(b)
    assert m["n_samples"] == 4
    pad = b["mask"] == 0
    dirty = {k: v.copy() for k, v in b.items()}
    dirty["lp_new"][pad], dirty["lp_old"][pad] = 1e30, np.nan
    dirty["top_new"][pad], dirty["top_old"][pad], dirty["top_teacher"][pad] = -np.inf, np.nan, np.inf
    got, _ = run_mlx(dirty)
    assert got == pytest.approx(want, rel=1e-5)
    g = mx.grad(
        lambda x: hybrid_loss(
            x,
            *[mx.array(dirty[k].astype(np.float32)) for k in ("lp_old", "reward", "top_new", "top_old", "top_teacher")],
            mx.array(dirty["has_hint"]),
            mx.array(dirty["mask"].astype(np.float32)),
        )[0]
    )(mx.array(dirty["lp_new"].astype(np.float32)))
    g = np.array(g)
    assert np.isfinite(g).all() and (g[pad] == 0).all()


@pytest.mark.parametrize("w_rl,w_opd", [(0.0, 1.0), (1.0, 0.0), (0.5, 2.0)])
def test_ablation_weights(w_rl, w_opd):
    rng = np.random.default_rng(3)
    for _ in range(3):
        b = random_batch(rng, B=8)
        _, m = assert_matches(b, w_rl=w_rl, w_opd=w_opd)
    # OPD-only: RL-only samples take no slot; RL-only: hint-only samples take no slot
    b["reward"], b["has_hint"] = np.array([1.0, -1, 0, 0, 1, 0, -1, 0]), np.array([0, 0, 1, 1, 1, 0, 0, 0], bool)
    _, m = assert_matches(b, w_rl=w_rl, w_opd=w_opd)
    assert m["n_samples"] == {(0.0, 1.0): 3, (1.0, 0.0): 4, (0.5, 2.0): 6}[(w_rl, w_opd)]


def boundary_batch(ratios, rewards, K=4):
    """One token per (ρ, r); OPD pairs get the same ρ with A_v of both signs and Δ beyond ±C."""
    n = len(ratios)
    lp_old = np.full((n, 1), -1.5)
    teacher_minus_old = np.array([3.0, -3.0, 0.5, -1.0])  # Δ clipped to +C, to −C, inside, at −C
    top_old = np.tile(np.log([0.4, 0.3, 0.2, 0.05]), (n, 1, 1))
    f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)  # noqa: E731
    return dict(
        lp_new=f32(lp_old + np.log(ratios)[:, None]),
        lp_old=f32(lp_old),
        reward=np.asarray(rewards, float),
        top_new=f32(top_old + np.log(ratios)[:, None, None]),
        top_old=f32(top_old),
        top_teacher=f32(top_old + teacher_minus_old),
        has_hint=np.ones(n, bool),
        mask=np.ones((n, 1)),
    )


def test_clip_boundaries():
    eps = 1e-3
    clear = [0.5, 0.8 - eps, 0.8 + eps, 1.0, 1.2, 1.28 - eps, 1.28 + eps, 2.0, 1.2 - eps, 1.2 + eps]
    for r in (1.0, -1.0):
        # strictly inside/outside: loss, ratio and clip fractions all agree
        b = boundary_batch(clear, [r] * len(clear))
        _, m = assert_matches(b)
        assert 0 < m["rl_clip_frac"] < 1 and 0 < m["opd_clip_frac"] < 1
        # exactly on 0.8 / 1.28: the loss is continuous there, so values must still agree;
        # which branch counts as "clipped" at a float tie is not defined, so skip the fractions
        b = boundary_batch([0.8, 1.28, 0.8, 1.28], [r, r, -r, -r])
        assert_matches(b, metrics=False)


def test_clip_branches_by_hand():
    """A few hand-computed values, so the reference itself is pinned to METHOD's words."""
    b = boundary_batch([2.0, 2.0, 0.5, 0.5], [1.0, -1.0, 1.0, -1.0])
    b["has_hint"][:] = False
    # r=+1, ρ=2 -> −min(2, 1.28) = −1.28;  r=−1, ρ=2 -> −min(−2, −1.28) = 2
    # r=+1, ρ=.5 -> −min(.5, .8) = −.5;    r=−1, ρ=.5 -> −min(−.5, −.8) = .8
    want = (-1.28 + 2 - 0.5 + 0.8) / 4
    assert reference_loss(**b)[0] == pytest.approx(want)
    assert run_mlx(b)[0] == pytest.approx(want, rel=1e-5)
    assert run_mlx(b)[1]["rl_clip_frac"] == 0.5
    # log-ratio beyond the ±20 clamp
    b = boundary_batch([1.0], [-1.0])
    b["lp_new"][:] = b["lp_old"] + 30.0
    b["has_hint"][:] = False
    assert run_mlx(b)[0] == pytest.approx(math.exp(20.0), rel=1e-5)


# ---------------------------------------------------------------- union support (opd_support = "union")


def union_batch(rng, B=6, T=7, k=4):
    """Supports of varying size: the student's k columns always real, then 0..k teacher columns."""
    b = random_batch(rng, B=B, T=T, K=2 * k)
    extra = rng.integers(0, k + 1, (B, T))
    b["top_mask"] = (np.arange(2 * k)[None, None] < (k + extra)[..., None]).astype(np.float64)
    return b


@pytest.mark.parametrize("case", ["hint_only", "mixed"])
def test_union_support_matches_reference(case):
    rng = np.random.default_rng(21 if case == "mixed" else 22)
    for _ in range(5):
        b = union_batch(rng)
        if case == "hint_only":
            b["reward"], b["has_hint"] = np.zeros(6), np.ones(6, bool)
        _, m = assert_matches(b)
        assert m["n_samples"] > 0
    # the mask matters: the same numbers read as a full 2k-wide support give another loss
    full = {key: v for key, v in b.items() if key != "top_mask"}
    assert abs(run_mlx(full)[0] - run_mlx(b)[0]) > 1e-4


def test_union_padding_columns_are_ignored_even_if_garbage():
    rng = np.random.default_rng(23)
    b = union_batch(rng)
    b["has_hint"][:] = True
    want, _ = assert_matches(b)
    pad = np.broadcast_to(b["top_mask"] == 0, b["top_new"].shape)
    dirty = {key: v.copy() for key, v in b.items()}
    dirty["top_new"][pad], dirty["top_old"][pad], dirty["top_teacher"][pad] = np.inf, np.nan, -np.inf
    got, got_m = run_mlx(dirty)
    assert got == pytest.approx(want, rel=1e-5)
    args = {key: mx.array(v.astype(np.float32) if v.dtype == np.float64 else v) for key, v in dirty.items()}
    g = np.array(mx.grad(lambda top: hybrid_loss(**{**args, "top_new": top})[0])(args["top_new"]))
    assert np.isfinite(g).all() and (g[pad] == 0).all() and np.abs(g[~pad]).max() > 0


# ---------------------------------------------------------------- teacher weighting (opd_weighting = "teacher")


@pytest.mark.parametrize("weighting", ["teacher", "both"])
@pytest.mark.parametrize("union", [False, True])
def test_teacher_weighting_matches_reference(union, weighting):
    rng = np.random.default_rng(31 + union)
    for _ in range(5):
        b = union_batch(rng) if union else random_batch(rng)
        b["has_hint"][:2] = True
        _, m = assert_matches(b, weighting=weighting)
        assert m["n_samples"] > 0
    # the weighting matters: the same batch under the student's weights is another loss
    assert abs(run_mlx(b, LossWeights(opd_weighting=weighting))[0] - run_mlx(b)[0]) > 1e-4


def _push(lp: np.ndarray, teacher: np.ndarray, weighting: str) -> np.ndarray:
    """−d loss / d ℓ_θ(v) of one hinted OPD position (support = lp's columns, π_θ = π_old): how
    hard a step raises each column under `weighting`."""
    args = dict(
        lp_new=mx.array(lp[..., 0]),
        lp_old=mx.array(lp[..., 0]),
        reward=mx.array([0.0]),
        top_old=mx.array(lp),
        top_teacher=mx.array(teacher),
        has_hint=mx.array([True]),
        mask=mx.ones((1, 1)),
    )
    g = mx.grad(lambda top: hybrid_loss(top_new=top, **args, weights=LossWeights(opd_weighting=weighting))[0])
    return -np.array(g(mx.array(lp)))[0, 0]


def test_teacher_weighting_raises_a_token_the_student_never_ranks():
    """The inshort case, measured with llama.cpp on Qwen 0.5B / 1.5B: at the first position the
    student puts ~0.001 on "In", the hinted teacher 0.9. On a union support the student's
    weights give that column ~0.001 of the step; the teacher's give it most of it."""
    lp = np.log(np.array([[[0.30, 0.25, 0.15, 0.10, 0.001]]]))  # student: 4 top tokens, then "In"
    teacher = np.log(np.array([[[0.02, 0.01, 0.01, 0.01, 0.90]]]))
    student, by_teacher = _push(lp, teacher, "student"), _push(lp, teacher, "teacher")
    assert student[4] < 0.01 and by_teacher[4] > 0.8  # "In": ~0 of the step against most of it
    assert (by_teacher[:4] < 0).all()  # the student's own top tokens are pushed down
    # Independent reading of the same step: A_v = w_v · clip(Δ, ±1) with w_v by hand.
    w = np.exp(teacher[0, 0]) / np.exp(teacher[0, 0]).sum()
    np.testing.assert_allclose(by_teacher, w * np.clip(teacher[0, 0] - lp[0, 0], -1, 1), rtol=1e-5)


def test_the_gate_weights_advantages_as_the_loss_does():
    """evaluate.advantages (the gate's gain) with weighting "teacher" = the reference's A_v."""
    from clawd.training.evaluate import advantages

    rng = np.random.default_rng(33)
    b = union_batch(rng, B=1)
    old, teacher, m = b["top_old"][0], b["top_teacher"][0], b["top_mask"][0]
    got = advantages(old, teacher, C, m, "teacher")
    for t in range(old.shape[0]):
        cols = [v for v in range(old.shape[1]) if m[t, v]]
        z = sum(math.exp(teacher[t, v]) for v in cols)
        for v in range(old.shape[1]):
            want = math.exp(teacher[t, v]) / z * clip(teacher[t, v] - old[t, v], -C, C) if m[t, v] else 0.0
            assert got[t, v] == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert not np.allclose(got, advantages(old, teacher, C, m))  # the student's weights differ
    # "both": the mean of the two weightings, column by column
    both = advantages(old, teacher, C, m, "both")
    np.testing.assert_allclose(both, (got + advantages(old, teacher, C, m)) / 2, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="opd_weighting"):
        advantages(old, teacher, C, m, "mixed")


def test_both_weighting_raises_the_teachers_token_and_pushes_down_the_students_own():
    """The inshort refusals (docs/learning.md): training "In" raised "I" with it. Under the
    teacher's weights the student's "I" (0.25, the teacher's 0.001) gets ~0 of the step;
    under both it is pushed down with about half the student's weight, and "In" still gets
    about half the teacher's push up."""
    lp = np.log(np.array([[[0.30, 0.25, 0.15, 0.10, 0.001]]]))  # student: "The", "I", …, then "In"
    teacher = np.log(np.array([[[0.05, 0.001, 0.02, 0.01, 0.90]]]))
    by_teacher, both = _push(lp, teacher, "teacher"), _push(lp, teacher, "both")
    assert abs(by_teacher[1]) < 0.01 and both[1] < -0.1  # "I": ~nothing against a real push down
    assert both[4] > 0.4  # "In" still raised
    with pytest.raises(ValueError, match="opd_weighting"):
        _push(lp, teacher, "mixed")


def test_all_real_mask_is_the_student_support():
    """opd_support = "student" is the union code path with every column real: same numbers."""
    b = random_batch(np.random.default_rng(24))
    with_mask = {**b, "top_mask": np.ones_like(b["top_new"])}
    assert run_mlx(with_mask) == run_mlx(b)


def test_loss_gradient_matches_reference_differences():
    """d loss / d (lp_new, top_new) vs central differences of the float64 reference."""
    rng = np.random.default_rng(4)
    b = random_batch(rng, B=4, T=3, K=3)
    b["reward"], b["has_hint"] = np.array([1.0, -1.0, 0.0, 1.0]), np.array([True, False, True, True])
    rest = {
        k: mx.array(b[k].astype(np.float32) if b[k].dtype == np.float64 else b[k])
        for k in ("lp_old", "reward", "top_old", "top_teacher", "has_hint", "mask")
    }
    g_lp, g_top = mx.grad(lambda lp, top: hybrid_loss(lp, top_new=top, **rest)[0], argnums=(0, 1))(
        mx.array(b["lp_new"].astype(np.float32)), mx.array(b["top_new"].astype(np.float32))
    )
    h = 1e-6
    for name, g in (("lp_new", np.array(g_lp)), ("top_new", np.array(g_top))):
        for idx in np.ndindex(b[name].shape):
            up, down = {**b, name: b[name].copy()}, {**b, name: b[name].copy()}
            up[name][idx] += h
            down[name][idx] -= h
            fd = (reference_loss(**up)[0] - reference_loss(**down)[0]) / (2 * h)
            assert g[idx] == pytest.approx(fd, rel=1e-4, abs=1e-5), (name, idx)


# ---------------------------------------------------------------- gathering from a model


def full_logsoftmax(lm, ids):
    logits = lm.model(ids[None])[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def lm():
    return add_lora(tiny_lm(0))


def test_response_logprobs_positions(lm):
    rng = np.random.default_rng(5)
    n_prompt, n_resp = 5, 7
    tokens = rng.integers(0, 100, n_prompt + n_resp)
    ids = mx.array(tokens, dtype=mx.int32)
    full = full_logsoftmax(lm, ids)
    gather = np.concatenate([tokens[n_prompt:, None], rng.integers(0, 100, (n_resp, 3))], axis=1)
    want = np.take_along_axis(full[n_prompt - 1 : -1], gather, axis=1)
    for chunk in (1, 3, 7, 64):
        got = np.array(response_logprobs(lm, ids, n_prompt, mx.array(gather), chunk=chunk))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"chunk={chunk}")
    got = np.array(response_logprobs(lm, ids, n_prompt, mx.array(gather), chunk=3, checkpoint=True))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        response_logprobs(lm, ids, 0, mx.array(gather))


def test_topk_logprobs(lm):
    rng = np.random.default_rng(6)
    n_prompt, n_resp, k = 4, 9, 4
    ids = mx.array(rng.integers(0, 100, n_prompt + n_resp), dtype=mx.int32)
    full = full_logsoftmax(lm, ids)[n_prompt - 1 : -1]
    want_ids = np.argsort(-full, axis=1)[:, :k]
    for chunk in (2, 64):
        top_ids, top_lp = topk_logprobs(lm, ids, n_prompt, k, chunk=chunk)
        assert top_ids.dtype == mx.int32 and top_ids.shape == (n_resp, k)
        np.testing.assert_array_equal(np.array(top_ids), want_ids)
        np.testing.assert_allclose(np.array(top_lp), np.take_along_axis(full, want_ids, 1), rtol=1e-5, atol=1e-5)


def test_checkpointed_gradient_equals_plain(lm):
    ids = mx.array(np.arange(3, 15), dtype=mx.int32)
    gather = mx.array(np.arange(8 * 2).reshape(8, 2) % 100, dtype=mx.int32)
    grads = []
    for ckpt in (False, True):
        f = nn.value_and_grad(
            lm.model, lambda _m: response_logprobs(lm, ids, 4, gather, chunk=3, checkpoint=ckpt).sum()
        )
        _, g = f(lm.model)
        grads.append(dict(tree_flatten(g)))
    for name in grads[0]:
        np.testing.assert_allclose(np.array(grads[1][name]), np.array(grads[0][name]), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the full pipeline


def pipeline(lm, seqs, n_prompt, k=4, seed=0):
    """Per sample: ids (n, 1+k) = sampled + top-k of π_old, old log-probs, a synthetic teacher."""
    rng = np.random.default_rng(seed)
    prepared = []
    for tokens in seqs:
        ids = mx.array(tokens, dtype=mx.int32)
        top_ids, _ = topk_logprobs(lm, ids, n_prompt, k)
        gather = mx.concatenate([ids[n_prompt:, None], top_ids], axis=1)
        old = np.array(response_logprobs(lm, ids, n_prompt, gather))
        teacher = old[:, 1:] + rng.normal(0, 0.7, old[:, 1:].shape)
        prepared.append((ids, gather, old, teacher))
    return prepared


def batch_loss(lm, prepared, n_prompt, reward, has_hint, weights=LossWeights()):
    """Pad the samples into one (B, T) batch and evaluate hybrid_loss."""
    T = max(p[1].shape[0] for p in prepared)
    lp_new, lp_old, top_new, top_old, teacher, mask = [], [], [], [], [], []
    for ids, gather, old, tch in prepared:
        lp = response_logprobs(lm, ids, n_prompt, gather, chunk=4)
        n = lp.shape[0]
        pad = lambda x: mx.pad(  # noqa: E731
            mx.array(x) if isinstance(x, np.ndarray) else x,
            [(0, T - n)] + [(0, 0)] * (x.ndim - 1),
        )
        lp_new.append(pad(lp[:, 0]))
        top_new.append(pad(lp[:, 1:]))
        lp_old.append(pad(old[:, 0]))
        top_old.append(pad(old[:, 1:]))
        teacher.append(pad(tch))
        mask.append(mx.arange(T) < n)
    s = mx.stack
    return hybrid_loss(
        s(lp_new), s(lp_old), mx.array(reward), s(top_new), s(top_old), s(teacher), mx.array(has_hint), s(mask), weights
    )


def perturb(lm, seed, std):
    """Move the LoRA away from π_old so ρ ≠ 1 (some tokens beyond the clip edges)."""
    mx.random.seed(seed)
    params = lora_params(lm)
    lm.model.update(
        tree_unflatten([(k, v + (std * mx.random.normal(v.shape)).astype(v.dtype)) for k, v in params.items()])
    )


def test_pipeline_gradient_matches_finite_differences():
    """MLX CPU computes its fast kernels (rms_norm, rope, attention) in float32 even for float64
    inputs, so this runs in float32 with a step of 1e-3: FD noise is ~1e-3 relative, far
    below a sign or factor-2 error. Entries whose ±h step moves a token across a clip edge
    (a kink) are skipped; the clip counts tell."""
    lm = add_lora(tiny_lm(0), b_std=0.2)
    n_prompt = 5
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, 100, n_prompt + n) for n in (8, 5, 6)]
    prepared = pipeline(lm, seqs, n_prompt)
    perturb(lm, seed=8, std=0.5)
    reward, hint = [1.0, -1.0, 0.0], [True, False, True]

    def loss_fn(_model):
        return batch_loss(lm, prepared, n_prompt, reward, hint)

    (loss, metrics), grads = nn.value_and_grad(lm.model, loss_fn)(lm.model)
    assert 0 < float(metrics["rl_clip_frac"]) < 1 and abs(float(metrics["ratio_mean"]) - 1) > 1e-3
    assert float(metrics["opd_clip_frac"]) > 0 and int(metrics["n_samples"]) == 3
    clips = (float(metrics["rl_clip_frac"]), float(metrics["opd_clip_frac"]))
    grads = dict(tree_flatten(grads))
    params = lora_params(lm)
    picks = np.random.default_rng(9)
    h = 1e-3
    checked = 0
    for name in sorted(params):
        flat = np.array(params[name]).ravel()
        for j in picks.choice(flat.size, 2, replace=False):
            vals = []
            for sign in (1, -1):
                moved = flat.copy()
                moved[j] += sign * h
                lm.model.update(tree_unflatten([(name, mx.array(moved.reshape(params[name].shape)))]))
                value, m = loss_fn(lm.model)
                vals.append((float(value), (float(m["rl_clip_frac"]), float(m["opd_clip_frac"]))))
            lm.model.update(tree_unflatten([(name, params[name])]))
            if vals[0][1] != clips or vals[1][1] != clips:
                continue  # crossed a kink
            fd = (vals[0][0] - vals[1][0]) / (2 * h)
            g = float(np.array(grads[name]).ravel()[j])
            assert g == pytest.approx(fd, rel=1e-2, abs=5e-4), (name, j)
            checked += abs(fd) > 2e-2
    assert checked >= 4  # not a vacuous 0 == 0 check


def test_no_signal_means_zero_gradient(lm):
    n_prompt = 4
    prepared = pipeline(lm, [np.arange(10, 20)], n_prompt)  # π_θ = π_old: ρ ≡ 1
    (loss, metrics), grads = nn.value_and_grad(lm.model, lambda _m: batch_loss(lm, prepared, n_prompt, [0.0], [False]))(
        lm.model
    )
    assert float(loss) == 0.0 and int(metrics["n_samples"]) == 0
    assert all(float(mx.abs(g).max()) == 0.0 for _, g in tree_flatten(grads))


@pytest.mark.parametrize("r", [1.0, -1.0])
def test_rl_step_moves_sampled_tokens_by_reward_sign(lm, r):
    n_prompt = 4
    saved = lora_params(lm)
    prepared = pipeline(lm, [np.arange(30, 42)], n_prompt)
    ids, gather, old, _ = prepared[0]
    (_, metrics), grads = nn.value_and_grad(lm.model, lambda _m: batch_loss(lm, prepared, n_prompt, [r], [False]))(
        lm.model
    )
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
    lm.model.update(tree_unflatten([(k, saved[k] - 0.05 * g) for k, g in tree_flatten(grads)]))
    after = np.array(response_logprobs(lm, ids, n_prompt, gather[:, :1]))[:, 0]
    lm.model.update(tree_unflatten(list(saved.items())))
    assert r * (after.mean() - old[:, 0].mean()) > 1e-4


@pytest.mark.parametrize("teacher", ["base", "policy"])
def test_teacher_scores_the_hinted_prompt_with_the_chosen_model(lm, teacher):
    """training.teacher: "base" scores with the frozen base (a fresh model of the same seed,
    no LoRA: the reference), "policy" with the adapter on; both at the student's top-k."""
    from clawd.training.data import Sample
    from clawd.training.evaluate import teacher_view

    rng = np.random.default_rng(8)
    prompt, hinted, response = ([int(t) for t in rng.integers(0, 100, n)] for n in (4, 9, 6))
    top = rng.integers(0, 100, (6, 4))
    sample = Sample("t", prompt, response, 1, hinted)
    scorer = tiny_lm(0) if teacher == "base" else lm
    want = np.take_along_axis(full_logsoftmax(scorer, mx.array(hinted + response, dtype=mx.int32))[8:-1], top, 1)
    got = teacher_view(lm, sample, top, teacher)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    other = teacher_view(lm, sample, top, "policy" if teacher == "base" else "base")
    assert np.abs(other - got).max() > 1e-3  # the LoRA moves these log-probs: the choice matters
    assert teacher_view(lm, Sample("t", prompt, response, 1, None), top, teacher) is None


def test_prepare_scores_the_teacher_it_is_told_to(lm, tmp_path):
    """run.prepare hands training.teacher through: its cached teacher arrays are the chosen
    teacher's at the student's top-k."""
    from clawd.training.data import Sample
    from clawd.training.evaluate import teacher_view
    from clawd.training.run import prepare

    sample = Sample("t", [5, 6, 7], [8, 9, 10, 11], -1, [5, 6, 7, 40, 41])
    preps = {}
    for teacher in ("base", "policy"):
        (preps[teacher],) = prepare(lm, [sample], 4, tmp_path / f"{teacher}.npz", lambda i, n: None, teacher)
        want = teacher_view(lm, sample, preps[teacher]["ids"][:, 1:], teacher)
        np.testing.assert_array_equal(preps[teacher]["teacher"], want)
    assert np.abs(preps["base"]["teacher"] - preps["policy"]["teacher"]).max() > 1e-3


def test_the_gate_on_training_signals_reuses_what_prepare_computed(lm, tmp_path, monkeypatch):
    """With nothing held out the gate judges on the training signals, whose π_old and teacher
    views prepare() already has under the same (active) weights: reusing them gives the very
    same verdict without the 3 extra forward passes per sample."""
    from clawd.training import evaluate
    from clawd.training.data import Sample
    from clawd.training.run import prepare

    rng = np.random.default_rng(11)
    samples = [
        Sample(f"t{i}", [int(t) for t in rng.integers(0, 100, 5)], [int(t) for t in rng.integers(0, 100, 8)], r, hint)
        for i, (r, hint) in enumerate([(1, [3, 4, 5, 6, 7, 8]), (-1, None), (0, [9, 10, 11, 12])])
    ]
    active = evaluate.lora_params(lm.model)
    prep = prepare(lm, samples, 4, tmp_path / "prep.npz", lambda i, n: None, "base")
    candidate = {k: v + 0.02 if k.endswith("lora_b") else v for k, v in active.items()}
    try:
        want = evaluate.direction(lm, samples, active, candidate, 4, 2.0, "base")
        assert want["gain"] != 0.0 and want["n"] == 3

        def recomputed(*a, **kw):
            raise AssertionError("the gate recomputed a view prepare() already had")

        monkeypatch.setattr(evaluate, "student_view", recomputed)
        monkeypatch.setattr(evaluate, "teacher_view", recomputed)
        got = evaluate.direction(lm, samples, active, candidate, 4, 2.0, "base", prepared=prep)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
        assert all(np.array_equal(evaluate.lora_params(lm.model)[k], v) for k, v in candidate.items())
    finally:
        evaluate.set_lora_params(lm.model, active)  # the module-scoped model, as other tests expect it


@pytest.mark.parametrize("chunk", [3, 64])
def test_student_view_is_topk_then_response_logprobs_in_one_pass(lm, chunk, monkeypatch):
    """π_old and its top-k from one body pass are the two-pass definition's numbers, to the
    bit (training's first ratio is exactly 1 only if they are); the model body runs once."""
    from clawd.training import evaluate
    from clawd.training.data import Sample

    rng = np.random.default_rng(12)
    sample = Sample("t", [int(t) for t in rng.integers(0, 100, 6)], [int(t) for t in rng.integers(0, 100, 10)], 1)
    ids = mx.array(sample.prompt_ids + sample.response_ids, dtype=mx.int32)
    top_ids, _ = topk_logprobs(lm, ids, 6, 4, chunk=chunk)
    want_ids = np.concatenate([np.array(sample.response_ids)[:, None], np.array(top_ids)], axis=1)
    want_lp = np.array(response_logprobs(lm, ids, 6, mx.array(want_ids), chunk=chunk))

    calls = []
    hidden = lm.hidden
    monkeypatch.setattr(lm, "hidden", lambda x: calls.append(1) or hidden(x))
    got_ids, got_lp = evaluate.student_view(lm, sample, 4, chunk=chunk)
    assert len(calls) == 1
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_lp, want_lp)


def test_union_support_ids_by_hand():
    from clawd.training.evaluate import union_support

    student = np.array([[5, 6, 7], [1, 2, 3]])
    teacher = np.array([[7, 9, 5], [3, 2, 1]])
    ids, mask = union_support(student, teacher)
    # the student's top-k first in its order, then the teacher's new ids in the teacher's order;
    # the second row adds nothing and is padded with its own first id
    np.testing.assert_array_equal(ids, [[5, 6, 7, 9], [1, 2, 3, 1]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1], [1, 1, 1, 0]])


@pytest.mark.parametrize("teacher", ["base", "policy"])
def test_union_views_against_an_independent_forward(lm, teacher):
    """sample_views with support "union": column 1.. k are π_old's top-k, the rest the teacher's
    own top-k it lacks (the chosen teacher's: a fresh base model, or the policy), and old /
    teacher are full-softmax log-probs of π_old / the hinted teacher at those ids."""
    from clawd.training.data import Sample
    from clawd.training.evaluate import sample_views

    rng = np.random.default_rng(25)
    prompt, hinted, response = ([int(t) for t in rng.integers(0, 100, n)] for n in (5, 9, 7))
    k = 4
    view = sample_views(lm, Sample("t", prompt, response, 1, hinted), k, teacher, "union")
    scorer = tiny_lm(0) if teacher == "base" else lm
    t_lp = full_logsoftmax(scorer, mx.array(hinted + response, dtype=mx.int32))[8:-1]
    s_lp = full_logsoftmax(lm, mx.array(prompt + response, dtype=mx.int32))[4:-1]
    ids, mask = view["ids"], view["mask"].astype(bool)
    assert ids.shape[1] > 1 + k and mask.sum() > len(response) * k  # the teacher added tokens
    for i in range(len(response)):
        support = ids[i, 1:][mask[i]].tolist()
        want = list(np.argsort(-s_lp[i])[:k]) + [v for v in np.argsort(-t_lp[i])[:k] if v not in support[:k]]
        assert support == want
        assert ids[i, 0] == response[i]
    np.testing.assert_allclose(view["old"], np.take_along_axis(s_lp, ids, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(view["teacher"], np.take_along_axis(t_lp, ids[:, 1:], 1), rtol=1e-5, atol=1e-5)
    # no hint: no teacher, no union, the student's top-k alone
    plain = sample_views(lm, Sample("t", prompt, response, 1, None), k, teacher, "union")
    assert plain["teacher"] is None and plain["mask"] is None and plain["ids"].shape[1] == 1 + k


def test_union_prepare_caches_the_mask_and_trains_at_ratio_one(lm, tmp_path):
    """prepare() keeps the union views (mask included) across a resume, and the loss at the
    prepared weights has ratio exactly 1: π_old comes from the very function training calls."""
    from clawd.training.data import Sample
    from clawd.training.loss import LossWeights
    from clawd.training.run import metric_counts, prepare, sample_loss

    rng = np.random.default_rng(26)
    sample = Sample(
        "t",
        [int(t) for t in rng.integers(0, 100, 5)],
        [int(t) for t in rng.integers(0, 100, 6)],
        1,
        [3, 4, 5, 6, 7, 8, 9],
    )
    (first,) = prepare(lm, [sample], 4, tmp_path / "p.npz", lambda i, n: None, "base", "union")
    (again,) = prepare(lm, [sample], 4, tmp_path / "p.npz", lambda i, n: None, "base", "union")
    for name in ("ids", "old", "teacher", "mask"):
        np.testing.assert_array_equal(first[name], again[name])
    _, m = sample_loss(lm, sample, again, LossWeights())
    assert float(m["ratio_mean"]) == 1.0 and float(m["opd_clip_frac"]) == 0.0
    assert metric_counts(sample, 4, LossWeights(), again["mask"])["opd_clip_frac"] == again["mask"].sum()


@pytest.mark.parametrize("w,batch", [(0.0, [0, 1]), (0.5, [0, 1]), (0.5, [1])])
def test_a_weighted_sample_counts_w_times_in_its_batch_mean(w, batch, tmp_path):
    """training.teacher_answers_weight: one step of `train` over [signal, answer] with the
    answer weighted w moves the LoRA by (g_signal + w·g_answer) / (1 + w), each gradient taken
    alone by MLX autodiff; w = 0 is the step without the answer, and an answer alone in its
    batch takes its whole gradient (its weight divides out)."""
    import mlx.optimizers as optim

    from clawd.training.data import Sample
    from clawd.training.run import prepare, sample_loss, train, weighted

    lm = add_lora(tiny_lm(0))
    rng = np.random.default_rng(41)
    hint = [3, 4, 5, 6, 7, 8, 9]
    signal = Sample("s", rng.integers(0, 100, 5).tolist(), rng.integers(0, 100, 6).tolist(), -1, hint)
    answer = Sample("s#teacher", signal.prompt_ids, rng.integers(0, 100, 4).tolist(), 0, hint)
    prep = prepare(lm, [signal, answer], 4, tmp_path / "p.npz", lambda i, n: None, "base", "union")
    samples, weights = [signal, answer], LossWeights()

    def grad(i):
        g = nn.value_and_grad(lm.model, lambda _m: sample_loss(lm, samples[i], prep[i], weights)[0])(lm.model)[1]
        return {k: np.array(v) for k, v in tree_flatten(g)}

    g_signal, g_answer = grad(0), grad(1)
    before = {k: np.array(v) for k, v in tree_flatten(lm.model.trainable_parameters())}
    done = train(
        lm.model,
        iter([batch]),
        lambda i: weighted(sample_loss(lm, samples[i], prep[i], weights), w if i == 1 else 1.0),
        optim.SGD(learning_rate=1.0),
        0.0,
        lambda step, m: True,
    )
    assert done == 1
    after = {k: np.array(v) for k, v in tree_flatten(lm.model.trainable_parameters())}
    assert np.abs(g_answer["model.layers.0.self_attn.q_proj.lora_b"]).max() > 1e-4  # the answer moves the LoRA
    for k in before:
        want = -(g_signal[k] + w * g_answer[k]) / (1 + w) if 0 in batch else -g_answer[k]
        np.testing.assert_allclose(after[k] - before[k], want, rtol=1e-4, atol=1e-6)
