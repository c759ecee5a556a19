"""The hybrid objective of one update (METHOD §5), written once, and the log-prob gathering it
needs from a model.

Boundary: pure MLX functions. `hybrid_loss` sees only per-token log-probs (current, old,
teacher), rewards, hint flags and a padding mask; it knows nothing of tokenizers, stores or
the optimizer. `response_logprobs` / `topk_logprobs` rely on exactly two methods of the model
wrapper (clawd.training.weights.LoadedModel): `hidden(ids (B,T)) -> (B,T,d)` after the final
norm and `logits(hidden) -> (..., V)` float32.

Which sample gets which term (METHOD §5): r != 0 -> RL term; a selected hint -> OPD term;
neither -> no sample (it is left out of the mean over samples, not counted as a zero).
A term whose weight is 0 (the ablations) is treated as absent, so an OPD-only run does not
dilute its batch with RL-only samples that contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class LossWeights:
    """METHOD §5/§6 constants, all configurable."""

    rl: float = 1.0  # w_RL (0 -> OPD-only ablation)
    opd: float = 1.0  # w_OPD (0 -> binary-RL-only ablation)
    clip_low: float = 0.2  # RL ratio clip 1-0.2
    clip_high: float = 0.28  # RL ratio clip 1+0.28
    opd_clip_low: float = 0.2  # OPD ratio clip 0.8
    opd_clip_high: float = 0.28  # OPD ratio clip 1.28
    delta_clip: float = 1.0  # C, the log-prob-difference clip
    ratio_log_clamp: float = 20.0  # |log ρ| cap before exp (both terms; see _ratio)
    # Whose probabilities weight the OPD columns (training.opd_weighting): "student" is METHOD
    # §5's softmax_S(ℓ_old); "teacher" is softmax_S(ℓ_T), see `opd_column_weights`.
    opd_weighting: str = "student"


def _ratio(lp_new: mx.array, lp_old: mx.array, clamp: float) -> mx.array:
    # METHOD clamps only the OPD ratio; the RL ratio gets the same ±20 guard. It never binds
    # for sane updates (|log ρ| <= 20) and keeps a stray token from turning the loss into inf
    # and the LoRA into NaN (with r = -1 the RL term is unbounded above in ρ).
    return mx.exp(mx.clip(lp_new - lp_old, -clamp, clamp))


WEIGHTINGS = ("student", "teacher", "both")  # training.opd_weighting


def opd_column_weights(top_old: mx.array, top_teacher: mx.array, mk: mx.array, weighting: str) -> mx.array:
    """w_v over the real columns of S_i: softmax of ℓ_old (METHOD §5, "student") or of ℓ_T
    ("teacher"). With the student's weights a token the student gives ~0 gets ~0 weight, so
    even a union support cannot raise the "In" or "Cheers" the hinted teacher puts 0.9 on
    (per-token reverse KL is mode-seeking); the teacher's weights make it a forward-KL step on
    S_i, which pulls mass toward what the teacher would write. "both" averages the two: the
    teacher's tokens are raised as by "teacher", and a token the student ranks but the teacher
    does not write keeps half the student's weight behind its push down (by "teacher" alone it
    gets ~0 weight). Aimed at the "I" that rose with "In" and opened refusals; measured, it did not
    stop them (docs/learning.md). Padding columns get a finite −1e9 (exp → 0; a row with no
    real column, i.e. a padding token, stays finite)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"opd_weighting must be one of {', '.join(WEIGHTINGS)}, not {weighting!r}")
    sources = {"student": (top_old,), "teacher": (top_teacher,), "both": (top_old, top_teacher)}[weighting]
    return sum(mx.softmax(mx.where(mk, x, -1e9), axis=-1) for x in sources) / len(sources)


def _ppo(ratio: mx.array, adv: mx.array, low: float, high: float) -> tuple[mx.array, mx.array]:
    """(-min(ρA, clip(ρ, 1-low, 1+high)A), whether the clipped branch is the strict min)."""
    unclipped = ratio * adv
    clipped = mx.clip(ratio, 1.0 - low, 1.0 + high) * adv
    return -mx.minimum(unclipped, clipped), clipped < unclipped


def hybrid_loss(
    lp_new: mx.array,  # (B, T)    log π_θ(a_i), carries the gradient
    lp_old: mx.array,  # (B, T)    log π_old(a_i)
    reward: mx.array,  # (B,)      r in {+1, -1, 0}
    top_new: mx.array,  # (B, T, K) log π_θ(v), v in S_i (student top-k under π_old)
    top_old: mx.array,  # (B, T, K) log π_old(v)
    top_teacher: mx.array,  # (B, T, K) log π_T(v | hint)
    has_hint: mx.array,  # (B,) bool
    mask: mx.array,  # (B, T) 1 for real response tokens, 0 for padding
    weights: LossWeights = LossWeights(),
    top_mask: mx.array | None = None,  # (B, T, K) 1 where v is in S_i; None = every column is
) -> tuple[mx.array, dict[str, mx.array]]:
    """L = mean over samples with a term of (w_RL·mean_i L_RL,i + w_OPD·mean_i L_OPD,i).

    `weights.opd_weighting = "teacher"` weights the OPD columns by the hinted teacher's
    softmax over S_i instead of the student's, "both" by their mean (`opd_column_weights`).

    Log-probs are global (full-vocabulary softmax), never renormalised over S_i.
    `top_mask`: a support of varying size per position (training.opd_support = "union": the
    student's top-k ∪ the teacher's, padded to K columns); w_v is then the softmax over the
    real columns only, and padding columns add nothing to the loss or the clip fraction.
    Returns (scalar loss, metrics); metrics are detached and pooled over tokens where
    they are per-token quantities (ratio_mean, clip fractions)."""
    w = weights
    m = mask.astype(mx.bool_)
    mk = m[..., None]
    if top_mask is not None:
        mk = mk & top_mask.astype(mx.bool_)
    # Padding may hold anything: zero it first so nothing non-finite reaches the arithmetic.
    lp_new = mx.where(m, lp_new, 0.0)
    lp_old = mx.stop_gradient(mx.where(m, lp_old, 0.0))
    top_new = mx.where(mk, top_new, 0.0)
    top_old = mx.stop_gradient(mx.where(mk, top_old, 0.0))
    top_teacher = mx.stop_gradient(mx.where(mk, top_teacher, 0.0))
    reward = mx.stop_gradient(reward).astype(lp_new.dtype)

    mf = m.astype(lp_new.dtype)
    n_tok = mf.sum(axis=1)  # (B,)
    has_rl = (reward != 0) & (n_tok > 0) & (w.rl != 0)
    has_opd = has_hint.astype(mx.bool_) & (n_tok > 0) & (w.opd != 0)
    counted = has_rl | has_opd
    rl_tok = mf * has_rl[:, None]  # (B, T) tokens that carry an RL term
    opd_tok = mf * has_opd[:, None]

    # RL: advantage = raw r on every token (no baseline: a live conversation has no group).
    ratio = _ratio(lp_new, lp_old, w.ratio_log_clamp)
    rl_i, rl_clipped = _ppo(ratio, reward[:, None], w.clip_low, w.clip_high)
    rl_s = (rl_i * rl_tok).sum(axis=1) / mx.maximum(n_tok, 1)  # (B,) token mean

    # OPD: A_v = w_v · clip(ℓ_T(v) − ℓ_old(v), −C, C), both detached; w_v is a softmax over
    # S_i only (padding columns get A_v = 0).
    weight = opd_column_weights(top_old, top_teacher, mk, w.opd_weighting)
    adv = mx.where(mk, weight * mx.clip(top_teacher - top_old, -w.delta_clip, w.delta_clip), 0.0)
    rho_v = _ratio(top_new, top_old, w.ratio_log_clamp)
    opd_v, opd_clipped = _ppo(rho_v, adv, w.opd_clip_low, w.opd_clip_high)
    opd_s = (opd_v.sum(axis=-1) * opd_tok).sum(axis=1) / mx.maximum(n_tok, 1)
    pair = mx.broadcast_to(mk, top_new.shape).astype(lp_new.dtype) * opd_tok[..., None]  # (B, T, K) real OPD pairs

    per_sample = w.rl * mx.where(has_rl, rl_s, 0.0) + w.opd * mx.where(has_opd, opd_s, 0.0)
    n = counted.sum()
    loss = per_sample.sum() / mx.maximum(n, 1)

    def frac(num, den):
        return mx.stop_gradient(num.sum() / mx.maximum(den.sum(), 1))

    n_rl_tok, n_opd_pairs = rl_tok.sum(), pair.sum()
    metrics = {
        "rl": frac(mx.where(has_rl, rl_s, 0.0), has_rl),
        "opd": frac(mx.where(has_opd, opd_s, 0.0), has_opd),
        "rl_clip_frac": mx.stop_gradient((rl_clipped * rl_tok).sum() / mx.maximum(n_rl_tok, 1)),
        "opd_clip_frac": mx.stop_gradient((opd_clipped * pair).sum() / mx.maximum(n_opd_pairs, 1)),
        "reward_mean": frac(reward * has_rl, has_rl),
        "ratio_mean": mx.stop_gradient((ratio * rl_tok).sum() / mx.maximum(n_rl_tok, 1)),
        "n_samples": n,
    }
    return loss, metrics


# A bucket below this mass counts as this mass: 1 − Σ p can round to 0 or below when the top-k
# hold nearly everything, and log 0 would make the term and its gradient non-finite.
REST_FLOOR = 1e-6


def coarse_kl(base_top: mx.array, top: mx.array) -> mx.array:
    """Per-position KL(base ‖ current) over k + 1 outcomes: the k support tokens and one bucket
    for the rest of the vocabulary (training.w_kl_base, clawd/training/kl_anchor.py).
    base_top, top: (..., k) global log-probs of the same tokens under the base (constant) and
    the current weights (differentiable). Returns (...,): ≥ 0, 0 with its gradient where the two
    agree, and never above the full-vocabulary KL (a coarsening never raises a KL), each up to
    REST_FLOOR: where the top-k hold all but < 1e-6 of the mass the rest bucket is floored and
    stops pulling (a pull of that size on the logits, measured 4.5e-8 in review, is nothing)."""
    base_top = mx.stop_gradient(base_top)
    p = mx.exp(base_top)
    base_rest = mx.maximum(1.0 - p.sum(axis=-1), REST_FLOOR)
    rest = mx.maximum(1.0 - mx.exp(top).sum(axis=-1), REST_FLOOR)
    return (p * (base_top - top)).sum(axis=-1) + base_rest * (mx.log(base_rest) - mx.log(rest))


def positions(lm, input_ids: mx.array, n_prompt: int) -> mx.array:
    """Hidden states that predict the response tokens: (n_resp, d).
    Response token j sits at n_prompt + j and is predicted from position n_prompt + j − 1;
    the last input token predicts nothing, so it is not fed (causal: no other state changes)."""
    if n_prompt < 1 or input_ids.shape[0] <= n_prompt:
        raise ValueError(f"need >= 1 prompt and >= 1 response token (n_prompt={n_prompt}, total={input_ids.shape[0]})")
    return lm.hidden(input_ids[None, :-1])[0, n_prompt - 1 :]


def _chunk_logprobs(lm, h: mx.array, ids: mx.array) -> mx.array:
    logits = lm.logits(h)  # (c, V): the expensive part, only at response positions
    return mx.take_along_axis(logits, ids, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)


def response_logprobs(
    lm, input_ids: mx.array, n_prompt: int, ids: mx.array, *, chunk: int = 64, checkpoint: bool = False
) -> mx.array:
    """log π(ids[j, :] | prefix) at each response position j: (n_resp, K'), differentiable.

    Logits are built only at response positions and `chunk` rows at a time. With
    `checkpoint=True` each chunk's (chunk, V) logits are recomputed in the backward pass
    instead of kept (peak memory ~one chunk instead of n_resp·V; about one extra LM-head
    matmul per step)."""
    h = positions(lm, input_ids, n_prompt)
    ids = ids.astype(mx.int32)
    if ids.shape[0] != h.shape[0]:
        raise ValueError(f"ids has {ids.shape[0]} rows for {h.shape[0]} response tokens")
    parts = []
    for s in range(0, h.shape[0], chunk):

        def fn(hc, ic=ids[s : s + chunk]):  # ids: constants, no VJP
            return _chunk_logprobs(lm, hc, ic)

        parts.append((mx.checkpoint(fn) if checkpoint else fn)(h[s : s + chunk]))
    return mx.concatenate(parts, axis=0)


def topk_logprobs(lm, input_ids: mx.array, n_prompt: int, k: int, *, chunk: int = 64) -> tuple[mx.array, mx.array]:
    """The k most likely tokens at each response position, most likely first:
    (ids (n_resp, k) int32, log-probs (n_resp, k)). No gradient; each chunk is evaluated
    before the next so only one chunk of logits is alive at a time."""
    h = mx.stop_gradient(positions(lm, input_ids, n_prompt))
    out_ids, out_lp = [], []
    for s in range(0, h.shape[0], chunk):
        logits = lm.logits(h[s : s + chunk])
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        top_lp = mx.take_along_axis(lp, top, axis=-1)
        order = mx.argsort(-top_lp, axis=-1)
        top, top_lp = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(top_lp, order, axis=-1)
        mx.eval(top, top_lp)
        out_ids.append(top.astype(mx.int32))
        out_lp.append(top_lp)
    return mx.concatenate(out_ids, axis=0), mx.concatenate(out_lp, axis=0)
