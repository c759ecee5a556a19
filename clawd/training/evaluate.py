"""Eval-gate metrics for a freshly trained adapter (METHOD: the forgetting guard).

Boundary: pure measurement on an MLX model wearing LoRA; the verdict's thresholds come from
TrainingSettings, and promotion itself is clawd/adapters.py's job.

- Direction on held-out signals: per sample, how far the candidate moved log-probs the way
  the signal asks, relative to the active adapter (whose own gain is 0 by definition):
  RL part r · mean_i (ℓ_cand(a_i) − ℓ_active(a_i)); OPD part mean_i Σ_v A_v (ℓ_cand(v) −
  ℓ_active(v)), with A_v exactly the loss's advantage (teacher-minus-old, clipped, weighted).
- Forgetting: mean per-token KL(candidate ‖ base) over the canary answers.
- Turn ends: greedy canary answers, parent vs candidate: the candidate's must end at least as
  often (within END_RATE_TOLERANCE) and show no template text the parent's did not.
- Capability canary: the fixed factual QA set (training/qa.py) answered greedily by the parent
  and the candidate; a candidate that loses more than training.qa_max_drop points is refused.
- Probe: per-token Δ log-prob (candidate − base) on one sample, so the daemon can check the
  adapter llama.cpp serves moves the same tokens the same way (live check).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from clawd.training import qa as qa_score
from clawd.training.data import QAQuestion, Sample, TurnEnd
from clawd.training.loss import positions, response_logprobs
from clawd.training.qa import QA_MAX_TOKENS


def lora_modules(model):
    return [m for _, m in model.named_modules() if hasattr(m, "lora_a") and hasattr(m, "scale")]


def lora_params(model) -> dict[str, mx.array]:
    return dict(tree_flatten(model.trainable_parameters()))


def set_lora_params(model, params: dict[str, mx.array]) -> None:
    model.update(tree_unflatten(list(params.items())))


@contextmanager
def base_model(model):
    """The frozen base model: every LoRA scale 0 for the duration (exactly base logits)."""
    mods = lora_modules(model)
    scales = [m.scale for m in mods]
    for m in mods:
        m.scale = 0.0
    try:
        yield model
    finally:
        for m, s in zip(mods, scales):
            m.scale = s


def tokens(s: Sample, teacher: bool = False) -> tuple[mx.array, int]:
    prompt = s.teacher_prompt_ids if teacher else s.prompt_ids
    return mx.array(prompt + s.response_ids, dtype=mx.int32), len(prompt)


def student_view(lm, s: Sample, k: int, chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(ids (n, 1+k), log-probs (n, 1+k)): the sampled token, then the policy's top-k.

    The same numbers as loss.topk_logprobs then loss.response_logprobs (the same ops on the
    same logits), but from one pass of the model body and one LM head per chunk instead of
    two of each: this is π_old for every training sample (run.prepare) and the gate's view
    of every held-out one."""
    ids, n_prompt = tokens(s)
    h = positions(lm, ids, n_prompt)
    sampled = mx.array(s.response_ids, dtype=mx.int32)[:, None]
    out_ids, out_lp = [], []
    for c in range(0, h.shape[0], chunk):
        logits = lm.logits(h[c : c + chunk])
        lse = mx.logsumexp(logits, axis=-1, keepdims=True)
        top = mx.argpartition(-(logits - lse), kth=k - 1, axis=-1)[:, :k]
        order = mx.argsort(-mx.take_along_axis(logits - lse, top, axis=-1), axis=-1)
        gather = mx.concatenate([sampled[c : c + chunk], mx.take_along_axis(top, order, axis=-1).astype(mx.int32)], 1)
        lp = mx.take_along_axis(logits, gather, axis=-1) - lse
        mx.eval(gather, lp)  # one chunk of (chunk, V) logits alive at a time
        out_ids.append(np.array(gather))
        out_lp.append(np.array(lp))
    return np.concatenate(out_ids), np.concatenate(out_lp)


def scoring_teacher(lm, teacher):
    """(the model that scores as the teacher, the context to score it in). `teacher` is
    training.teacher's "base" (the student's frozen base: every LoRA scale 0) or "policy" (the
    student as it stands, adapter on), or, for "model:NAME", that model already loaded (the
    trainer loads it: run.load_teacher); its token ids are the student's (checked by the
    daemon before the job is written)."""
    if teacher == "base":
        return lm, base_model(lm.model)
    if teacher == "policy":
        return lm, nullcontext()
    if isinstance(teacher, str):
        raise ValueError(f"teacher {teacher!r} must be loaded first (run.load_teacher)")
    return teacher, nullcontext()


def teacher_view(lm, s: Sample, top_ids: np.ndarray, teacher="base") -> np.ndarray | None:
    """The teacher + hint at the student's top-k ids: (n, k), or None without a hint
    (`teacher`: see scoring_teacher)."""
    if s.teacher_prompt_ids is None:
        return None
    ids, n_prompt = tokens(s, teacher=True)
    scorer, context = scoring_teacher(lm, teacher)
    with context:
        lp = response_logprobs(scorer, ids, n_prompt, mx.array(top_ids, dtype=mx.int32))
        mx.eval(lp)
    return np.array(lp)


def union_support(student_ids: np.ndarray, teacher_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """S_i ∪ T_i per position (training.opd_support = "union"): (ids (n, K'), mask (n, K')).
    The student's top-k first, in its order (so column 0.. k−1 are S_i as in "student"), then
    the teacher's ids the student does not rank, in the teacher's order; rows are padded to
    the widest union with the row's own first id (a valid id to gather; mask 0)."""
    rows = []
    for s, t in zip(student_ids.tolist(), teacher_ids.tolist()):
        rows.append(s + [v for v in dict.fromkeys(t) if v not in s])
    width = max((len(r) for r in rows), default=student_ids.shape[1])
    ids = np.array([r + [r[0]] * (width - len(r)) for r in rows], dtype=np.int32).reshape(len(rows), width)
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=np.float32).reshape(len(rows), width)
    return ids, mask


def teacher_topk(lm, s: Sample, k: int, teacher="base", chunk: int = 64) -> np.ndarray:
    """The teacher's own top-k ids (n, k) at each response position of the hinted context,
    most likely first: T_i of METHOD §4, scored by the teacher the loss uses."""
    ids, n_prompt = tokens(s, teacher=True)
    out = []
    scorer, context = scoring_teacher(lm, teacher)
    with context:
        h = positions(scorer, ids, n_prompt)
        for c in range(0, h.shape[0], chunk):
            logits = scorer.logits(h[c : c + chunk])
            top = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
            order = mx.argsort(-mx.take_along_axis(logits, top, axis=-1), axis=-1)
            top = mx.take_along_axis(top, order, axis=-1)
            mx.eval(top)
            out.append(np.array(top, dtype=np.int32))
    return np.concatenate(out)


def sample_views(lm, s: Sample, k: int, teacher="base", support: str = "student") -> dict:
    """Everything the loss and the gate need of one sample under the weights in place (π_old):
    ids (n, 1+K) = the sampled token then the support S_i; old (n, 1+K) = π_old there;
    teacher (n, K) = the teacher + hint there, or None without a hint; mask (n, K) = which
    support columns are real (None: all, the student's top-k).

    support "union": S_i ∪ T_i for a hinted sample. π_old at the union comes from
    loss.response_logprobs, the very function training calls, so the first step's ratio is
    exactly 1 on every column; one more student pass (and one teacher pass for T_i) per sample."""
    ids, old = student_view(lm, s, k)
    if s.teacher_prompt_ids is None or support != "union":
        return {"ids": ids, "old": old, "teacher": teacher_view(lm, s, ids[:, 1:], teacher), "mask": None}
    union, mask = union_support(ids[:, 1:], teacher_topk(lm, s, k, teacher))
    ids = np.concatenate([ids[:, :1], union], axis=1)
    t, n_prompt = tokens(s)
    old = response_logprobs(lm, t, n_prompt, mx.array(ids))
    mx.eval(old)
    return {"ids": ids, "old": np.array(old), "teacher": teacher_view(lm, s, union, teacher), "mask": mask}


def advantages(
    top_old: np.ndarray,
    top_teacher: np.ndarray,
    delta_clip: float,
    mask: np.ndarray | None = None,
    weighting: str = "student",
) -> np.ndarray:
    """A_v = softmax_S(ℓ_old)(v) · clip(ℓ_T(v) − ℓ_old(v), −C, C)  (METHOD §5); `mask`: which
    columns are in S_i (a union support's padding gets no weight and A_v = 0); `weighting`
    "teacher": the softmax is over ℓ_T instead, "both": the mean of the two
    (training.opd_weighting, as the loss does)."""
    real = np.ones_like(top_old, dtype=bool) if mask is None else mask.astype(bool)

    def softmax(lp):
        x = np.where(real, lp, -np.inf)
        w = np.where(real, np.exp(x - x.max(axis=1, keepdims=True)), 0.0)
        return w / w.sum(axis=1, keepdims=True)

    sources = {"student": (top_old,), "teacher": (top_teacher,), "both": (top_old, top_teacher)}
    if weighting not in sources:
        raise ValueError(f"opd_weighting must be one of {', '.join(sources)}, not {weighting!r}")
    by = sources[weighting]
    w = sum(softmax(lp) for lp in by) / len(by)
    return np.where(real, w * np.clip(top_teacher - top_old, -delta_clip, delta_clip), 0.0)


def direction(
    lm,
    samples: list[Sample],
    active: dict,
    candidate: dict,
    k: int,
    delta_clip: float,
    teacher="base",
    prepared: list[dict] | None = None,
    support: str = "student",
    weighting: str = "student",
) -> dict:
    """Mean signalled-direction gain of the candidate over the active adapter (the OPD part
    weighted as the loss weighted it: `weighting` = training.opd_weighting).

    `prepared`: run.prepare's views of these very samples (ids, π_old = the active adapter's
    log-probs, the teacher's), when the gate judges on the training signals. They are exactly
    what this would recompute under `active`, and recomputing them was 3 of the 4 forward
    passes per sample: most of the gate's time in the first hour, when nothing is held out."""
    if prepared is not None and len(prepared) != len(samples):
        raise ValueError(f"{len(prepared)} prepared views for {len(samples)} samples")
    gains = []
    if prepared is not None:
        set_lora_params(lm.model, candidate)
    for i, s in enumerate(samples):
        if prepared is not None:
            view = prepared[i]
        else:
            set_lora_params(lm.model, active)
            view = sample_views(lm, s, k, teacher, support)
            set_lora_params(lm.model, candidate)
        ids, lp_active, top_teacher = view["ids"], view["old"], view["teacher"]
        t, n_prompt = tokens(s)
        lp_cand = np.array(response_logprobs(lm, t, n_prompt, mx.array(ids)))
        diff = lp_cand - lp_active
        gain = s.reward * float(diff[:, 0].mean()) if s.reward else 0.0
        if top_teacher is not None:
            adv = advantages(lp_active[:, 1:], top_teacher, delta_clip, view.get("mask"), weighting)
            gain += float((adv * diff[:, 1:]).sum(axis=1).mean())
        gains.append(gain)
    set_lora_params(lm.model, candidate)
    return {
        "n": len(gains),
        "gain": float(np.mean(gains)) if gains else None,
        "improved": float(np.mean([g > 0 for g in gains])) if gains else None,
    }


def full_logprobs(lm, s: Sample) -> np.ndarray:
    """log-softmax over the whole vocabulary at each response position: (n, V)."""
    ids, n_prompt = tokens(s)
    h = lm.hidden(ids[None, :-1])[0, n_prompt - 1 :]
    logits = lm.logits(h).astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(lp)
    return np.array(lp)


def kl_to_base(lm, canary: list[Sample]) -> float:
    """Mean per-token KL(current ‖ base) over the canary answers, in nats."""
    kls = []
    for s in canary:
        cur = full_logprobs(lm, s)
        with base_model(lm.model):
            base = full_logprobs(lm, s)
        kls.extend((np.exp(cur) * (cur - base)).sum(axis=1).tolist())
    return float(np.mean(kls)) if kls else 0.0


def probe(lm, s: Sample, max_response: int = 64) -> dict:
    """Δ log p(sampled token), candidate − base, per position, for the live check."""
    s = Sample(s.turn_id, s.prompt_ids, s.response_ids[:max_response])
    ids, n_prompt = tokens(s)
    at = mx.array(s.response_ids, dtype=mx.int32)[:, None]
    cand = np.array(response_logprobs(lm, ids, n_prompt, at))[:, 0]
    with base_model(lm.model):
        base = np.array(response_logprobs(lm, ids, n_prompt, at))[:, 0]
    return {"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "delta": (cand - base).tolist()}


# The gate's turn-end check: an adapter may change what the model says, never stop it ending its
# turns. Training on the stop string's tokens with r = −1 once cut the demo model's chance of
# ending its turn after the answer from 85% to 28%, and every answer then ran on into the
# transcript's preamble; the direction and KL checks both passed it. 5 points: on the 4
# canaries, any single answer that no longer ends is refused. Only fewer ends are refused:
# more ends is what a lesson for shorter answers does (a parent's answer cut by the room, the
# candidate's shorter one ending); an answer ended before any word counts as not ended (end_rate).
END_RATE_TOLERANCE = 0.05


def first_stop(text: str, stops: list[str]) -> int:
    """Where the first of `stops` begins in `text`, or -1."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


def greedy_answer(
    lm,
    prompt_ids: list[int],
    turn_end: TurnEnd,
    max_tokens: int | None = None,
    enough: Callable[[str], bool] | None = None,
) -> tuple[str, bool]:
    """The greedy answer (text before any stop) and whether the turn ended within
    `max_tokens` (default turn_end.max_tokens), at an end-of-turn token or a stop string.
    `enough(text)`: stop early once it holds (the QA canary stops at a right answer: its
    verdict cannot change after that); such an answer counts as not ended."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm.model)
    end_ids = lm.tokenizer.eos_ids
    out: list[int] = []
    step = mx.array(prompt_ids, dtype=mx.int32)[None]
    for _ in range(turn_end.max_tokens if max_tokens is None else max_tokens):
        # The LM head on the last position only: on the prompt's prefill, logits at every
        # position cost ~50 times the head of one (Gemma's 262k vocabulary) and are never read.
        h = lm.model.model(step, cache=cache)
        tok = int(mx.argmax(lm.logits(h[0, -1])).item())
        if tok in end_ids:
            return lm.tokenizer.decode(out), True
        out.append(tok)
        text = lm.tokenizer.decode(out)
        hit = first_stop(text, turn_end.stops)
        if hit >= 0:
            return text[:hit], True
        if enough is not None and enough(text):
            return text, False
        step = mx.array([[tok]], dtype=mx.int32)
    return lm.tokenizer.decode(out), False


def end_rate(answers: list[tuple[str, bool]]) -> float:
    """Share of (text, ended) answers that ended with something said: a turn ended before any
    word is no answer, so a candidate taught to stop at once cannot pass for one that ends more."""
    return sum(ended and text.strip() != "" for text, ended in answers) / len(answers) if answers else 0.0


def new_leaks(parent: list[tuple[str, bool]], candidate: list[tuple[str, bool]], markers: list[str]) -> list[dict]:
    """Template text each (text, ended) candidate answer shows where the parent's answer to the
    same canary did not (a parent that already leaks on a prompt does not hold every later
    adapter back). Where neither ended within the room, both ramble and neither is a reference:
    what they say past a canary answer's length differs by chance (a tiny random model's "<s>");
    a candidate that runs out of room where the parent ended is an end lost (end_rate)."""

    def shown(text: str) -> list[str]:
        return [m for m in markers if m and m in text]

    def around(text: str, marker: str) -> str:  # the leak itself, however far into the answer
        at = text.find(marker)
        return text[max(0, at - 60) : at + len(marker) + 60]

    return [
        {"canary": i, "markers": new, "answer": around(cand, new[0])}
        for i, ((par, par_ended), (cand, cand_ended)) in enumerate(zip(parent, candidate))
        if (par_ended or cand_ended) and (new := [m for m in shown(cand) if m not in shown(par)])
    ]


def turn_end_check(lm, canary: list[Sample], parent: dict, candidate: dict, turn_end: TurnEnd) -> dict:
    """Greedy canary answers under the parent and the candidate: end-of-turn rates, and template
    text the candidate shows where the parent did not (new_leaks). Leaves the candidate's
    weights in place."""
    answers = {}
    prompts = [s.prompt_ids for s in canary]
    never = [lambda _t: False] * len(prompts)
    for name, params in (("parent", parent), ("candidate", candidate)):
        set_lora_params(lm.model, params)
        batched = batch_greedy_answers(lm, prompts, turn_end, turn_end.max_tokens, never) if prompts else []
        answers[name] = batched if batched is not None else [greedy_answer(lm, p, turn_end) for p in prompts]
    set_lora_params(lm.model, candidate)

    leaks = new_leaks(answers["parent"], answers["candidate"], turn_end.markers)
    return {
        "end_rate_parent": end_rate(answers["parent"]),
        "end_rate": end_rate(answers["candidate"]),
        "leaks": leaks,
        "answers": [a for a, _ in answers["candidate"]],
    }


def _batch_cache(model, left_padding: list[int]) -> list | None:
    """mlx-lm's batched KV caches (left-padded rows) in the shape of the model's own cache, or
    None for a cache kind that has no batched form (then answers go one at a time)."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, make_prompt_cache

    out = []
    for c in make_prompt_cache(model):
        if type(c) is RotatingKVCache:
            out.append(BatchRotatingKVCache(c.max_size, left_padding))
        elif type(c) is KVCache:
            out.append(BatchKVCache(left_padding))
        else:
            return None
    return out


def batch_greedy_ids(
    lm, prompts: list[list[int]], max_tokens: int, done: Callable[[int, list[int]], bool] | None = None
) -> list[tuple[list[int], bool]] | None:
    """Greedy token ids for many prompts at once (left-padded, one batched step per token: the
    weights are read once per step for every row, not once per row; that read is what a
    decode step on a CPU costs): per row (ids, ended), where a row that met an end-of-turn
    token holds it last and ended is True; `done(row, ids)` true ends a row there with ended
    False. Finished rows leave the batch. None when the model's cache has no batched form and
    there is more than one prompt (one prompt needs no padding: the model's own cache serves).

    (Prefilling the template's shared preamble once and tiling its cache would save most of
    the prefill; tried with mlx-lm 0.32's right-padded prefill + BatchKVCache.finalize, it gave
    other answers than one at a time on the tiny test model, so it is not done.)"""
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    cache = _batch_cache(lm.model, pads)
    if cache is None:
        if len(prompts) > 1:
            return None
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(lm.model)
    end_ids = lm.tokenizer.eos_ids
    out: list[list[int]] = [[] for _ in prompts]
    finished: dict[int, bool] = {}  # row -> ended at an end token
    rows = list(range(len(prompts)))  # the rows still in the batch, in cache order
    step = mx.array([[0] * pad + p for pad, p in zip(pads, prompts)], dtype=mx.int32)
    for _ in range(max_tokens):
        h = lm.model.model(step, cache=cache)
        toks = mx.argmax(lm.logits(h[:, -1]), axis=-1)
        mx.eval(toks)
        for i, tok in zip(rows, toks.tolist()):
            out[i].append(tok)
            if tok in end_ids:
                finished[i] = True
            elif done is not None and done(i, out[i]):
                finished[i] = False
        keep = [k for k, i in enumerate(rows) if i not in finished]
        if not keep:
            break
        if len(keep) < len(rows):  # a finished row leaves the batch: no more compute for it
            idx = mx.array(keep, dtype=mx.int32)
            for c in cache:
                c.filter(idx)
            toks, rows = toks[idx], [rows[k] for k in keep]
        step = toks[:, None].astype(mx.int32)
    return [(o, finished.get(i, False)) for i, o in enumerate(out)]


def batch_greedy_answers(
    lm, prompts: list[list[int]], turn_end: TurnEnd, max_tokens: int, enough: list[Callable[[str], bool]]
) -> list[tuple[str, bool]] | None:
    """greedy_answer for many prompts at once (batch_greedy_ids): rows end as greedy_answer's
    do, (text, ended) as it returns. None when the model's cache has no batched form."""
    decode = lm.tokenizer.decode

    def done(i: int, ids: list[int]) -> bool:
        text = decode(ids)
        return first_stop(text, turn_end.stops) >= 0 or enough[i](text)

    answers = batch_greedy_ids(lm, prompts, max_tokens, done)
    if answers is None:
        return None
    out = []
    for ids, at_end_token in answers:
        text = decode(ids[:-1] if at_end_token else ids)
        hit = -1 if at_end_token else first_stop(text, turn_end.stops)
        out.append((text[:hit], True) if hit >= 0 else (text, at_end_token))
    return out


QA_BATCH = 64  # questions answered in one batch (the whole set: 50)


def qa_answers(lm, qa: list[QAQuestion], turn_end: TurnEnd, max_tokens: int = QA_MAX_TOKENS) -> list[tuple[str, bool]]:
    """(greedy answer, right?) per canary question under the weights in place, answered in
    batches. A row stops at a right answer (its verdict is final: scoring is "contains")."""
    out = []
    for b in range(0, len(qa), QA_BATCH):
        part = qa[b : b + QA_BATCH]
        checks = [lambda t, a=q.accepted: qa_score.is_correct(t, a) for q in part]
        answers = batch_greedy_answers(lm, [q.prompt_ids for q in part], turn_end, max_tokens, checks)
        if answers is None:
            answers = [greedy_answer(lm, q.prompt_ids, turn_end, max_tokens, c) for q, c in zip(part, checks)]
        out += [(text, qa_score.is_correct(text, q.accepted)) for (text, _), q in zip(answers, part)]
    return out


def qa_check(
    lm,
    questions: list[QAQuestion],
    parent: dict,
    candidate: dict,
    turn_end: TurnEnd,
    parent_result: list[bool] | None = None,
    max_tokens: int = QA_MAX_TOKENS,
) -> dict:
    """The capability canary: QA accuracy of the parent and the candidate, and the questions the
    candidate lost (right under the parent, wrong now, with its answer). `parent_result`: the
    parent's per-question `right` list when already known (its own gate measured it), so only
    the candidate is asked. Leaves the candidate's weights in place."""
    if parent_result is not None and len(parent_result) == len(questions):
        parent_right = [bool(r) for r in parent_result]
    else:
        set_lora_params(lm.model, parent)
        parent_right = [ok for _, ok in qa_answers(lm, questions, turn_end, max_tokens)]
    set_lora_params(lm.model, candidate)
    cand = qa_answers(lm, questions, turn_end, max_tokens)
    right = [ok for _, ok in cand]
    return {
        "n": len(questions),
        "accuracy": qa_score.accuracy(right),
        "accuracy_parent": qa_score.accuracy(parent_right),
        "right": right,
        "right_parent": parent_right,
        "lost": [
            {"question": i, "answer": a[:120]}
            for i, ((a, ok), was) in enumerate(zip(cand, parent_right))
            if was and not ok
        ],
    }


def qa_drop_points(qa: dict) -> float:
    """Accuracy lost against the parent, in percentage points (rounded: 1 of 50 is 2.0, not 2.0000000000000018)."""
    return round((qa["accuracy_parent"] - qa["accuracy"]) * 100, 6)


def refusals(gate: dict, kl_bound: float, qa_max_drop: float = 2.0) -> list[str]:
    """Why the gate refuses the candidate (empty: it passes), in words for the CLI and TUI."""
    out = []
    if gate.get("gain") is None or gate["gain"] <= 0:
        out.append("it does not move held-out signals the way they ask (gain ≤ 0)")
    if gate.get("kl_to_base", 0.0) > kl_bound:
        out.append(f"it drifts from the base model on the canaries (KL {gate['kl_to_base']:.4f} > {kl_bound})")
    end = gate.get("turn_end")
    if end:
        if end["end_rate"] < end["end_rate_parent"] - END_RATE_TOLERANCE:
            out.append(
                f"it stops ending turns (greedy canary answers that end: {end['end_rate']:.0%}, "
                f"parent {end['end_rate_parent']:.0%})"
            )
        if end["leaks"]:
            shown = sorted({m for leak in end["leaks"] for m in leak["markers"]})
            out.append(f"its canary answers show template text ({', '.join(repr(m) for m in shown)})")
    qa = gate.get("qa")
    if qa and qa_drop_points(qa) > qa_max_drop:
        out.append(
            f"it answers fewer factual questions right (QA canary {qa['accuracy']:.0%}, parent "
            f"{qa['accuracy_parent']:.0%}: −{qa_drop_points(qa):g} points > {qa_max_drop:g})"
        )
    return out
