"""Simulated users for the learning benchmark: a TOML file each.

Boundary: loads and validates user files, and turns a response into what the user does
next — the deterministic preference detector decides pass/fail, and the user answers with a
natural-language correction (never naming the detector) or an approval, sometimes plus a
thumb. No HTTP here; clawd/bench/learning.py does the talking.

A user file (see clawd/bench/users/*.toml):

    name = "terse"
    about = "one line for the report"
    thumbs = 0.25            # chance of also clicking thumbs up / down after replying
    tasks = ["...", ...]     # first messages of training sessions (cycled, shuffled per seed)
    held_out = ["...", ...]  # first messages used only to measure compliance

    [preference]             # every check must pass
    checks = [{ kind = "max_words", limit = 15 }]

    [reactions]
    corrections = ["...", ...]  # said when a check fails
    approvals = ["...", ...]    # said when all pass
"""

from __future__ import annotations

import random
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clawd.errors import ConfigError

SHIPPED_DIR = Path(__file__).resolve().parent / "users"
# Users written for the learning benchmark on people clawd was not tuned on (issue 16 item 6),
# frozen before any model or judge ran on them. Kept apart from the shipped users, whose
# corrections the rules judge is tested (and was tuned) to understand.
UNSEEN_DIR = SHIPPED_DIR / "unseen"

_BOLD = re.compile(r"\*\*[^*\n]+\*\*|__[^_\n]+__")
_LIST_LINE = re.compile(r"(?m)^\s*([-*+•]|\d+[.)])\s+\S")
_HEADING = re.compile(r"(?m)^\s*#{1,6}\s")
_TRAILING = re.compile(r"[\s.!?,;:)\"'*_~-]+$")


def _words(text: str) -> list[str]:
    return re.findall(r"[^\W_]+(?:['’][^\W_]+)*", text)


# Each detector: (params) -> (text -> passed). Parameters are checked when the file loads.
def _max_words(limit: int) -> Callable[[str], bool]:
    return lambda text: len(_words(text)) <= limit


def _min_words(limit: int) -> Callable[[str], bool]:
    return lambda text: len(_words(text)) >= limit


def _no_markdown() -> Callable[[str], bool]:
    return lambda text: not (_BOLD.search(text) or _LIST_LINE.search(text) or _HEADING.search(text))


def _ends_with(phrases: list[str]) -> Callable[[str], bool]:
    wanted = [p.lower() for p in phrases]
    return lambda text: any(_TRAILING.sub("", text.strip().lower()).endswith(p) for p in wanted)


def _no_exclamation() -> Callable[[str], bool]:
    return lambda text: "!" not in text


def _lowercase() -> Callable[[str], bool]:
    return lambda text: text == text.lower()


# A sentence ends at . ! or ? (and any closing quote, bracket or Markdown emphasis right after
# it) followed by a space or the end. "3.5" does not end one, nor the last dot of "e.g." / "i.e.",
# nor a title's dot ("Dr. Smith"). Not handled: initials ("J. K. Rowling") and a numbered list's
# "1." count as ends, and "5 p.m." ending a sentence does not.
_SENTENCE_END = re.compile(r"(?<!\b[a-z]\.[a-z])[.!?]+[\"'”’)\]*_]*(?=\s|$)", re.IGNORECASE)
_TITLE = re.compile(r"\b(Dr|Mr|Mrs|Ms|Prof|St)\.(?=\s+[A-Z])")


def sentence_count(text: str) -> int:
    """Sentences with at least one word; an unpunctuated tail (an answer cut at max_tokens, or
    one that never ends its last sentence) counts as one more: the user reads it."""
    return sum(1 for part in _SENTENCE_END.split(_TITLE.sub(r"\1", text)) if _words(part))


def _sentences(count: int) -> Callable[[str], bool]:
    return lambda text: sentence_count(text) == count


def _starts_with(phrases: list[str]) -> Callable[[str], bool]:
    wanted = [_words(p.lower()) for p in phrases]
    return lambda text: any(_words(text.lower())[: len(w)] == w for w in wanted)


# American spellings with a British variant that a general answer may use; any one fails the
# check (a possessive's "'s" aside). Besides these words, the -ize / -yze forms fail (organize,
# prioritize, analyzing, recognizable, organizational...), except words whose "iz" is no suffix
# and that British English spells the same (size and its compounds, prize, seize, capsize...).
AMERICAN_SPELLINGS = frozenset(
    "color colors colored coloring colorful favor favors favored favorite favorites favorable flavor "
    "flavors flavored flavoring flavorful neighbor neighbors neighboring neighborhood behavior behaviors "
    "behavioral honor honors honored honoring humor labor labors harbor harbors rumor rumors center "
    "centers centered centerpiece theater theaters liter liters gray cozy "
    "jewelry defense catalog fiber mold plow traveling traveled traveler travelers".split()
)
_IZE = re.compile(r"^[a-z]+(?:iz|yz)(?:e|es|ed|ing|ation|ations|ational|able|er|ers)$")
# Named size compounds only: "emphasize" and "synthesize" end in "size" too.
_NOT_IZE = re.compile(
    r"^(?:(?:re|over|down|up|under|super|mid|king|life|bite|full|plus)?siz(?:e|es|ed|ing|er|able)"
    r"|prize\w*|seiz\w*|capsiz\w*|maize|baize)$"
)


def _is_american(word: str) -> bool:
    w = re.sub(r"['’]s$", "", word.lower())
    return w in AMERICAN_SPELLINGS or (bool(_IZE.match(w)) and not _NOT_IZE.match(w))


def _british_spelling() -> Callable[[str], bool]:
    return lambda text: not any(_is_american(w) for w in _words(text))


# First person singular: the assistant talking about itself. "mine" is left out (a gold mine).
FIRST_PERSON = frozenset("i i'm i've i'd i'll me my myself".split())


# "i.e." and "I/O" hold an "i" that is no pronoun.
_NOT_PRONOUN = re.compile(r"\bi\.e\.|\bI/O\b", re.IGNORECASE)


def _no_first_person() -> Callable[[str], bool]:
    return lambda text: (
        not any(w.lower().replace("’", "'") in FIRST_PERSON for w in _words(_NOT_PRONOUN.sub(" ", text)))
    )


DETECTORS: dict[str, tuple[Callable[..., Callable[[str], bool]], dict[str, type]]] = {
    "max_words": (_max_words, {"limit": int}),
    "min_words": (_min_words, {"limit": int}),
    "no_markdown": (_no_markdown, {}),
    "ends_with": (_ends_with, {"phrases": list}),
    "no_exclamation": (_no_exclamation, {}),
    "lowercase": (_lowercase, {}),
    "sentences": (_sentences, {"count": int}),
    "starts_with": (_starts_with, {"phrases": list}),
    "british_spelling": (_british_spelling, {}),
    "no_first_person": (_no_first_person, {}),
}


@dataclass(frozen=True)
class Reaction:
    text: str  # the user's next message
    thumbs: str | None  # "up" | "down" | None


@dataclass(frozen=True)
class SimulatedUser:
    name: str
    about: str
    tasks: tuple[str, ...]
    held_out: tuple[str, ...]
    checks: tuple[tuple[str, Callable[[str], bool]], ...]
    corrections: tuple[str, ...]
    approvals: tuple[str, ...]
    thumbs: float
    path: Path | None = None

    def complies(self, response: str) -> bool:
        """True when the response satisfies every check. An empty answer never complies:
        "say nothing" would otherwise satisfy a word limit or a no-lists rule."""
        if not _words(response):
            return False
        return all(check(response) for _, check in self.checks)

    def react(self, response: str, rng: random.Random) -> Reaction:
        passed = self.complies(response)
        text = rng.choice(self.approvals if passed else self.corrections)
        thumbs = ("up" if passed else "down") if rng.random() < self.thumbs else None
        return Reaction(text, thumbs)

    def session_tasks(self, n: int, seed: int) -> list[str]:
        """The first messages of n training sessions: the pool shuffled per seed, cycled."""
        order = list(self.tasks)
        random.Random(f"{self.name}:{seed}").shuffle(order)
        return [order[i % len(order)] for i in range(n)]


def _fail(path: Path | str, msg: str) -> ConfigError:
    return ConfigError(f"simulated user {path}: {msg}")


def _strings(data: dict, key: str, path, *, minimum: int = 1) -> tuple[str, ...]:
    value = data.get(key)
    if not isinstance(value, list) or len(value) < minimum or not all(isinstance(v, str) and v.strip() for v in value):
        raise _fail(path, f"`{key}` must be a list of at least {minimum} non-empty strings")
    return tuple(v.strip() for v in value)


def _check(spec, path) -> tuple[str, Callable[[str], bool]]:
    if not isinstance(spec, dict) or "kind" not in spec:
        raise _fail(path, f"each preference check needs a `kind`, got {spec!r}")
    kind = spec["kind"]
    if kind not in DETECTORS:
        raise _fail(path, f"unknown check kind {kind!r}; known: {', '.join(sorted(DETECTORS))}")
    make, params = DETECTORS[kind]
    extra = set(spec) - {"kind"} - set(params)
    if extra:
        takes = ", ".join(params) or "nothing"
        raise _fail(path, f"check {kind!r} takes no {', '.join(sorted(extra))} (takes: {takes})")
    args = {}
    for name, typ in params.items():
        if not isinstance(spec.get(name), typ) or isinstance(spec.get(name), bool):
            raise _fail(path, f"check {kind!r} needs `{name}` ({typ.__name__})")
        args[name] = spec[name]
    if kind in ("max_words", "min_words") and args["limit"] < 1:
        raise _fail(path, f"{kind} needs limit >= 1")
    if kind == "sentences" and args["count"] < 1:
        raise _fail(path, "sentences needs count >= 1")
    if kind in ("ends_with", "starts_with") and not args["phrases"]:
        raise _fail(path, f"{kind} needs at least one phrase")
    if kind == "ends_with" and not all(isinstance(p, str) and p.strip() for p in args["phrases"]):
        raise _fail(path, "ends_with needs non-empty phrases")
    if kind == "starts_with" and not all(isinstance(p, str) and _words(p) for p in args["phrases"]):
        raise _fail(path, "starts_with needs phrases with words in them")
    return kind, make(**args)


def parse_user(data: dict, path: Path | str = "<memory>") -> SimulatedUser:
    name = data.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):
        raise _fail(path, "`name` must be a short lowercase id (letters, digits, - and _)")
    pref, reactions = data.get("preference"), data.get("reactions")
    if not isinstance(pref, dict) or not isinstance(pref.get("checks"), list) or not pref["checks"]:
        raise _fail(path, "[preference] needs `checks`, a non-empty list of {kind = ...}")
    if not isinstance(reactions, dict):
        raise _fail(path, "[reactions] with `corrections` and `approvals` is missing")
    thumbs = data.get("thumbs", 0.0)
    if not isinstance(thumbs, (int, float)) or isinstance(thumbs, bool) or not 0 <= thumbs <= 1:
        raise _fail(path, "`thumbs` must be a probability between 0 and 1")
    tasks, held_out = _strings(data, "tasks", path), _strings(data, "held_out", path)
    if set(tasks) & set(held_out):
        raise _fail(path, "held_out first messages must not also be training tasks")
    return SimulatedUser(
        name=name,
        about=str(data.get("about", "")),
        tasks=tasks,
        held_out=held_out,
        checks=tuple(_check(c, path) for c in pref["checks"]),
        # several wordings, so the model cannot learn one sentence instead of the preference
        corrections=_strings(reactions, "corrections", path, minimum=2),
        approvals=_strings(reactions, "approvals", path),
        thumbs=float(thumbs),
        path=Path(path),
    )


def load_user(path: Path | str) -> SimulatedUser:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise _fail(path, f"cannot read it: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise _fail(path, f"not valid TOML: {e}") from None
    return parse_user(data, path)


def shipped_users() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.toml"))}


def unseen_users() -> dict[str, Path]:
    return {p.stem: p for p in sorted(UNSEEN_DIR.glob("*.toml"))}


def resolve_user(ref: str) -> SimulatedUser:
    """A shipped or unseen user's name, or a path to any user file."""
    known = {**unseen_users(), **shipped_users()}  # a shipped user keeps its name
    if ref in known:
        return load_user(known[ref])
    if ref.endswith(".toml") or "/" in ref:
        return load_user(ref)
    raise ConfigError(f"no simulated user {ref!r}: use one of {', '.join(known)} or a path to a .toml file")
