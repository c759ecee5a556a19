"""The capability canary: a fixed factual QA set and its exact-match scoring (issue 16 item 5).

Boundary: data and pure-Python scoring only (no MLX, no tokenizer), so the daemon (jobs.py
tokenizes the questions with the served model's template) and the trainer child (the gate
answers them greedily, training/evaluate.py) share one definition.

Why: a preference adapter can pass the direction and KL checks and still teach the model to
be wrong ("Electricity is the power that is produced by the sun."). The gate answers these
questions under the parent and the candidate and refuses a candidate whose accuracy drops by
more than training.qa_max_drop.

Scoring (decided, not guessed): an answer is right when its normalised text contains one of
the question's accepted answers as a whole phrase (lowercase; accents, punctuation and
hyphens become spaces; whitespace collapsed). "Contains", not "starts with": a base model
answers in a sentence ("The capital of France is Paris."). Whole phrases keep "4" from
matching "14" and "seven" from matching "seventy". Every question was chosen so that no
accepted answer is a word of the question itself and a wrong answer does not contain a right
one by accident (no "a", no yes/no questions, no Italy: the transcript format's example
exchange answers it). Chosen on the embedded Gemma 3 270M base: of a first 50, it answered 37; the
13 it got wrong (mostly counts and sums: "How many days are in a week? 10 days.") were replaced
by questions it answers, since a question the parent already gets wrong cannot show a loss
(docs/learning.md has the measurement).
"""

from __future__ import annotations

import re
import unicodedata

# (question, accepted answers). Order is fixed: the gate's per-question results line up.
QA_SET: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Germany?", ("berlin",)),
    ("What is the capital of Spain?", ("madrid",)),
    ("What is the capital of the United Kingdom?", ("london",)),
    ("What is the capital of Russia?", ("moscow",)),
    ("What is the capital of China?", ("beijing", "peking")),
    ("What is the capital of Egypt?", ("cairo",)),
    ("What is the capital of Canada?", ("ottawa",)),
    ("What is the capital of Greece?", ("athens",)),
    ("What is the capital of Ireland?", ("dublin",)),
    ("What is the capital of Portugal?", ("lisbon",)),
    ("What is the capital of Norway?", ("oslo",)),
    ("What is the capital of Austria?", ("vienna",)),
    ("What is the capital of Poland?", ("warsaw",)),
    ("What is the capital of South Korea?", ("seoul",)),
    ("What is the capital of Thailand?", ("bangkok",)),
    ("What is the capital of Kenya?", ("nairobi",)),
    ("What is the capital of Cuba?", ("havana",)),
    ("What is the capital of Peru?", ("lima",)),
    ("What is the capital of Hungary?", ("budapest",)),
    ("What is the capital of Denmark?", ("copenhagen",)),
    ("What is the capital of Argentina?", ("buenos aires",)),
    ("What is the capital of the Netherlands?", ("amsterdam",)),
    ("What is the capital of the Czech Republic?", ("prague",)),
    ("What is the capital of Chile?", ("santiago",)),
    ("What is the capital of Iran?", ("tehran",)),
    ("What is the capital of Colombia?", ("bogota",)),
    ("What is 2 + 2?", ("4", "four")),
    ("What is 3 + 5?", ("8", "eight")),
    ("What is 5 times 5?", ("25", "twenty five")),
    ("What is 9 + 10?", ("19", "nineteen")),
    ("How many sides does a triangle have?", ("3", "three")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What color is grass?", ("green",)),
    ("What color is snow?", ("white",)),
    ("What is the opposite of hot?", ("cold",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("What planet do we live on?", ("earth",)),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("What is the tallest mountain in the world?", ("everest",)),
    ("What is the longest river in Africa?", ("nile",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("Who wrote Hamlet?", ("shakespeare",)),
    ("Who painted the Mona Lisa?", ("leonardo", "da vinci")),
    ("Who was the first president of the United States?", ("washington",)),
    ("What is frozen water called?", ("ice",)),
    ("Which organ pumps blood through the body?", ("heart",)),
    ("What language is spoken in Brazil?", ("portuguese",)),
    ("What is the currency of Japan?", ("yen",)),
)
QA_MAX_TOKENS = 20  # the longest right answer ("The first president ... was George Washington.") fits


def normalise(text: str) -> str:
    """Lowercase, accents dropped, everything but letters and digits a space, spaces collapsed."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii").lower()
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text).split())


def is_correct(answer: str, accepted: tuple[str, ...] | list[str]) -> bool:
    """Whether `answer` contains one of `accepted` as a whole phrase (after normalise)."""
    padded = f" {normalise(answer)} "
    return any(f" {normalise(a)} " in padded for a in accepted if normalise(a))


def accuracy(correct: list[bool]) -> float:
    return sum(correct) / len(correct) if correct else 0.0
