"""Synthetic long-range retrieval generated on the fly: the passkey task.

Each sample is ``context_length`` tokens of filler: as in the passkey test of Mohtashami &
Jaggi (2023), one fixed "sentence" of ``filler_period`` tokens repeated from a random phase
(``filler: repeat``), or uniformly random tokens (``filler: random``, harder). Somewhere in
the first ``needle_max_frac`` of the sequence sits the needle ``[NEEDLE, key x needle_repeat]``
(the key ``k_1..k_L`` stated ``needle_repeat`` times in a row; the original test states it
twice; a louder needle is learned from fewer samples); the sequence ends with the question
``[QUERY, k_1, ..., k_L]``. Only the answer tokens after ``QUERY`` carry labels, so the loss
measures retrieval alone. With the default ``needle_max_frac`` 0.5 and a sequence-parallel
group of 2, the whole needle lies in rank 0's shard and the question in rank 1's, at least
``context_length / 2 - passkey_len`` tokens later: the model can only learn the task if
attention crosses the shard boundary. Chance accuracy per answer token is ``1 / num_values``.

Token ids: 0 = BOS, 1 = NEEDLE, 2 = QUERY, then ``passkey_len`` disjoint blocks of
``num_values`` key tokens (digit ``j`` of the key is drawn from block ``j``), then filler
tokens up to ``vocab_size``. Samples are a pure function of ``(seed, index)``, so any rank
regenerates any sample and a resumed run sees the same data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from ..parallel.sharding import IGNORE_INDEX

__all__ = ["NEEDLE", "PasskeyDataset", "PasskeySpec", "QUERY", "answer_accuracy", "make_passkey_sample"]

_BOS, NEEDLE, QUERY = 0, 1, 2


@dataclass(frozen=True)
class PasskeySpec:
    """Shape of the passkey task (see the module docstring)."""

    context_length: int
    vocab_size: int = 256
    num_values: int = 16
    passkey_len: int = 1
    needle_max_frac: float = 0.5
    seed: int = 0
    filler: str = "repeat"
    filler_period: int = 32
    filler_seed: int = 0  # the repeated sentence; shared by training and held-out samples
    needle_repeat: int = 1  # the needle states the key this many times in a row

    def __post_init__(self) -> None:
        first_filler = 3 + self.num_values * self.passkey_len
        if self.num_values < 2 or self.passkey_len < 1:
            raise ValueError("synthetic.num_values must be >= 2 and synthetic.passkey_len >= 1")
        if self.vocab_size <= first_filler:
            raise ValueError(
                f"synthetic: vocab_size {self.vocab_size} leaves no filler tokens; it must exceed "
                f"3 + num_values * passkey_len = {first_filler}"
            )
        if self.needle_repeat < 1:
            raise ValueError("synthetic.needle_repeat must be >= 1")
        if self.filler not in ("repeat", "random") or self.filler_period < 1:
            raise ValueError("synthetic.filler must be 'repeat' or 'random' and filler_period >= 1")
        if not 0.0 < self.needle_max_frac < 1.0:
            raise ValueError("synthetic.needle_max_frac must be in (0, 1)")
        if self.needle_stop <= 1:
            raise ValueError(
                f"synthetic: context_length {self.context_length} is too short for the needle; "
                "raise context_length or needle_max_frac"
            )

    @property
    def first_filler(self) -> int:
        return 3 + self.num_values * self.passkey_len

    @property
    def needle_len(self) -> int:
        """Tokens of the needle: the marker and the key ``needle_repeat`` times."""
        return 1 + self.passkey_len * self.needle_repeat

    @property
    def needle_stop(self) -> int:
        """Exclusive upper bound of the needle's start position (the whole needle fits before
        ``needle_max_frac * context_length``)."""
        return min(int(self.context_length * self.needle_max_frac),
                   self.context_length - 2 * (self.passkey_len + 1)) - self.needle_len + 1

    @property
    def chance(self) -> float:
        """Chance accuracy of one answer token."""
        return 1.0 / self.num_values

    @property
    def min_distance(self) -> int:
        """Fewest tokens between the last needle token and the first answer token."""
        return self.context_length - self.passkey_len - (self.needle_stop - 1 + self.needle_len - 1)


def make_passkey_sample(spec: PasskeySpec, index: int) -> dict[str, torch.Tensor]:
    """Sample ``index``: ``input_ids`` and ``labels`` (HF convention, unshifted), both ``(N,)``."""
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + index)
    n, L = spec.context_length, spec.passkey_len
    if spec.filler == "repeat":
        sentence = torch.randint(spec.first_filler, spec.vocab_size, (spec.filler_period,),
                                 generator=torch.Generator().manual_seed(spec.filler_seed))
        phase = int(torch.randint(0, spec.filler_period, (1,), generator=g))
        ids = sentence.roll(-phase).repeat(n // spec.filler_period + 1)[:n].clone()
    else:
        ids = torch.randint(spec.first_filler, spec.vocab_size, (n,), generator=g)
    ids[0] = _BOS
    key = torch.randint(0, spec.num_values, (L,), generator=g) + 3 + spec.num_values * torch.arange(L)
    pos = int(torch.randint(1, spec.needle_stop, (1,), generator=g))
    ids[pos] = NEEDLE
    ids[pos + 1: pos + spec.needle_len] = key.repeat(spec.needle_repeat)
    ids[n - L - 1] = QUERY
    ids[n - L:] = key
    labels = torch.full((n,), IGNORE_INDEX, dtype=torch.long)
    labels[n - L:] = key
    return {"input_ids": ids, "labels": labels}


class PasskeyDataset(Dataset):
    """``num_samples`` passkey samples, generated when indexed."""

    def __init__(self, spec: PasskeySpec, num_samples: int) -> None:
        self.spec = spec
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return make_passkey_sample(self.spec, index)


def answer_accuracy(pred_ids: torch.Tensor, labels: torch.Tensor) -> tuple[int, int, int, int]:
    """Count correct answer tokens and fully correct keys.

    ``pred_ids[b, t]`` is the model's prediction of token ``t`` (already shifted);
    labels are the sample's (unshifted) labels. Returns ``(tokens_correct, tokens,
    keys_correct, keys)``.
    """
    mask = labels != IGNORE_INDEX
    hit = (pred_ids == labels) & mask
    tokens_correct, tokens = int(hit.sum()), int(mask.sum())
    per_key = (hit | ~mask).all(dim=1) & mask.any(dim=1)
    return tokens_correct, tokens, int(per_key.sum()), int(mask.any(dim=1).sum())
