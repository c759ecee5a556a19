"""Runtime LoRA for the mlx engine: adapters are swapped in place, never by reloading the model.

Boundary: reading mlx-lm adapter directories (what clawd's trainer writes: adapters.safetensors
+ adapter_config.json, clawd/training/export.py) and wearing them. mlx-lm itself attaches LoRA
by rebuilding layers (and its server reloads the model on an adapter change). Here each linear
layer an adapter touches is wrapped once in a `SwappableLoRA`; switching adapters only rebinds
its (lora_a, lora_b, scale), so a switch costs microseconds per layer. A wrapper with no
adapter returns its base layer's output untouched: the base model is bit-exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from clawd.errors import AdapterError
from clawd.training.export import ADAPTER_FILE, CONFIG_FILE


class SwappableLoRA(nn.Module):
    """A base linear layer plus at most one LoRA delta, bound from outside.
    `y = linear(x) + scale * (x @ A) @ B` in exactly mlx-lm LoRALinear's operation order, so
    outputs equal mlx-lm's own loader's bit for bit."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear
        # Kept out of parameters(): the model's weights never change, only this binding.
        object.__setattr__(self, "delta", None)

    def bind(self, delta: tuple[mx.array, mx.array, float] | None) -> None:
        object.__setattr__(self, "delta", delta)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        if self.delta is None:
            return y
        a, b, scale = self.delta
        return y + (scale * ((x @ a) @ b)).astype(x.dtype)


@dataclass(frozen=True)
class Adapter:
    source: Path
    scale: float
    deltas: dict[str, tuple[mx.array, mx.array]]  # module path -> (lora_a (in, r), lora_b (r, out))


def adapter_dir(path: Path) -> Path:
    """The adapter directory for `path`: the directory itself, or the one holding the file
    given (clawd's adapter registry names adapters/<id>/adapter.gguf, which sits beside the
    mlx-lm files)."""
    path = Path(path)
    if path.is_dir():
        return path
    if path.parent.is_dir() and (path.parent / ADAPTER_FILE).is_file():
        return path.parent
    raise AdapterError(
        f"adapter {path} does not exist (or has no {ADAPTER_FILE} beside it): check the "
        "adapter id, or retrain the adapter"
    )


def _dims(linear: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear or quantized linear layer."""
    out_dims, in_dims = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        in_dims = in_dims * 32 // linear.bits
    return in_dims, out_dims


class LoRASwitch:
    """Wraps the model's linear layers as adapters need them and binds one adapter at a time."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._wrapped: dict[str, SwappableLoRA] = {}
        self.bound: Adapter | None = None

    def read(self, path: Path) -> Adapter:
        """Read and check an adapter directory against the model; the model is not touched.
        Raises AdapterError naming every problem."""
        where = adapter_dir(path)
        try:
            config = json.loads((where / CONFIG_FILE).read_text())
            weights = mx.load(str(where / ADAPTER_FILE))
        except (OSError, ValueError, RuntimeError) as e:
            raise AdapterError(f"{path} is not a readable mlx-lm adapter directory ({e}); retrain the adapter") from e
        if not isinstance(config, dict):
            raise AdapterError(f"{where}: {CONFIG_FILE} is not a JSON object; retrain the adapter")
        kind = config.get("fine_tune_type", "lora")
        if kind != "lora":
            raise AdapterError(f"{where}: fine_tune_type {kind!r} cannot be swapped at runtime (plain LoRA only)")
        try:
            scale = float(config["lora_parameters"]["scale"])
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterError(f"{where}: adapter_config.json has no lora_parameters.scale") from e
        modules = dict(self._model.named_modules())
        deltas, problems = {}, []
        for name in sorted(weights):
            module, _, leaf = name.rpartition(".")
            if leaf not in ("lora_a", "lora_b"):
                problems.append(f"{name}: not a LoRA tensor")
                continue
            if leaf == "lora_b":
                if module + ".lora_a" not in weights:
                    problems.append(f"{module} has lora_b but no lora_a")
                continue
            a, b = weights[name], weights.get(module + ".lora_b")
            layer = modules.get(module)
            if isinstance(layer, SwappableLoRA):
                layer = layer.linear
            if b is None:
                problems.append(f"{module} has lora_a but no lora_b")
            elif not isinstance(layer, (nn.Linear, nn.QuantizedLinear)):
                problems.append(f"{module}: the model has no linear layer there")
            elif a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or (a.shape[0], b.shape[1]) != _dims(layer):
                problems.append(
                    f"{module}: LoRA shapes {tuple(a.shape)} / {tuple(b.shape)} do not fit the layer "
                    f"(in, out) = {_dims(layer)}"
                )
            else:
                deltas[module] = (a, b)
        if not deltas and not problems:
            problems.append("no LoRA tensors")
        if problems:
            raise AdapterError(f"adapter {where} does not fit the model: " + "; ".join(problems))
        mx.eval([d for pair in deltas.values() for d in pair])
        return Adapter(where, scale, deltas)

    def bind(self, adapter: Adapter | None) -> None:
        """Make `adapter` (or none) the one every wrapped layer applies."""
        if adapter is not None:
            self._wrap(adapter.deltas.keys())
        for path, layer in self._wrapped.items():
            pair = adapter.deltas.get(path) if adapter is not None else None
            layer.bind(None if pair is None else (*pair, adapter.scale))
        self.bound = adapter

    def _wrap(self, paths) -> None:
        new = [p for p in paths if p not in self._wrapped]
        if not new:
            return
        modules = dict(self._model.named_modules())
        wrappers = {p: SwappableLoRA(modules[p]) for p in new}
        self._model.update_modules(tree_unflatten(list(wrappers.items())))
        self._wrapped.update(wrappers)
