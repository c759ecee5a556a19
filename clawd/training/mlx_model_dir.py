"""A served GGUF base as an mlx-lm model folder, so an exported mlx adapter runs in mlx-lm.

Why: mlx-lm's `--adapter-path` needs `--model DIR` (config.json, *.safetensors, a Hugging Face
tokenizer), and a GGUF file is none of that. `clawd adapters export --format mlx` on a GGUF base
writes this folder beside the adapter files (adapters.py runs `python -m clawd.training.mlx_model_dir`
in a child, so the daemon never holds the weights).

The weights are the trainer's own (weights.read_gguf_weights: dequantized bit-exact with ggml,
llama's q/k rows un-permuted, Gemma's norms un-folded, from the trainer's cache when it has
them), stored as bfloat16: half the float32 size, and Gemma's activations overflow float16.
The tokenizer is rebuilt from the GGUF's vocabulary by transformers' own GGUF converter and then
checked against llama.cpp's tokenizer on probe texts, so mlx-lm sees the same token ids the
adapter was trained on, or the export fails saying so.

Usage: python -m clawd.training.mlx_model_dir SOURCE.gguf OUT_DIR [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from clawd.errors import ClawdError, ModelLoadError

DTYPE = "bfloat16"
MODEL_FILE = "model.safetensors"
# Texts whose ids must match llama.cpp's: spaces, newlines, digits, non-Latin scripts and an emoji
# are where a rebuilt tokenizer goes wrong first.
PROBES = (
    "Hello world, the capital of France is Paris.",
    "  two  spaces\n\nand newlines\ttab",
    "émoji 🎉 中文 1234567 ünïcödé",
    "def f(x):\n    return x ** 2  # square",
)


def _value(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _hf_tokenizer(reader, arch: str):
    """transformers' tokenizer for the GGUF's vocabulary (the same converter `from_pretrained(...,
    gguf_file=...)` uses; called directly because that entry point requires torch)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        add_gguf_special_tokens,
        select_tokenizer_builder,
        set_split_regex,
    )

    def group(name: str) -> dict:
        keys = GGUF_TOKENIZER_MAPPING[name].items()
        return {to: _value(reader, f"tokenizer.{key}") for key, to in keys if reader.get_field(f"tokenizer.{key}")}

    spec, config = group("tokenizer"), group("tokenizer_config")
    if not spec.get("tokens"):
        raise ModelLoadError("the GGUF has no tokenizer.ggml.tokens: its tokenizer cannot be rebuilt")
    try:
        tok = select_tokenizer_builder(arch, spec.get("tokenizer_type"))(spec)
    except ValueError as e:
        raise ModelLoadError(f"cannot rebuild the GGUF's tokenizer for mlx-lm: {e}") from e
    tok = set_split_regex(add_gguf_special_tokens(tok, spec), spec)
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unk_token_id"),
        ("pad", "pad_token_id"),
    ):
        if spec.get(key) is not None and spec[key] < len(spec["tokens"]):
            setattr(tok, f"{name}_token", spec["tokens"][spec[key]])
    # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
    tok.add_bos_token = bool(config.get("add_bos_token", spec.get("tokenizer_type") == "llama"))
    tok.add_eos_token = bool(config.get("add_eos_token", False))
    if config.get("chat_template"):
        tok.chat_template = config["chat_template"]
    return tok


def _check_tokenizer(tok, source: Path) -> list[int]:
    """Raise unless `tok` gives llama.cpp's ids on every probe; return llama.cpp's EOS/EOT ids."""
    from clawd.training.weights import GGUFTokenizer

    ref = GGUFTokenizer(source)
    for text in PROBES:
        ours, theirs = list(tok(text)["input_ids"]), ref.encode(text, add_bos=True)
        if ours != theirs:
            raise ModelLoadError(
                f"the tokenizer rebuilt from {source.name} disagrees with llama.cpp's on {text!r} "
                f"({ours[:8]}... vs {theirs[:8]}...): this GGUF cannot be exported as an mlx-lm model; "
                "use --format peft with the original Hugging Face model"
            )
    return sorted(ref.eos_ids)


def _config(arch: str, meta: dict, weights: dict, eos_ids: list[int], bos_id: int | None) -> dict:
    if meta.get("rope_factors") is not None:
        raise ModelLoadError(
            "this model's rope frequency factors (rope_freqs, Llama 3.1+) have no mlx-lm config "
            "equivalent clawd can write: use --format peft with the original Hugging Face model"
        )
    config = {
        **meta["args"],
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "torch_dtype": DTYPE,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
    }
    if bos_id is not None:
        config["bos_token_id"] = bos_id
    if arch == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in weights
    return config


def write_mlx_model_dir(source: Path, out_dir: Path, *, cache_dir: Path | None = None) -> Path:
    """Write the GGUF at `source` as an mlx-lm model folder at `out_dir` (replacing one there),
    built in a temporary sibling and renamed into place. Raises ModelLoadError saying why not."""
    import mlx.core as mx

    from clawd.modelfile import open_gguf
    from clawd.training.weights import read_gguf_weights

    source, out_dir = Path(source), Path(out_dir)
    arch, meta, weights = read_gguf_weights(source, cache_dir)
    try:
        reader = open_gguf(source)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {source} as GGUF ({e})") from e
    tok = _hf_tokenizer(reader, arch)
    eos_ids = _check_tokenizer(tok, source)
    config = _config(arch, meta, weights, eos_ids, _value(reader, "tokenizer.ggml.bos_token_id"))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide the folder from the user's other tools
    try:
        mx.save_safetensors(
            str(tmp / MODEL_FILE), {k: v.astype(mx.bfloat16) for k, v in weights.items()}, metadata={"format": "mlx"}
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tok.save_pretrained(str(tmp))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clawd.training.mlx_model_dir", description=__doc__.split("\n")[0])
    p.add_argument("source", type=Path, help="the GGUF file")
    p.add_argument("out", type=Path, help="the mlx-lm model folder to write")
    p.add_argument("--cache", type=Path, help="clawd's cache dir (the trainer's dequantized weights)")
    args = p.parse_args(argv)
    try:
        write_mlx_model_dir(args.source, args.out, cache_dir=args.cache)
    except (ClawdError, OSError) as e:
        print(f"{e}", file=sys.stderr)  # the daemon shows the last line to the user
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
