"""The adapter registry: register, promote (hot-swap + live check), roll back, retire, export.

Boundary: decides which adapter the served model wears. Rows are written by
store/adapters.py; files are written by the trainer child (adapters/<id>/: mlx-lm files,
meta.json, and adapter.gguf when the base is a GGUF file) and read here. The engine is
handed adapter.gguf on a GGUF base (llama.cpp loads it; the mlx engine loads the mlx-lm files
beside it) and the directory on an MLX/HF model directory base (mlx only). The database row marked active is the truth:
a swap first loads and verifies the adapter in the engine, then commits the row, then
switches what new requests use — so a crash at any point leaves the old or the new adapter
active, and start-up (`restore`) loads and re-verifies whichever the row names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np

from clawd.errors import AdapterError, ClawdError, Conflict, NotFound
from clawd.served import ServedModel
from clawd.store import adapters as rows
from clawd.store import signals
from clawd.store.db import Database

log = logging.getLogger(__name__)

MLX_BASE_DIR = "base"  # an mlx export of a GGUF-based adapter: OUT/ (adapter files) + OUT/base/ (the model)
MLX_LM_PROMPT = "The capital of France is"


def mlx_lm_command(model: Path, adapter: Path) -> str:
    """The mlx-lm command that runs an exported adapter on its base (README shows the same one)."""
    return (
        f"mlx_lm.generate --model {shlex.quote(str(model))} --adapter-path {shlex.quote(str(adapter))} "
        f'--prompt "{MLX_LM_PROMPT}"'
    )


def live_check(probe: dict, served_delta: np.ndarray) -> tuple[bool, dict]:
    """Does the served adapter move the probe's log-probs the way the MLX model predicted?

    A silent no-op adapter (wrong scale, tensors ignored) is the usual failure (CONVENTIONS
    §7.5), so the served Δ must be non-zero and track the trainer's Δ per token.
    """
    mlx_delta = np.asarray(probe["delta"], dtype=np.float64)
    served = np.asarray(served_delta, dtype=np.float64)
    err = float(np.abs(served - mlx_delta).mean())
    size = float(np.abs(mlx_delta).mean())
    corr = float(np.corrcoef(served, mlx_delta)[0, 1]) if served.std() > 0 and mlx_delta.std() > 0 else 0.0
    moved = float(np.abs(served).max()) > 1e-4
    ok = moved and (corr >= 0.5 or err <= 0.02 + 0.25 * size)
    return ok, {
        "served_mean_abs": float(np.abs(served).mean()),
        "mlx_mean_abs": size,
        "mean_abs_err": err,
        "corr": corr,
    }


def _gate_note(gate: dict) -> str:
    why = "; ".join(gate.get("refused") or [])  # a trainer before the reasons were kept gives none
    return "failed the eval gate" + (f": {why}" if why else "")


def served_artifact(path: Path, base_model: Path) -> Path:
    """What the engine loads from adapter dir `path`: on an MLX/HF directory base the mlx-lm
    adapter dir itself (no GGUF base to pair a GGUF LoRA with), else its adapter.gguf."""
    return path if Path(base_model).is_dir() else path / "adapter.gguf"


def check_files(path: Path, base_model: Path) -> list[str]:
    """Every problem with an adapter dir, as sentences (empty = fine). It reads the base model's
    header, which takes seconds on a big vocabulary: callers on the event loop run it in a thread,
    so promotion never stalls the API."""
    from clawd.training.export import check_gguf_lora, check_mlx_lora

    if not (path / "meta.json").is_file():
        return [f"{path} has no meta.json (not a clawd adapter, or half-written)"]
    if Path(base_model).is_dir():
        return check_mlx_lora(path, base_model)
    if not (path / "adapter.gguf").is_file():
        return [f"{path} has no adapter.gguf"]
    return check_gguf_lora(path / "adapter.gguf", base_model)


class Registry:
    def __init__(
        self,
        db: Database,
        model: ServedModel,
        adapters_dir: Path,
        base_model: Path,
        *,
        cache_dir: Path | None = None,
        python: str = sys.executable,
    ):
        self.db = db
        self.model = model
        self.dir = adapters_dir
        self.base_model = base_model
        self.cache_dir = cache_dir  # the trainer's dequantized weights: an mlx export reuses them
        self.python = python
        # Activate, rollback and retire read then write the active row: one at a time, or a
        # promotion racing a user's rollback could record the wrong rollback target.
        self._switching = asyncio.Lock()

    @property
    def active_id(self) -> str | None:
        """What new requests wear: the served model's adapter, which only this registry sets."""
        return self.model.active_adapter

    @active_id.setter
    def active_id(self, adapter_id: str | None) -> None:
        self.model.active_adapter = adapter_id

    @property
    def engine(self):
        return self.model.engine

    async def restore(self) -> None:
        """At start-up: drop half-written dirs, register finished-but-unrecorded ones, and
        put the recorded active adapter back on (verified), else fall back to its rollback
        target."""
        for tmp in self.dir.glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        known = {r.id for r in await rows.list_all(self.db)}
        stranded = []
        for d in sorted(p for p in self.dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if d.name not in known and (d / "meta.json").is_file():
                try:
                    stranded.append(await self.register(d))
                except AdapterError as e:
                    log.warning("adapter %s not registered: %s", d.name, e)
        rec = await rows.active(self.db)
        if rec is not None and rec.model != self.model.model_id:
            log.warning(
                "adapter %s is for %s, but %s is served: serving the base model", rec.id, rec.model, self.model.model_id
            )
            await rows.activate(self.db, None, previous_id=None, note=f"the served model is now {self.model.model_id}")
            rec = None
        # Put the active adapter back on, verified; one that fails falls back down its rollback chain.
        while rec is not None:
            try:
                await self._swap_in(rec)
                self.active_id = rec.id
                break
            except AdapterError as e:
                log.error("active adapter %s failed its check at start-up (%s); rolling back", rec.id, e)
                await rows.set_status(self.db, rec.id, "rejected", f"failed the live check at start-up: {e}")
                prev = await rows.get(self.db, rec.previous_id) if rec.previous_id else None
                if prev is not None and (prev.forgotten or prev.model != self.model.model_id):
                    prev = None
                await rows.activate(
                    self.db, prev.id if prev else None, previous_id=prev.previous_id if prev else None, note=None
                )
                rec = prev
        # The daemon died between the trainer finishing and the promotion: finish the promotion.
        for cand in stranded:
            if cand.status == "candidate" and cand.parent_id == self.active_id:
                try:
                    await self.activate(cand.id)
                except AdapterError as e:
                    log.warning("adapter %s was not promoted at start-up: %s", cand.id, e)

    async def register(self, path: Path) -> rows.AdapterRecord:
        """Record a finished trainer output as candidate (or rejected, if its gate failed)."""
        problems = await asyncio.to_thread(check_files, path, self.base_model)
        if problems:
            raise AdapterError(f"adapter {path.name} refused: " + "; ".join(problems))
        try:
            meta = json.loads((path / "meta.json").read_text())
            adapter_id, model = meta["id"], meta["model"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise AdapterError(f"adapter {path.name} refused: unreadable meta.json ({e!r})") from e
        gate = meta.get("gate", {})
        rec = rows.AdapterRecord(
            id=adapter_id,
            path=str(path),
            model=model,
            parent_id=meta.get("parent_id"),
            signals=meta.get("signals", []),
            holdout=meta.get("holdout", []),
            metrics=meta.get("metrics", {}),
            gate=gate,
            status="candidate" if gate.get("passed") else "rejected",
            note=None if gate.get("passed") else _gate_note(gate),
            created_at=meta.get("created_at", 0.0),
        )
        if await rows.get(self.db, rec.id) is None:
            await rows.insert(self.db, rec)
        return await rows.get(self.db, rec.id)

    async def get(self, adapter_id: str) -> rows.AdapterRecord:
        rec = await rows.get(self.db, adapter_id)
        if rec is None:
            raise NotFound(f"no adapter {adapter_id!r}: see `clawd adapters list`")
        return rec

    async def activate(self, adapter_id: str | None) -> rows.AdapterRecord | None:
        """Hot-swap `adapter_id` in (None = the base model), verified live; the adapter that
        was active stays on disk, retired, as the new one's rollback target."""
        async with self._switching:
            current = await rows.active(self.db)
            if adapter_id is not None:
                await self._usable(adapter_id)
            if (current.id if current else None) == adapter_id:
                return current
            await self._activate(
                adapter_id,
                previous_id=current.id if current else None,
                note=f"replaced by {adapter_id or 'the base model'}",
            )
            return await rows.get(self.db, adapter_id) if adapter_id else None

    async def rollback(self) -> rows.AdapterRecord | None:
        """Back to what was active before the current adapter (instant: it is kept loaded)."""
        async with self._switching:
            current = await rows.active(self.db)
            if current is None:
                raise AdapterError("no adapter is active: the base model is already served")
            target = current.previous_id
            prev = await rows.get(self.db, target) if target else None
            if prev is not None and prev.forgotten:
                target, prev = None, None
            await self._activate(
                target,
                previous_id=prev.previous_id if prev else None,
                note=f"rolled back to {target or 'the base model'}",
            )
            return prev

    async def _activate(self, adapter_id: str | None, *, previous_id: str | None, note: str | None) -> None:
        if adapter_id is not None:
            rec = await self.get(adapter_id)
            try:
                check = await self._swap_in(rec)
            except AdapterError as e:
                await rows.set_status(self.db, adapter_id, "rejected", str(e))
                raise
            await rows.set_gate(self.db, rec.id, dict(rec.gate, live_check=check))
        await rows.activate(self.db, adapter_id, previous_id=previous_id, note=note)
        self.active_id = adapter_id

    async def ensure_loaded(self, adapter_id: str) -> rows.AdapterRecord:
        """Load an adapter into the engine without activating it (to compare answers)."""
        rec = await self._usable(adapter_id)
        await self._load(rec)
        return rec

    async def _usable(self, adapter_id: str) -> rows.AdapterRecord:
        """The adapter's record, if it still has weights and fits the served model."""
        rec = await self.get(adapter_id)
        if rec.forgotten:
            raise AdapterError(f"adapter {adapter_id} was trained on a forgotten session; its weights are deleted")
        if rec.model != self.model.model_id:
            raise AdapterError(f"adapter {adapter_id} is for model {rec.model}, but {self.model.model_id} is served")
        return rec

    async def _load(self, rec: rows.AdapterRecord) -> None:
        """Check the adapter's files against the served model and load them (if not yet)."""
        path = Path(rec.path)
        problems = await asyncio.to_thread(check_files, path, self.base_model)
        if problems:
            raise AdapterError(f"adapter {rec.id} refused: " + "; ".join(problems))
        if rec.id not in self.engine.loaded_adapters:
            await self.model.runner.call(self.engine.load_adapter, rec.id, served_artifact(path, self.base_model))

    async def _swap_in(self, rec: rows.AdapterRecord) -> dict:
        """Load the adapter into the engine (if not yet) and prove it is live."""
        await self._load(rec)
        runner = self.model.runner
        path = Path(rec.path)
        try:
            probe = json.loads((path / "meta.json").read_text())["probe"]
            p, t = probe["prompt_ids"], probe["response_ids"]
            with_adapter = await runner.call(self.engine.score, p, t, adapter=rec.id)
            base = await runner.call(self.engine.score, p, t, adapter=None)
        except (OSError, ValueError, KeyError, TypeError, ClawdError) as e:
            await runner.call(self.engine.unload_adapter, rec.id)
            raise AdapterError(f"adapter {rec.id} cannot be checked live: its probe is unusable ({e})") from e
        ok, check = live_check(probe, with_adapter.logprobs - base.logprobs)
        if not ok:
            await runner.call(self.engine.unload_adapter, rec.id)
            raise AdapterError(
                f"adapter {rec.id} failed the live check: the served log-probs do not move as "
                f"the trainer predicted ({check}); it was not activated"
            )
        return check

    async def retire_forgotten(self) -> list[str]:
        """Retire, for good, every adapter trained on a forgotten turn and every adapter
        continued from one; delete their weights. The active one falls back to the nearest
        clean ancestor (or the base model)."""
        async with self._switching:
            gone = await signals.forgotten_turns(self.db)
            all_rows = await rows.list_all(self.db)
            tainted = {r.id for r in all_rows if not r.forgotten and gone.intersection(r.signals)}
            changed = True
            while changed:  # descendants carry the parent's weights
                new = {r.id for r in all_rows if r.parent_id in tainted and r.id not in tainted and not r.forgotten}
                changed = bool(new)
                tainted |= new
            if not tainted:
                return []
            current = await rows.active(self.db)
            if current is not None and current.id in tainted:
                by_id = {r.id: r for r in all_rows}
                target = current.parent_id
                while target is not None and target in tainted:
                    target = by_id[target].parent_id if target in by_id else None
                await self._activate(target, previous_id=None, note="trained on a forgotten session")
            await rows.mark_forgotten(self.db, sorted(tainted), "trained on a forgotten session; weights deleted")
            for a in tainted:
                if a in self.engine.loaded_adapters:
                    await self.model.runner.call(self.engine.unload_adapter, a)
                shutil.rmtree(self.dir / a, ignore_errors=True)
            return sorted(tainted)

    async def export(
        self, adapter_id: str, fmt: str | None, out: Path, *, force: bool = False
    ) -> tuple[str, Path, Path | None]:
        """Copy an adapter out as mlx (mlx-lm dir), gguf (one file) or peft (dir); no format:
        gguf where the adapter has one (a GGUF base), else mlx. An existing `out` is replaced
        only with `force` (else Conflict). Written beside `out` first, then renamed into
        place, so a failed export leaves nothing under the name. Returns (format, path, mlx_model):
        for mlx, the model folder mlx-lm runs it on (the served MLX directory itself, or the GGUF
        base written as one into path/base), else None."""
        rec = await self.get(adapter_id)
        src = Path(rec.path)
        if rec.forgotten or not src.is_dir():
            raise AdapterError(f"adapter {adapter_id} has no files left to export")
        has_gguf = (src / "adapter.gguf").is_file()
        fmt = fmt or ("gguf" if has_gguf else "mlx")
        if fmt not in ("gguf", "mlx", "peft"):
            raise AdapterError(f"unknown export format {fmt!r}: use mlx, gguf or peft")
        if fmt == "gguf" and not has_gguf:
            raise AdapterError(
                f"adapter {adapter_id} has no GGUF form (an adapter trained on an MLX model directory "
                "has none): export it with --format mlx or --format peft (llama.cpp's "
                "convert_lora_to_gguf.py turns PEFT into GGUF)"
            )
        out = Path(out)
        if (out.exists() or out.is_symlink()) and not force:
            raise Conflict(f"{out.name} exists already: export under another name, or overwrite it with force")
        try:
            await asyncio.to_thread(_write_export, src, fmt, out, rec.model)
        except OSError as e:
            raise AdapterError(
                f"could not export {adapter_id} to {out}: {e.strerror or e}; pick a writable path"
            ) from e
        mlx_model = None
        if fmt == "mlx":
            base = Path(self.base_model)
            mlx_model = base if base.is_dir() else out / MLX_BASE_DIR
            if not base.is_dir():
                await self._write_mlx_base(mlx_model)
        return fmt, out, mlx_model

    async def _write_mlx_base(self, target: Path) -> None:
        """The GGUF base as an mlx-lm model folder at `target`, written by a child process
        (training/mlx_model_dir.py): it holds the whole model in float32 for a moment, which
        must not land in the daemon's memory, and the event loop keeps serving meanwhile."""
        argv = [self.python, "-m", "clawd.training.mlx_model_dir", str(self.base_model), str(target)]
        if self.cache_dir is not None:
            argv += ["--cache", str(self.cache_dir)]
        # transformers warns that torch is missing (only its tokenizer converter is used)
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            lines = [ln for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit status {proc.returncode}"
            raise AdapterError(
                f"the adapter files are in {target.parent}, but the base model could not be written "
                f"as an mlx-lm folder: {why}"
            )


def _write_export(src: Path, fmt: str, out: Path, base_model: str) -> None:
    """Write the export to a hidden name beside `out`, then swap it in (an existing `out`,
    file, folder or link, is removed, never followed)."""
    out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
    try:
        if fmt == "gguf":
            shutil.copyfile(src / "adapter.gguf", tmp)
        elif fmt == "mlx":
            tmp.mkdir(mode=0o700)
            for name in ("adapters.safetensors", "adapter_config.json"):
                shutil.copyfile(src / name, tmp / name)
        else:
            from clawd.training.export import mlx_to_peft

            mlx_to_peft(src, tmp, base_model=base_model)
        if out.is_symlink() or out.is_file():
            out.unlink()
        elif out.is_dir():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
