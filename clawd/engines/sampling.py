"""Token sampling from one row of logits, in NumPy, for engines that do not bring their own.

The chain is llama.cpp's (what clawd's reference engine runs): top-k, then top-p on the
unscaled distribution, then temperature, then a seeded draw; temperature 0 is the argmax
(the first maximum). The reported log-prob is always the raw model's (base.SampledToken).
"""

from __future__ import annotations

import numpy as np

from clawd.engines.base import SamplingParams


def make_rng(params: SamplingParams) -> np.random.Generator:
    """Same seed, same draws; seed None: fresh entropy."""
    return np.random.default_rng(None if params.seed is None else params.seed & 0xFFFFFFFF)


def log_softmax_at(row: np.ndarray, ids) -> np.ndarray:
    """float64 log-probs of `ids` under the logits `row` (float64 log-sum-exp)."""
    row = row.astype(np.float64, copy=False)
    top = row.max()
    return row[ids] - top - np.log(np.exp(row - top).sum())


def sample(row: np.ndarray, params: SamplingParams, top_k: int, rng: np.random.Generator) -> int:
    """One token id from the logits `row` (V,)."""
    if params.temperature <= 0:
        return int(row.argmax())
    if 0 < top_k < row.shape[0]:
        idx = np.argpartition(row, -top_k)[-top_k:]
    else:
        idx = np.arange(row.shape[0])
    logits = row[idx].astype(np.float64)
    order = np.argsort(-logits, kind="stable")
    idx, logits = idx[order], logits[order]
    if params.top_p < 1.0:
        p = np.exp(logits - logits[0])
        cum = np.cumsum(p / p.sum())
        keep = int(np.searchsorted(cum, params.top_p)) + 1  # the smallest set holding top_p
        idx, logits = idx[:keep], logits[:keep]
    p = np.exp((logits - logits[0]) / params.temperature)
    cum = np.cumsum(p)
    return int(idx[min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), len(idx) - 1)])


def top_alternatives(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely token ids of the logits `row`, most likely first, with their float64
    log-probs under the unscaled distribution (what a client's `top_logprobs` asks for)."""
    row = row.astype(np.float64, copy=False)
    idx = np.argpartition(row, -k)[-k:]
    idx = idx[np.argsort(-row[idx], kind="stable")]
    top = row.max()
    return idx, row[idx] - top - np.log(np.exp(row - top).sum())
