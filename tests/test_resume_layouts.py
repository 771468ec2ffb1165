"""A resume under another launch (world size, ``sp_size``, batch shape) continues from the same sample.

The samples trained are read from the rows the model was called with. On 2 gloo processes, one group for
every run: an uninterrupted epoch with ``sp_size`` 2 (one data-parallel group), then its step-3
checkpoint resumed with ``sp_size`` 1 (two groups), and the reverse; the interrupted and resumed halves
together train every sample of the epoch once, in the uninterrupted run's order, and a changed step count
is refused by ``saving.on_schedule_change`` naming both layouts. In process: the sampler's position
across data-parallel sizes, the epoch's step count, and a changed data order refused by ``--check``.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import yaml
from distributed import run_distributed

from lightseq_hf.training.build import count_steps
from lightseq_hf.training.cli import main
from lightseq_hf.training.config import ConfigError, config_from_dict
from lightseq_hf.training.data import ParallelSampler
from lightseq_hf.training.layout import DataLayout, check_resume_layout, resumed_total_steps
from lightseq_hf.training.saving import write_completion_record

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
# 16 samples of 64 tokens: an epoch is 8 steps of 2 samples with one data-parallel group, 4 with two
SMALL = ["training.device=cpu", "logging.progress_bar=false", "logging.plot=false", "context_length=64",
         "model.config.max_position_embeddings=64", "data.synthetic.needle_repeat=1",
         "data.synthetic.filler_period=8", "data.synthetic.num_samples=16", "data.synthetic.eval_samples=0",
         "training.max_steps=null", "training.warmup_steps=0", "parity.enabled=false"]


# ----------------------------------------------------------------------------- the sampler, in process


def test_the_epoch_continues_from_the_same_sample_under_any_data_parallel_size() -> None:
    for n, dp_then, dp_now, batch in itertools.product((10, 16), (1, 2, 3), (1, 2, 4), (1, 2)):
        order = ParallelSampler(n, 1, 0, seed=3).indices()
        per_group = math.ceil(n / dp_then)
        for steps in range(math.ceil(per_group / batch) + 1):
            taken = min(steps * batch, per_group)
            before = [ParallelSampler(n, dp_then, r, seed=3).indices()[:taken] for r in range(dp_then)]
            position = taken * dp_then  # what the run records: samples of all groups together
            after = []
            for r in range(dp_now):
                s = ParallelSampler(n, dp_now, r, seed=3)
                s.set_epoch(0, start=position)
                assert len(s) == len(s.indices()), (n, dp_then, dp_now, steps)
                after.append(s.indices())
            consumed = {i for g in before for i in g}  # a prefix of the order (and top-up repeats at its end)
            assert consumed == set(order[:min(position, n)]), (n, dp_then, steps)
            rest = [i for row in itertools.zip_longest(*after) for i in row if i is not None]
            assert rest[:max(n - position, 0)] == order[position:], (n, dp_then, dp_now, steps)
            assert {len(a) for a in after} <= {math.ceil(max(n - position, 0) / dp_now)}


def test_the_epoch_step_count_follows_the_layout() -> None:
    for n, dp, batch, accum, epochs in itertools.product((7, 16), (1, 2, 3), (1, 2), (1, 3), (1, 2)):
        layout = DataLayout(dp, 1, dp, batch, accum, 0)
        cfg = config_from_dict(TINY, [f"training.batch_size={batch}", f"training.grad_accum={accum}",
                                      f"training.epochs={epochs}", "training.max_steps=null"],
                               base_dir=ROOT / "configs")
        if batch > math.ceil(n / dp):
            continue
        total = count_steps(cfg.training, n, dp)
        per_epoch = total // epochs
        for step in range(total + 1):  # a resume under the same layout keeps the fresh run's count
            epoch, done = min(step // per_epoch, epochs), step - min(step // per_epoch, epochs) * per_epoch
            position = min(done * batch * accum, math.ceil(n / dp)) * dp
            assert resumed_total_steps(epochs, n, step, epoch, position, layout) == total, (n, dp, step)
    # 6 of 16 samples trained with one group: the other 10 take 3 steps of two groups of 2
    assert resumed_total_steps(1, 16, 3, 0, 6, DataLayout(2, 1, 2, 2, 1, 0)) == 6


def test_another_data_order_mid_epoch_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    saved = DataLayout(2, 2, 1, 2, 1, 0).to_dict()
    with pytest.raises(ConfigError) as e:
        check_resume_layout(saved, DataLayout(2, 2, 1, 2, 1, 5), 6, 0, tmp_path / "checkpoint-3")
    message = str(e.value)
    assert "training.seed=0" in message and "training.seed=5" in message and "\n" not in message
    assert "continues at the start" in check_resume_layout(saved, DataLayout(2, 2, 1, 2, 1, 5), 0, 1,
                                                           tmp_path)  # between epochs the order may change

    out = tmp_path / "run"  # the same through --check (and the launcher, which runs its checks)
    (out / "checkpoint-3" / "state").mkdir(parents=True)
    (out / "checkpoint-3" / "state" / "x.bin").write_bytes(b"state")
    cfg = config_from_dict(TINY, SMALL, base_dir=ROOT / "configs")
    from lightseq_hf.training.data import data_fingerprint

    fingerprint = data_fingerprint(cfg.data, cfg.context_length)
    write_completion_record(out / "checkpoint-3", 3, {"epoch": 0, "samples_in_epoch": 6, "layout": saved,
                                                      "schedule_steps": 8, "data_fingerprint": fingerprint})
    args = [str(ROOT / "configs" / "tiny.yaml"), *SMALL, f"output_dir={out}", "saving.resume_from=latest",
            "--check", "--world-size", "2"]
    assert main([*args, "training.seed=5"]) == 2
    err = capsys.readouterr().err
    assert "stopped at sample 6 of epoch 0 in the order of training.seed=0" in err, err
    assert err.count("\n") == 1, err
    assert main([*args, "sp_size=1"]) == 2  # two groups finish the epoch in 3 steps, not the 5 left
    err = capsys.readouterr().err
    assert "schedule of 8 steps, this run has 6 (its layout: world 2 = 1 data-parallel x 2 " in err, err
    assert "this run's: world 2 = 2 data-parallel x 1 sequence-parallel" in err and err.count("\n") == 1, err
    assert main([*args, "sp_size=1", "saving.on_schedule_change=rebuild"]) == 0
    assert "continues at sample 6 of epoch 0 under another layout" in capsys.readouterr().out


# ----------------------------------------------------------------------------- real runs, 2 processes


def _train(overrides: list[str]) -> tuple[dict[int, list[int]], str]:
    """Run the fine-tune in this process group; the samples (dataset indices) the model was called with at
    each step by this rank, and the run's log."""
    import io
    import logging

    import torch.distributed as dist

    from lightseq_hf.training import loop

    seen: dict[int, list[int]] = {}
    original = loop.Trainer.train_step

    def recording(self, batches):
        index = {tuple(self.dataset[i]["input_ids"].tolist()): i for i in range(len(self.dataset))}
        assert len(index) == len(self.dataset), "two samples are identical: they cannot be told apart"
        seen[self.state.step + 1] = [index[tuple(row.tolist())] for b in batches for row in b["input_ids"]]
        return original(self, batches)

    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("lightseq_hf").addHandler(handler)
    logging.getLogger("lightseq_hf").setLevel(logging.INFO)
    loop.Trainer.train_step = recording
    try:
        loop.train(config_from_dict(TINY, [*SMALL, *overrides], base_dir=ROOT / "configs",
                                    world_size=dist.get_world_size()))
    finally:
        loop.Trainer.train_step = original
        logging.getLogger("lightseq_hf").removeHandler(handler)
    return seen, log.getvalue()


def _global(seen: dict[int, list[int]], sp_size: int) -> dict[int, list[int]]:
    """Every data-parallel group's samples of each step (the first rank of each sequence-parallel group)."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    steps = sorted(everyone[0])
    return {s: sorted(i for r in range(0, len(everyone), sp_size) for i in everyone[r][s]) for s in steps}


def _shared_boundaries(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Sample counts at which a step of ``a`` and a step of ``b`` both end."""
    return sorted(set(itertools.accumulate(map(len, a))) & set(itertools.accumulate(map(len, b))))


def _first(steps: list[list[int]], count: int) -> set[int]:
    return set([i for s in steps for i in s][:count])


def worker_resume_across_layouts(rank: int, world: int, out: str) -> list[str]:
    from accelerate.state import PartialState

    PartialState.destroy_process_group = lambda self, group=None: None  # the harness owns the group
    fails = []
    for then_sp, now_sp, at in ((2, 1, 3), (1, 2, 1)):
        first = Path(out) / f"sp{then_sp}"
        full, _ = _train([f"sp_size={then_sp}", f"saving.every={at}", "saving.final=false",
                          f"output_dir={first}"])
        full = _global(full, then_sp)
        epoch = [i for s in sorted(full) for i in full[s]]
        if sorted(epoch) != list(range(16)):
            fails.append(f"sp {then_sp}: the uninterrupted epoch trained {epoch}")
        resumed_dir = Path(out) / f"sp{then_sp}-to-sp{now_sp}"
        resume = [f"sp_size={now_sp}", f"output_dir={resumed_dir}", "saving.resume_other_run=true",
                  f"saving.resume_from={first / f'checkpoint-{at}'}"]
        if then_sp == 2:  # by default, a changed epoch length is refused naming both layouts
            try:
                _train(resume)
                fails.append(f"sp {then_sp} -> {now_sp}: a changed epoch length was not refused")
            except ConfigError as e:
                if "(its layout: world 2 = 1 data-parallel x 2 sequence-parallel" not in str(e):
                    fails.append(f"sp {then_sp} -> {now_sp}: refusal does not name the layouts: {e}")
        seen, log = _train([*resume, "saving.on_schedule_change=rebuild", "saving.final=false"])
        seen = _global(seen, now_sp)
        before = [i for s in sorted(full) if s <= at for i in full[s]]
        after = [seen[s] for s in sorted(seen)]
        if sorted(before + [i for a in after for i in a]) != list(range(16)):
            fails.append(f"sp {then_sp} -> {now_sp}: trained {before} then {after}, not the epoch once")
        rest = [full[s] for s in sorted(full) if s > at]
        for boundary in _shared_boundaries(rest, after):  # the resumed steps follow the uninterrupted order
            if _first(after, boundary) != _first(rest, boundary):
                fails.append(f"sp {then_sp} -> {now_sp}: the first {boundary} resumed samples are "
                             f"{sorted(_first(after, boundary))}, the uninterrupted run's next "
                             f"{sorted(_first(rest, boundary))}")
        if rank == 0 and f"continues at sample {len(before)} of epoch 0 under another layout" not in log:
            fails.append(f"sp {then_sp} -> {now_sp}: the resume does not say where it continues:\n{log}")
    return fails


def test_a_checkpoint_resumed_under_another_layout_trains_the_rest_of_the_epoch_once(tmp_path: Path) -> None:
    failures = [f for fs in run_distributed(worker_resume_across_layouts, 2, str(tmp_path)) for f in fs]
    assert not failures, "\n".join(failures)
