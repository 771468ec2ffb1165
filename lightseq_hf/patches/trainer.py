"""Hugging Face ``Trainer`` data loading for sequence parallelism.

Accelerate shards a map-style dataset's batches over all processes. With sequence parallelism
the ranks of a sequence-parallel group must get the *same* batches (the model slices them) and
only data-parallel groups disjoint ones: the patch re-targets the prepared loader's
``BatchSamplerShard`` from (world size, global rank) to (data-parallel size, data-parallel rank).
Every rank still draws the same seeded permutation, so an epoch visits every sample once.

Evaluation gathers predictions for ``compute_metrics`` over all processes; the ranks of a group
hold the same samples (and, from the patched model, the logits of the whole sequence), so the
patch keeps one copy per group (:func:`_gather_for_metrics_per_group`).
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from ..parallel.groups import current_groups

__all__ = ["data_parallel_coordinates", "patch_trainer", "shard_by_data_parallel_rank", "unpatch_trainer"]

_saved: dict[str, object] = {}


def data_parallel_coordinates() -> tuple[int, int, int]:
    """(sp_size, dp_size, dp_rank) of this process under the current patch (1, 1, 0 without distributed)."""
    from .state import resolve_sp_group

    group = resolve_sp_group()
    if group is None:
        return 1, 1, 0
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = current_groups()
    if groups is not None and groups.sp_group is group:
        return groups.sp_size, groups.dp_size, groups.dp_rank
    sp_size = dist.get_world_size(group)
    if world % sp_size:
        raise ValueError(f"the sequence-parallel group has {sp_size} ranks, which does not divide the world "
                         f"size {world}; use lightseq_hf.parallel.init_sequence_parallel(sp_size).")
    dp_rank = rank // sp_size
    if list(dist.get_process_group_ranks(group)) != list(range(dp_rank * sp_size, (dp_rank + 1) * sp_size)):
        raise ValueError(
            "the Trainer patch needs sequence-parallel groups of consecutive ranks ([0, sp), [sp, 2 sp), "
            "...); create them with lightseq_hf.parallel.init_sequence_parallel(sp_size)."
        )
    return sp_size, world // sp_size, dp_rank


def shard_by_data_parallel_rank(dataloader):
    """Make an Accelerate-prepared loader yield this rank's data-parallel share; returns it."""
    from accelerate.data_loader import BatchSamplerShard

    sp_size, dp_size, dp_rank = data_parallel_coordinates()
    if sp_size == 1:
        return dataloader
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if not isinstance(batch_sampler, BatchSamplerShard):
        raise ValueError(
            f"lightseq_hf cannot shard this data loader ({type(dataloader).__name__}) by data-parallel rank: "
            "with sequence parallelism the Trainer needs a map-style dataset (with __len__) and "
            "accelerator_config dispatch_batches=False and split_batches=False. Convert an iterable "
            "dataset with datasets.Dataset.from_list / from_generator."
        )
    batch_sampler.num_processes = dp_size
    batch_sampler.process_index = dp_rank
    if dp_size == 1:  # one data-parallel group: no need to complete the last batch with repeated samples
        batch_sampler.even_batches = False
    return dataloader


def _gather_for_metrics_per_group(accelerator, data, *, sp_size: int, dp_size: int):
    """``accelerator.gather_for_metrics`` when the ``sp_size`` ranks of each group hold the same samples.

    Gathers over all ranks (consecutive groups, as :func:`data_parallel_coordinates` requires),
    keeps the first rank's rows of each group, and drops the duplicated samples of the last batch
    the way Accelerate does (its remainder counts data-parallel groups once the loader is resharded).
    """
    from accelerate.utils import recursively_apply

    def first_of_each_group(t):
        return t.reshape(dp_size, sp_size, -1, *t.shape[1:])[:, 0].reshape(-1, *t.shape[1:])

    data = recursively_apply(first_of_each_group, accelerator.gather(data))
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        data = recursively_apply(lambda t: t[:state.remainder], data)
    return data


def patch_trainer() -> None:
    """Wrap ``Trainer._get_dataloader`` (train, eval and test loaders) and ``evaluation_loop``. Idempotent."""
    from transformers import Trainer

    if "_get_dataloader" in _saved or not hasattr(Trainer, "_get_dataloader"):
        return
    original = Trainer.__dict__["_get_dataloader"]
    original_loop = Trainer.__dict__["evaluation_loop"]

    @functools.wraps(original)
    def _get_dataloader(self, *args, **kwargs):
        return shard_by_data_parallel_rank(original(self, *args, **kwargs))

    @functools.wraps(original_loop)
    def evaluation_loop(self, *args, **kwargs):
        sp_size, dp_size, _ = data_parallel_coordinates()
        if sp_size > 1:  # the loop resets gather_function to gather_for_metrics when it ends
            self.gather_function = functools.partial(_gather_for_metrics_per_group, self.accelerator,
                                                     sp_size=sp_size, dp_size=dp_size)
        return original_loop(self, *args, **kwargs)

    _saved["_get_dataloader"] = original
    _saved["evaluation_loop"] = original_loop
    Trainer._get_dataloader = _get_dataloader
    Trainer.evaluation_loop = evaluation_loop


def unpatch_trainer() -> None:
    """Restore the Trainer's data loading and evaluation loop."""
    from transformers import Trainer

    for name in ("_get_dataloader", "evaluation_loop"):
        if name in _saved:
            setattr(Trainer, name, _saved.pop(name))
