"""patch_llama() before a transformers Trainer, on 2 gloo processes.

* Sequence parallel over both ranks, gradient checkpointing on (rematerialization-aware through
  TrainingArguments), gradient accumulation 2, a length the group does not divide: the per-step
  losses of 5 optimizer steps match the unpatched single-process Trainer's (rel err <= 1e-4:
  5 AdamW steps compound the 1e-7 gradient differences), and the attention forward ran once per
  layer per micro-batch.
* Data: both ranks of the sequence-parallel group get identical batches and an epoch visits every
  sample once; with sp_size=1 (2-way data parallel) the ranks get disjoint batches covering the set.
"""

from __future__ import annotations

import tempfile

import torch
from distributed import run_distributed

SAMPLES, LENGTH, BATCH, ACCUM, STEPS, LAYERS = 24, 29, 2, 2, 5, 2


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 128, (SAMPLES, LENGTH), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out_dir, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(output_dir=out_dir, use_cpu=True, report_to=[], max_steps=STEPS, logging_steps=1,
                  per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM, learning_rate=3e-3,
                  save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def train_losses(gradient_checkpointing):
    """Per-step losses of a Trainer run on the tiny Llama; also the attention-forward count."""
    from kernel_checks import OpCalls
    from tiny_models import make_model
    from transformers import Trainer

    model = make_model("llama", layers=LAYERS, seed=3)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = Trainer(model=model, args=_args(out_dir, gradient_checkpointing=gradient_checkpointing),
                          train_dataset=TokenDataset())
        with OpCalls() as seen:
            trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return losses, seen.calls["forward"]


def epoch_samples(dataset):
    """Indices of the samples, batch by batch, of one epoch of this rank's Trainer train loader."""
    from tiny_models import make_model
    from transformers import Trainer

    index = {tuple(row.tolist()): i for i, row in enumerate(dataset.ids)}
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = Trainer(model=make_model("llama", layers=1), args=_args(out_dir), train_dataset=dataset)
        loader = trainer.get_train_dataloader()
        return [[index[tuple(row.tolist())] for row in batch["input_ids"]] for batch in loader]


def worker(rank, world):
    import torch.distributed as dist

    import lightseq_hf
    from lightseq_hf.parallel import init_sequence_parallel

    failures = []
    lightseq_hf.patch_llama()  # before the Trainer, as a user would
    losses, forwards = train_losses(gradient_checkpointing=True)
    if forwards != LAYERS * STEPS * ACCUM:
        failures.append(f"attention forward ran {forwards} times, want {LAYERS * STEPS * ACCUM}")

    dataset = TokenDataset()
    seen = [None] * world
    dist.all_gather_object(seen, epoch_samples(dataset))
    if seen[0] != seen[1]:
        failures.append(f"sequence-parallel ranks got different batches: {seen}")
    if sorted(i for b in seen[0] for i in b) != list(range(SAMPLES)):
        failures.append(f"a sequence-parallel epoch does not visit every sample once: {seen[0]}")

    init_sequence_parallel(1)  # 2-way data parallel, no sequence parallelism
    dist.all_gather_object(seen, epoch_samples(dataset))
    flat = [set(i for b in s for i in b) for s in seen]
    if flat[0] & flat[1]:
        failures.append(f"data-parallel ranks share samples: {seen}")
    if sorted(flat[0] | flat[1]) != list(range(SAMPLES)) or sum(len(f) for f in flat) != SAMPLES:
        failures.append(f"a data-parallel epoch does not visit every sample once: {seen}")
    lightseq_hf.unpatch_llama()
    return {"failures": failures, "losses": losses}


def test_trainer_two_processes_matches_single_process():
    results = run_distributed(worker, 2)
    failures = [f for r in results for f in (r if isinstance(r, list) else r["failures"])]
    assert not failures, "\n".join(failures)
    reference, _ = train_losses(gradient_checkpointing=False)  # unpatched, one process
    assert len(reference) == STEPS
    for r in results:
        assert len(r["losses"]) == STEPS
        for got, want in zip(r["losses"], reference):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], reference)
    assert reference[-1] < reference[0]  # it trains


def test_reshard_four_ranks_two_by_two(monkeypatch):
    """World 4 = 2 data-parallel x 2 sequence-parallel, simulated on one process (Accelerate sharding)."""
    from accelerate.data_loader import prepare_data_loader

    from lightseq_hf.patches import trainer as patch

    seen = []
    for rank in range(4):
        loader = prepare_data_loader(torch.utils.data.DataLoader(list(range(16)), batch_size=2),
                                     num_processes=4, process_index=rank, put_on_device=False)
        monkeypatch.setattr(patch, "data_parallel_coordinates", lambda r=rank: (2, 2, r // 2))
        seen.append([b.tolist() for b in patch.shard_by_data_parallel_rank(loader)])
    assert seen[0] == seen[1] and seen[2] == seen[3]  # sequence-parallel ranks: identical batches
    first, second = ({i for b in s for i in b} for s in (seen[0], seen[2]))
    assert not first & second and first | second == set(range(16))  # data-parallel groups: disjoint, complete
