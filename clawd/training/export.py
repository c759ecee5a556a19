"""LoRA adapter files: mlx-lm's directory format, and exports to GGUF (llama.cpp) and PEFT.

Boundary: the trainer keeps adapters as mlx-lm adapter directories (CONVENTIONS §6); this
module writes them, loads them back onto a model, converts them to the GGUF LoRA file clawd
serves (§4) and to a PEFT directory (§5), and checks an adapter against its base model before
an engine sees it: a GGUF LoRA against a base GGUF, an mlx-lm directory against an MLX/HF
model directory. Every file is written to a temporary name and renamed into place.

Layouts (§7): mlx `lora_a` (in, r), `lora_b` (r, out), `y += scale · x A B`; GGUF and PEFT
store A as (r, in) and B as (out, r) with alpha = scale · r. Llama's q/k rows are permuted in
GGUF (weights.permute_rows), so B's output rows get the same permutation there.

The daemon calls `check_gguf_lora` / `check_mlx_lora` (and `mlx_to_peft` on export), so mlx and
mlx-lm are imported only inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from clawd.errors import AdapterError
from clawd.modelfile import open_gguf

if TYPE_CHECKING:
    from clawd.training.weights import LoadedModel

ADAPTER_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
_LORA_LEAVES = ("lora_a", "lora_b")


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")


def _save_safetensors(path: Path, arrays: dict, metadata: dict | None = None) -> None:
    import mlx.core as mx

    tmp = _tmp(path)  # ends in .safetensors, so mlx keeps the name as given
    mx.save_safetensors(str(tmp), {k: mx.array(v) for k, v in arrays.items()}, metadata=metadata or {})
    os.replace(tmp, path)


def _write_json(path: Path, obj: dict) -> None:
    tmp = _tmp(path)
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


# ---- mlx-lm adapter directory ---------------------------------------------------------------


def save_mlx_adapter(
    model, out_dir: Path, *, rank: int, scale: float, num_layers: int, keys: list[str], extra: dict | None = None
) -> None:
    """adapters.safetensors (the lora_a / lora_b arrays only) + adapter_config.json, as mlx-lm
    writes them, so `mlx_lm.tuner.utils.load_adapters` and `mlx_lm.server` read the directory."""
    from mlx.utils import tree_flatten

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    params = {k: v for k, v in tree_flatten(model.parameters()) if k.rsplit(".", 1)[-1] in _LORA_LEAVES}
    if not params:
        raise AdapterError("the model has no LoRA layers to save: attach LoRA before training")
    config = {
        **(extra or {}),
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)},
    }
    _save_safetensors(out_dir / ADAPTER_FILE, params)
    _write_json(out_dir / CONFIG_FILE, config)


def _read_mlx_adapter(adapter_dir: Path) -> tuple[dict, dict]:
    import mlx.core as mx

    adapter_dir = Path(adapter_dir)
    try:
        config = json.loads((adapter_dir / CONFIG_FILE).read_text())
        weights = mx.load(str(adapter_dir / ADAPTER_FILE))
    except (OSError, ValueError, RuntimeError) as e:
        raise AdapterError(
            f"{adapter_dir} is not a readable mlx-lm adapter directory ({e}); retrain the adapter"
        ) from e
    if config.get("fine_tune_type", "lora") != "lora":
        raise AdapterError(
            f"{adapter_dir}: fine_tune_type {config.get('fine_tune_type')!r} is not supported (plain LoRA only)"
        )
    return config, weights


def load_mlx_adapter(model, adapter_dir: Path) -> dict:
    """Attach LoRA as adapter_config.json says and load its weights; return the config.
    Raises AdapterError naming every tensor that is missing, unexpected or the wrong shape."""
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    config, weights = _read_mlx_adapter(adapter_dir)
    lp = config.get("lora_parameters") or {}
    try:
        linear_to_lora_layers(model, config["num_layers"], {"dropout": 0.0, **lp})
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise AdapterError(f"{adapter_dir}: adapter_config.json does not fit the model ({e})") from e
    expected = {k: v.shape for k, v in tree_flatten(model.parameters()) if k.rsplit(".", 1)[-1] in _LORA_LEAVES}
    problems = [f"{k}: not a LoRA parameter of the model" for k in sorted(weights.keys() - expected.keys())]
    problems += [f"{k}: missing from the adapter" for k in sorted(expected.keys() - weights.keys())]
    problems += [
        f"{k}: shape {tuple(weights[k].shape)} != model's {tuple(expected[k])}"
        for k in sorted(weights.keys() & expected.keys())
        if weights[k].shape != expected[k]
    ]
    if problems:
        raise AdapterError(f"adapter {adapter_dir} does not fit the model: " + "; ".join(problems))
    model.load_weights(list(weights.items()), strict=False)
    return config


def _pairs(weights: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """module path -> (lora_a (in, r), lora_b (r, out)) as float32 numpy."""
    out = {}
    for name in sorted(weights):
        module, _, leaf = name.rpartition(".")
        if leaf == "lora_a":
            if module + ".lora_b" not in weights:
                raise AdapterError(f"{module} has lora_a but no lora_b; retrain the adapter")
            out[module] = (np.array(weights[name], np.float32), np.array(weights[module + ".lora_b"], np.float32))
        elif leaf == "lora_b" and module + ".lora_a" not in weights:
            raise AdapterError(f"{module} has lora_b but no lora_a; retrain the adapter")
    return out


# ---- GGUF -------------------------------------------------------------------------------------


def mlx_to_gguf(adapter_dir: Path, lm: LoadedModel, out_path: Path) -> Path:
    """The GGUF LoRA llama.cpp loads at runtime on `lm`'s base GGUF (CONVENTIONS §4).
    Checked against the base file when `lm` came from one; raises AdapterError on a mismatch."""
    import gguf

    from clawd.training.weights import permute_rows

    config, weights = _read_mlx_adapter(adapter_dir)
    lp = config["lora_parameters"]
    rank, scale = int(lp["rank"]), float(lp["scale"])
    out_path = Path(out_path)
    tmp = _tmp(out_path)
    w = gguf.GGUFWriter(str(tmp), lm.arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    # llama.cpp applies alpha / r per tensor: alpha = scale · r reproduces mlx's direct scale
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, scale * rank)
    args = lm.model.args
    for module, (a, b) in _pairs(weights).items():
        if a.shape[1] != rank or b.shape[0] != rank:
            raise AdapterError(f"{module}: LoRA rank {a.shape[1]}/{b.shape[0]} != the config's {rank}")
        if module.endswith("embed_tokens"):
            raise AdapterError("LoRA on the token embedding cannot be exported to GGUF; train without it")
        base = lm.gguf_tensor_name(module)
        b_t = b.T  # (out, r)
        if lm.arch == "llama" and module.endswith(("q_proj", "k_proj")):
            b_t = permute_rows(b_t, args.num_attention_heads if module.endswith("q_proj") else args.num_key_value_heads)
        w.add_tensor(base + ".lora_a", np.ascontiguousarray(a.T))
        w.add_tensor(base + ".lora_b", np.ascontiguousarray(b_t))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if Path(lm.source).is_file():
            problems = check_gguf_lora(tmp, Path(lm.source))
            if problems:
                raise AdapterError(f"exported adapter does not fit {lm.source}: " + "; ".join(problems))
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def _str_field(reader, key: str) -> str | None:
    field = reader.get_field(key)
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) else None


def _open_gguf(path: Path):
    """GGUFReader, with every tensor's data inside the file (a truncated file fails here)."""
    reader = open_gguf(path)
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(f"tensor {t.name} runs past the end of the file (truncated)")
    return reader


def check_gguf_lora(adapter_path: Path, base_gguf: Path) -> list[str]:
    """Every reason llama.cpp would refuse (or silently mis-scale) this adapter on this base,
    each as one sentence; [] when it fits. Mirrors llama-adapter.cpp's checks."""
    adapter_path, base_gguf = Path(adapter_path), Path(base_gguf)
    try:
        reader = _open_gguf(adapter_path)
    except Exception as e:
        return [f"cannot read adapter {adapter_path}: {e}"]
    try:
        base = _open_gguf(base_gguf)
    except Exception as e:
        return [f"cannot read base model {base_gguf}: {e}"]
    problems = []
    kind = _str_field(reader, "general.type")
    if kind != "adapter":
        problems.append(f"{adapter_path.name} is not an adapter (general.type is {_said(kind)}, not 'adapter')")
    lora = _str_field(reader, "adapter.type")
    if lora != "lora":
        problems.append(f"{adapter_path.name} is not a LoRA adapter (adapter.type is {_said(lora)}, not 'lora')")
    arch, base_arch = _str_field(reader, "general.architecture"), _str_field(base, "general.architecture")
    if arch != base_arch:
        problems.append(f"architecture mismatch: the adapter is for {arch!r}, the base model is {base_arch!r}")
    if kind == "adapter" and lora == "lora" and reader.get_field("adapter.lora.alpha") is None:
        problems.append("adapter.lora.alpha is missing: llama.cpp would apply scale 1 instead of alpha / r")

    base_shapes = {t.name: tuple(int(n) for n in t.shape) for t in base.tensors}
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"(.+)\.(lora_a|lora_b)", t.name)
        if m:
            halves.setdefault(m.group(1), {})[m.group(2)] = tuple(int(n) for n in t.shape)
        elif not t.name.endswith("_norm.weight"):  # llama.cpp skips norms, refuses anything else
            problems.append(f"tensor {t.name} is neither a .lora_a nor a .lora_b")
    for name, (a, b) in _paired(halves, adapter_path.name, problems).items():  # ggml ne order
        if name not in base_shapes:
            problems.append(f"{name}: the base model has no such tensor (adapter built for another model?)")
            continue
        w = base_shapes[name]
        if name == "token_embd.weight":  # llama.cpp flips A and B for the embedding
            ok = len(w) == 2 and w[0] == b[1] and w[1] == a[1]
        else:
            ok = len(w) == 2 and w[0] == a[0] and w[1] == b[1]
        if not ok:
            problems.append(
                f"{name}: LoRA shapes A {_np_shape(a)} / B {_np_shape(b)} do not fit the base "
                f"tensor {_np_shape(w)} (numpy order; A must be (r, in), B (out, r))"
            )
        elif name != "token_embd.weight" and a[1] != b[0]:
            problems.append(f"{name}: rank disagreement, lora_a has rank {a[1]} but lora_b has {b[0]}")
    return problems


def _paired(
    halves: dict[str, dict[str, tuple[int, ...]]], what: str, problems: list[str]
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """name -> (lora_a shape, lora_b shape) for the complete pairs among `halves` (name -> leaf ->
    shape); a missing half, or no LoRA tensor at all in `what`, is added to `problems`."""
    if not halves:
        problems.append(f"{what} has no LoRA tensors")
    pairs = {}
    for name, pair in sorted(halves.items()):
        if len(pair) == 2:
            pairs[name] = (pair["lora_a"], pair["lora_b"])
        else:
            have, missing = ("lora_a", "lora_b") if "lora_a" in pair else ("lora_b", "lora_a")
            problems.append(f"{name} has {have} but no {missing}")
    return pairs


def safetensors_shapes(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from a safetensors file's JSON header, without reading the
    tensors (or importing mlx). Raises ValueError for a file that is not whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("too short to be a safetensors file")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError("its header runs past the end of the file (truncated, or not safetensors)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"its header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        try:
            end = int(t["data_offsets"][1])
            out[name] = (str(t["dtype"]), tuple(int(d) for d in t["shape"]))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"tensor {name} has a malformed header entry") from e
        if end > size - 8 - n:
            raise ValueError(f"tensor {name} runs past the end of the file (truncated)")
    return out


def _base_linears(base_dir: Path) -> dict[str, tuple[int, int]]:
    """module path -> (in, out) of every linear layer in an MLX/HF model directory, quantized
    ones included: a QuantizedLinear stores its weight packed 32 // bits per uint32, so
    in = columns · 32 / bits, with bits from config.json's mlx-lm `quantization` (per layer or global)."""
    config = json.loads((base_dir / "config.json").read_text())
    quant = config.get("quantization") or {}
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise ValueError("it has no *.safetensors weights")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        tensors.update(safetensors_shapes(f))
    out = {}
    for name, (_dtype, shape) in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) != 2 or module.endswith("embed_tokens"):
            continue  # an embedding is (vocab, d), not (out, in), and the mlx engine wears LoRA on linears only
        n_out, cols = shape
        if module + ".scales" in tensors:
            layer = quant.get(module) if isinstance(quant.get(module), dict) else quant
            bits = int(layer.get("bits", 0) or 0)
            if bits <= 0:
                continue  # quantized without a readable bit width: not a layer we can size
            cols = cols * 32 // bits
        out[module] = (cols, n_out)
    return out


def check_mlx_lora(adapter_dir: Path, base_dir: Path) -> list[str]:
    """Every reason the mlx engine would refuse this mlx-lm adapter directory on the MLX/HF
    model directory `base_dir`, or the config that would misdescribe it, each as one
    sentence; [] when it fits. Reads JSON and safetensors headers only (no mlx)."""
    adapter_dir, base_dir = Path(adapter_dir), Path(base_dir)
    problems = []
    rank = None
    keys: list[str] | None = None
    try:
        config = json.loads((adapter_dir / CONFIG_FILE).read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        problems.append(f"cannot read {CONFIG_FILE} in {adapter_dir} ({e})")
    else:
        kind = config.get("fine_tune_type", "lora")
        if kind != "lora":
            problems.append(f"fine_tune_type is {kind!r}, not 'lora' (only plain LoRA is served)")
        lp = config.get("lora_parameters")
        lp = lp if isinstance(lp, dict) else {}
        rank = lp.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            problems.append(f"{CONFIG_FILE} has no usable lora_parameters.rank (found {rank!r})")
            rank = None
        scale = lp.get("scale")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            problems.append(f"{CONFIG_FILE} has no usable lora_parameters.scale (found {scale!r})")
        keys = lp.get("keys") if isinstance(lp.get("keys"), list) else None
    try:
        weights = safetensors_shapes(adapter_dir / ADAPTER_FILE)
    except (OSError, ValueError) as e:
        return problems + [f"cannot read {ADAPTER_FILE} in {adapter_dir}: {e}"]
    try:
        base = _base_linears(base_dir)
    except (OSError, ValueError, AttributeError) as e:
        return problems + [f"cannot read base model {base_dir}: {e}"]

    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, (dtype, shape) in sorted(weights.items()):
        module, _, leaf = name.rpartition(".")
        if leaf not in _LORA_LEAVES:
            problems.append(f"tensor {name} is neither a .lora_a nor a .lora_b")
        elif dtype not in ("F32", "F16", "BF16"):
            problems.append(f"tensor {name} has dtype {dtype}, not a float type")
        else:
            halves.setdefault(module, {})[leaf] = shape
    for module, (a, b) in _paired(halves, ADAPTER_FILE, problems).items():
        dims = base.get(module)
        if dims is None:
            problems.append(f"{module}: the base model has no such linear layer (adapter built for another model?)")
            continue
        parts = module.split(".")
        block_key = ".".join(parts[3:]) if parts[:2] == ["model", "layers"] else module
        if keys is not None and block_key not in keys:
            problems.append(f"{module}: {block_key} is not among {CONFIG_FILE}'s lora_parameters.keys {keys}")
        if len(a) != 2 or len(b) != 2 or (a[0], b[1]) != dims:
            problems.append(
                f"{module}: LoRA shapes A {a} / B {b} do not fit the base layer (in, out) = {dims} "
                "(A must be (in, r), B (r, out))"
            )
        elif a[1] != b[0]:
            problems.append(f"{module}: rank disagreement, lora_a has rank {a[1]} but lora_b has {b[0]}")
        elif rank is not None and a[1] != rank:
            problems.append(f"{module}: rank {a[1]}, but {CONFIG_FILE} says lora_parameters.rank = {rank}")
    return problems


def _said(value: str | None) -> str:
    return "missing" if value is None else repr(value)


def _np_shape(ne: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(ne))


# ---- PEFT -------------------------------------------------------------------------------------


def mlx_to_peft(adapter_dir: Path, out_dir: Path, *, base_model: str) -> Path:
    """A PEFT LoRA directory (CONVENTIONS §5, §7 rule 1) with the same weights and scale.
    Names are HF module paths, which mlx-lm's are, so no permutation is needed here."""
    config, weights = _read_mlx_adapter(adapter_dir)
    lp = config["lora_parameters"]
    rank, scale = int(lp["rank"]), float(lp["scale"])
    tensors, layers = {}, set()
    for module, (a, b) in _pairs(weights).items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a.T)  # (r, in)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b.T)  # (out, r)
        m = re.search(r"\.layers\.(\d+)\.", module)
        if m:
            layers.add(int(m.group(1)))
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": scale * rank,
        "lora_dropout": float(lp.get("dropout", 0.0)),
        "bias": "none",
        "target_modules": sorted({k.rsplit(".", 1)[-1] for k in lp["keys"]}),
        "layers_to_transform": sorted(layers),
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
        "revision": None,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_safetensors(out_dir / "adapter_model.safetensors", tensors, {"format": "pt"})
    _write_json(out_dir / "adapter_config.json", peft_config)
    return out_dir
