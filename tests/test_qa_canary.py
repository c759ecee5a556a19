"""The gate's capability canary (issue 16 item 5): the QA set, its exact-match scoring, the
check on a real (tiny) MLX model with a deliberately damaged adapter, the verdict's words,
and the parent's result carried to the next job."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from clawd.training import evaluate
from clawd.training.data import QAQuestion, TurnEnd
from clawd.training.qa import QA_SET, accuracy, is_correct, normalise
from tests.tiny_mlx import add_lora, tiny_lm

# ---------------------------------------------------------------- the set and its scoring


@pytest.mark.parametrize(
    "answer,accepted,right",
    [
        ("The capital of France is Paris.", ("paris",), True),
        ("PARIS!", ("paris",), True),
        ("Parisian food is good.", ("paris",), False),  # a whole word, not a prefix
        ("2 + 2 = 4", ("4", "four"), True),
        ("It is four.", ("4", "four"), True),
        ("The answer is 14.", ("4", "four"), False),
        ("Seventy.", ("7", "seven"), False),
        ("There are twenty-four hours in a day.", ("24", "twenty four"), True),
        ("Leonardo da Vinci painted it.", ("leonardo", "da vinci"), True),
        ("Beijing", ("beijing", "peking"), True),
        ("São Paulo", ("sao paulo",), True),  # accents dropped on both sides
        ("", ("paris",), False),
    ],
)
def test_exact_match_scoring(answer, accepted, right):
    assert is_correct(answer, accepted) is right


def test_normalise():
    assert normalise("  Hello,   World! It's 24-7. ") == "hello world it s 24 7"


def test_the_set_is_fixed_and_fair():
    """40-60 short questions, none repeated, and no accepted answer is spelled in its own
    question (an answer that parrots the question must not score)."""
    assert 40 <= len(QA_SET) <= 60
    assert len({q for q, _ in QA_SET}) == len(QA_SET)
    for question, accepted in QA_SET:
        assert accepted and all(normalise(a) for a in accepted), question
        assert not is_correct(question, accepted), question
    # the transcript format's worked example answers Italy: not a fair question
    assert not any("italy" in normalise(q) for q, _ in QA_SET)


def test_accuracy():
    assert accuracy([True, False, True, True]) == 0.75
    assert accuracy([]) == 0.0


# ---------------------------------------------------------------- the verdict


def gate_with(qa_parent: float, qa_cand: float, n: int = 50) -> dict:
    return {"gain": 0.5, "kl_to_base": 0.01, "qa": {"n": n, "accuracy": qa_cand, "accuracy_parent": qa_parent}}


def test_refused_on_a_drop_over_the_bound_whatever_the_gain():
    why = evaluate.refusals(gate_with(48 / 50, 46 / 50), kl_bound=0.5, qa_max_drop=2.0)
    assert len(why) == 1 and "factual questions" in why[0] and "92%" in why[0] and "96%" in why[0]
    assert "4 points > 2" in why[0]


def test_one_question_of_fifty_is_exactly_two_points_and_passes():
    # 48/50 − 47/50 is 2.0000000000000018 in floats: the bound must not refuse it
    assert evaluate.refusals(gate_with(48 / 50, 47 / 50), kl_bound=0.5, qa_max_drop=2.0) == []
    assert evaluate.refusals(gate_with(48 / 50, 47 / 50), kl_bound=0.5, qa_max_drop=1.0) != []  # configurable
    assert evaluate.refusals(gate_with(40 / 50, 49 / 50), kl_bound=0.5) == []  # a gain is never refused
    assert evaluate.refusals({"gain": 0.5, "kl_to_base": 0.0}, kl_bound=0.5) == []  # no QA ran: nothing to judge


# ---------------------------------------------------------------- the check on a real tiny model


class WordTokenizer:
    """A tokenizer for the tiny MLX model: token i reads as the word "w<i>"; no end token, so
    every greedy answer runs to max_tokens (or stops once it is right)."""

    eos_ids: set[int] = set()

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def lm():
    lm = add_lora(tiny_lm(0), b_std=0.0)  # the parent: LoRA present, a no-op
    lm.tokenizer = WordTokenizer()
    return lm


def questions_the_parent_knows(lm, n: int = 10) -> tuple[list[QAQuestion], TurnEnd]:
    """Random prompts whose accepted answer is the parent's own greedy answer (its first 3
    words): the parent scores 100% by construction, so any loss is the candidate's."""
    end = TurnEnd(stops=[], markers=[], max_tokens=6)
    rng = np.random.default_rng(3)
    qs = []
    for _ in range(n):
        prompt = [int(t) for t in rng.integers(2, 100, 8)]
        text, _ = evaluate.greedy_answer(lm, prompt, end)
        qs.append(QAQuestion(prompt, [" ".join(text.split()[:3])]))
    return qs, end


def damaged(params: dict, std: float, seed: int = 5) -> dict:
    mx.random.seed(seed)
    return {k: v + std * mx.random.normal(v.shape) if k.endswith("lora_b") else v for k, v in params.items()}


def test_gate_refuses_a_damaged_adapter_and_passes_a_harmless_one(lm):
    parent = evaluate.lora_params(lm.model)
    qs, end = questions_the_parent_knows(lm)
    try:
        broken = evaluate.qa_check(lm, qs, parent, damaged(parent, 3.0), end, max_tokens=6)
        assert broken["accuracy_parent"] == 1.0 and broken["accuracy"] < 0.8, broken
        assert len(broken["lost"]) == round((1 - broken["accuracy"]) * len(qs))
        why = evaluate.refusals({"gain": 1.0, "kl_to_base": 0.0, "qa": broken}, kl_bound=0.5, qa_max_drop=2.0)
        assert len(why) == 1 and "factual questions" in why[0]
        # the candidate's weights are left in place, as the other gate checks leave them
        assert all(np.array_equal(evaluate.lora_params(lm.model)[k], v) for k, v in damaged(parent, 3.0).items())

        harmless = evaluate.qa_check(lm, qs, parent, damaged(parent, 1e-6), end, max_tokens=6)
        assert harmless["accuracy"] == harmless["accuracy_parent"] == 1.0 and harmless["lost"] == []
        assert evaluate.refusals({"gain": 1.0, "kl_to_base": 0.0, "qa": harmless}, kl_bound=0.5) == []
    finally:
        evaluate.set_lora_params(lm.model, parent)


def test_a_known_parent_result_is_not_asked_again(lm, monkeypatch):
    parent = evaluate.lora_params(lm.model)
    qs, end = questions_the_parent_knows(lm, n=4)
    try:
        want = evaluate.qa_check(lm, qs, parent, damaged(parent, 3.0), end, max_tokens=6)
        asked = []
        real = evaluate.qa_answers
        monkeypatch.setattr(evaluate, "qa_answers", lambda *a, **kw: asked.append(1) or real(*a, **kw))
        got = evaluate.qa_check(lm, qs, parent, damaged(parent, 3.0), end, parent_result=[True] * 4, max_tokens=6)
        assert len(asked) == 1  # the candidate only
        assert got == want
        # a result for another question set (another length) is not trusted: both are asked
        asked.clear()
        evaluate.qa_check(lm, qs, parent, damaged(parent, 3.0), end, parent_result=[True] * 3, max_tokens=6)
        assert len(asked) == 2
    finally:
        evaluate.set_lora_params(lm.model, parent)


def test_a_right_answer_stops_generation_early(lm, monkeypatch):
    qs, end = questions_the_parent_knows(lm, n=1)
    heads = []
    logits = lm.logits
    monkeypatch.setattr(lm, "logits", lambda h: heads.append(h.shape) or logits(h))
    ((answer, right),) = evaluate.qa_answers(lm, qs, end, max_tokens=6)
    # 3 tokens (the accepted answer is 3 words), each from the LM head on the last position only
    assert right and len(answer.split()) == 3 and len(heads) == 3
    assert all(shape[:-1] == (1,) for shape in heads), heads


@pytest.mark.parametrize("shared", [True, False])
def test_batched_answers_are_the_one_at_a_time_answers(lm, shared):
    """Left-padded batched greedy decoding gives each prompt the answer it gets alone (prompts of
    different lengths; rows that end early at a stop string or a right answer, others that run on)."""
    rng = np.random.default_rng(9)
    # a shared prefix (a template's preamble), then questions of different lengths, one of them
    # no longer than the prefix plus its last token
    prefix = [int(t) for t in rng.integers(2, 100, 7)]
    prompts = [prefix + [int(t) for t in rng.integers(2, 100, int(n))] for n in [1, *rng.integers(2, 12, 11)]]
    if not shared:  # nothing in common, lengths 1 to 18
        prompts = [[int(rng.integers(2, 100))] + p[len(prefix) - i % 7 :] for i, p in enumerate(prompts)]
    free = [evaluate.greedy_answer(lm, p, TurnEnd(max_tokens=8))[0] for p in prompts]
    end = TurnEnd(stops=[free[0].split()[3]], markers=[], max_tokens=8)  # a word the first answer says
    alone = [evaluate.greedy_answer(lm, p, end) for p in prompts]
    picky = [lambda t: False] * 6 + [lambda t, a=a: t.startswith(a.split(" ")[0]) for a, _ in alone[6:]]
    batched = evaluate.batch_greedy_answers(lm, prompts, end, 8, picky)
    assert batched[:6] == alone[:6]  # text and whether it ended (at the stop string)
    # stopped at the first word, as "right": not ended (or ended at once by the stop string)
    assert [t for t, _ in batched[6:]] == [a.split(" ")[0] if a else "" for a, _ in alone[6:]]
    assert {ended for _, ended in alone[:6]} == {True, False}  # some rows ended, some ran to max_tokens


# ---------------------------------------------------------------- the daemon side


def test_the_parent_result_is_carried_only_for_the_same_questions():
    from clawd.jobs import parent_qa, qa_fingerprint
    from clawd.store.adapters import AdapterRecord

    end = TurnEnd(stops=["\nUser:"], markers=[])
    qs = [QAQuestion([1, 2, 3], ["paris"]), QAQuestion([4, 5], ["4", "four"])]
    fp = qa_fingerprint(qs, end)
    parent = AdapterRecord("a1", "/x", "m", gate={"qa": {"fingerprint": fp, "right": [True, False]}})
    assert parent_qa(parent, fp) == [True, False]
    assert parent_qa(None, fp) is None  # from the base: the gate asks the base itself
    assert parent_qa(AdapterRecord("a0", "/x", "m", gate={"gain": 1.0}), fp) is None  # a parent from before the canary
    # another template, stop string or accepted answer is another question set
    for other in (
        qa_fingerprint([QAQuestion([1, 2, 9], ["paris"]), qs[1]], end),
        qa_fingerprint(qs, TurnEnd(stops=["<end>"], markers=[])),
        qa_fingerprint([QAQuestion([1, 2, 3], ["paris", "lutetia"]), qs[1]], end),
    ):
        assert other != fp and parent_qa(parent, other) is None


def test_the_cli_shows_the_canary_and_why_it_refused():
    from clawd.cli import _adapter_line, _training_summary

    gate = {"gain": 0.2, "kl_to_base": 0.01, "passed": False, "qa": {"accuracy": 0.9, "accuracy_parent": 0.96}}
    why = "failed the eval gate: it answers fewer factual questions right (QA canary 90%, parent 96%: −6 points > 2)"
    line = _adapter_line({"id": "a1", "status": "refused", "gate": gate, "note": why}, None)
    assert "QA 90% (parent 96%)" in line and "fewer factual questions" in line
    summary = _training_summary({"adapter_id": "a1", "gate": gate, "promoted": False, "note": why})
    assert "QA 90% (parent 96%)" in summary and "fewer factual questions" in summary


# ---------------------------------------------------------------- the real embedded model (slow)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_embedded_model_knows_the_set_and_a_damaged_adapter_is_refused(tmp_path):
    """The gate's own path on the embedded Gemma 3 270M: questions in its served template, MLX
    weights, batched greedy answers. The base answers at least 45 of the 50 (the set was chosen
    so a healthy model does: it measured 50 of 50, docs/learning.md), and an adapter with its
    LoRA scrambled loses enough of them to be refused."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from clawd import jobs
    from clawd.engines.llamacpp import Engine
    from clawd.engines.runner import EngineRunner
    from clawd.models import EMBEDDED_ID, ensure_embedded_model
    from clawd.paths import ensure_dirs, resolve_paths
    from clawd.served import ServedModel
    from clawd.templates import choose_format
    from clawd.training.weights import load_model
    from tests.conftest import make_env

    paths = resolve_paths(make_env(tmp_path / "home"))
    ensure_dirs(paths)
    path = ensure_embedded_model(paths)
    engine = Engine(path, n_ctx=1024, n_threads=2, model_id=EMBEDDED_ID)
    info = engine.info
    fmt = choose_format("auto", info.chat_template, info.bos_token, info.eos_token, info.add_bos)
    served = ServedModel(EngineRunner(engine), fmt)
    qs, end = jobs.qa_questions(served), jobs.turn_end(served)

    lm = load_model(path, cache_dir=paths.cache_dir)
    lm.model.freeze()
    linear_to_lora_layers(
        lm.model,
        len(lm.model.layers),
        {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": ["self_attn.v_proj", "mlp.down_proj"]},
    )
    parent = evaluate.lora_params(lm.model)  # lora_b = 0: exactly the base
    gate = evaluate.qa_check(lm, qs, parent, damaged(parent, 0.5), end)
    assert gate["accuracy_parent"] >= 0.9, gate
    assert gate["accuracy"] <= gate["accuracy_parent"] - 0.1, gate
    assert any(
        "factual questions" in why for why in evaluate.refusals({"gain": 1.0, "kl_to_base": 0.0, "qa": gate}, 0.5)
    )


def test_the_base_result_is_kept_for_the_next_run_from_the_base(tmp_path):
    """A run from the base asks the base once; later runs from it read its result back, until
    the model file or the questions change."""
    import os
    from types import SimpleNamespace

    from clawd.training.run import base_qa_file, read_base_qa, write_base_qa

    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    job = SimpleNamespace(model_path=str(model), qa_fingerprint="abc")
    path = base_qa_file(tmp_path / "cache", job)
    assert read_base_qa(path) is None
    write_base_qa(path, [True, False, True])
    assert read_base_qa(base_qa_file(tmp_path / "cache", job)) == [True, False, True]
    assert base_qa_file(tmp_path / "cache", SimpleNamespace(model_path=str(model), qa_fingerprint="abd")) != path
    os.utime(model, ns=(1, 1))  # a replaced model file
    assert base_qa_file(tmp_path / "cache", job) != path
    assert base_qa_file(tmp_path / "cache", SimpleNamespace(model_path=str(model), qa_fingerprint=None)) is None
    path.write_text("not json")
    assert read_base_qa(path) is None  # damaged: asked again, never a crash


def test_the_tui_shows_the_canary():
    from tui.screens.adapters import adapter_info

    gate = {
        "passed": False,
        "gain": 0.2,
        "kl_to_base": 0.01,
        "qa": {"accuracy": 0.9, "accuracy_parent": 0.96, "lost": [{"question": 3, "answer": "Sydney"}]},
    }
    text = adapter_info({"id": "a1", "status": "refused", "gate": gate}).plain
    assert "QA canary: 90% right (parent 96%), 1 lost, e.g. 'Sydney'" in text
