"""Real agent clients nobody here wrote, against a real clawd daemon (issue 17, item 5).

The OpenAI Agents SDK (its chat-completions model class) and smolagents' ToolCallingAgent
(its OpenAI-compatible model class) each run a tool-using task: a tool hands out a secret the
model must fetch. Two models per client:

- a tiny random-weight GGUF with Qwen2.5's chat template (built here, always present). It
  cannot choose to call a tool, so the client forces the call (`tool_choice` required or
  named → a grammar): what is tested is the wire, that the client's requests are accepted,
  its tool call parses with valid arguments, the tool result goes back, and the run ends;
- an instruction-tuned GGUF from `CLAWD_TEST_INSTRUCT_GGUF` (Qwen2.5-Coder-0.5B-Instruct
  Q4_K_M was measured) with `tool_choice: auto`: the model decides to call the tool and
  reports the secret. Skipped, with the reason, when the variable names no file;
- for smolagents' whole task (fetch, then final_answer), `CLAWD_TEST_AGENT_GGUF`: the 0.5B
  never gives its final answer, Qwen2.5-Coder-1.5B-Instruct does.

Each test also reads what clawd logged: the turn that called the tool keeps its calls, and
the request that carried the tool result is mined as that turn's next state.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import pytest

from clawd.store import signals, turns
from clawd.tool_calls.schema_check import schema_errors
from tests.conftest import ROOT, TEST_TOKEN, start_daemon
from tests.test_tool_calls import QWEN_TEMPLATE
from tests.tiny_models import build_tiny_gguf

pytestmark = pytest.mark.slow

SECRET = "7431-ZEBRA"
# The tools take a name from a short list: a random model's free string under a grammar runs on
# until max_tokens, while an enum ends; the instruct model's task is the same either way.
NAMES = ("vault", "attic")
KEY_SCHEMA = {"type": "object", "properties": {"name": {"enum": list(NAMES)}}, "required": ["name"]}
MINING = {"CLAWD_MINING_ENABLED": 1, "CLAWD_MINING_JUDGE": "rules", "CLAWD_MINING_HINT_JUDGE": "rules"}
INSTRUCT_ENV = "CLAWD_TEST_INSTRUCT_GGUF"
AGENT_ENV = "CLAWD_TEST_AGENT_GGUF"  # `clawd models pull qwen2.5-coder-1.5b-instruct` gives one


def instruct_gguf() -> Path:
    path = os.environ.get(INSTRUCT_ENV)
    if not path or not Path(path).is_file():
        pytest.skip(f"{INSTRUCT_ENV} names no GGUF file (an instruct model, e.g. Qwen2.5-Coder-0.5B-Instruct Q4_K_M)")
    return Path(path)


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory):
    return build_tiny_gguf(
        tmp_path_factory.mktemp("tiny-qwen") / "tiny-qwen.gguf",
        arch="qwen2",
        chat_template=QWEN_TEMPLATE,
        n_ctx_train=8192,
    )


def daemon_on(home: Path, path: Path, n_ctx: int, model_id: str):
    from clawd.engines.llamacpp import Engine

    d = start_daemon(home, Engine(path, n_ctx=n_ctx, n_threads=2, model_id=model_id), env_extra=MINING)
    d.run(d.state.miner.stop())  # mined when the test says so
    return d


@pytest.fixture
def tiny_daemon(clawd_home, qwen_gguf):
    d = daemon_on(clawd_home, qwen_gguf, 8192, "tiny-qwen")
    yield d
    d.stop()


def agent_gguf() -> Path:
    path = os.environ.get(AGENT_ENV)
    if not path or not Path(path).is_file():
        pytest.skip(
            f"{AGENT_ENV} names no GGUF file (an instruct model that finishes agent tasks: Qwen2.5-Coder-1.5B-Instruct)"
        )
    return Path(path)


@pytest.fixture
def agent_daemon(clawd_home):
    d = daemon_on(clawd_home, agent_gguf(), 8192, "agent")
    yield d
    d.stop()


@pytest.fixture
def instruct_daemon(clawd_home):
    d = daemon_on(clawd_home, instruct_gguf(), 8192, "instruct")
    yield d
    d.stop()


def logged_turns(d) -> list:
    """Every turn the daemon logged, oldest first."""
    return list(reversed(d.run(turns.list_turns(d.state.db, limit=100))))


def wait_signal(d, turn_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d.run(d.state.miner.run_until_idle())
        sig = d.run(signals.get(d.state.db, turn_id))
        if sig is not None and sig.status != "pending" and sig.next_turn_id is not None:
            return sig
        time.sleep(0.05)
    raise AssertionError(f"turn {turn_id} was not mined")


def check_the_log(d, calls_made: list[dict], want_next_role: str):
    """The turn whose call ran keeps it; the request that carried its result is its next state."""
    logged = logged_turns(d)
    with_calls = [t for t in logged if t.tool_calls]
    assert with_calls, "no logged turn has tool calls"
    first = with_calls[0]
    assert first.finish_reason == "tool_calls"
    args = json.loads(first.tool_calls[0]["function"]["arguments"])
    assert first.tool_calls[0]["function"]["name"] == "get_secret" and args == calls_made[0]
    later = [t for t in logged if t.created_at > first.created_at]
    assert later, "the tool result never came back to clawd"
    assert later[0].session_id == first.session_id  # the agent's next request is the same conversation
    sig = wait_signal(d, first.id)
    assert (sig.next_turn_id, sig.next_role) == (later[0].id, want_next_role)
    return first, sig


# ---- the OpenAI Agents SDK -------------------------------------------------------------------------


def agents_sdk_run(d, tool_choice: str, **settings):
    """Run an Agents SDK agent with one function tool against `d`; return (result, calls)."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # tracing would post to OpenAI's servers
    calls: list[dict] = []

    @function_tool
    def get_secret(name: Literal["vault", "attic"]) -> str:
        """Look up a secret by its name."""
        calls.append({"name": name})
        return f"The secret {name} is {SECRET}."

    async def run():
        async with AsyncOpenAI(base_url=d.url + "/v1", api_key=TEST_TOKEN, max_retries=0) as client:
            agent = Agent(
                name="secret keeper",
                instructions="You answer questions. Use the get_secret tool to look secrets up, then tell the user.",
                tools=[get_secret],
                model=OpenAIChatCompletionsModel(model="clawd", openai_client=client),
                model_settings=ModelSettings(tool_choice=tool_choice, **settings),
            )
            return await Runner.run(agent, "What is the secret named 'vault'?", max_turns=4)

    result = asyncio.run(run())
    return result, calls


def test_agents_sdk_forced_tool_call_on_a_tiny_model(tiny_daemon):
    result, calls = agents_sdk_run(tiny_daemon, "get_secret", max_tokens=120, extra_args={"seed": 3})
    # The forced call reached the tool with arguments that fit its schema; then (the SDK resets
    # tool_choice after a call) the random model's words end the run.
    assert len(calls) >= 1 and schema_errors(calls[0], KEY_SCHEMA) == []
    assert isinstance(result.final_output, str)
    first, sig = check_the_log(tiny_daemon, calls, "tool")
    assert sig.reward == 1  # the tool succeeded: +1
    assert "<tool_call>" in first.response_text and first.sampling["grammar"]


@pytest.mark.timeout(1800)  # minutes of CPU on a loaded machine
def test_agents_sdk_auto_tool_call_on_an_instruct_model(instruct_daemon):
    result, calls = agents_sdk_run(instruct_daemon, "auto", max_tokens=200, temperature=0.0)
    assert calls, "the model did not call the tool"
    assert SECRET in result.final_output
    first, sig = check_the_log(instruct_daemon, calls, "tool")
    assert sig.reward == 1
    assert not first.sampling.get("grammar")  # auto: the model chose the call unconstrained


# ---- smolagents --------------------------------------------------------------------------------------


def smolagents_run(d, first_choices: list, max_steps: int, **model_kw):
    """Run a smolagents ToolCallingAgent with one tool against `d`; return (answer, calls, agent).
    The model's steps use `first_choices` as their tool_choice in turn (smolagents' per-call
    parameter), then its own default."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    calls: list[dict] = []

    @tool
    def get_secret(name: Literal["vault", "attic"]) -> str:
        """Look up a secret by its name.

        Args:
            name: the secret's name
        """
        calls.append({"name": name})
        return f"The secret {name} is {SECRET}."

    class StepChoices(OpenAIServerModel):
        def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None, **kw):
            if tools_to_call_from and first_choices:
                kw["tool_choice"] = first_choices.pop(0)
            return super().generate(messages, stop_sequences, response_format, tools_to_call_from, **kw)

    model = StepChoices(
        model_id="clawd", api_base=d.url + "/v1", api_key=TEST_TOKEN, client_kwargs={"max_retries": 0}, **model_kw
    )
    agent = ToolCallingAgent(tools=[get_secret], model=model, max_steps=max_steps, verbosity_level=0)
    answer = agent.run("What is the secret named 'vault'? Look it up with get_secret, then give the final answer.")
    return answer, calls, agent


def test_smolagents_forced_tool_call_on_a_tiny_model(tiny_daemon):
    named = {"type": "function", "function": {"name": "get_secret"}}
    answer, calls, agent = smolagents_run(tiny_daemon, [named, named], max_steps=2, max_tokens=120, seed=3)
    # Every step called the named tool with valid arguments; after max_steps smolagents asks for
    # a final answer without tools, and the run ends with it.
    assert len(calls) == 2 and all(schema_errors(c, KEY_SCHEMA) == [] for c in calls)
    assert answer is not None
    # smolagents sends its history as text (tool results as user messages): the next state is "user".
    check_the_log(tiny_daemon, calls, "user")


@pytest.mark.timeout(1800)  # smolagents' own system prompt is ~2k tokens
def test_smolagents_auto_tool_call_on_an_instruct_model(instruct_daemon):
    d = instruct_daemon
    answer, calls, agent = smolagents_run(d, ["auto"] * 3, max_steps=3, max_tokens=200, temperature=0.0)
    assert calls and all(schema_errors(c, KEY_SCHEMA) == [] for c in calls), "the tool was not called"
    assert answer is not None  # the run ended (with final_answer, or after max_steps)
    logged = logged_turns(d)
    assert len(logged) >= len(calls)  # every step went through clawd
    # smolagents' own prompt teaches a text form ("Action:\n{json}"), which it parses itself when
    # no tool_calls come back; Qwen2.5-Coder-0.5B writes that form, so clawd logs text turns
    # (as llama.cpp's server would). A model that answers in its template's syntax gets
    # tool_calls, and then the log is checked as for the Agents SDK.
    if any(t.tool_calls for t in logged):
        check_the_log(d, calls, "user")


@pytest.mark.timeout(1800)
def test_smolagents_completes_the_task_with_its_default_tool_choice(agent_daemon):
    """smolagents asks for `tool_choice: required` unless told otherwise: clawd then generates
    under the grammar of "one of the tools", final_answer included, so every step is a valid
    call. The model fetches the secret, then hands it over through final_answer.

    One call per step (`parallel_tool_calls: false`, passed through OpenAIServerModel's kwargs):
    allowed several, Qwen2.5-Coder-1.5B wrote get_secret and a guessed final_answer in one
    step, which smolagents refuses, every step. The 0.5B calls get_secret at every step and
    never final_answer, hence a model of its own for this test (README, "Agent clients")."""
    d = agent_daemon
    answer, calls, agent = smolagents_run(
        d, [], max_steps=4, max_tokens=200, temperature=0.0, parallel_tool_calls=False
    )
    assert calls and calls[0] == {"name": "vault"}, calls
    assert SECRET in str(answer), answer
    check_the_log(d, calls, "user")
    final = logged_turns(d)[-1]
    assert final.tool_calls and final.tool_calls[0]["function"]["name"] == "final_answer", final.response_text


# ---- OpenClaw ----------------------------------------------------------------------------------------


@pytest.mark.timeout(3600)
def test_openclaw_writes_a_file_through_clawd(tmp_path):
    """examples/openclaw_agent.sh for real: Node and OpenClaw from npm (cached in the script's
    cache directory), clawd on the instruct model, `openclaw agent --local` with the file tools.
    The model is CLAWD_OPENCLAW_MODEL, else CLAWD_TEST_INSTRUCT_GGUF."""
    model = os.environ.get("CLAWD_OPENCLAW_MODEL") or os.environ.get(INSTRUCT_ENV)
    if not model or not Path(model).is_file():
        pytest.skip(f"CLAWD_OPENCLAW_MODEL / {INSTRUCT_ENV} name no GGUF file (an instruct model)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWD_") or k == "CLAWD_OPENCLAW_CACHE"}
    env["CLAWD_CMD"] = f"{sys.executable} -m clawd.cli"
    env["PYTHONPATH"] = str(ROOT)
    script = ROOT / "examples" / "openclaw_agent.sh"
    proc = subprocess.run(
        ["bash", str(script), "--model", model, "--work", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=3500,
    )
    out = proc.stdout + proc.stderr
    if proc.returncode == 2:
        pytest.skip("Node >= 24.16 or OpenClaw could not be installed from npm:\n" + out[-2000:])
    assert proc.returncode == 0, out[-6000:]
    # The script checked the file holds the word; clawd logged the agent's write call and mined
    # its tool result. (Qwen2.5-Coder-1.5B reports the word without calling read.)
    assert "calls write(" in out, out[-6000:]
    assert "ready   r=+1 (rules)" in out, out[-6000:]  # the write's result, mined
