"""The held-out half of the judge corpus (clawd/bench/judge_corpus/heldout.jsonl, issue #15):
every item follows the corpus format the judge benchmark reads, and the split covers what the
issue asks for. Only the format and the coverage are checked here; whether a label is right is
a human judgement made when the item was written (each item was read by its writer).

The held-out split is reported, never tuned on, so nothing here looks at what a judge says."""

from __future__ import annotations

import collections
import json
from importlib import resources

import pytest

KINDS = {
    "length", "format", "tone", "language", "spelling", "factual", "wrong_tool", "persona",
    "ordering", "answer_first", "signoff", "code_style", "units", "detail_level", "approval",
    "topic_change", "tool_failure", "tool_success", "challenge", "other",
}  # fmt: skip
VOICES = {
    "terse", "polite", "sarcastic", "non_native", "thanks_but", "challenging_question",
    "embedded", "neutral", "tool",
}  # fmt: skip
FIELDS = {"id", "kind", "voice", "messages", "response", "next", "label", "instruction"}


def load_heldout() -> list[dict]:
    path = resources.files("clawd.bench").joinpath("judge_corpus/heldout.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


ITEMS = load_heldout()


def check_tool_call_response(item: dict) -> None:
    response = item["response"]
    assert response["role"] == "assistant" and response["tool_calls"]
    for call in response["tool_calls"]:
        assert call["type"] == "function" and call["id"]
        # OpenAI sends arguments as a JSON *string*; one item keeps deliberately broken JSON
        # (its tool result is the parse error), so only the type is checked here.
        assert isinstance(call["function"]["name"], str)
        assert isinstance(call["function"]["arguments"], str)
    if item["next"]["role"] == "tool":
        ids = {call["id"] for call in response["tool_calls"]}
        assert item["next"]["tool_call_id"] in ids


@pytest.mark.parametrize("item", ITEMS, ids=[item["id"] for item in ITEMS])
def test_item_follows_the_corpus_format(item):
    assert FIELDS <= item.keys() <= FIELDS | {"note"}
    assert item["kind"] in KINDS and item["voice"] in VOICES
    assert item["label"] in (-1, 0, 1)
    messages = item["messages"]
    assert messages and messages[-1]["role"] == "user"
    assert all(m["role"] in ("system", "user", "assistant") for m in messages)
    assert all(isinstance(m["content"], str) and m["content"].strip() for m in messages)
    if isinstance(item["response"], dict):
        check_tool_call_response(item)
    else:
        assert isinstance(item["response"], str) and item["response"].strip()
    assert item["next"]["role"] in ("user", "tool") and item["next"]["content"].strip()
    # Only a correction carries an instruction; an approval or a neutral state has none.
    if item["label"] == -1:
        assert item["instruction"] is None or item["instruction"].strip()
    else:
        assert item["instruction"] is None


def test_ids_and_conversations_are_unique():
    ids = [item["id"] for item in ITEMS]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith("ho-") and i[3:].isdigit() for i in ids)
    seen = collections.Counter(json.dumps([item["messages"], item["response"]], sort_keys=True) for item in ITEMS)
    assert max(seen.values()) == 1
    nexts = collections.Counter(item["next"]["content"] for item in ITEMS)
    assert max(nexts.values()) == 1


def test_the_split_covers_what_the_issue_asks_for():
    assert len(ITEMS) >= 200
    kinds = collections.Counter(item["kind"] for item in ITEMS)
    # Every kind is present, and the complaint kinds the issue names have several items each.
    assert set(kinds) == KINDS
    assert all(n >= 5 for kind, n in kinds.items() if kind not in ("other",))
    assert set(item["voice"] for item in ITEMS) == VOICES
    # Roughly 45% corrections, 30% approvals, 25% neutral: within 7 points of each.
    labels = collections.Counter(item["label"] for item in ITEMS)
    for label, share in ((-1, 0.45), (1, 0.30), (0, 0.25)):
        assert abs(labels[label] / len(ITEMS) - share) <= 0.07, (label, labels)
    # Tool results fail in several ways, and some failures are not the call's fault (label 0).
    failures = [item for item in ITEMS if item["kind"] == "tool_failure"]
    assert {item["label"] for item in failures} == {-1, 0}
    # Most corrections carry an instruction the model could follow.
    corrections = [item for item in ITEMS if item["label"] == -1]
    assert sum(item["instruction"] is not None for item in corrections) >= 0.8 * len(corrections)
