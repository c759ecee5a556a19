"""The engine contract: what chat, the miner and the trainer may ask of a model runtime.

An engine owns one loaded model and is *synchronous*: every method is called from a
worker thread, one call at a time (engines/runner.py serialises and queues them), so an
engine never needs its own locking. Heavy libraries are imported inside the engine
module only. Each engine module exports a class named `Engine`.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy; seed None means random."""

    max_tokens: int = 512
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int | None = None
    # Also report this many most likely tokens per step (SampledToken.top), for a client's
    # `top_logprobs`; at most Engine.max_top_logprobs.
    top_logprobs: int = 0


@dataclass(frozen=True)
class Alternative:
    """One of the most likely tokens at a step, under the same unscaled distribution as
    SampledToken.logprob. `piece` is its text as bytes (a control token's own spelling)."""

    id: int
    piece: bytes
    logprob: float


@dataclass(frozen=True)
class SampledToken:
    """One sampled token: its id, its raw bytes, and its log-prob under the model's
    unscaled distribution (log-softmax of the raw logits, temperature 1), which is what
    the trainer recomputes as pi_old."""

    id: int
    piece: bytes
    logprob: float
    is_end: bool = False  # an end-of-generation token (EOS/EOT); its piece is not text
    top: tuple[Alternative, ...] = ()  # params.top_logprobs most likely tokens, most likely first


@dataclass
class ScoreResult:
    """Log-probs of given target tokens, each conditioned on the prompt plus the
    targets before it.

    logprobs: float32 (n,) — log p(target_i | prefix)
    top_ids: int32 (n, k) — the k most likely tokens at position i, most likely first
    top_logprobs: float32 (n, k) — their log-probs
    at_logprobs: float32 (n, m) — log-probs of the caller's `at_ids` tokens (m = 0 if none)
    """

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    at_logprobs: np.ndarray | None = None


def check_at_ids(at_ids, n: int) -> np.ndarray:
    """The `at_ids` argument of score() as an int (n, m) array ((n, 0) when absent)."""
    if at_ids is None:
        return np.zeros((n, 0), np.int64)
    at = np.asarray(at_ids, dtype=np.int64)
    if at.ndim != 2 or at.shape[0] != n:
        raise ValueError(f"at_ids must have shape (n_targets={n}, m), got {at.shape}")
    return at


@dataclass(frozen=True)
class ModelInfo:
    """What the engine knows about its model, for /v1/models, templates and status."""

    id: str
    path: Path
    architecture: str
    n_ctx: int
    n_ctx_train: int
    n_vocab: int
    chat_template: str | None
    bos_token: str
    eos_token: str
    add_bos: bool
    metadata: dict = field(default_factory=dict)


class Engine(abc.ABC):
    """A loaded model that can generate, score and wear LoRA adapters."""

    name: str  # "llamacpp", "mlx", "fake", ...
    # The most SamplingParams.top_logprobs generate() can honour; 0: it cannot report the
    # alternatives to a sampled token at all (the API then refuses `top_logprobs`).
    max_top_logprobs: int = 0

    @property
    @abc.abstractmethod
    def info(self) -> ModelInfo:
        """Returns: the loaded model's ModelInfo."""

    @abc.abstractmethod
    def tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        """Tokenize text with the model's own tokenizer.

        Args:
            text: the rendered prompt (or any text).
            add_bos: prepend the BOS token when the model uses one.
            special: parse special-token text (e.g. "<start_of_turn>") as special tokens.
        Returns: token ids.
        """

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Returns: the text of the ids (special tokens rendered as text)."""

    @abc.abstractmethod
    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        adapter: str | None = None,
        cancel: threading.Event | None = None,
        slot: int = 0,
    ) -> Iterator[SampledToken]:
        """Sample up to params.max_tokens tokens after prompt_ids.

        Args:
            prompt_ids: the full prompt; a common prefix with the previous call may be
                reused from the KV cache.
            params: sampling parameters.
            adapter: id of a loaded adapter to apply (scale 1), or None for the base model.
            cancel: when set, generation stops before the next token.
            slot: 0 for user turns, 1 for background work; engines that cache prompts
                keep one cache per slot, so background work never evicts the user's.
        Returns: an iterator of SampledToken; the last one has is_end=True when the model
            ended on its own. Closing the iterator early stops generation.
        Raises:
            ContextLengthExceeded: the prompt does not fit the context.
            AdapterError: `adapter` is not loaded.
            EngineError: the runtime failed.
        """

    @abc.abstractmethod
    def score(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        *,
        top_k: int = 0,
        adapter: str | None = None,
        at_ids: np.ndarray | None = None,
        cancel: threading.Event | None = None,
        slot: int = 0,
        reuse_cache: bool = True,
    ) -> ScoreResult:
        """Log-prob of every target token given the prompt and the targets before it.

        Args:
            prompt_ids: the conditioning context (non-empty).
            target_ids: the tokens to score (non-empty).
            top_k: also return the k most likely tokens per position (0 = none).
            adapter: id of a loaded adapter to apply, or None for the base model.
            at_ids: int (n, m): also return the log-probs of these tokens at each
                position (a teacher scored at the student's top-k tokens).
            cancel: when set, stop between decode chunks and raise Preempted.
            slot: the prompt-cache slot, as in generate().
            reuse_cache: start from the cached prefix. False computes every position
                afresh, so the same weights give bit-identical numbers whatever ran before
                (an engine's float results can depend on how a prompt was split in batches).
        Returns: ScoreResult with n = len(target_ids) rows.
        Raises:
            ContextLengthExceeded: prompt + targets do not fit the context.
            AdapterError: `adapter` is not loaded.
            Preempted: `cancel` was set.
        """

    @abc.abstractmethod
    def load_adapter(self, adapter_id: str, path: Path) -> None:
        """Load a LoRA adapter file for this model without reloading the model.

        Args:
            adapter_id: the name later passed as `adapter=`.
            path: the adapter file in this engine's format (GGUF LoRA for llama.cpp).
        Raises:
            AdapterError: the file is missing, corrupt, or does not fit the model; the
                engine's state is unchanged.
        """

    @abc.abstractmethod
    def unload_adapter(self, adapter_id: str) -> None:
        """Free a loaded adapter. Unknown ids are ignored."""

    @property
    @abc.abstractmethod
    def loaded_adapters(self) -> list[str]:
        """Returns: ids of the adapters currently loaded."""

    def close(self) -> None:  # noqa: B027 - optional: engines holding nothing need no close
        """Free the model. The engine is unusable afterwards."""
