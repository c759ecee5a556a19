"""A fast BLAS for MLX on Linux CPU, switched on before mlx is imported.

Boundary: the only module that knows about the BLAS shim. The mlx-cpu wheel for Linux links a
reference BLAS (~3 GFLOP/s fp32; a 256-token LoRA step ~117 s, STACK.md). `enable()` compiles
a tiny shim (blas_shim.c) that forwards cblas_{s,d,c}gemm to scipy-openblas32 (a dependency on
Linux), caches it, and loads it RTLD_GLOBAL so its symbols win over the bundled BLAS when
libmlx is loaded. It must run in a process before its first `import mlx`: the trainer child
and the training benchmark call it first thing. macOS needs none of this (Accelerate/Metal).

`python -m clawd.training.blas CACHE_DIR [--stock]` prints what was chosen and the measured
matmul GFLOP/s as JSON; `clawd doctor` runs it in a child process.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SHIM_SOURCE = Path(__file__).with_name("blas_shim.c")


@dataclass(frozen=True)
class BlasChoice:
    name: str  # "openblas" | "accelerate" | "stock"
    detail: str  # where it came from, or why the fast one is not used


def _openblas_lib() -> Path | None:
    try:
        import scipy_openblas32
    except ImportError:
        return None
    lib = Path(scipy_openblas32.get_lib_dir()) / f"lib{scipy_openblas32.get_library()}.so"
    return lib if lib.exists() else None


def _build_shim(lib: Path, cache_dir: Path) -> Path:
    """Compile the shim once per (source, OpenBLAS build); return the cached .so path."""
    st = lib.stat()
    key = hashlib.sha256(SHIM_SOURCE.read_bytes() + f"{lib}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    out = cache_dir / "blas" / f"shim-{key[:16]}.so"
    if out.exists():
        return out
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc/clang) on PATH to build the BLAS shim; install gcc")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        cmd = [
            cc,
            "-O2",
            "-shared",
            "-fPIC",
            str(SHIM_SOURCE),
            "-o",
            str(tmp_so),
            f"-L{lib.parent}",
            f"-l:{lib.name}",
            f"-Wl,-rpath,{lib.parent}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the BLAS shim failed: {proc.stderr.strip()[:300]}")
        os.replace(tmp_so, out)  # atomic: a concurrent trainer sees the whole file or none
    return out


def enable(cache_dir: Path, *, stock: bool = False) -> BlasChoice:
    """Route MLX's matmuls to the fastest BLAS available. Call before `import mlx`.

    Args:
        cache_dir: where the compiled shim is kept (clawd's cache dir).
        stock: keep the wheel's own BLAS (benchmarks compare against it).
    Returns:
        What MLX will use, with a one-line reason. Never raises: a failure to build the
        shim leaves the stock BLAS (slow, but correct) and says why.
    """
    if sys.platform == "darwin":
        return BlasChoice("accelerate", "macOS: MLX uses Accelerate / Metal")
    if stock:
        return BlasChoice("stock", "the mlx-cpu wheel's reference BLAS (asked for)")
    if "mlx.core" in sys.modules:
        return BlasChoice("stock", "mlx was imported before the BLAS shim could be loaded")
    lib = _openblas_lib()
    if lib is None:
        return BlasChoice("stock", "scipy-openblas32 is not installed (pip install scipy-openblas32)")
    try:
        shim = _build_shim(lib, Path(cache_dir))
        ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
    except (OSError, RuntimeError) as e:
        return BlasChoice("stock", str(e))
    return BlasChoice("openblas", f"scipy-openblas32 {lib.name} via {shim}")


def matmul_gflops(n: int = 512, repeats: int = 5) -> float:
    """fp32 n×n matmul throughput as MLX sees it (imports mlx)."""
    import mlx.core as mx

    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a @ b)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    choice = enable(Path(args[0]), stock="--stock" in args)
    print(json.dumps({**asdict(choice), "gflops": round(matmul_gflops(), 1)}))


if __name__ == "__main__":
    main()
