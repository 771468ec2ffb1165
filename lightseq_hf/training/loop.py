"""The accelerate training loop for sequence-parallel fine-tuning.

Every rank of a sequence-parallel group receives the same full batch and calls the patched model with it
(the patch slices the sequence and returns the group's global token-mean loss); DDP (or FSDP, through the
accelerate config) averages gradients over all ranks. Data-parallel groups get disjoint samples from
:class:`ParallelSampler`. :class:`Trainer` is the run: :meth:`~Trainer.setup`, then per optimizer step
:meth:`~Trainer.train_step` and :meth:`~Trainer.log_step`, :meth:`~Trainer.evaluate` and
:meth:`~Trainer.save` on their cadence, and :meth:`~Trainer.finish`.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import metrics
from .build import (
    apply_patch,
    build_model_or_explain,
    build_optimizer,
    check_tokenizer_fits,
    count_steps,
    offload_setting,
    rank_memory_budget,
    run_sharding,
    use_fsdp_cpu_offload,
)
from .checkpoints import TrainState, check_same_data, load_resume_state, reconcile_schedule, save_checkpoint
from .config import FinetuneConfig, validate
from .data import ParallelSampler, build_train_dataset, collate, data_fingerprint, load_tokenizer
from .errors import ConfigError
from .evaluation import evaluate_passkey
from .guards import NonFiniteError, Progress, check_every_parameter_has_a_gradient
from .layout import DataLayout, place_resume
from .log import logger
from .output import MetricsWriter, plot_metrics, prepare_output_dir, read_summary, write_json
from .output import release_output_dir_locks as release_locks
from .planning import memory_advice
from .processes.board import (
    FailureBoard,
    is_out_of_memory,
    main_decides,
    out_of_memory_line,
    stop_for_out_of_memory,
    tell_peers,
)
from .processes.watchdog import watch_peers
from .saving import read_completion_record
from .shape import run_shape

__all__ = ["StepResult", "Trainer", "train"]


@dataclass
class StepResult:
    """One optimizer step: the group-mean loss, the gradient norm (when computed), whether the update was
    skipped, its seconds and the micro-batches it consumed."""

    loss: float
    grad_norm: float | None
    skipped: bool
    seconds: float
    batches: list[dict]


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _resume_point(cfg: FinetuneConfig) -> tuple[Path | None, dict | None, str]:
    """Main process: the checkpoint to resume from (see prepare_output_dir), its completion record's step
    and metadata, and the training data's fingerprint."""
    resume = prepare_output_dir(cfg)
    record = read_completion_record(resume) if resume is not None else None
    saved = {"step": record["step"], **record.get("meta", {})} if record is not None else None
    return resume, saved, data_fingerprint(cfg.data, cfg.context_length)


class Trainer:
    """One fine-tune run of a validated config. ``run()`` trains and returns the summary."""

    def __init__(self, cfg: FinetuneConfig) -> None:
        self.cfg, self.t = cfg, cfg.training
        self.out_dir = Path(cfg.output_dir)
        self.last_eval: dict = {}
        self.parity_report: dict = {}
        self.last_loss = float("nan")
        self.train_time = 0.0

    # ------------------------------------------------------------------ set-up

    def _start_processes(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs, set_seed

        t = self.t
        use_cpu = t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available())
        if t.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("training.device is 'cuda' but no CUDA device is available")
        self.timeout = datetime.timedelta(seconds=t.timeout_s)
        self.accelerator = Accelerator(cpu=use_cpu, mixed_precision=t.mixed_precision,
                                       kwargs_handlers=[InitProcessGroupKwargs(timeout=self.timeout)])
        world = self.accelerator.num_processes
        self.is_main = self.accelerator.is_main_process
        self.device = self.accelerator.device
        validate(self.cfg, world_size=world)
        self.shape = run_shape(self.cfg, world)  # the run's one shape
        set_seed(t.seed)  # the same initial weights on every rank
        self.progress = Progress(self.accelerator.process_index, world, t.timeout_s)
        self.memory_budget = rank_memory_budget(self.accelerator)  # before this run holds any
        self.failures = FailureBoard.for_default_group(self.accelerator.process_index, world)

    def _build_run(self) -> None:
        """Groups, the resume choice, tokenizer, patched model, dataset and the step count."""
        from ..parallel.groups import init_sequence_parallel

        cfg, t = self.cfg, self.t
        with self.progress.phase("set-up", 0):
            self.groups = init_sequence_parallel(self.shape.sp_size, timeout=self.timeout)
            self.resume, self.saved, self.data_fingerprint = main_decides(
                self.accelerator, lambda: _resume_point(cfg))
        self.resume_step = self.saved["step"] if self.saved is not None else None
        self.tokenizer = load_tokenizer(cfg.tokenizer, cfg.model.path)
        model = build_model_or_explain(cfg, self.device)
        self.vocab_size = model.config.vocab_size
        check_tokenizer_fits(cfg, self.tokenizer, self.vocab_size)
        offload = offload_setting(cfg, self.shape, self.accelerator)
        self.model = apply_patch(model, cfg, self.groups.sp_group, offload)
        self.n_params = metrics.flop_params(self.model)
        self.dataset = build_train_dataset(cfg.data, self.shape.context_length, self.vocab_size,
                                           self.tokenizer, self.accelerator.main_process_first)
        dp_size = self.shape.dp_size
        self.sampler = ParallelSampler(len(self.dataset), dp_size, self.groups.dp_rank, shuffle=True,
                                       seed=t.seed)
        self.total_steps = count_steps(t, len(self.dataset), dp_size)
        self.layout = DataLayout.of(self.shape, t.seed)
        if self.saved is not None:  # where the epoch continues under this layout (ConfigError if it cannot)
            self.place = place_resume(self.saved, self.layout, len(self.dataset), t.max_steps, t.epochs,
                                      self.total_steps, self.resume)
            self.total_steps = self.place.total_steps

    def _prepare_training(self) -> None:
        """Optimizer and schedule, accelerate's wrapping, the resumed state, metrics and FLOP counts.

        Nothing here may keep a reference to the model's parameters from before ``prepare``: FSDP copies
        them into sharded storage, so a list of the originals would pin a full float32 copy of the
        model on every rank (build_optimizer's lists die with its frame)."""
        cfg, t, acc = self.cfg, self.t, self.accelerator
        optimizer, self.scheduler = build_optimizer(self.model, cfg, self.total_steps)
        if t.cpu_offload:
            use_fsdp_cpu_offload(acc)
        self.model, self.optimizer = acc.prepare(self.model, optimizer)
        self.state = TrainState()
        acc.register_for_checkpointing(self.scheduler, self.state)
        if self.resume is not None:
            with self.progress.phase(f"loading {self.resume.name}", 0):
                load_resume_state(acc, self.resume)
            check_same_data(self.state.data_fingerprint, self.data_fingerprint, self.resume)
            self.state.data_fingerprint = self.data_fingerprint
            if self.state.layout is None:  # a position counted per data-parallel group of this layout
                self.state.samples_in_epoch *= self.shape.dp_size
            reconcile_schedule(t, cfg.saving, self.state, self.total_steps, self.scheduler, self.resume,
                               self.place.why)
            if self.is_main:
                s = self.state
                verified = " (checksums verified)" if cfg.saving.checksums else ""
                logger.info(f"resumed from {self.resume}: step {s.step}, epoch {s.epoch}, {s.tokens} tokens "
                            f"trained; weights, optimizer, scheduler and RNG states loaded{verified}; "
                            f"{self.place.note}")
        else:
            self.state.schedule_steps, self.state.data_fingerprint = self.total_steps, self.data_fingerprint
        self.state.layout = self.layout.to_dict()
        self.writer = MetricsWriter(self.out_dir / cfg.logging.metrics_file if self.is_main else None,
                                    self.state.step if self.resume is not None else None)
        run = self.shape
        self.flops_per_step = metrics.model_flops_per_step(
            acc.unwrap_model(self.model).config, self.n_params, run.sequences_per_step, run.context_length)
        self.peak = metrics.peak_tflops(self.device, cfg.logging.peak_tflops)
        if self.is_main:
            logger.info(f"{run.describe()}; "
                        f"context {run.context_length} ({run.tokens_per_rank} tokens per rank); "
                        f"{self.n_params / 1e6:.2f}M non-embedding parameters; {self.total_steps} steps; "
                        f"device {self.device}")

    def setup(self) -> bool:
        """Build everything; False when the checkpoint to resume from already reached the last step (then
        nothing has been written)."""
        self._start_processes()
        self._build_run()
        if self.resume_step is not None and self.resume_step >= self.total_steps:
            return False
        if self.is_main:
            write_json(self.out_dir / "config.json", self.cfg.to_dict())
        self._prepare_training()
        return True

    # ------------------------------------------------------------------ one step

    def _gradient_sync(self, last: bool) -> Any:
        """The context of a micro-batch's backward. DDP reduces gradients on the last micro-batch only
        (``no_sync`` before). FSDP reduces every micro-batch: skipping its reduce-scatter would keep every
        layer's unsharded gradient (the whole model in the compute dtype, on every rank) until the last
        one, while one more reduce-scatter per micro-batch costs little beside a long-context step."""
        from accelerate.utils import DistributedType

        if last or self.accelerator.distributed_type == DistributedType.FSDP:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(self.model)

    def _forward_backward(self, batches: list[dict], step: int) -> torch.Tensor:
        """Accumulate the gradients of ``batches`` (see _gradient_sync); their summed loss."""
        acc, model, device = self.accelerator, self.model, self.device
        loss_sum = torch.zeros((), device=device)
        for i, batch in enumerate(batches):
            with self._gradient_sync(last=i == len(batches) - 1):
                extra = {"position_ids": batch["position_ids"].to(device)} \
                    if "position_ids" in batch else {}  # packed documents (data.packing)
                out = model(input_ids=batch["input_ids"].to(device), labels=batch["labels"].to(device),
                            **extra)
                acc.backward(out.loss / len(batches))
            loss_sum += out.loss.detach().float()
        return loss_sum

    def _raise_or_warn_nonfinite(self, step: int, loss: float, grad_norm: float | None) -> None:
        if self.t.on_nonfinite == "error":
            raise NonFiniteError(
                f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); stopped before the "
                "update, so no saved checkpoint holds it. Lower training.lr or check the data; "
                "training.on_nonfinite=skip skips such steps instead"
            )
        self.state.skipped_steps += 1
        if self.is_main:
            logger.warning(f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); update "
                           f"skipped (training.on_nonfinite=skip; {self.state.skipped_steps} skipped so far)")

    def train_step(self, batches: list[dict]) -> StepResult:
        """One optimizer step over ``batches`` (gradient accumulation), guarded against non-finite values:
        a NaN/Inf loss or gradient norm raises NonFiniteError, or skips the update (on_nonfinite=skip)."""
        t, acc = self.t, self.accelerator
        step = self.state.step + 1
        tic = time.perf_counter()
        if step == 1 and self.cfg.parity.enabled and self.shape.sp_size > 1:
            with self.progress.phase("parity check", step):
                self._check_parity(batches[0])
        with self.progress.phase("forward/backward", step):
            loss_sum = self._forward_backward(batches, step)
            if self.state.step == self.start_step:
                check_every_parameter_has_a_gradient(self.model)
        # fp16's gradient scaler skips steps with overflowed gradients itself: only the loss is checked then
        check_grad_norm = getattr(acc, "scaler", None) is None
        with self.progress.phase("loss all-reduce and gradient norm", step):
            loss = acc.reduce(loss_sum / len(batches), reduction="mean").item()
            grad_norm = None
            if t.max_grad_norm is not None or check_grad_norm:
                max_norm = t.max_grad_norm if t.max_grad_norm is not None else float("inf")
                grad_norm = float(acc.clip_grad_norm_(self.model.parameters(), max_norm))
        skipped = not (_finite(loss) and (_finite(grad_norm) or not check_grad_norm))
        if skipped:
            self._raise_or_warn_nonfinite(step, loss, grad_norm)
        else:
            self.progress.set("optimizer step", step)
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.state.step = step
        self.state.samples_in_epoch += sum(len(b["input_ids"]) for b in batches) * self.shape.dp_size
        self.state.tokens += self.shape.tokens_per_step
        return StepResult(loss, grad_norm, skipped, time.perf_counter() - tic, batches)

    def _guarded_step(self, batches: list[dict]) -> StepResult:
        """:meth:`train_step`; running out of memory raises OutOfMemoryStop, one line on every rank."""
        try:
            return self.train_step(batches)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            advice = memory_advice(self.cfg, self.shape, run_sharding(self.accelerator), *self.memory_budget)
            line = out_of_memory_line(self.accelerator.process_index, self.progress.operation,
                                      self.state.step + 1, e, self.device, advice)
        raise stop_for_out_of_memory(self.failures, line)  # outside the handler: its frames are freed

    def _check_parity(self, batch: dict) -> None:
        """The first step's parity check (lightseq_hf.check_parity) on ``batch``; its report goes to the
        metrics and the summary; a failure raises ParityError (one line)."""
        from ..guard.first_step import run_first_step_check
        from ..guard.parity import summary

        inputs = {k: batch[k].to(self.device) for k in ("input_ids", "labels", "position_ids") if k in batch}
        report = summary(run_first_step_check(self.model, inputs, self.cfg.parity.model_dump()))
        self.parity_report = report
        if self.is_main:
            self.writer.write({"kind": "parity", "step": 1, **report})
            logger.info(f"parity check passed on {report.get('parity_tokens')} tokens: loss rel err "
                        f"{report.get('parity_loss_rel_err', 0):.1e}, gradients "
                        f"{report.get('parity_grad_rel_err', 0):.1e} (rtol {report.get('parity_rtol')})")

    # ------------------------------------------------------------------ logging

    def _step_flops(self, batches: list[dict]) -> float:
        """Model FLOPs of the step; packed documents count the query-key pairs they see."""
        if not batches or "position_ids" not in batches[0]:
            return self.flops_per_step
        pairs = sum(metrics.packed_attention_pairs(b["position_ids"]) for b in batches)
        total = self.accelerator.reduce(torch.tensor(float(pairs), device=self.device), reduction="sum")
        pairs = float(total)
        return metrics.model_flops_per_step(self.accelerator.unwrap_model(self.model).config, self.n_params,
                                            self.shape.sequences_per_step, self.shape.context_length,
                                            attention_pairs=pairs / self.shape.sp_size)

    def log_step(self, r: StepResult) -> dict:
        """The step's metrics record (written every ``logging.every`` steps, the last, and skipped ones)
        and the progress bar."""
        self.train_time += r.seconds
        self.last_loss = r.loss
        s = self.state
        rec = {"kind": "train", "step": s.step, "epoch": s.epoch, "loss": r.loss,
               "lr": self.scheduler.get_last_lr()[0], "step_time_s": r.seconds, "tokens": s.tokens,
               "tokens_per_s": self.shape.tokens_per_step / r.seconds,
               "elapsed_s": time.perf_counter() - self.t_start}
        if r.grad_norm is not None:
            rec["grad_norm"] = r.grad_norm
        if r.skipped:
            rec["skipped"] = True
        flops = self._step_flops(r.batches)
        if self.device.type == "cuda":
            rec["tflops_per_gpu"] = metrics.tflops_per_device(flops, r.seconds, self.shape.world_size)
            if self.peak:
                rec["mfu"] = metrics.mfu(flops, r.seconds, self.shape.world_size, self.peak)
            mem = torch.tensor([metrics.memory_stats(self.device)["peak_allocated_gib"]], device=self.device)
            rec["peak_mem_gib_per_rank"] = [round(float(x), 2) for x in self.accelerator.gather(mem).cpu()]
        if s.step % self.cfg.logging.every == 0 or s.step == self.total_steps or r.skipped:
            self.writer.write(rec)
        post = {"loss": f"{r.loss:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
        if "mfu" in rec:
            post["mfu"] = f"{rec['mfu']:.1%}"
        if self.last_eval:  # the latest evaluation's accuracy, and the step it was measured at
            post["acc"] = f"{self.last_eval['accuracy']:.2f}@step{self.last_eval['step']}"
        self.bar.set_postfix(post)
        self.bar.update(1)
        return rec

    # ------------------------------------------------------------------ evaluation and saving

    def evaluate(self) -> dict:
        """Held-out retrieval accuracy (synthetic data), written to the metrics."""
        with self.progress.phase("evaluation", self.state.step):
            res = evaluate_passkey(self.model, self.cfg.data.synthetic, self.shape.context_length,
                                   self.vocab_size, self.groups, self.device, self.shape.batch_size)
        res.update(kind="eval", step=self.state.step)
        self.writer.write(res)
        self.last_eval = res
        return res

    def save(self) -> Path:
        """``checkpoint-<step>/`` (see save_checkpoint); a failed write (a full disk) is a CheckpointError."""
        with self.progress.phase("checkpoint save", self.state.step):
            return save_checkpoint(self.accelerator, self.model, self.tokenizer, self.cfg.saving, self.state,
                                   self.out_dir)

    def _after_step(self) -> None:
        step, cfg = self.state.step, self.cfg
        if step >= self.total_steps:
            return
        if cfg.data.type == "synthetic" and cfg.logging.eval_every and step % cfg.logging.eval_every == 0:
            self.evaluate()
        if cfg.saving.every and step % cfg.saving.every == 0:
            self.save()

    # ------------------------------------------------------------------ the loop

    def _steps_of_epoch(self):
        """The epoch's optimizer steps, each a list of up to ``grad_accum`` micro-batches."""
        t = self.t
        self.sampler.set_epoch(self.state.epoch, start=self.state.samples_in_epoch)
        loader = torch.utils.data.DataLoader(self.dataset, batch_size=t.batch_size, sampler=self.sampler,
                                             collate_fn=collate, num_workers=0)
        it = iter(loader)
        while batches := [b for b in (next(it, None) for _ in range(t.grad_accum)) if b is not None]:
            yield batches

    def _train_all_steps(self) -> None:
        while self.state.step < self.total_steps:
            for batches in self._steps_of_epoch():
                self.log_step(self._guarded_step(batches))
                self._after_step()
                if self.state.step >= self.total_steps:
                    return
            self.state.epoch += 1
            self.state.samples_in_epoch = 0
            if self.t.max_steps is None and self.state.epoch >= self.t.epochs:
                return

    def run(self) -> dict:
        """Set up, train, evaluate, save, summarize; the summary (also written to summary.json)."""
        if not self.setup():
            return self.finish_finished_run()
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.total_steps, initial=self.state.step, desc="fine-tune", dynamic_ncols=True,
                        disable=not (self.is_main and self.cfg.logging.progress_bar))
        metrics.reset_peak_memory(self.device)
        self.watch = watch_peers(self.failures)
        self.t_start = time.perf_counter()
        self.model.train()
        self.start_step = self.state.step
        try:
            self._train_all_steps()
            self.bar.close()
            if self.cfg.data.type == "synthetic" and self.cfg.data.synthetic.eval_samples:
                self.evaluate()
            ckpt = self.save() if self.cfg.saving.final else None
        except Exception as e:
            tell_peers(self.failures, e)  # their watch ends them, naming this rank
            raise
        return self.finish(ckpt)

    # ------------------------------------------------------------------ the end

    def summary(self, ckpt: Path | None) -> dict:
        run, s = self.shape, self.state
        summary = {
            "steps": s.step, "final_loss": self.last_loss, "wall_s": time.perf_counter() - self.t_start,
            "train_s": self.train_time, "tokens": s.tokens, "world_size": run.world_size,
            "sp_size": run.sp_size, "dp_size": run.dp_size, "context_length": run.context_length,
            "device": _device_name(self.device),
            "date": datetime.date.today().isoformat(), "checkpoint": str(ckpt) if ckpt else None,
            "resumed_from": str(self.resume) if self.resume is not None else None,
            "skipped_steps": s.skipped_steps, "torch": torch.__version__, "host": platform.node(),
            **self.parity_report,
        }
        summary.update({k if k.startswith("eval") else f"eval_{k}": v for k, v in self.last_eval.items()
                        if k != "kind"})
        return summary

    def finish(self, ckpt: Path | None) -> dict:
        """Write summary.json and the plot (main process), report, and end the process group."""
        summary = self.summary(ckpt)
        if self.is_main:
            write_json(self.out_dir / "summary.json", summary)
            if self.cfg.logging.plot:
                plot_metrics(self.out_dir / self.cfg.logging.metrics_file, self.out_dir / "loss.png",
                             f"{self.shape.context_length} tokens, sp {self.shape.sp_size} x dp "
                             f"{self.shape.dp_size}")
            msg = f"done: {summary['steps']} steps in {summary['wall_s']:.0f}s, loss {self.last_loss:.3f}"
            if self.last_eval:
                e = self.last_eval
                msg += (f", retrieval accuracy {e['accuracy']:.3f} (chance {e['chance']:.3f}, "
                        f"{e['eval_samples']} held-out samples)")
            logger.info(msg + f"; outputs in {self.out_dir}")
        self.end()
        return summary

    def finish_finished_run(self) -> dict:
        """The checkpoint to resume from is at or past the last step: say so, change nothing."""
        if self.is_main:
            logger.info(
                f"nothing to do: {self.resume} is step {self.resume_step} and this run has "
                f"{self.total_steps} steps, so the run in {self.out_dir} is finished; nothing was changed. "
                "Raise training.max_steps (with saving.on_schedule_change) to train further")
        self.end()
        return read_summary(self.out_dir) or {"steps": self.resume_step, "resumed_from": str(self.resume)}

    def end(self) -> None:
        """Every rank arrives, then the process groups are destroyed."""
        if getattr(self, "watch", None) is not None:
            self.watch.stop()
        with self.progress.phase("finish", getattr(self, "state", TrainState()).step):
            self.accelerator.wait_for_everyone()
        release_locks()
        self.accelerator.end_training()


def train(cfg: FinetuneConfig) -> dict:
    """Run the fine-tune the config describes; return the summary (also written to summary.json).

    Raises ConfigError, CheckpointError, NonFiniteError or PeerFailure with a message naming the
    problem (the CLI prints it as one line)."""
    return Trainer(cfg).run()

