"""How far did training move the token a preference hinges on? (issue 16, `inshort` and `signoff`)

Compliance counts greedy answers, so a run that raised the right token from 0.001 to 0.2 reads
0% just like a run that did nothing. This probe reads the distributions instead, with
llama-cpp-python's own `Llama` (the GGUF's chat template, the adapter as `lora_path`), on the
user's held-out first messages, for the base model and each adapter a kept learning run left:

- `inshort` ("open with In short"): at the answer's first position, the probability of a token
  that reads "In", its rank, and how many greedy first tokens are "In".
- `signoff` ("end with Cheers"): at the position where the model's own greedy answer ends (or
  runs out of --max-tokens), the probability of a piece of "Cheers" there; where it ended, the
  probability of ending the turn, and of "Cheers" after a forced blank line.

`--teacher T.gguf` adds the teacher with the user's correction as the miner's hint (METHOD §3,
`teacher_context`) as the reference the OPD term aims at.

`--prompts qa` asks the QA canary's 50 questions (clawd/training/qa.py) instead of the user's
held-out messages, and `--also WORD` reads P(WORD) at the first position too: what a lesson for
the first token does to answers it should leave alone (`--also I`: the first token of Qwen's
"I'm sorry, but I can't assist with that.", which the `inshort` adapters the gate refused gave to
"Who wrote Hamlet?").

    python benchmarks/preference_token_probe.py --model S.gguf --user inshort \
        [--home KEPT_ARM_HOME ...] [--teacher T.gguf] [--prompts held-out|qa] [--also WORD ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clawd.bench.learning import teacher_context, teacher_hint  # noqa: E402
from clawd.bench.users import resolve_user  # noqa: E402
from clawd.training.qa import QA_SET  # noqa: E402


def _is_start_of(piece: str, word: str) -> bool:
    return len(piece) >= 3 and word.startswith(piece)


# What each probed user's preference hinges on: where to look, and the tokens' text test.
PROBES = {
    "inshort": ("first", lambda text: text.strip().lower() == "in"),
    # A piece of "Cheers" ("Che", "Cheers", " cheers!"), not "check" or "chemical".
    "signoff": ("end", lambda text: _is_start_of(text.strip().lower().rstrip("!.,"), "cheers")),
}

# The preference's second token, read after the model's likeliest first one: "In" alone is not
# "In short", and on-policy distillation teaches "short" only once the student says "In".
FOLLOWS = {"inshort": lambda text: text.strip().lower() == "short"}
OPENING_TOKENS = 6


def load(model: Path, adapter: Path | None):
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    llm = Llama(
        model_path=str(model),
        lora_path=str(adapter) if adapter else None,
        n_ctx=1024,
        logits_all=True,
        n_threads=2,
        verbose=False,
    )
    # special=True: control tokens (<|im_end|>, <end_of_turn>) keep their text, else they read "".
    vocab = [llm.detokenize([i], special=True).decode("utf-8", "replace") for i in range(llm.n_vocab())]
    template = llm.metadata.get("tokenizer.chat_template")
    if not template:  # the probe asks as a chat client would: through the model's own template
        raise SystemExit(f"{model.name} has no chat template in its GGUF; probe an instruct model")
    fmt = Jinja2ChatFormatter(
        template,
        eos_token=vocab[llm.token_eos()],
        bos_token=vocab[llm.token_bos()] if llm.token_bos() >= 0 else "",
    )
    return llm, vocab, fmt


def logprobs_after(llm, tokens: list[int]) -> np.ndarray:
    """Evaluate `tokens` on top of what llm holds; the log-softmax of the next-token row."""
    llm.eval(tokens)
    row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    return row - np.logaddexp.reduce(row)


def greedy(llm, lp: np.ndarray, end_ids: set[int], max_tokens: int) -> tuple[list[int], np.ndarray]:
    """The greedy continuation from the row `lp` until the turn ends or the room runs out, and
    the row where it stopped."""
    answer: list[int] = []
    while len(answer) < max_tokens:
        top = int(np.argmax(lp))
        if top in end_ids:
            break
        answer.append(top)
        lp = logprobs_after(llm, [top])
    return answer, lp


def probe_one(
    llm, fmt, messages, where: str, wanted: np.ndarray, follows, end_ids: set[int], max_tokens: int, also: dict
) -> dict:
    prompt = fmt(messages=messages).prompt
    tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    llm.reset()
    lp = logprobs_after(llm, tokens)
    if where == "first":
        best = int(np.argmax(np.where(wanted, lp, -np.inf)))
        row = {
            "p": float(np.exp(lp[wanted]).sum()),
            "rank": int((lp > lp[best]).sum()) + 1,
            "greedy_hit": bool(wanted[int(np.argmax(lp))]),
            "also": {word: float(np.exp(lp[mask]).sum()) for word, mask in also.items()},
        }
        opening, _ = greedy(llm, lp, end_ids, OPENING_TOKENS)
        row["opening"] = llm.detokenize(opening).decode("utf-8", "replace")
        if follows is not None:  # force the likeliest wanted first token, read the next row
            llm.reset()
            after = logprobs_after(llm, tokens + [best])
            row["p_follow"] = float(np.exp(after[follows]).sum())
        return row
    answer, lp = greedy(llm, lp, end_ids, max_tokens)
    row = {
        "p": float(np.exp(lp[wanted]).sum()),
        "p_end": float(np.exp(lp[sorted(end_ids)]).sum()),
        "ended": len(answer) < max_tokens,
        "answer": llm.detokenize(answer).decode("utf-8", "replace"),
    }
    if row["ended"]:  # a sign-off mostly comes after a blank line: read it there too
        after = logprobs_after(llm, llm.tokenize(b"\n\n", add_bos=False, special=False))
        row["p_after_blank_line"] = float(np.exp(after[wanted]).sum())
    return row


def probe(
    model: Path, adapter: Path | None, user, max_tokens: int, hinted: bool, prompts: list[str], also_words: list[str]
) -> dict:
    import llama_cpp

    where, test = PROBES[user.name]
    llm, vocab, fmt = load(model, adapter)
    wanted = np.array([test(t) for t in vocab])
    also = {w: np.array([t.strip() == w for t in vocab]) for w in also_words}
    if not wanted.any():
        raise SystemExit(f"{model.name}: no token of its vocabulary reads as {user.name}'s preference; wrong model?")
    follows = np.array([FOLLOWS[user.name](t) for t in vocab]) if user.name in FOLLOWS else None
    # Every token llama.cpp itself ends a generation on (end of turn, end of text).
    end_ids = {i for i in range(len(vocab)) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, i)}
    rows = []
    for i, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt}]
        if hinted:
            hint = teacher_hint(user, prompt, i)
            if hint is None:
                continue
            messages = teacher_context(prompt, hint)
        row = probe_one(llm, fmt, messages, where, wanted, follows, end_ids, max_tokens, also)
        rows.append({"prompt": prompt, **row})
    del llm
    ps = [r["p"] for r in rows]
    out = {"prompts": len(rows), "p_mean": float(np.mean(ps)), "p_max": float(np.max(ps)), "rows": rows}
    if where == "first":
        out["rank_median"] = float(np.median([r["rank"] for r in rows]))
        out["greedy_hits"] = sum(r["greedy_hit"] for r in rows)
        if follows is not None:
            out["p_follow_mean"] = float(np.mean([r["p_follow"] for r in rows]))
        out["also_mean"] = {w: float(np.mean([r["also"][w] for r in rows])) for w in also_words}
    else:
        # Only where the greedy answer ended: a row that ran out of room is read mid-sentence.
        ended = [r for r in rows if r["ended"]]
        out["ended"] = len(ended)
        out["p_end_mean"] = float(np.mean([r["p_end"] for r in ended])) if ended else None
        out["p_after_blank_line_mean"] = float(np.mean([r["p_after_blank_line"] for r in ended])) if ended else None
    return out


def adapters_of(home: Path) -> list[tuple[str, Path]]:
    """Each adapter a kept arm's daemon trained, oldest first (ids are ad-YYYYMMDD-HHMMSS-…), with
    whether its gate passed. A run starts from its parent's weights, so each file is the whole
    adapter, not a delta."""
    found = []
    for meta in sorted((home / "data" / "adapters").glob("*/meta.json"), key=lambda p: p.parent.name):
        gguf = meta.parent / "adapter.gguf"
        if gguf.exists():
            passed = json.loads(meta.read_text()).get("gate", {}).get("passed")
            found.append((f"{home.name}/{meta.parent.name} (gate {'passed' if passed else 'refused'})", gguf))
    return found


def _fmt(x: float | None, digits: int) -> str:
    return "–" if x is None else f"{x:.{digits}f}"  # None: no greedy answer ended


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the student GGUF the runs served")
    p.add_argument("--user", choices=sorted(PROBES), required=True)
    p.add_argument("--home", type=Path, nargs="*", default=[], help="kept arm homes (clawd bench learning --keep)")
    p.add_argument("--teacher", type=Path, help="also probe this model with the miner's hint")
    p.add_argument("--max-tokens", type=int, default=48, help="room for the greedy answer (the bench's default)")
    p.add_argument("--prompts", choices=("held-out", "qa"), default="held-out", help="the user's or the QA canary's")
    p.add_argument(
        "--also", action="append", default=[], metavar="WORD", help="also read P(WORD) at the first position"
    )
    p.add_argument("--json", type=Path, help="write every row here")
    args = p.parse_args(argv)
    user = resolve_user(args.user)
    where = PROBES[args.user][0]
    if args.prompts == "qa" and args.teacher:
        raise SystemExit("--teacher needs the user's held-out prompts: its hint is the user's correction of them")
    if args.also and where != "first":
        raise SystemExit(f"--also reads the first position, and {args.user} is read where the answer ends")
    prompts = [q for q, _ in QA_SET] if args.prompts == "qa" else user.held_out
    subjects = [("base", args.model, None, False)]
    subjects += [(name, args.model, gguf, False) for h in args.home for name, gguf in adapters_of(h)]
    if args.teacher:
        subjects.append(("teacher + hint", args.teacher, None, True))
    results = {}
    for name, model, adapter, hinted in subjects:
        r = results[name] = probe(model, adapter, user, args.max_tokens, hinted, prompts, args.also)
        extra = (
            f"median rank {r['rank_median']:g}, greedy first {r['greedy_hits']}/{r['prompts']}"
            + (f", P(next | first) {r['p_follow_mean']:.3f}" if "p_follow_mean" in r else "")
            + "".join(f", P({w}) {v:.3f}" for w, v in r["also_mean"].items())
            if where == "first"
            else f"ended {r['ended']}/{r['prompts']}; where it ended: P(end) {_fmt(r['p_end_mean'], 3)}, "
            f"P(wanted after a blank line) {_fmt(r['p_after_blank_line_mean'], 4)}"
        )
        print(f"{name:60s} P(wanted) mean {r['p_mean']:.4f} max {r['p_max']:.4f}  {extra}", flush=True)
    if args.json:
        out = {"user": args.user, "where": where, "prompts": args.prompts, "results": results}
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
