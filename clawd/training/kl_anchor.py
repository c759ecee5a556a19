"""training.w_kl_base: a KL(base ‖ adapter) term on the base's own answers to everyday
prompts that carry no signal (issue 16).

Why: a lesson spreads. Taught to open with "In short", Qwen 0.5B also opened "Who wrote
Hamlet?" with "In …" or "I'm sorry, but I can't assist with that.", and the gate's QA canary
refused those adapters (docs/learning.md). Every run continues from the active adapter, so a
KL to the parent would be 0 at each run's first step; the pull is toward the base, the model
the user chose. METHOD.md leaves this term at 0 by default and so does clawd.

What is pulled: the base's greedy answer (up to ANSWER_TOKENS) to each of ANCHOR_PROMPTS in
the served model's template (the daemon tokenizes them into the job, as it does the canaries).
At each answer position the base's top-k (the job's top_k, as OPD's support) plus one bucket
for the rest of the vocabulary form a distribution of k + 1 outcomes; the term is the KL
between the base's and the adapter's on those (loss.coarse_kl). It is 0 with its gradient at
the base and lower-bounds the full KL (a coarsening never raises a KL).

The cost: the pull works against any lesson meant for every answer (an opening "In short" is
one), and since each run continues from the active adapter, against earlier lessons too; a
lesson has to be worth more to the user's prompts than the KL it costs on these.

The prompts are everyday requests written for this term before any run, none of them a
question of the QA canary nor of its main kinds (capitals, sums, authors): the canary stays
mostly a measurement of what the term protects. Not wholly: two prompts (autumn leaves, the
rainbow) draw answers about colours, as three canary questions ask (tests/test_kl_anchor.py
checks the prompts, not the base's answers).
"""

from __future__ import annotations

# The base's answer per prompt, whole where it ends within this: its end is pulled too. With
# 32 tokens (the opening alone) `signoff`, whose lesson lives at the answer's end, lost QA as
# without the term; at 128 no run of that seed did (seed 1: one of four). The cost: each
# anchor's KL is a mean over its tokens, so the opening's share fell to about a third, and on
# `inshort` (an opening lesson) QA refusals rose from 1 of 12 runs to 5 (docs/learning.md, "a
# KL pull toward the base"). Giving the first 32 positions their own mean (opening + rest) was
# tried and not kept (run 5 there): `inshort` a little better, `signoff` and `british` refused
# as with 32-token anchors.
ANSWER_TOKENS = 128
PER_STEP = 8  # anchors in each optimizer step, taken in turn: a step costs 8 samples more

ANCHOR_PROMPTS: tuple[str, ...] = (
    "Why do leaves change color in autumn?",
    "Give me a tip for falling asleep faster.",
    "How do I boil an egg?",
    "What does a thermometer measure?",
    "Suggest a name for a small orange cat.",
    "Explain what a noun is.",
    "How does a rainbow form?",
    "What should I pack for a day at the beach?",
    "Write one sentence about the sea.",
    "What is a good way to learn new words?",
    "Why do we need sleep?",
    "How do plants get water?",
    "Describe a bicycle in a few words.",
    "What is the difference between weather and climate?",
    "How can I keep bread fresh for longer?",
    "What does a librarian do?",
)


def with_anchors(plan: list[list[int]], start: int, n_samples: int, n_anchors: int) -> list[list[int]]:
    """The steps from `start` (a resume's first) on: each batch of `plan` (sample indices) with
    its step's turn of the anchors, indexed after the samples (n_samples + anchor)."""
    return [plan[s] + [n_samples + a for a in step_anchors(s, n_anchors)] for s in range(start, len(plan))]


def step_anchors(step: int, n: int, per_step: int = PER_STEP) -> list[int]:
    """The anchors (indices into n) of optimizer step `step` (0-based): per_step of them, taken
    in turn so consecutive steps cover the whole set; all of them when there are fewer."""
    if n <= per_step:
        return list(range(n))
    return [(step * per_step + j) % n for j in range(per_step)]


def base_answers(lm, prompts: list, stops: list[str], cache, max_len: int) -> list:
    """The anchors to train on: each of `prompts` (Samples holding a prompt only, built by the
    daemon) with the base's greedy answer, up to ANSWER_TOKENS within `max_len`
    (training.max_tokens); an empty answer drops its prompt. Answers are saved to `cache` (a
    JSON list) once made, so a resumed run decodes none (trainer side: imports MLX)."""
    import json
    import os

    from clawd.training.data import Sample
    from clawd.training.teacher_answers import generate

    if cache.exists():
        answers = json.loads(cache.read_text(encoding="utf-8"))
    else:
        room = [min(ANSWER_TOKENS, max_len - len(p.prompt_ids)) for p in prompts]
        fits = [i for i, r in enumerate(room) if r > 0]
        made = generate(lm, [prompts[i].prompt_ids for i in fits], "base", [room[i] for i in fits], stops)
        answers = [[] for _ in prompts]
        for i, ids in zip(fits, made):
            answers[i] = ids
        tmp = cache.with_name(cache.name + ".tmp")
        tmp.write_text(json.dumps(answers), encoding="utf-8")
        os.replace(tmp, cache)
    return [Sample(p.turn_id, p.prompt_ids, ids) for p, ids in zip(prompts, answers) if ids]
