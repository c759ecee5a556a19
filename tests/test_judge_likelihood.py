"""The likelihood judge: the verdict is the most likely of the three \\boxed{} endings after the
evaluative prompt, scored by llama.cpp. Checked against an independent scoring of the same
prompt with llama-cpp-python's high-level Llama on a tiny real GGUF."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from clawd.config import Settings
from clawd.daemon import build_judge
from clawd.errors import ConfigError
from clawd.judge import VERDICT_TEXTS, JudgeInput, LikelihoodJudge, LLMJudge, evaluative_messages
from clawd.protocol import Message
from clawd.templates import TranscriptFormat

INP = JudgeInput(
    request=[{"role": "user", "content": "Name a color."}],
    response="Blue.",
    next_state="no, a warm one",
    next_role="user",
)


def _independent_logprob(llm, prompt_ids: list[int], target_ids: list[int]) -> float:
    llm.reset()
    llm.eval(prompt_ids + target_ids[:-1])
    p, n = len(prompt_ids), len(target_ids)
    rows = np.asarray(llm.scores[p - 1 : p - 1 + n], dtype=np.float64)
    m = rows.max(axis=1, keepdims=True)
    logp = rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))
    return float(logp[np.arange(n), target_ids].sum())


@pytest.fixture(scope="module")
def tiny_gguf_2k(tmp_path_factory):
    """The tiny model with a 2k context: the evaluative prompt is ~1,100 of its byte-level tokens."""
    from tests.tiny_models import build_tiny_gguf

    return build_tiny_gguf(tmp_path_factory.mktemp("tiny2k") / "tiny-2k.gguf", n_ctx_train=2048)


def test_likelihood_verdict_matches_an_independent_scoring(tiny_gguf_2k):
    from llama_cpp import Llama

    tiny_gguf = tiny_gguf_2k

    from clawd.engines.llamacpp import Engine
    from clawd.engines.runner import EngineRunner
    from clawd.judge_completers import ServedModelCompleter
    from clawd.served import ServedModel

    model = ServedModel(EngineRunner(Engine(tiny_gguf, n_ctx=2048, n_threads=1, model_id="tiny")), TranscriptFormat())
    completer = ServedModelCompleter(model)
    judge = LikelihoodJudge(completer)

    async def go():
        mine = {v: await completer.logprob(evaluative_messages(INP), t) for v, t in VERDICT_TEXTS.items()}
        return mine, await judge.evaluate(INP)

    try:
        mine, verdict = asyncio.run(go())
    finally:
        model.runner.close()

    llm = Llama(model_path=str(tiny_gguf), n_ctx=2048, logits_all=True, n_threads=1, verbose=False)
    try:
        rendered = TranscriptFormat(add_bos=True).render([Message(**m) for m in evaluative_messages(INP)]).prompt
        prompt_ids = llm.tokenize(rendered.encode(), add_bos=True, special=True)
        ref = {
            v: _independent_logprob(llm, prompt_ids, llm.tokenize(t.encode(), add_bos=False, special=False))
            for v, t in VERDICT_TEXTS.items()
        }
    finally:
        llm.close()

    for v in VERDICT_TEXTS:
        assert mine[v] == pytest.approx(ref[v], abs=2e-3)
    assert verdict.score == max(ref, key=ref.get)
    assert verdict.votes == [verdict.score] and verdict.source == "self"


# A chat template whose turn markers are the tiny vocabulary's control tokens, as an
# instruction-tuned model's are (Qwen's <|im_start|> / <|im_end|>).
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def test_likelihood_judge_on_a_gguf_scores_under_its_chat_template(tmp_path):
    """likelihood:gguf:PATH (a second local model, as `clawd bench judge` and the miner build
    it) scores each verdict as the reply in the model's own chat template: checked against
    the template rendered with jinja2 and scored with llama-cpp-python directly."""
    import dataclasses

    import jinja2
    from llama_cpp import Llama

    from tests.tiny_models import build_tiny_gguf

    path = build_tiny_gguf(tmp_path / "chat.gguf", n_ctx_train=2048, chat_template=CHAT_TEMPLATE)
    settings = Settings()
    settings = dataclasses.replace(settings, model=dataclasses.replace(settings.model, n_ctx=2048, n_threads=1))
    judge = build_judge(f"likelihood:gguf:{path}", settings, None)
    assert isinstance(judge, LikelihoodJudge) and judge.completer.source == "gguf"
    messages = evaluative_messages(INP)

    async def go():
        try:
            mine = {v: await judge.completer.logprob(messages, t) for v, t in VERDICT_TEXTS.items()}
            return (
                mine,
                await judge.evaluate(INP),
                judge.completer.chat.prompt_ids([Message.model_validate(m) for m in messages]),
            )
        finally:
            await judge.completer.aclose()

    mine, verdict, used_ids = asyncio.run(go())

    llm = Llama(model_path=str(path), n_ctx=2048, logits_all=True, n_threads=1, verbose=False)
    try:
        template = llm.metadata["tokenizer.chat_template"]
        rendered = jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True)
        assert rendered.endswith("<s>assistant\n")
        # No client text here spells a marker, so tokenizing it all with special=True is exact.
        prompt_ids = llm.tokenize(rendered.encode(), add_bos=False, special=True)
        assert prompt_ids.count(0) == len(messages) + 1  # <s> as the control token, once per turn
        ref = {
            v: _independent_logprob(llm, prompt_ids, llm.tokenize(t.encode(), add_bos=False, special=False))
            for v, t in VERDICT_TEXTS.items()
        }
    finally:
        llm.close()

    assert used_ids == prompt_ids
    for v in VERDICT_TEXTS:
        assert mine[v] == pytest.approx(ref[v], abs=2e-3)
    assert verdict.score == max(ref, key=ref.get)
    assert verdict.logprobs == pytest.approx(ref, abs=2e-3)


def test_likelihood_judge_specs():
    settings = Settings()
    served = object()  # build_judge only hands it to the completer
    assert isinstance(build_judge("likelihood:self", settings, served), LikelihoodJudge)
    plain = build_judge("self", settings, served)
    assert isinstance(plain, LLMJudge) and not isinstance(plain, LikelihoodJudge)
    with pytest.raises(ConfigError, match="likelihood judge scores with a model clawd runs"):
        build_judge("likelihood:openai:http://127.0.0.1:9/v1", settings, served)
    with pytest.raises(ConfigError, match="likelihood:self"):
        build_judge("likelihood:rules", settings, served)


def test_bench_runs_the_likelihood_judge_on_a_local_gguf(tiny_gguf_2k, tmp_path):
    """`clawd bench judge` loads --model in-process and runs the judge the daemon would build."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, make_env

    out = tmp_path / "judge.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "clawd.cli",
            "bench",
            "judge",
            "--judge",
            "likelihood:self",
            "--model",
            str(tiny_gguf_2k),
        ]
        + ["--limit", "3", "--no-hints", "--json", str(out)],
        cwd=ROOT,
        env=make_env(tmp_path / "home", CLAWD_MODEL_N_CTX=2048, CLAWD_MODEL_N_THREADS=1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "| likelihood:self | dev | 3 |" in p.stdout and "| rules>likelihood:self | dev | 3 |" in p.stdout
    outcomes = [o for o in json.loads(out.read_text())["outcomes"] if o["judge"] == "likelihood:self"]
    # every item either fits the tiny context and gets a verdict, or is reported as too long
    assert len(outcomes) == 3
    for o in outcomes:
        assert (o["score"] in (-1, 0, 1) and o["votes"] == [o["score"]]) or "tokens" in (o["error"] or "")


def test_a_gguf_judge_model_can_be_named_as_in_clawd_models(tiny_gguf, clawd_home, tmp_path):
    """gguf:NAME is the GGUF registered under NAME (`clawd models add`); a path stays a path,
    relative ones from config.toml's folder, as model.path."""
    from functools import partial

    from clawd.model_registry import add_model, second_model_path
    from clawd.paths import ensure_dirs, resolve_paths
    from tests.conftest import make_env

    paths = resolve_paths(make_env(clawd_home))
    ensure_dirs(paths)
    add_model(paths, tiny_gguf, name="tiny-judge", echo=lambda _: None)
    judge_model_path = partial(second_model_path, role="judge")
    assert judge_model_path("tiny-judge", paths) == tiny_gguf.resolve()
    assert judge_model_path(str(tiny_gguf), paths) == tiny_gguf
    assert judge_model_path("judges/j.gguf", paths) == (paths.config_dir / "judges/j.gguf").resolve()
    assert judge_model_path("unknown-name", paths) == (paths.config_dir / "unknown-name").resolve()
    assert judge_model_path("~/j.gguf", None) == Path("~/j.gguf").expanduser()
    # the daemon's builder loads the named model as the judge's second model
    import dataclasses

    settings = Settings()
    settings = dataclasses.replace(settings, model=dataclasses.replace(settings.model, n_ctx=512, n_threads=1))
    judge = build_judge("likelihood:gguf:tiny-judge", settings, None, paths)
    try:
        assert judge.completer.source == "gguf" and judge.completer.chat.info.n_ctx == 512
    finally:
        asyncio.run(judge.completer.aclose())


class _FixedScorer:
    source = "gguf"

    def __init__(self, lp: dict[int, float]):
        self.lp = lp

    async def logprob(self, messages, completion):
        return self.lp[{t: v for v, t in VERDICT_TEXTS.items()}[completion]]


def test_a_near_tie_under_the_margin_is_no_decision():
    from clawd.bench.judge_scoring import undecided

    scorer = _FixedScorer({-1: -2.0, 0: -2.9, 1: -2.6})  # -1 leads by 0.6 nats
    clear = asyncio.run(LikelihoodJudge(scorer, margin=0.5).evaluate(INP))
    assert (clear.score, clear.votes) == (-1, [-1]) and not undecided(clear.score, clear.votes)
    close = asyncio.run(LikelihoodJudge(scorer, margin=1.0).evaluate(INP))
    assert (close.score, close.votes) == (0, [None]) and undecided(close.score, close.votes)
    assert close.logprobs == scorer.lp
    assert asyncio.run(LikelihoodJudge(scorer).evaluate(INP)).score == -1  # default: the most likely
    with pytest.raises(ConfigError, match="margin"):
        LikelihoodJudge(scorer, margin=-1)


def test_the_margin_comes_from_the_mining_settings():
    import dataclasses

    settings = Settings()
    settings = dataclasses.replace(settings, mining=dataclasses.replace(settings.mining, likelihood_margin=1.5))
    assert build_judge("likelihood:self", settings, object()).margin == 1.5
    assert Settings().mining.likelihood_margin == 0.0
