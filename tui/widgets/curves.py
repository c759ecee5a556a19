"""Training curves: one sparkline per metric over the run's steps, labelled with its range."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline

CURVES = (
    ("loss", "loss"),
    ("rl", "RL term"),
    ("opd", "OPD term"),
    ("reward_mean", "reward mean"),
    ("rl_clip_frac", "RL clip fraction"),
    ("opd_clip_frac", "OPD clip fraction"),
)


class Curve(Vertical):
    def __init__(self, key: str, title: str):
        super().__init__(id=f"curve-{key}", classes="curve")
        self.key, self.title = key, title

    def compose(self) -> ComposeResult:
        yield Label(self.title, classes="curve-title")
        yield Sparkline([], summary_function=max)

    def show(self, values: list[float]) -> None:
        label = self.title
        if values:
            label += f"  last {values[-1]:+.4f}  (min {min(values):+.4f}, max {max(values):+.4f}, {len(values)} steps)"
        self.query_one(Label).update(label)
        self.query_one(Sparkline).data = values


class Curves(Vertical):
    def compose(self) -> ComposeResult:
        for key, title in CURVES:
            yield Curve(key, title)

    def show(self, steps: list[dict]) -> None:
        for curve in self.query(Curve):
            curve.show([float(s[curve.key]) for s in steps if isinstance(s.get(curve.key), (int, float))])
