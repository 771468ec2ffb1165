"""Held-out evaluation of the synthetic passkey task, sequence-parallel like training."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..parallel.sharding import shard_for
from .data import collate, passkey_spec

__all__ = ["evaluate_passkey"]


@torch.no_grad()
def evaluate_passkey(model: torch.nn.Module, synthetic: Any, context_length: int, vocab_size: int,
                     groups: Any, device: torch.device, batch_size: int) -> dict:
    """Retrieval accuracy on ``data.synthetic.eval_samples`` held-out passkey samples of ``context_length``
    tokens (greedy prediction of each answer token).

    Data-parallel groups split the samples; each rank scores the answer positions inside its
    own slice of the sequence; counts are summed over all ranks.
    """
    from .synthetic import PasskeyDataset, answer_accuracy

    spec = passkey_spec(synthetic, context_length, vocab_size, seed=synthetic.seed + 1_000_000)
    n_eval = synthetic.eval_samples
    ds = PasskeyDataset(spec, n_eval)
    mine = list(range(groups.dp_rank, n_eval, groups.dp_size))
    n = context_length
    shard = shard_for(n, groups.sp_rank, groups.sp_size)  # n is a multiple of sp_size (validate)
    start, local = shard.start, shard.local_len
    counts = torch.zeros(4, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for i in range(0, max(len(mine), 1), batch_size):
        idx = mine[i: i + batch_size] or [0]  # groups with no sample left run a dummy to stay in step
        batch = collate([ds[j] for j in idx])
        out = model(input_ids=batch["input_ids"].to(device), lightseq_logits="shard")  # 1/P of the logits
        logits = out.logits
        if logits.shape[1] == n:  # unsliced output (sp_size 1)
            logits = logits[:, start: start + local]
        pred = logits.argmax(-1).cpu()  # pred[:, i] predicts token start + i + 1
        targets = batch["labels"][:, start + 1: start + local + 1]
        pred = pred[:, : targets.shape[1]]
        if mine[i: i + batch_size]:
            counts += torch.tensor(answer_accuracy(pred, targets), dtype=torch.float64)
    model.train(was_training)
    if dist.is_available() and dist.is_initialized():
        counts = counts.to(device)  # NCCL reduces device tensors only
        dist.all_reduce(counts)
        counts = counts.cpu()
    tc, tt, kc, kt = counts.tolist()
    return {"accuracy": tc / max(tt, 1), "key_accuracy": kc / max(kt, 1), "chance": spec.chance,
            "eval_samples": n_eval, "answer_tokens": int(tt)}
