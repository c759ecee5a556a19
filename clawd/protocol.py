"""Wire types of the daemon's HTTP API: pydantic models only.

The API's routes declare these as their request and response models, so /openapi.json
describes what the daemon sends. Clients do not import them: the TUI is an HTTP client like
any other (it may not import clawd at all, so it starts fast and works against another
version of the daemon), and its tests drive it against a real daemon.

Requests follow the OpenAI chat-completions shape (CONVENTIONS.md §1) and tolerate
unknown keys; clawd's own fields (session_id, turn_type, session_done) are read and
then stripped before anything reaches an engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from clawd.config import TEMPERATURE_MAX, TOP_P_MIN_EXCLUSIVE

TOP_LOGPROBS_MAX = 20  # OpenAI's limit for chat `top_logprobs`
COMPLETION_LOGPROBS_MAX = 5  # OpenAI's limit for the legacy completions `logprobs`
# A session id is echoed in a response header and logged: printable ASCII only (a CR/LF would
# break the header, and a megabyte one would be echoed whole), and short.
SESSION_ID_PATTERN = r"^[\x20-\x7e]{1,128}$"


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message's text: a string content, or its text parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ScoreRequest(BaseModel):
    """POST /clawd/score: how likely the served model finds `completion` as the reply to
    `messages`, with the active adapter, the base model, or a named adapter. This is how a
    user (or the learning demo) sees what an adapter changed, as a log-prob margin."""

    messages: list[Message] = Field(min_length=1)
    completion: str = Field(min_length=1)
    adapter: str = "active"  # "active" | "base" | an adapter id


def _check_stops(v):
    if isinstance(v, list) and len(v) > 4:
        raise ValueError("at most 4 stop sequences")
    return v


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    return [s for s in stops if s]


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions. Unknown keys are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    # Any name: one model is served, and it answers whatever a client's settings call it
    # (as llama.cpp's server and LM Studio do); responses carry the served model's id.
    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=TEMPERATURE_MAX)
    top_p: float | None = Field(None, gt=TOP_P_MIN_EXCLUSIVE, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: as OpenAI, several calls may come
    response_format: dict[str, Any] | None = None
    # The sampled tokens' log-probs (choices[].logprobs.content) and, per token, this many
    # most likely alternatives; top_logprobs needs logprobs: true, as with OpenAI.
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS_MAX)
    # clawd's own fields (headers X-Session-Id / X-Turn-Type / X-Session-Done win)
    session_id: str | None = Field(
        None, pattern=SESSION_ID_PATTERN, description="1-128 printable ASCII characters (no control characters)"
    )
    turn_type: Literal["main", "side"] | None = None
    session_done: bool | str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return _check_stops(v)

    def stop_list(self) -> list[str]:
        return _stop_list(self.stop)


class CompletionRequest(BaseModel):
    """POST /v1/completions (OpenAI's legacy raw-prompt endpoint): the prompt goes to the
    model as it is, with no chat template. Unknown keys are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str  # any name, as for chat
    prompt: Any = Field(description="a string, or a list holding one string")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=TEMPERATURE_MAX)
    top_p: float | None = Field(None, gt=TOP_P_MIN_EXCLUSIVE, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    # The legacy shape: tokens, token_logprobs, top_logprobs (this many per token, plus the
    # sampled one), text_offset.
    logprobs: int | None = Field(None, ge=0, le=COMPLETION_LOGPROBS_MAX)
    echo: bool = False
    suffix: str | None = None
    session_id: str | None = None  # header X-Session-Id wins

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return _check_stops(v)

    def stop_list(self) -> list[str]:
        return _stop_list(self.stop)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "clawd"
    # clawd's own: whether the served model's replies are parsed into `tool_calls`, and in
    # which family's syntax (tool_calls/formats.py); None: its chat template defines none.
    tool_calls: bool = False
    tool_format: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Status(BaseModel):
    """GET /clawd/status: what the daemon is doing, for `clawd status` and the TUI."""

    version: str
    pid: int
    uptime_s: float
    host: str
    port: int
    model: str
    model_path: str
    engine: str
    architecture: str
    n_ctx: int
    chat_format: str
    active_adapter: str | None
    busy: bool
    queued: int
    turns: int
    sessions: int
    db_path: str
    home: str
    signals: dict[str, int] = {}
    miner: dict[str, Any] | None = None
    training: dict[str, Any] | None = None  # the scheduler's TrainingStatus; None without training
    # Live config reload: last_reload_at, last_error, last_error_at, restart_required
    # (changed keys that wait for a restart), applied, watching. None when not watched.
    config: dict[str, Any] | None = None
    # Whether turns are being logged: status ok / degraded, reason (disk full, read-only, other),
    # detail, since. Degraded clears itself when a write succeeds again.
    storage: dict[str, Any] | None = None
    # The Open WebUI connector (openwebui.url set): url, last_pull_at, last_error, last (outcome
    # counts of the last pull), outcomes (every rating held, by outcome). None when not set.
    openwebui: dict[str, Any] | None = None


class TurnSummary(BaseModel):
    id: str
    session_id: str
    turn_type: str
    created_at: float
    request_messages: list[dict[str, Any]]
    response_text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    engine: str
    model: str
    adapter_id: str | None
    requery_of: str | None
    timings: dict[str, Any]
    tool_calls: list[dict[str, Any]] = []  # the calls parsed from response_text (its raw text)


class SessionSummary(BaseModel):
    id: str
    created_at: float
    updated_at: float
    title: str | None
    turns: int
    done: bool


class SignalView(BaseModel):
    """One mined signal (GET /clawd/signals): the evaluative and directive evidence of a turn.
    The teacher's arrays stay in the database; `teacher_arrays` says whether it has them."""

    turn_id: str
    session_id: str
    status: str  # waiting | pending | ready | empty
    next_turn_id: str | None = None
    next_state: str | None = None
    next_role: str | None = None
    reward: int | None = None
    reward_source: str | None = None
    votes: list = []
    hints: list[dict[str, Any]] = []  # [{"text", "source", "overlap"}]
    hint: str | None = None
    top_k: int | None = None
    vetoed: bool = False
    attempts: int = 0
    error: str | None = None
    retry_at: float = 0.0
    created_at: float = 0.0
    updated_at: float = 0.0
    teacher_arrays: bool = False
    held_out: bool = False  # kept out of training for the gate (training.holdout, training.holdout_min)


class AdapterView(BaseModel):
    """One trained adapter: where it is, what it learned from, what its gate measured."""

    id: str
    path: str
    model: str
    status: str  # candidate | active | retired | rejected
    parent_id: str | None = None
    previous_id: str | None = None
    signals: list[str] = []
    holdout: list[str] = []
    metrics: dict[str, Any] = {}
    gate: dict[str, Any] = {}
    note: str | None = None
    forgotten: bool = False
    created_at: float
    updated_at: float


class AdapterList(BaseModel):
    active: str | None
    adapters: list[AdapterView]


class ActiveAdapter(BaseModel):
    active: str | None  # None: the base model


class TrainingStatus(BaseModel):
    """GET /clawd/training: the scheduler's current or last run. The scheduler keeps one and
    updates its fields as the trainer reports."""

    state: str = "idle"  # idle | running | paused | error
    job_id: str | None = None
    phase: str | None = None  # load | prepare | train | gate | promote
    step: int = 0
    total: int = 0
    prepared: int = 0
    samples: int = 0
    metrics: dict[str, Any] = {}  # the latest step's loss terms, reward mean, clip fractions
    blas: str | None = None
    started_at: float | None = None
    result: dict[str, Any] | None = None  # the last finished run: adapter, gate, promoted / error
    reason: str = ""  # why the scheduler is (not) training now
    holdout: str = ""  # what is held out for the gate, and why (GET /clawd/training)

    def public(self) -> dict:
        return self.model_dump()


class TrainingHistory(BaseModel):
    job_id: str | None
    source: Literal["live", "adapter"] | None  # this daemon's run, or the newest adapter's curve
    steps: list[dict[str, Any]]


class TrainingStart(BaseModel):
    job_id: str | None  # None: not started (`reason` says why)
    state: str
    reason: str | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the API answers with: OpenAI's error object (CONVENTIONS.md §1)."""

    error: ErrorDetail


# An export's name: one plain file or folder name under the exports folder, so the HTTP body
# can never name a place outside it (no separators, no "..", no NUL, no "~", bounded).
EXPORT_NAME_MAX = 128
EXPORT_NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$"  # not starting with '.': no '..', no hidden


class ExportRequest(BaseModel):
    """POST /clawd/adapters/{id}/export: write the adapter to <data dir>/exports/<name>."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["gguf", "mlx", "peft"] | None = Field(
        None, description="gguf (one file), mlx or peft (a folder); default: gguf where the adapter has one, else mlx"
    )
    name: str = Field(
        ...,
        max_length=EXPORT_NAME_MAX,
        pattern=EXPORT_NAME_PATTERN,
        description="a plain file or folder name (letters, digits, '.', '_', '-'; not starting with '.'): "
        "written under the exports folder",
    )
    force: bool = Field(False, description="overwrite an existing export of that name")


class ExportResult(BaseModel):
    adapter_id: str
    format: str
    path: str
    mlx_model: str | None = Field(
        None,
        description="mlx only: the model folder mlx-lm runs the adapter on (the served MLX directory, or path/base)",
    )
    command: str | None = Field(None, description="mlx only: the mlx-lm command that runs the exported adapter")
