"""The eval gate refuses an adapter that stops ending turns (issue 15). Trained on the old
samples (the stop string's tokens kept, with r = −1), the demo's adapter stopped ending its
turns and ran on into the hidden transcript; the direction and KL checks passed it. Here a real
LoRA is trained by the real trainer on a tiny real GGUF model, once on such old samples and
once on samples that hold only what the user saw, and the gate judges both."""

from __future__ import annotations

import dataclasses
import json

import pytest

from clawd.config import TrainingSettings
from clawd.training.data import Job, Sample, TurnEnd, write_job
from clawd.training.evaluate import END_RATE_TOLERANCE, end_rate, new_leaks, refusals

PROMPTS = ("hi", "hello there", "what is it", "tell me more")
OTHER_PROMPTS = ("good day", "so what", "why not", "and then")
SETTINGS = TrainingSettings(
    rank=4, alpha=8.0, batch_size=4, epochs=2, learning_rate=0.004, holdout=0.0, kl_bound=50.0, targets="q_proj,v_proj"
)


@pytest.fixture(scope="module")
def world(tiny_gguf):
    """The tiny model as the trainer loads it, its canaries, and the turn ends its greedy answers
    really have: each canary's answer ends at a stop string taken from inside that answer (the
    tiny model never writes "\\nUser:"; these stand in for it)."""
    from clawd.training.evaluate import greedy_answer
    from clawd.training.weights import load_model

    lm = load_model(tiny_gguf)
    tok = lm.tokenizer

    def prompt_ids(text: str) -> list[int]:
        return tok.encode(f"User: {text}\nAssistant:", add_bos=True)

    free = TurnEnd(stops=[], markers=[], max_tokens=24)
    stops, canary, old, new = [], [], [], []
    for i, text in enumerate(PROMPTS):
        ids = prompt_ids(text)
        answer, _ = greedy_answer(lm, ids, free)
        k = next(
            j
            for j in range(3, len(answer) - 3)
            if answer[j : j + 3].isascii() and answer[j : j + 3].strip() and answer.find(answer[j : j + 3]) == j
        )
        stops.append(answer[k : k + 3])
        canary.append(Sample(f"canary-{i}", ids, tok.encode(answer[:k], add_bos=False)))
    turn_end = TurnEnd(stops=stops, markers=["User:", "Assistant:"], max_tokens=24)
    for i, text in enumerate(PROMPTS):
        ids = prompt_ids(text)
        assert greedy_answer(lm, ids, turn_end)[1]  # the base model ends every canary turn
        sampled = _sampled_through_stop(lm, ids, turn_end)  # what the engine sampled: the stop's tokens too
        old.append(Sample(f"old-{i}", ids, sampled, -1))
    for i, text in enumerate(OTHER_PROMPTS):
        ids = prompt_ids(text)
        shown, _ = greedy_answer(lm, ids, turn_end)
        new.append(Sample(f"new-{i}", ids, tok.encode(shown, add_bos=False)[:8] or [5], -1))
    return {"canary": canary, "turn_end": turn_end, "old": old, "new": new}


def _sampled_through_stop(lm, prompt: list[int], turn_end: TurnEnd) -> list[int]:
    import mlx.core as mx

    out: list[int] = []
    for _ in range(turn_end.max_tokens):
        logits = lm.logits(lm.hidden(mx.array(prompt + out, dtype=mx.int32)[None])[0, -1])
        out.append(int(mx.argmax(logits).item()))
        if any(s in lm.tokenizer.decode(out) for s in turn_end.stops):
            return out
    raise AssertionError("no stop")


def train_and_gate(tmp_path, tiny_gguf, world, samples: list[Sample], name: str) -> dict:
    from clawd.training import run as trainer

    job = Job(
        name,
        str(tiny_gguf),
        "tiny",
        dataclasses.asdict(SETTINGS),
        train=samples,
        canary=world["canary"],
        turn_end=world["turn_end"],
    )
    job_dir = tmp_path / "jobs" / name
    job_dir.mkdir(parents=True)
    write_job(job, job_dir / "job.json")
    assert trainer.run(job_dir, tmp_path / "cache", tmp_path / "adapters", stock_blas=True) == 0
    return json.loads((tmp_path / "adapters" / name / "meta.json").read_text())["gate"]


@pytest.mark.timeout(600)
def test_the_gate_refuses_an_adapter_trained_on_old_samples_and_passes_a_good_one(tmp_path, tiny_gguf, world):
    old = train_and_gate(tmp_path, tiny_gguf, world, world["old"] * 2, "ad-old")
    end = old["turn_end"]
    assert end["end_rate_parent"] == 1.0
    assert end["end_rate"] < end["end_rate_parent"] - END_RATE_TOLERANCE, end
    assert not old["passed"]
    assert old["refused"] == [r for r in old["refused"] if "stops ending turns" in r or "template" in r], old
    # The checks before this one (held-out direction, canary KL) would have passed it.
    assert old["gain"] > 0 and old["kl_to_base"] <= SETTINGS.kl_bound, old

    good = train_and_gate(tmp_path, tiny_gguf, world, world["new"] * 2, "ad-good")
    assert good["turn_end"]["end_rate"] == good["turn_end"]["end_rate_parent"] == 1.0, good["turn_end"]
    assert good["turn_end"]["leaks"] == []
    assert good["passed"] and good["refused"] == [], good


def test_refusal_reasons_name_each_failed_check():
    ok = {"gain": 0.1, "kl_to_base": 0.01, "turn_end": {"end_rate_parent": 1.0, "end_rate": 1.0, "leaks": []}}
    assert refusals(ok, 0.5) == []
    assert refusals({**ok, "turn_end": {**ok["turn_end"], "end_rate": 0.96}}, 0.5) == []  # within 5 points
    # More answers end: what a lesson for shorter answers does (seen on the 0.5B: the parent's
    # two-sentence canary answer was cut by the room, the candidate's one sentence ended).
    shorter = {**ok, "turn_end": {"end_rate_parent": 0.75, "end_rate": 1.0, "leaks": []}}
    assert refusals(shorter, 0.5) == []
    fewer = {**ok, "turn_end": {"end_rate_parent": 1.0, "end_rate": 0.75, "leaks": []}}
    assert refusals(fewer, 0.5) == ["it stops ending turns (greedy canary answers that end: 75%, parent 100%)"]
    leak = {"canary": 0, "markers": ["The following is a conversation"], "answer": " Tokyo.\n\nThe following is a"}
    bad = {
        "gain": -0.1,
        "kl_to_base": 0.9,
        "turn_end": {"end_rate_parent": 1.0, "end_rate": 0.25, "leaks": [leak]},
    }
    why = refusals(bad, 0.5)
    assert len(why) == 4
    assert "gain" in why[0] and "KL" in why[1] and "25%" in why[2] and "100%" in why[2]
    assert "The following is a conversation" in why[3]


def test_an_empty_answer_is_no_ended_turn():
    # Ending at once is what a lesson for shorter answers pushes towards; it must not count as
    # ending, or the one-sided check would let an adapter that says nothing through.
    parent = [("Paris.", True), ("Red, blue and yellow.", True), ("Seven.", True), ("Honey.", True)]
    assert end_rate(parent) == 1.0
    assert end_rate([("", True), (" \n", True), ("Seven.", True), ("Honey, and", False)]) == 0.25
    candidate = {"end_rate_parent": end_rate(parent), "end_rate": end_rate([("", True)] * 4), "leaks": []}
    assert refusals({"gain": 0.1, "kl_to_base": 0.01, "turn_end": candidate}, 0.5) == [
        "it stops ending turns (greedy canary answers that end: 0%, parent 100%)"
    ]


def test_a_leak_counts_where_either_answer_ended():
    markers = ["The following is a conversation", "User:", "<s>"]
    tokyo = " Tokyo.\n\nThe following is a conversation between a helpful assistant and a user."
    parent = [(" Tokyo.", True), (" Paris.", True), ("ab <s> cd", True), ("xy zz", False), ("User: hi", True)]
    candidate = [
        (tokyo, True),
        (" Paris. User: more", False),
        ("ab cd", False),
        ("xy <s> zz", False),
        ("User: hi", True),
    ]
    leaks = new_leaks(parent, candidate, markers)
    # 0: the demo's leak, ended at the stop string; 1: ran on where the parent ended; 2: shows
    # less than the parent; 3: neither ended (both ramble, no reference); 4: the parent's own leak.
    assert [(leak["canary"], leak["markers"]) for leak in leaks] == [
        (0, ["The following is a conversation"]),
        (1, ["User:"]),
    ]
    assert leaks[0]["answer"] == tokyo  # shorter than the excerpt around the marker
    far = "x" * 500 + "User: more" + "y" * 500
    (leak,) = new_leaks([("Paris.", True)], [(far, False)], markers)
    assert leak["answer"] == "x" * 60 + "User:" + " more" + "y" * 55  # the marker, however deep
    # A candidate that ends with template text where the parent rambled is still a leak.
    assert new_leaks([("ab cd", False)], [("ab <s>", True)], markers) == [
        {"canary": 0, "markers": ["<s>"], "answer": "ab <s>"}
    ]
