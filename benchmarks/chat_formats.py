"""Which chat format makes a base model (no chat template) answer best?

The embedded Gemma 3 270M is a *base* model: its GGUF has no `tokenizer.chat_template`,
so clawd must pick the prompt format itself (clawd/templates.py, TranscriptFormat). This
script measures candidate formats on a fixed prompt set, greedily, and prints a Markdown
table plus a few sample answers.

Prompt set: short factual questions, a few instructions and two two-turn conversations
(scripted first answer, the second user message refers to it). Each prompt has a checker:
a regex that must match the answer (case-insensitive), or "at least N distinct words
from a list".

Metrics per format:
  acc      expected keyword present in the answer (after cutting at the stop string)
  stopped  the model ended its turn itself (stop string or EOS) before the token limit
  clean    correct AND stopped AND not degenerate: what a user would call a good reply
  len      mean answer length in tokens (answer re-tokenized, after the stop cut)
  degen    answer empty, or some token 4-gram occurs 3+ times
  tok/s    generated tokens / generation wall time (prefill included), information only

Deterministic: greedy decoding (temperature 0), a fixed thread count and a fixed prompt
order (the engine's KV-prefix reuse then follows the same path on every run), so two
runs give identical answers; only tok/s varies.

Usage:
    python benchmarks/chat_formats.py [--model PATH] [--formats a,b,...] [--max-tokens 64]
                                      [--threads 2] [--out results.json] [--samples 2]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clawd.engines.base import SamplingParams  # noqa: E402
from clawd.protocol import Message  # noqa: E402
from clawd.templates import TRANSCRIPT_PREAMBLE, TranscriptFormat  # noqa: E402

# ---- prompt set ---------------------------------------------------------------------------

FRUITS = [
    "apple",
    "apples",
    "banana",
    "bananas",
    "orange",
    "oranges",
    "pear",
    "pears",
    "grape",
    "grapes",
    "mango",
    "mangoes",
    "mangos",
    "cherry",
    "cherries",
    "strawberry",
    "strawberries",
    "lemon",
    "lemons",
    "peach",
    "peaches",
    "plum",
    "plums",
    "kiwi",
    "pineapple",
    "watermelon",
    "melon",
    "lime",
    "blueberry",
    "blueberries",
    "raspberry",
    "raspberries",
    "apricot",
    "papaya",
    "coconut",
]
COLORS = [
    "red",
    "blue",
    "green",
    "yellow",
    "orange",
    "purple",
    "pink",
    "black",
    "white",
    "brown",
    "gray",
    "grey",
    "violet",
    "indigo",
    "cyan",
    "magenta",
    "gold",
    "silver",
]


def num(n: int, word: str) -> str:
    """The number as digits (not part of a longer number or a decimal) or as a word."""
    return rf"(?<![\d.]){n}(?!\.?\d)|\b{word}\b"


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # fact | instruction | two-turn
    turns: tuple  # alternating user, assistant, ..., user
    pattern: str = ""  # regex that must match the answer (re.I)
    any_of: tuple = ()  # or: at least `min_count` distinct words from this list
    min_count: int = 0

    def check(self, answer: str) -> bool:
        if self.any_of:
            words = set(re.findall(r"[a-z]+", answer.lower()))
            return len(words & set(self.any_of)) >= self.min_count
        return re.search(self.pattern, answer, re.I) is not None

    def messages(self) -> list[tuple[str, str]]:
        return [("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(self.turns)]


CASES = [
    Case("capital-france", "fact", ("What is the capital of France?",), r"\bparis\b"),
    Case("two-plus-two", "fact", ("What is 2 + 2?",), num(4, "four")),
    Case("largest-planet", "fact", ("What is the largest planet in our solar system?",), r"\bjupiter\b"),
    Case("romeo-juliet", "fact", ("Who wrote Romeo and Juliet?",), r"shakespeare"),
    Case("water-symbol", "fact", ("What is the chemical symbol for water?",), r"\bH2O\b|H₂O"),
    Case("days-week", "fact", ("How many days are in a week?",), num(7, "seven")),
    Case("sky-color", "fact", ("What color is the sky on a clear day?",), r"\bblue\b"),
    Case("capital-japan", "fact", ("What is the capital of Japan?",), r"\btokyo\b"),
    Case("freezing-point", "fact", ("At what temperature in degrees Celsius does water freeze?",), num(0, "zero")),
    Case("spider-legs", "fact", ("How many legs does a spider have?",), num(8, "eight")),
    Case("hello-french", "instruction", ("Say hello in French.",), r"\bbonjour\b|\bsalut\b"),
    Case("three-colors", "instruction", ("Name three colors.",), any_of=tuple(COLORS), min_count=3),
    Case("thanks-spanish", "instruction", ("Translate 'thank you' to Spanish.",), r"\bgracias\b"),
    Case("opposite-hot", "instruction", ("What is the opposite of the word 'hot'?",), r"\bcold\b"),
    Case(
        "banana-unripe",
        "two-turn",
        ("Name a fruit that is yellow.", "A banana.", "What color is it before it is ripe?"),
        r"\bgreen\b",
    ),
    Case(
        "berlin-language",
        "two-turn",
        (
            "What is the capital of Germany?",
            "The capital of Germany is Berlin.",
            "What language do people speak there?",
        ),
        r"\bgerman\b",
    ),
]

# A second, held-out set (--set heldout/all): written after the first results, to check that
# a winner on the 16 dev prompts is not tuned to them.
HELDOUT = [
    Case("boiling-point", "fact", ("What is the boiling point of water in degrees Celsius?",), num(100, "hundred")),
    Case("our-planet", "fact", ("What planet do we live on?",), r"\bearth\b"),
    Case("capital-spain", "fact", ("What is the capital of Spain?",), r"\bmadrid\b"),
    Case("hours-day", "fact", ("How many hours are in a day?",), num(24, "twenty-four")),
    Case("plants-gas", "fact", ("What gas do plants absorb from the air?",), r"carbon dioxide|\bCO2\b|CO₂"),
    Case("largest-ocean", "fact", ("What is the largest ocean on Earth?",), r"\bpacific\b"),
    Case("continents", "fact", ("How many continents are there?",), num(7, "seven")),
    Case("ten-minus-three", "fact", ("What is 10 minus 3?",), num(7, "seven")),
    Case("tallest-animal", "fact", ("What is the tallest animal?",), r"\bgiraffes?\b"),
    Case("bees-make", "fact", ("What do bees make?",), r"\bhoney\b"),
    Case("capital-uk", "fact", ("What is the capital of the United Kingdom?",), r"\blondon\b"),
    Case("pyramids", "fact", ("In which country are the pyramids of Giza?",), r"\begypt\b"),
    Case("brazil-language", "fact", ("What language is mainly spoken in Brazil?",), r"\bportuguese\b"),
    Case("frozen-water", "fact", ("What is frozen water called?",), r"\bice\b"),
    Case("mona-lisa", "fact", ("Who painted the Mona Lisa?",), r"leonardo|da vinci"),
    Case("goodbye-spanish", "instruction", ("Say goodbye in Spanish.",), r"\badi[oó]s\b|hasta luego"),
    Case("two-fruits", "instruction", ("Name two fruits.",), any_of=tuple(FRUITS), min_count=2),
    Case("cat-french", "instruction", ("Translate 'cat' to French.",), r"\bchat\b"),
    Case(
        "rhyme-cat",
        "instruction",
        ("Give me a word that rhymes with 'cat'.",),
        r"\b(hat|bat|mat|rat|sat|fat|pat|vat|that|flat|chat|brat|spat|splat|gnat)\b",
    ),
    Case("five-digit", "instruction", ("Write the number five as a digit.",), num(5, "_no_word_")),
    Case(
        "spain-language",
        "two-turn",
        ("What is the capital of Spain?", "Madrid.", "What language do people speak there?"),
        r"\bspanish\b",
    ),
    Case(
        "dog-legs", "two-turn", ("Name an animal that barks.", "A dog.", "How many legs does it have?"), num(4, "four")
    ),
    Case(
        "red-planet",
        "two-turn",
        ("Which planet is known as the Red Planet?", "Mars.", "Is it bigger or smaller than Earth?"),
        r"\bsmaller\b",
    ),
    Case(
        "japan-food",
        "two-turn",
        ("Which country is famous for sushi?", "Japan.", "What is the capital of that country?"),
        r"\btokyo\b",
    ),
]
SETS = {"dev": CASES, "heldout": HELDOUT, "all": CASES + HELDOUT}

# ---- candidate formats ----------------------------------------------------------------------

SHORT_PREAMBLE = (
    "The following is a conversation between a helpful assistant and a user. "
    "The assistant answers each question correctly in one short sentence."
)
FEWSHOT_1 = [("user", "What is the capital of Italy?"), ("assistant", "The capital of Italy is Rome.")]
FEWSHOT_1B = [
    ("user", "Who was the first president of the United States?"),
    ("assistant", "George Washington was the first president of the United States."),
]
FEWSHOT_2 = FEWSHOT_1 + [("user", "Name two animals."), ("assistant", "Two animals are the dog and the cat.")]


@dataclass(frozen=True)
class Format:
    key: str
    name: str
    description: str
    preamble: str  # text before the first turn ("" for none); ends without newline
    user: str  # template for a user turn, {text}
    assistant: str  # template for a finished assistant turn, {text}
    cue: str  # what follows the last user turn: where the model starts answering
    stops: tuple
    examples: tuple = ()  # few-shot (role, text) turns rendered after the preamble
    add_bos: bool = True

    def render(self, messages: list[tuple[str, str]]) -> str:
        out = self.preamble
        for role, text in list(self.examples) + messages:
            out += (self.user if role == "user" else self.assistant).format(text=text)
        return out + self.cue

    def spec(self) -> dict:
        return {
            "key": self.key,
            "name": self.name,
            "description": self.description,
            "preamble": self.preamble,
            "user_turn": self.user,
            "assistant_turn": self.assistant,
            "generation_cue": self.cue,
            "stops": list(self.stops),
            "few_shot_examples": [list(e) for e in self.examples],
            "example_render": self.render([("user", "What is the capital of France?")]),
        }


def _transcript(key, name, desc, preamble, examples=(), stops=("\nUser:",)):
    # clawd's TranscriptFormat: preamble, blank line, "User: x" / "Assistant: y" lines,
    # then "\nAssistant:" (no trailing space: the model writes " The ...").
    return Format(
        key,
        name,
        desc,
        preamble + "\n\n" if preamble else "",
        "User: {text}\n",
        "Assistant: {text}\n",
        "Assistant:",
        stops,
        tuple(examples),
    )


FORMATS = [
    _transcript(
        "a", "transcript (current)", "clawd's TranscriptFormat: preamble + User:/Assistant: lines", TRANSCRIPT_PREAMBLE
    ),
    _transcript("b", "transcript, no preamble", "User:/Assistant: lines only", ""),
    Format(
        "c",
        "gemma turns",
        "Gemma chat turn markers (the -it template), BOS added",
        "",
        "<start_of_turn>user\n{text}<end_of_turn>\n",
        "<start_of_turn>model\n{text}<end_of_turn>\n",
        "<start_of_turn>model\n",
        ("<end_of_turn>", "<start_of_turn>"),
    ),
    Format("d", "Q/A", "Q: ... / A: ... lines", "", "Q: {text}\n", "A: {text}\n", "A:", ("\nQ:",)),
    Format(
        "e",
        "alpaca",
        "### Instruction: / ### Response: blocks",
        "",
        "### Instruction:\n{text}\n\n",
        "### Response:\n{text}\n\n",
        "### Response:\n",
        ("###",),
    ),
    _transcript("f", "transcript, short-answer preamble", "preamble asks for one short sentence", SHORT_PREAMBLE),
    _transcript("g", "transcript, 1-shot", "current preamble + one example exchange", TRANSCRIPT_PREAMBLE, FEWSHOT_1),
    _transcript("h", "transcript, 2-shot", "current preamble + two example exchanges", TRANSCRIPT_PREAMBLE, FEWSHOT_2),
    _transcript(
        "i",
        "transcript, short preamble + 2-shot",
        "short-answer preamble + two example exchanges",
        SHORT_PREAMBLE,
        FEWSHOT_2,
    ),
    Format(
        "j",
        "Q/A, 2-shot",
        "Q:/A: lines after the same two example exchanges",
        "",
        "Q: {text}\n",
        "A: {text}\n",
        "A:",
        ("\nQ:",),
        tuple(FEWSHOT_2),
    ),
    _transcript(
        "k",
        "transcript, 1-shot (other example)",
        "current preamble + a non-capital example exchange",
        TRANSCRIPT_PREAMBLE,
        FEWSHOT_1B,
    ),
    Format(
        "l",
        "Q/A, 1-shot",
        "Q:/A: lines after one example exchange",
        "",
        "Q: {text}\n",
        "A: {text}\n",
        "A:",
        ("\nQ:",),
        tuple(FEWSHOT_1),
    ),
    Format(
        "m",
        "alpaca, 1-shot",
        "### Instruction:/### Response: after one example exchange",
        "",
        "### Instruction:\n{text}\n\n",
        "### Response:\n{text}\n\n",
        "### Response:\n",
        ("###",),
        tuple(FEWSHOT_1),
    ),
]


def check_current_format_matches_clawd() -> None:
    """Format (a) must render exactly what clawd's TranscriptFormat renders today."""
    fa = FORMATS[0]
    tf = TranscriptFormat()
    for case in CASES + HELDOUT:
        msgs = case.messages()
        clawd = tf.render([Message(role=r, content=t) for r, t in msgs])
        ours = fa.render(msgs)
        if clawd.prompt != ours or "\nUser:" not in clawd.stops:
            raise SystemExit(f"format (a) drifted from clawd's TranscriptFormat:\n{clawd.prompt!r}\nvs\n{ours!r}")


# ---- generation and metrics --------------------------------------------------------------------


def degenerate(answer: str, tokens: list[int]) -> bool:
    if not answer.strip():
        return True
    grams = Counter(tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3))
    return bool(grams) and max(grams.values()) >= 3


def generate(engine, fmt: Format, case: Case, max_tokens: int) -> dict:
    prompt = fmt.render(case.messages())
    ids = engine.tokenize(prompt, add_bos=fmt.add_bos)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    buf = b""
    gen_ids: list[int] = []
    reason = "length"
    cut = None
    t0 = time.perf_counter()
    for tok in engine.generate(ids, params):
        if tok.is_end:
            reason = "eos"
            break
        gen_ids.append(tok.id)
        piece = tok.piece or engine.detokenize([tok.id]).encode()  # control tokens: their text
        buf += piece
        text = buf.decode("utf-8", "ignore")
        hits = [i for i in (text.find(s) for s in fmt.stops) if i >= 0]
        if hits:
            cut = min(hits)
            reason = "stop"
            break
    dt = time.perf_counter() - t0
    text = buf.decode("utf-8", "replace")
    if cut is not None:
        text = text[:cut]
    answer = text.strip()
    ans_tokens = engine.tokenize(answer, add_bos=False) if answer else []
    return {
        "id": case.id,
        "kind": case.kind,
        "prompt_tokens": len(ids),
        "answer": answer,
        "raw": buf.decode("utf-8", "replace"),
        "stop_reason": reason,
        "stopped": reason != "length",
        "answer_tokens": len(ans_tokens),
        "generated_tokens": len(gen_ids),
        "seconds": dt,
        "correct": case.check(answer),
        "degenerate": degenerate(answer, ans_tokens),
    }


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    gen = sum(r["generated_tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    clean = [r["correct"] and r["stopped"] and not r["degenerate"] for r in rows]
    by_kind = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        ks = [r for r in rows if r["kind"] == kind]
        by_kind[kind] = sum(r["correct"] for r in ks) / len(ks)
    return {
        "n": n,
        "accuracy": sum(r["correct"] for r in rows) / n,
        "stopped": sum(r["stopped"] for r in rows) / n,
        "clean": sum(clean) / n,
        "mean_answer_tokens": sum(r["answer_tokens"] for r in rows) / n,
        "degenerate": sum(r["degenerate"] for r in rows) / n,
        "tok_per_s": gen / secs if secs else 0.0,
        "accuracy_by_kind": by_kind,
    }


def table(results: list[dict]) -> str:
    kinds = list(results[0]["summary"]["accuracy_by_kind"])
    base = next((r for r in results if r["format"]["key"] == "a"), None)
    head = (
        ["format", "acc", "clean", "stopped", "len (tok)", "degen"]
        + [f"acc {k}" for k in kinds]
        + (["vs (a) +won/-lost"] if base else [])
        + ["tok/s"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for res in results:
        s = res["summary"]
        n = s["n"]
        cells = [
            f"({res['format']['key']}) {res['format']['name']}",
            f"{s['accuracy']:.0%} ({round(s['accuracy'] * n)}/{n})",
            f"{s['clean']:.0%}",
            f"{s['stopped']:.0%}",
            f"{s['mean_answer_tokens']:.1f}",
            f"{s['degenerate']:.0%}",
        ]
        cells += [f"{s['accuracy_by_kind'][k]:.0%}" for k in kinds]
        if base:  # paired: prompts this format gets right and (a) wrong, and the reverse
            pairs = list(zip(res["answers"], base["answers"]))
            won = sum(x["correct"] and not y["correct"] for x, y in pairs)
            lost = sum(y["correct"] and not x["correct"] for x, y in pairs)
            cells.append(f"+{won}/-{lost}")
        cells += [f"{s['tok_per_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rank_key(res: dict):
    s = res["summary"]
    return (-s["clean"], -s["accuracy"], s["degenerate"], s["mean_answer_tokens"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="GGUF file (default: clawd's embedded Gemma 3 270M base)")
    ap.add_argument("--home", default="/tmp/clawd-bench-home", help="CLAWD_HOME for the embedded model")
    ap.add_argument("--formats", default="", help="comma-separated format keys (default: all)")
    ap.add_argument(
        "--set",
        choices=list(SETS),
        default="dev",
        help="prompt set: the 16 dev prompts (default), the 24 held-out ones, or both",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="fixed so results are reproducible")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--out", type=Path, help="write full JSON results here")
    ap.add_argument("--samples", type=int, default=2, help="print every answer of the best N formats")
    args = ap.parse_args(argv)

    cases = SETS[args.set]
    check_current_format_matches_clawd()
    if args.model:
        model = args.model
    else:
        from clawd.models import ensure_embedded_model
        from clawd.paths import ensure_dirs, resolve_paths

        paths = resolve_paths({"CLAWD_HOME": args.home})
        ensure_dirs(paths)
        model = ensure_embedded_model(paths)

    from clawd.engines.llamacpp import Engine

    engine = Engine(model, n_ctx=args.n_ctx, n_threads=args.threads)
    keys = [k.strip() for k in args.formats.split(",") if k.strip()]
    formats = [f for f in FORMATS if not keys or f.key in keys]
    print(
        f"model: {model.name}  ({engine.info.architecture}, chat template: "
        f"{'yes' if engine.info.chat_template else 'none'})  threads={args.threads}  "
        f"max_tokens={args.max_tokens}  prompts={len(cases)} ({args.set})  formats={len(formats)}",
        file=sys.stderr,
    )

    results = []
    try:
        for fmt in formats:
            t0 = time.perf_counter()
            rows = [generate(engine, fmt, case, args.max_tokens) for case in cases]
            res = {"format": fmt.spec(), "summary": summarize(rows), "answers": rows}
            results.append(res)
            s = res["summary"]
            print(
                f"  ({fmt.key}) {fmt.name}: acc {s['accuracy']:.0%} clean {s['clean']:.0%} "
                f"[{time.perf_counter() - t0:.0f}s]",
                file=sys.stderr,
            )
    finally:
        engine.close()

    print(
        f"\n## Chat formats on {model.name} — {len(cases)} prompts ({args.set} set), greedy, max {args.max_tokens} tokens\n"
    )
    print(table(results))
    ranked = sorted(results, key=rank_key)
    print(
        "\nRanked by clean, then accuracy, then degenerate rate, then length: "
        + " > ".join(f"({r['format']['key']})" for r in ranked)
    )
    for res in ranked[: args.samples]:
        f = res["format"]
        print(f"\n### ({f['key']}) {f['name']} — stops {f['stops']}\n")
        print("```\n" + f["example_render"] + "\n```\n")
        for r in res["answers"]:
            mark = (
                ("ok " if r["correct"] else "BAD") + (" " if r["stopped"] else "…") + ("D" if r["degenerate"] else " ")
            )
            print(f"- `{mark}` **{r['id']}**: {json.dumps(r['answer'], ensure_ascii=False)}")

    if args.out:
        doc = {
            "model": str(model),
            "max_tokens": args.max_tokens,
            "threads": args.threads,
            "n_ctx": args.n_ctx,
            "set": args.set,
            "cases": [c.__dict__ for c in cases],
            "results": results,
        }
        args.out.write_text(json.dumps(doc, indent=2, ensure_ascii=False, default=list) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
