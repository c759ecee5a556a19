"""Training: the current or last run, live (progress, ETA, loss terms, curves); start and stop."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, Header, Label, ProgressBar, Static

from tui.client import DaemonError
from tui.screens.base import ClawdScreen
from tui.screens.modals import ConfirmModal
from tui.widgets.curves import Curves
from tui.widgets.status_bar import StatusBar

TERMS = (
    ("loss", "loss"),
    ("rl", "RL term"),
    ("opd", "OPD term"),
    ("reward_mean", "reward mean"),
    ("rl_clip_frac", "RL clip frac"),
    ("opd_clip_frac", "OPD clip frac"),
    ("ratio_mean", "ratio mean"),
    ("grad_norm", "grad norm"),
    ("seconds", "s / step"),
)


def eta_text(training: dict, steps: list[dict]) -> str:
    """step / total and the time left, from the measured seconds per step of this run."""
    step, total = training.get("step", 0), training.get("total", 0)
    if not total:
        return f"phase {training.get('phase') or '-'}"
    text = f"step {step} / {total}"
    timed = [s["seconds"] for s in steps if isinstance(s.get("seconds"), (int, float))]
    if training.get("state") in ("running", "paused") and timed and step < total:
        left = (total - step) * sum(timed) / len(timed)
        text += f"  ·  ETA {int(left // 60)}:{int(left % 60):02d}"
    return text


def summary(training: dict) -> Text:
    t = Text()
    t.append(f"{training.get('state', '?').upper()}", style="bold")
    if training.get("job_id"):
        t.append(f"   run {training['job_id']}   phase {training.get('phase') or '-'}")
    if training.get("samples"):
        t.append(f"   {training['samples']} samples")
    if training.get("blas"):
        t.append(f"   BLAS {training['blas']}", style="dim")
    t.append("\n")
    if training.get("reason"):
        t.append(f"scheduler: {training['reason']}\n", style="dim")
    result = training.get("result")
    if result:
        t.append("last run: ", style="bold")
        if result.get("error"):
            t.append(f"{result.get('job_id') or result.get('adapter_id')} failed: {result['error']}", style="red")
        elif result.get("resumable"):
            t.append(f"{result['job_id']} stopped at step {result.get('stopped_at')} (the next run resumes it)")
        else:
            gate = result.get("gate") or {}
            verdict = "promoted, now active" if result.get("promoted") else (result.get("note") or "not promoted")
            gain = gate.get("gain")
            t.append(
                f"{result.get('adapter_id')}: {verdict}; gate gain "
                f"{'-' if gain is None else format(gain, '+.4f')}, KL {gate.get('kl_to_base', 0):.4f}"
            )
            qa = gate.get("qa")
            if isinstance(qa, dict) and qa.get("accuracy") is not None:
                t.append(f", QA {qa['accuracy']:.0%} (parent {qa.get('accuracy_parent', 0):.0%})")
    return t


def terms_table(step: dict) -> Table:
    table = Table(box=None, show_header=True, header_style="bold", pad_edge=False)
    shown = [(key, title) for key, title in TERMS if isinstance(step.get(key), (int, float))]
    for _, title in shown:
        table.add_column(title, justify="right")
    if shown:
        table.add_row(*(f"{step[key]:+.4f}" if key != "seconds" else f"{step[key]:.2f}" for key, _ in shown))
    return table


class TrainingScreen(ClawdScreen):
    BINDINGS = [
        Binding("s", "start", "Start a run now"),
        Binding("x", "stop", "Stop the run"),
        Binding("ctrl+r", "refresh", "Refresh"),
    ]

    def __init__(self, poll_s: float = 1.0):
        super().__init__()
        self.poll_s = poll_s
        self.training: dict | None = None

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with VerticalScroll(id="training-pane"):
            yield Static("Loading…", id="run-summary")
            with Horizontal(id="progress-row"):
                yield ProgressBar(total=None, show_eta=False, id="progress")
                yield Label("", id="eta")
            yield Static("", id="terms")
            yield Label("Curves over steps", classes="pane-title")
            yield Curves(id="curves")
        yield StatusBar(id="status-bar")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Training"
        self.action_refresh()
        self._timer = self.set_interval(self.poll_s, self.action_refresh)

    def on_screen_suspend(self) -> None:
        self._timer.pause()

    def on_screen_resume(self) -> None:
        if self.is_mounted:
            self._timer.resume()
            self.action_refresh()

    @work(group="load", exclusive=True)
    async def action_refresh(self) -> None:
        try:
            training = await self.client.training()
            history = await self.client.training_history()
        except DaemonError as e:
            self.query_one("#run-summary", Static).update(Text(f"Training is not available: {e}", style="yellow"))
            self.query_one("#progress", ProgressBar).display = False
            return
        self.training = training
        steps = history.get("steps") or []
        self.query_one("#run-summary", Static).update(summary(training))
        bar = self.query_one("#progress", ProgressBar)
        # No total yet: hide the bar rather than show its indeterminate animation.
        bar.display = bool(training.get("total"))
        if bar.display:
            bar.update(total=training["total"], progress=training.get("step", 0))
        self.query_one("#eta", Label).update(eta_text(training, steps))
        latest = training.get("metrics") or (steps[-1] if steps else {})
        self.query_one("#terms", Static).update(terms_table(latest))
        curves = self.query_one(Curves)
        curves.border_title = f"{history.get('source') or 'no'} run {history.get('job_id') or ''}".strip()
        curves.show(steps)

    async def action_start(self) -> None:
        started = await self.attempt(self.client.start_training())
        if started is not None:
            self.notify(
                f"training run {started.get('job_id')} started"
                if started.get("job_id")
                else f"not started: {started.get('reason')}",
                title="clawd",
            )
            self.action_refresh()

    def action_stop(self) -> None:
        if not self.training or self.training.get("state") not in ("running", "paused"):
            self.notify("No run is in progress.", severity="warning")
            return

        async def confirmed(yes: bool | None) -> None:
            if yes and await self.attempt(self.client.stop_training(), done="stopped at a checkpoint"):
                self.action_refresh()

        self.app.push_screen(
            ConfirmModal(
                "Stop the training run at its next step?\n\nIt checkpoints; the next run resumes it.", confirm="Stop"
            ),
            confirmed,
        )
