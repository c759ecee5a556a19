"""`python -m tests.slow_tokenizer_daemon`: a real daemon in a process of its own (so the
test's client threads do not share its interpreter lock), on the fake engine made to
tokenize as slowly as llama.cpp does a long prompt. CLAWD_* settings come from the
environment; prints `ready URL` once it listens. Used by tests/test_big_inputs.py."""

from __future__ import annotations

import asyncio
import os
import time

from clawd import daemon
from clawd.config import load_settings
from clawd.engines import fake
from clawd.paths import ensure_dirs, resolve_paths

MB = 1024 * 1024


class SlowTokenizer(fake.Engine):
    """Holds the calling thread about 1 s per MB of text, as llama.cpp's tokenizer does for
    a long prompt: called on the event loop, it would stall every other request."""

    def tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        time.sleep(len(text) / MB)
        return super().tokenize(text, add_bos=add_bos, special=special)

    def _intended(self, prompt_ids, adapter):
        # The fake reads its reply off the prompt in Python, holding the interpreter lock
        # for a 900k-token prompt as llama.cpp's C++ never does: only the tail matters.
        return super()._intended(prompt_ids[-256:], adapter)


def main() -> None:
    env = dict(os.environ)
    paths = resolve_paths(env)
    ensure_dirs(paths)
    settings = load_settings(paths.config_file, env)

    def ready(state, _server):
        print(f"ready http://127.0.0.1:{state.port}", flush=True)

    # n_ctx big enough that a ~0.9 MB prompt fits (the cheap 64-chars-per-token check passes).
    asyncio.run(daemon.serve(settings, paths, SlowTokenizer(n_ctx=2_000_000), on_ready=ready))


if __name__ == "__main__":
    main()
