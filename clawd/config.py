"""clawd's settings: dataclasses with help text beside every default.

Boundary: `load_settings` resolves the layers once — defaults < config.toml <
CLAWD_<SECTION>_<FIELD> environment variables < explicit overrides (CLI flags) — and
returns a frozen `Settings` that `cli.py` passes down. Nothing else reads config.toml
or `os.environ`; the environment arrives here as a mapping. Every bad value becomes a
one-line ConfigError naming where it came from, the key and what is wrong.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from clawd.errors import ConfigError

ENV_PREFIX = "CLAWD_"


# What a chat request may ask for (protocol.ChatCompletionRequest validates with the same numbers),
# so a default the config accepts is always a value a request could have sent.
TEMPERATURE_MAX = 2.0
TOP_P_MIN_EXCLUSIVE = 0.0

# Said in the log and by `clawd status` while config.toml still sets it.
DEPRECATED_REQUIRE_TOKEN = (
    "server.require_token is deprecated: the token is required from loopback too by default now "
    "(server.trust_loopback = true is the opt-out); remove require_token from config.toml"
)


def _f(default, help: str, **meta):
    # One place that pairs a default with its help text (DESIGN "How to write it" rule 2).
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class ServerSettings:
    host: str = _f("127.0.0.1", "Address the HTTP API listens on; keep 127.0.0.1 unless other machines must reach it.")
    port: int = _f(8757, "TCP port of the HTTP API (0 = any free port).", min=0, max=65535)
    trust_loopback: bool = _f(
        False,
        "Let loopback clients in without the bearer token. Off: every route but /clawd/health and the "
        "API schema needs the token (`clawd token`), from this machine too, since every local user and "
        "every web page in your browser can reach loopback.",
    )
    allowed_origins: str = _f(
        "",
        "Comma-separated web origins (e.g. http://localhost:3000) whose pages may send state-changing "
        "requests (they still need the token); the daemon's own http://host:port is always allowed.",
    )
    require_token: bool = _f(
        False, "Deprecated: the token is required by default now. true still forces it (over trust_loopback)."
    )
    max_request_mb: float = _f(
        1.0, "Largest request body accepted, in MB (bigger bodies get 413 before they are read).", gt=0.0
    )


@dataclass(frozen=True)
class ModelSettings:
    path: str = _f("", "Model file (GGUF) or directory (MLX); empty = the embedded Gemma 3 270M model.")
    engine: str = _f(
        "llamacpp",
        "Inference engine: llamacpp, mlx (mlx-lm: fastest on Apple Silicon; GGUF files or "
        "MLX model directories), openai (an OpenAI-compatible server you run: set "
        "model.base_url) or fake (for tests).",
        choices=("llamacpp", "mlx", "openai", "fake"),
    )
    base_url: str = _f(
        "",
        "openai engine: the upstream's OpenAI base URL, e.g. http://127.0.0.1:8080/v1 "
        "(llama-server) or http://127.0.0.1:8000/v1 (vLLM); clawd contacts nothing else.",
    )
    api_key: str = _f("", "openai engine: bearer token for the upstream, if it needs one.")
    n_ctx: int = _f(8192, "Context window in tokens (agents resend a ~6k-token system prompt and tool list).", min=1)
    n_threads: int = _f(0, "CPU threads for generation; 0 = all physical cores.", min=0)
    prefix_cache_mb: float = _f(
        512.0,
        "llamacpp engine: host memory for saved prompt prefixes (KV states, per adapter, least "
        "recently used dropped first), so a session switch or adapter switch does not re-read a "
        "shared system prompt; 0 = off.",
        min=0.0,
    )
    chat_format: str = _f(
        "auto",
        "auto: the model's own chat template, else clawd's transcript format (base models); "
        "or force template / transcript.",
        choices=("auto", "template", "transcript"),
    )
    name: str = _f(
        "",
        "Model id shown in /v1/models; empty = derived from the file name (openai engine: the "
        "upstream's model id to use; empty = its first).",
    )


@dataclass(frozen=True)
class GenerationSettings:
    # Defaults for requests that don't say; a request's own value always wins.
    max_tokens: int = _f(512, "Default maximum tokens generated per response.", min=1)
    temperature: float = _f(
        0.7, f"Default sampling temperature, 0 (greedy) to {TEMPERATURE_MAX:g}.", min=0.0, max=TEMPERATURE_MAX
    )
    top_p: float = _f(
        0.95, "Default nucleus sampling probability mass, above 0 up to 1.", gt=TOP_P_MIN_EXCLUSIVE, max=1.0
    )
    top_k: int = _f(40, "Sample only among the k most likely tokens (0 = no limit), as llama.cpp does.", min=0)


@dataclass(frozen=True)
class MiningSettings:
    # METHOD.md §2-4; the miner runs between user requests and yields to them.
    enabled: bool = _f(True, "Mine every main turn into training signals in the background.")
    judge: str = _f(
        "self",
        "Evaluative judge used when the rules are undecided: rules (rules only), self (the served "
        "model, no adapter), gguf:PATH or gguf:NAME (a second local model, a file or a name from `clawd models "
        "list`), openai:BASE_URL[#MODEL], or likelihood:self / likelihood:gguf:PATH (the verdict scored by "
        "likelihood instead of sampled votes).",
    )
    hint_judge: str = _f(
        "self", "Hint (directive) judge, same forms as judge; rules = the user's own correction sentences only."
    )
    votes: int = _f(3, "Judge votes per turn (majority; ties give 0).", min=1)
    likelihood_margin: float = _f(
        0.0,
        "A likelihood judge gives its verdict only when it beats the next most likely one by this many "
        "nats (log-prob); closer calls give 0 (no decision). 0 = always the most likely.",
        min=0.0,
    )
    judge_examples: bool = _f(
        False,
        "Show an LLM judge twelve judged turns (clawd/judge_examples.py) before each turn it judges. "
        "Helps instruct judges find corrections, not the embedded base: README, 'Worked examples'.",
    )
    temperature: float = _f(0.6, "Judge sampling temperature.", min=0.0)
    top_k: int = _f(4, "Top-k tokens per position for overlap-guided hint selection and OPD.", min=1)
    max_hints: int = _f(3, "Hint candidates kept per turn (shortest first).", min=1)
    quiet_s: float = _f(
        2.0,
        "Seconds after a user request before the miner may use the model again "
        "(keeps the conversation's prompt cache warm).",
        min=0.0,
    )
    retry_s: float = _f(60.0, "First wait before retrying a failed judge (doubles, up to an hour).", min=0.0)


@dataclass(frozen=True)
class TrainingSettings:
    # METHOD.md §5-6 constants, and when the scheduler may train (DESIGN: never while serving).
    auto: bool = _f(
        True, "Train automatically when enough signals are ready and the machine is idle or in the overnight window."
    )
    min_signals: int = _f(8, "Ready, untrained signals needed before an automatic run.", min=1)
    idle_minutes: float = _f(10.0, "Minutes without a user request before the machine counts as idle.", min=0.0)
    window: str = _f(
        "01:00-06:00",
        "Overnight window (local time, HH:MM-HH:MM) in which training may run regardless of idleness; empty = none.",
    )
    batch_size: int = _f(16, "Samples per optimizer step (a smaller last batch is allowed).", min=1)
    epochs: int = _f(2, "Passes over each batch (2, so the PPO clip binds).", min=1)
    learning_rate: float = _f(1e-4, "Adam learning rate for the LoRA parameters.", min=0.0)
    weight_decay: float = _f(0.1, "Decoupled weight decay on the LoRA parameters.", min=0.0)
    grad_clip: float = _f(1.0, "Gradient global-norm clip.", min=0.0)
    rank: int = _f(16, "LoRA rank.", min=1)
    alpha: float = _f(32.0, "LoRA alpha (scale = alpha / rank).", min=0.0)
    targets: str = _f(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "Comma-separated projections of every block that get LoRA.",
    )
    w_rl: float = _f(1.0, "Weight of the PPO-clip RL term (0 = OPD-only ablation).", min=0.0)
    w_opd: float = _f(1.0, "Weight of the on-policy distillation term (0 = binary-RL-only ablation).", min=0.0)
    teacher: str = _f(
        "base",
        "Who scores the hinted answer for on-policy distillation in training: base (the "
        "frozen base model + hint, METHOD.md §3), policy (the active adapter, each run's "
        "π_old, + hint: no pull back toward the base) or model:NAME (another local GGUF with "
        "the served model's vocabulary, a path or a name from `clawd models list`, e.g. "
        "model:qwen2.5-coder-1.5b-instruct over the 0.5B; the trainer loads it for the run). "
        "The miner picks hints with the base either way.",
        check=lambda v: (
            None
            if v in ("base", "policy") or (v.startswith("model:") and v[6:].strip())
            else "must be base, policy or model:NAME"
        ),
    )
    opd_support: str = _f(
        "student",
        "Which tokens the on-policy distillation term scores at each position: student (the "
        "student's top-k, METHOD.md §4) or union (the student's top-k and the teacher's: a token "
        "the student never ranks, the 'Cheers' it never writes, gets a signal too).",
        choices=("student", "union"),
    )
    opd_weighting: str = _f(
        "student",
        "Whose probabilities weight the distillation term's tokens: student (METHOD.md §5, the "
        "student's softmax over the support: a token it gives ~0 gets ~0 weight, so even union "
        "cannot raise it) or teacher (the hinted teacher's softmax: a forward-KL step toward "
        "what the teacher would write, e.g. the 'In short' it opens with) or both (their mean: "
        "the teacher's tokens raised, and the student's own tokens the teacher does not write "
        "pushed down, each with half its own side's weight).",
        choices=("student", "teacher", "both"),
    )
    teacher_answers: int = _f(
        0,
        "Also train on the hinted teacher's own greedy answer to each hinted signal, up to this many "
        "tokens (0 = off): distillation then scores the teacher along an answer that follows the hint, "
        "not only along the student's, so a preference the student never starts ('In short', a "
        "closing 'Cheers') is taught past its first token. The answer trains with the hint's "
        "distillation term only.",
        min=0,
        max=1024,
    )
    teacher_endings: int = _f(
        0,
        "Also train on the hinted teacher's greedy continuation of each hinted signal's finished "
        "answer, up to this many tokens (0 = off): after the student's last sentence the teacher "
        "adds what the hint asks for at the end (a closing 'Cheers') and ends, and distillation "
        "scores those positions, which no sampled answer reaches. Only a continuation that ends "
        "within this room trains, with the hint's distillation term only; turns that ended at a "
        "stop string (the transcript template) get none.",
        min=0,
        max=1024,
    )
    teacher_answers_weight: float = _f(
        1.0,
        "How much each of the teacher's answers (training.teacher_answers) and endings "
        "(training.teacher_endings) counts in its batch "
        "against a signal's 1, in the gradient and in the batch mean alike: below 1, a smaller step "
        "toward the teacher's own wording; 0 makes no answers or endings at all.",
        min=0.0,
        max=1.0,
    )
    w_kl_base: float = _f(
        0.0,
        "Weight of a KL(base ‖ adapter) term on the base model's own answers to a fixed set of "
        "everyday prompts that are no signal (0 = off, METHOD.md's default): each step also pulls "
        "the model back toward the base where the user asked nothing of it, so a lesson spreads "
        "less to unrelated answers. The pull also works against a lesson meant for every answer "
        "and, since each run continues from the active adapter, against earlier lessons. Costs "
        "8 more samples per step (the base's answers; a step of 8 samples took about 3 times "
        "as long).",
        min=0.0,
    )
    max_tokens: int = _f(
        512, "Longest prompt+response a sample may have; longer prompts are cut from the left.", min=16
    )
    holdout: float = _f(0.2, "Fraction of signals held out from training for the eval gate.", min=0.0, max=0.9)
    holdout_min: int = _f(
        20,
        "Hold signals out only once this many are ready (learned ones included); below it every signal "
        "trains, and the gate judges on the training signals and the canaries.",
        min=0,
    )
    kl_bound: float = _f(
        0.5,
        "Eval gate: the candidate's mean per-token KL to the base model on the canary "
        "prompts must stay under this (nats).",
        min=0.0,
    )
    qa_canary: bool = _f(
        True,
        "Eval gate: answer a fixed factual QA set (50 short questions, greedy, exact match) under the "
        "parent and the candidate, and refuse a candidate that loses accuracy (training.qa_max_drop).",
    )
    qa_max_drop: float = _f(
        2.0,
        "Eval gate: the most QA-canary accuracy (percentage points) a candidate may lose against its "
        "parent, whatever its preference gain (2.0 = one question of the 50).",
        min=0.0,
        max=100.0,
    )
    nice: int = _f(19, "CPU niceness of the trainer process (19 = lowest priority).", min=0, max=19)


@dataclass(frozen=True)
class OpenWebUISettings:
    url: str = _f(
        "",
        "Open WebUI's address, e.g. http://localhost:3000 (`clawd connect openwebui`): clawd pulls the "
        "thumbs, reasons and comments given there onto the turns they rate. Empty: never contacted.",
    )
    api_key: str = _f(
        "",
        "An Open WebUI API key (or login token), sent as a bearer token. An admin's reads everyone's "
        "ratings; a user's reads that user's only (without the chat snapshot: the ids must match).",
    )
    poll_s: float = _f(30.0, "Seconds between two pulls of new, changed and removed ratings.", min=1.0)


@dataclass(frozen=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    mining: MiningSettings = field(default_factory=MiningSettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    openwebui: OpenWebUISettings = field(default_factory=OpenWebUISettings)
    log_level: str = _f(
        "info", "Log verbosity: debug, info, warning or error.", choices=("debug", "info", "warning", "error")
    )


_SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(Settings)
    if dataclasses.is_dataclass(f.default_factory)
}
_TOP = [f.name for f in dataclasses.fields(Settings) if f.name not in _SECTIONS]


@dataclass(frozen=True)
class _Spec:
    key: str  # "server.port" or "log_level"
    type: type
    default: object
    help: str
    meta: Mapping[str, object]


def _specs() -> dict[str, _Spec]:
    out: dict[str, _Spec] = {}
    for name in _TOP:
        out[name] = _spec(Settings, name, name)
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            out[f"{section}.{f.name}"] = _spec(cls, f.name, f"{section}.{f.name}")
    return out


def _spec(cls: type, name: str, key: str) -> _Spec:
    # Annotations are strings under `from __future__ import annotations`; resolve them.
    hints = typing.get_type_hints(cls)
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return _Spec(key, hints[name], f.default, f.metadata["help"], f.metadata)


SPECS: dict[str, _Spec] = _specs()


def env_var(key: str) -> str:
    """The environment variable for a settings key: "server.port" → CLAWD_SERVER_PORT."""
    return ENV_PREFIX + key.replace(".", "_").upper()


def describe_settings() -> list[tuple[str, object, str]]:
    """Every setting as (key, default, help), in declaration order, top-level keys first."""
    return [(s.key, s.default, s.help) for s in SPECS.values()]


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_TYPE_WORDS = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}


def _convert(spec: _Spec, raw: object, where: str) -> object:
    """Convert one raw value (TOML-typed or a string from env/flags) and validate it."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where}: {spec.key} {what}", param=spec.key)

    t = spec.type
    value: object
    if t is bool:
        if isinstance(raw, bool):
            value = raw
        elif isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            value = raw.strip().lower() in _TRUE
        else:
            raise bad(f"must be {_TYPE_WORDS[t]} (1/true/yes/on or 0/false/no/off), got {raw!r}")
    elif t is int:
        # bool is an int subclass; `port = true` is a mistake, not 1.
        if isinstance(raw, int) and not isinstance(raw, bool):
            value = raw
        elif isinstance(raw, str):
            try:
                value = int(raw.strip())
            except ValueError:
                raise bad(f"must be {_TYPE_WORDS[t]}, got {raw!r}") from None
        else:
            raise bad(f"must be {_TYPE_WORDS[t]}, got {raw!r}")
    elif t is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            value = float(raw)
        elif isinstance(raw, str):
            try:
                value = float(raw.strip())
            except ValueError:
                raise bad(f"must be {_TYPE_WORDS[t]}, got {raw!r}") from None
        else:
            raise bad(f"must be {_TYPE_WORDS[t]}, got {raw!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise bad(f"must be a finite number, got {raw!r}")
    elif t is str:
        if isinstance(raw, os.PathLike):  # a CLI flag may hand over a Path
            raw = os.fspath(raw)
        if not isinstance(raw, str):
            raise bad(f"must be {_TYPE_WORDS[t]}, got {raw!r}")
        value = raw
    else:  # pragma: no cover - a new field type needs a converter here
        raise TypeError(f"no converter for {spec.key}: {t!r}")

    check = spec.meta.get("check")
    if check is not None:
        value = value.strip()
        problem = check(value)
        if problem:
            raise bad(f"{problem}, got {raw!r}")
    choices = spec.meta.get("choices")
    if choices is not None:
        value = str(value).strip().lower()
        if value not in choices:
            raise bad(f"must be one of {', '.join(choices)}, got {raw!r}")
    lo, hi, above = spec.meta.get("min"), spec.meta.get("max"), spec.meta.get("gt")
    if lo is not None and value < lo:  # type: ignore[operator]
        raise bad(f"must be >= {lo}, got {raw!r}")
    if above is not None and value <= above:  # type: ignore[operator]
        raise bad(f"must be > {above}, got {raw!r}")
    if hi is not None and value > hi:  # type: ignore[operator]
        raise bad(f"must be <= {hi}, got {raw!r}")
    return value


def _read_toml(config_file: Path, problems: list[str] | None = None) -> dict[str, object]:
    """Flatten config.toml into {"server.port": raw, ...}; unknown keys are errors (with
    `problems`: noted there and skipped, see load_settings)."""

    def refuse(e: ConfigError) -> None:
        if problems is None:
            raise e
        problems.append(e.message)

    try:
        text = config_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}  # no file = all defaults; every `clawd` command writes one first (cli._setup)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config_file}: cannot read config file: {e}") from e
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{config_file}: invalid TOML ({e}); fix the line or delete the file to use defaults") from e

    flat: dict[str, object] = {}
    valid_top = _TOP + [f"[{s}]" for s in _SECTIONS]
    for k, v in doc.items():
        if k in _SECTIONS:
            if not isinstance(v, dict):
                refuse(ConfigError(f"{config_file}: {k} must be a table ([{k}]), got {v!r}", param=k))
                continue
            valid = [key.split(".", 1)[1] for key in SPECS if key.startswith(k + ".")]
            for sk, sv in v.items():
                if sk not in valid:
                    refuse(
                        ConfigError(
                            f"{config_file}: unknown key {k}.{sk}; valid keys in [{k}]: {', '.join(valid)}",
                            param=f"{k}.{sk}",
                        )
                    )
                    continue
                flat[f"{k}.{sk}"] = sv
        elif k in _TOP:
            flat[k] = v
        else:
            refuse(
                ConfigError(
                    f"{config_file}: unknown key {k}; valid top-level keys and tables: {', '.join(valid_top)}",
                    param=k,
                )
            )
    return flat


def load_settings(
    config_file: Path,
    env: Mapping[str, str],
    overrides: Mapping[str, object] = {},  # noqa: B006 - read only
    *,
    problems: list[str] | None = None,
) -> Settings:
    """Resolve defaults < config.toml < CLAWD_* env < overrides into one Settings.

    Args:
        config_file: path to config.toml; a missing file means defaults.
        env: the environment mapping (only CLAWD_<SECTION>_<FIELD> / CLAWD_LOG_LEVEL are read).
        overrides: explicit values from CLI flags, keyed "server.port" / "log_level";
            a None value means "flag not given" and is skipped.
        problems: given, a bad config.toml does not raise: each problem is appended to it and
            the bad part is skipped (its defaults stand in), so `clawd status` still finds the
            daemon, which keeps its previous settings, and can say what is wrong with the file.
    Returns:
        The frozen Settings.
    Raises:
        ConfigError: unreadable or invalid TOML, unknown key, or a value of the wrong type/range.
    """
    values: dict[str, object] = {key: spec.default for key, spec in SPECS.items()}

    try:
        from_file = _read_toml(config_file, problems)
    except ConfigError as e:
        if problems is None:
            raise
        problems.append(e.message)
        from_file = {}
    for key, raw in from_file.items():
        try:
            values[key] = _convert(SPECS[key], raw, str(config_file))
        except ConfigError as e:
            if problems is None:
                raise
            problems.append(e.message)

    for key, spec in SPECS.items():
        var = env_var(key)
        if var in env:
            values[key] = _convert(spec, env[var], var)

    for key, raw in overrides.items():
        if key not in SPECS:
            raise ConfigError(f"unknown setting {key!r}; valid settings: {', '.join(SPECS)}", param=key)
        if raw is None:
            continue
        values[key] = _convert(SPECS[key], raw, f"override {key}")

    sections = {
        name: cls(**{k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(name + ".")})
        for name, cls in _SECTIONS.items()
    }
    return Settings(**sections, **{k: values[k] for k in _TOP})


def settings_to_dict(s: Settings) -> dict:
    """Plain nested dict (JSON-ready) for `clawd status --json`."""
    return dataclasses.asdict(s)


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        # TOML basic strings share JSON's escapes for the characters that matter here.
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def render_default_config() -> str:
    """The commented config.toml text: every setting with its help and default, none set."""
    lines = [
        "# clawd configuration.",
        "# Every setting is commented out, so the defaults stay in clawd's code.",
        "# Uncomment a line to change it. CLAWD_<SECTION>_<KEY> environment variables",
        "# (e.g. CLAWD_SERVER_PORT) override this file; command-line flags override both.",
        "",
    ]
    current = ""  # top-level keys come first: TOML puts them before any table
    for key, default, help_text in describe_settings():
        section, _, name = key.rpartition(".")
        if section != current:
            # Table headers stay live (an empty table sets nothing), so an uncommented
            # key lands in the right section.
            lines += [f"[{section}]", ""]
            current = section
        for h in textwrap.wrap(help_text, 86, break_on_hyphens=False):  # keep names like llama-server whole
            lines.append(f"# {h}")
        lines.append(f"# env: {env_var(key)}")
        lines.append(f"# {name} = {_toml_value(default)}")
        lines.append("")
    return "\n".join(lines)


def write_default_config(config_file: Path) -> bool:
    """Write the commented default config.toml unless one exists; never overwrites.

    Returns:
        True if the file was written, False if it already existed.
    Raises:
        ConfigError: the file cannot be created.
    """
    try:
        config_file.parent.mkdir(parents=True, exist_ok=True)
        # "x" is create-only: atomic against a concurrent writer and never clobbers user edits.
        with open(config_file, "x", encoding="utf-8") as fh:
            fh.write(render_default_config())
    except FileExistsError:
        return False
    except OSError as e:
        raise ConfigError(f"cannot write default config {config_file}: {e.strerror}") from e
    return True
