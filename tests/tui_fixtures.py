"""Fixed daemon answers for deterministic TUI pictures: the snapshot tests and the
screenshots in docs/screens/ (docs/screens/make_screens.py). Served through httpx's
MockTransport, so the TUI's real client code parses them. Times are fixed; render in UTC."""

from __future__ import annotations

import json

import httpx

from tui.client import DaemonClient

T0 = 1767225600.0  # 2026-01-01 00:00 UTC
A1, A2, A3 = "ad-20260101-031502-7f3a", "ad-20260102-030911-c21e", "ad-20260103-031744-90bd"
TURNS = [
    "chatcmpl-4f1c9a0e2b7d4c8e9a1b2c3d",
    "chatcmpl-8b2d7e1f0a9c4b3d8e7f6a5b",
    "chatcmpl-1a2b3c4d5e6f7a8b9c0d1e2f",
    "chatcmpl-9e8d7c6b5a4f3e2d1c0b9a8f",
]

STATUS = {
    "version": "0.1.0",
    "pid": 4242,
    "uptime_s": 3600.0,
    "host": "127.0.0.1",
    "port": 8757,
    "model": "gemma3-270m",
    "model_path": "/home/me/.local/share/clawd/models/gemma3-270m.gguf",
    "engine": "llamacpp",
    "architecture": "gemma3",
    "n_ctx": 4096,
    "chat_format": "transcript",
    "active_adapter": A2,
    "busy": False,
    "queued": 0,
    "turns": 42,
    "sessions": 3,
    "db_path": "clawd.db",
    "home": "/home/me/.config/clawd",
    "signals": {"ready": 6, "waiting": 1, "pending": 0, "empty": 2},
    "miner": {"judge": "self", "mined": 9, "busy": False},
    "training": {"state": "running"},
    "config": None,
}

SESSIONS = [
    {
        "id": "s-capitals",
        "created_at": T0,
        "updated_at": T0 + 120,
        "title": "What is the capital of France?",
        "turns": 2,
        "done": False,
    },
    {
        "id": "s-recipes",
        "created_at": T0 - 7200,
        "updated_at": T0 - 7000,
        "title": "A quick pancake recipe",
        "turns": 3,
        "done": False,
    },
    {
        "id": "s-haiku",
        "created_at": T0 - 86400,
        "updated_at": T0 - 86000,
        "title": "Write a haiku about rain",
        "turns": 1,
        "done": True,
    },
]


def _turn(tid: str, messages: list[dict], reply: str, **kw) -> dict:
    return {
        "id": tid,
        "session_id": "s-capitals",
        "turn_type": "main",
        "created_at": T0,
        "request_messages": messages,
        "response_text": reply,
        "finish_reason": "stop",
        "prompt_tokens": 20,
        "completion_tokens": 30,
        "engine": "llamacpp",
        "model": "gemma3-270m",
        "adapter_id": A2,
        "requery_of": None,
        "timings": {},
        **kw,
    }


Q1 = [{"role": "user", "content": "What is the capital of France?"}]
R1 = (
    "The capital of France is **Paris**. It is also the largest city in France, known for:\n\n"
    "- the Eiffel Tower\n- the Louvre\n- its cafés"
)
Q2 = [*Q1, {"role": "assistant", "content": R1}, {"role": "user", "content": "No, just the name please: Paris."}]
SESSION_TURNS = {"s-capitals": [_turn(TURNS[1], Q2, "Paris."), _turn(TURNS[0], Q1, R1)]}  # newest first, as served
TURN_BY_ID = {t["id"]: t for ts in SESSION_TURNS.values() for t in ts}

SIGNALS = [
    {
        "turn_id": TURNS[0],
        "session_id": "s-capitals",
        "status": "ready",
        "next_turn_id": TURNS[1],
        "next_state": "No, just the name please: Paris.",
        "next_role": "user",
        "reward": -1,
        "reward_source": "rules",
        "votes": [-1, -1, 0],
        "hint": "Answer with just the name.",
        "hints": [
            {"text": "Answer with just the name.", "source": "judge", "overlap": 0.62},
            {"text": "Be shorter.", "source": "judge", "overlap": 0.31},
        ],
        "vetoed": False,
        "error": None,
        "attempts": 0,
        "teacher_arrays": True,
    },
    {
        "turn_id": TURNS[1],
        "session_id": "s-capitals",
        "status": "waiting",
        "next_turn_id": None,
        "next_state": None,
        "next_role": None,
        "reward": None,
        "reward_source": None,
        "votes": [],
        "hint": None,
        "hints": [],
        "vetoed": False,
        "error": None,
        "attempts": 0,
        "teacher_arrays": False,
    },
    {
        "turn_id": TURNS[2],
        "session_id": "s-recipes",
        "status": "ready",
        "next_turn_id": "x",
        "next_state": "thanks!",
        "next_role": "user",
        "reward": 1,
        "reward_source": "feedback",
        "votes": [],
        "hint": None,
        "hints": [],
        "vetoed": False,
        "error": None,
        "attempts": 0,
        "teacher_arrays": False,
    },
    {
        "turn_id": TURNS[3],
        "session_id": "s-haiku",
        "status": "ready",
        "next_turn_id": "y",
        "next_state": "that is not a haiku",
        "next_role": "user",
        "reward": -1,
        "reward_source": "self",
        "votes": [-1, None, -1],
        "hint": None,
        "hints": [],
        "vetoed": True,
        "error": None,
        "attempts": 1,
        "teacher_arrays": False,
    },
]

STEPS = [
    {
        "step": i + 1,
        "total": 8,
        "loss": 0.42 - 0.05 * i,
        "rl": 0.30 - 0.04 * i,
        "opd": 0.12 - 0.01 * i,
        "reward_mean": [0.0, 0.5, -0.5, 1.0, 0.5][i],
        "rl_clip_frac": [0.0, 0.02, 0.05, 0.04, 0.03][i],
        "opd_clip_frac": [0.0, 0.01, 0.01, 0.02, 0.02][i],
        "ratio_mean": 1.0 + 0.01 * i,
        "grad_norm": 0.8 - 0.1 * i,
        "n_samples": 2,
        "seconds": 6.0,
        "tokens": 64,
    }
    for i in range(5)
]
TRAINING = {
    "state": "running",
    "job_id": A3,
    "phase": "train",
    "step": 5,
    "total": 8,
    "prepared": 6,
    "samples": 6,
    "metrics": STEPS[-1],
    "blas": "openblas",
    "started_at": T0,
    "reason": "running",
    "result": {"adapter_id": A2, "gate": {"gain": 0.0132, "kl_to_base": 0.0041}, "promoted": True},
}
HISTORY = {"job_id": A3, "source": "live", "steps": STEPS}

ADAPTERS = {
    "active": A2,
    "adapters": [
        {
            "id": A2,
            "parent_id": A1,
            "previous_id": A1,
            "status": "active",
            "created_at": T0 + 86400,
            "signals": [TURNS[0], TURNS[2]],
            "holdout": [TURNS[3]],
            "note": None,
            "forgotten": False,
            "model": "gemma3-270m",
            "gate": {"passed": True, "gain": 0.0132, "kl_to_base": 0.0041, "kl_bound": 0.05, "judged_on": "holdout"},
        },
        {
            "id": A1,
            "parent_id": None,
            "previous_id": None,
            "status": "retired",
            "created_at": T0,
            "signals": [TURNS[2]],
            "holdout": [],
            "note": f"replaced by {A2}",
            "forgotten": False,
            "model": "gemma3-270m",
            "gate": {"passed": True, "gain": 0.0071, "kl_to_base": 0.0020, "kl_bound": 0.05, "judged_on": "train"},
        },
        {
            "id": "ad-20251231-031200-0e0e",
            "parent_id": None,
            "previous_id": None,
            "status": "rejected",
            "created_at": T0 - 86400,
            "signals": [TURNS[3]],
            "holdout": [],
            "note": "failed the eval gate",
            "forgotten": False,
            "model": "gemma3-270m",
            "gate": {"passed": False, "gain": -0.0040, "kl_to_base": 0.0012, "kl_bound": 0.05, "judged_on": "train"},
        },
    ],
}
ADAPTER_SIGNALS = {
    A2: [
        {
            "turn_id": TURNS[0],
            "held_out": False,
            "missing": False,
            "prompt": "What is the capital of France?",
            "response": R1,
            "reward": -1,
            "hint": "Answer with just the name.",
            "vetoed": False,
        },
        {
            "turn_id": TURNS[2],
            "held_out": False,
            "missing": False,
            "prompt": "A quick pancake recipe",
            "response": "Mix flour, eggs and milk…",
            "reward": 1,
            "hint": None,
            "vetoed": False,
        },
        {
            "turn_id": TURNS[3],
            "held_out": True,
            "missing": False,
            "prompt": "Write a haiku about rain",
            "response": "Rain falls on the roof",
            "reward": -1,
            "hint": None,
            "vetoed": True,
        },
    ]
}
COMPARE = {
    A2: {
        "adapter_id": A2,
        "parent_id": A1,
        "max_tokens": 96,
        "columns": [
            {"name": "base", "adapter": None},
            {"name": "previous", "adapter": A1},
            {"name": "this", "adapter": A2},
        ],
        "prompts": [
            {
                "turn_id": TURNS[0],
                "prompt": "What is the capital of France?",
                "logged": R1,
                "answers": {
                    "base": "The capital of France is Paris. It is also the largest city…",
                    "previous": "The capital of France is Paris.",
                    "this": "Paris.",
                },
            },
            {
                "turn_id": TURNS[2],
                "prompt": "A quick pancake recipe",
                "logged": "",
                "answers": {
                    "base": "Pancakes are a type of flat cake…",
                    "previous": "Mix flour, eggs and milk; fry.",
                    "this": "Mix 1 cup flour, 1 egg, 1 cup milk; fry 2 min a side.",
                },
            },
        ],
    }
}


def _route(request: httpx.Request):
    path, method = request.url.path, request.method
    fixed = {
        ("GET", "/clawd/health"): {"status": "ok"},
        ("GET", "/clawd/status"): STATUS,
        ("GET", "/clawd/sessions"): SESSIONS,
        ("GET", "/clawd/signals"): SIGNALS,
        ("GET", "/clawd/training"): TRAINING,
        ("GET", "/clawd/training/history"): HISTORY,
        ("GET", "/clawd/adapters"): ADAPTERS,
    }
    if (method, path) in fixed:
        return fixed[method, path]
    parts = path.strip("/").split("/")
    if method == "GET" and parts[:2] == ["clawd", "sessions"] and parts[-1] == "turns":
        return SESSION_TURNS.get(parts[2], [])
    if method == "GET" and parts[:2] == ["clawd", "turns"]:
        return TURN_BY_ID.get(parts[2])
    if method == "GET" and parts[:2] == ["clawd", "adapters"] and parts[-1] == "signals":
        return {"adapter_id": parts[2], "signals": ADAPTER_SIGNALS.get(parts[2], [])}
    if method == "POST" and parts[:2] == ["clawd", "adapters"] and parts[-1] == "compare":
        return COMPARE.get(parts[2])
    return None


def fixed_transport() -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        body = _route(request)
        if body is None:
            return httpx.Response(
                404,
                json={
                    "error": {
                        "message": f"no fixture for {request.method} {request.url.path}",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                },
            )
        return httpx.Response(200, content=json.dumps(body).encode(), headers={"content-type": "application/json"})

    return httpx.MockTransport(handler)


def fixed_client() -> DaemonClient:
    return DaemonClient("http://127.0.0.1:8757", transport=fixed_transport())


async def settle(pilot) -> None:
    """Until the app's workers (and what they started) are done and the screen is drawn."""
    from textual.worker import WorkerCancelled

    for _ in range(4):
        try:
            await pilot.app.workers.wait_for_complete()
        except WorkerCancelled:  # an exclusive worker replaced by a newer one: wait for that
            pass
        await pilot.pause()


async def show_chat(pilot) -> None:
    await settle(pilot)
    pilot.app.screen.open_session("s-capitals")
    await settle(pilot)
    await pilot.press("shift+tab")  # the last reply: its keys show in the footer
    await settle(pilot)


async def show_learning(pilot) -> None:
    await pilot.app.switch_mode("learning")
    await settle(pilot)


async def show_training(pilot) -> None:
    await pilot.app.switch_mode("training")
    await settle(pilot)


async def show_adapters(pilot) -> None:
    await pilot.app.switch_mode("adapters")
    await settle(pilot)
    await pilot.press("g")  # side-by-side answers
    await settle(pilot)


async def show_rollback_modal(pilot) -> None:
    await show_adapters(pilot)
    await pilot.press("b")
    await settle(pilot)


SCREENS = {
    "chat": show_chat,
    "learning": show_learning,
    "training": show_training,
    "adapters": show_adapters,
    "rollback": show_rollback_modal,
}
