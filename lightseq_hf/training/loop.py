"""The accelerate training loop for sequence-parallel fine-tuning.

Every rank of a sequence-parallel group receives the same full batch and calls the
patched model with it (the patch slices the sequence and returns the group's global
token-mean loss); DDP (or FSDP, through the accelerate config) averages gradients over
all ranks. Data-parallel groups get disjoint samples from :class:`ParallelSampler`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..metrics import (
    flop_params,
    memory_stats,
    model_flops_per_step,
    packed_attention_pairs,
    peak_tflops,
    reset_peak_memory,
    tflops_per_device,
)
from ..parallel.sharding import shard_for
from .config import RESUME_LATEST, RESUME_LATEST_OR_FRESH, ConfigError, FinetuneConfig, validate
from .data import ParallelSampler, build_train_dataset, collate, load_tokenizer, passkey_spec
from .guards import NonFiniteError, Progress, fault
from .saving import (
    CheckpointError,
    checkpoint_step,
    find_latest_checkpoint,
    publish,
    temporary_path,
    verify_checkpoint,
    write_completion_record,
)


class TrainState:
    """Progress counters, saved with the checkpoint (accelerate ``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0
        self.epoch = 0
        self.samples_in_epoch = 0  # samples this data-parallel group consumed in the current epoch
        self.tokens = 0  # tokens trained on, all data-parallel groups together
        self.schedule_steps: int | None = None  # the step count the learning-rate schedule spans
        self.skipped_steps = 0  # steps whose update was skipped (non-finite, training.on_nonfinite=skip)

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def lr_lambda(cfg: FinetuneConfig, total_steps: int):
    """Warmup then cosine, linear or constant decay to ``min_lr_ratio`` (multiplier of ``lr``)."""
    t = cfg.training

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        span = max(1, total_steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if t.lr_schedule == "cosine" else 1 - progress
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * decay

    return f


def build_model(cfg: FinetuneConfig, device: torch.device | None = None) -> torch.nn.Module:
    """Load ``model.path`` or build ``model.config`` with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, cfg.model.dtype)
    m = cfg.model
    if m.path is not None:
        hf_cfg = AutoConfig.from_pretrained(m.path)
        if m.config:
            hf_cfg.update({k: v for k, v in m.config.items() if k != "model_type"})
        if not m.random_init:
            return AutoModelForCausalLM.from_pretrained(m.path, config=hf_cfg, dtype=dtype)
    else:
        entries = dict(m.config)
        hf_cfg = AutoConfig.for_model(entries.pop("model_type"), **entries)
    ctx = torch.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()
    with ctx:  # random init straight on the GPU: a 7B model initializes in seconds there
        return AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)


def offload_setting(cfg: FinetuneConfig, accelerator: Any) -> bool | int:
    """``training.offload_checkpoints``, with ``auto`` resolved by the planner against this rank's
    device memory and its share of the host's available memory."""
    offload = cfg.training.offload_checkpoints
    if offload != "auto":
        return offload
    if accelerator.device.type != "cuda":
        return False  # nothing to gain: the "device" is host memory
    from accelerate.utils import DistributedType

    from ..memory import memory_budget
    from .cli import resolve_auto_offload

    world = accelerator.num_processes
    sharding = "fsdp" if accelerator.distributed_type == DistributedType.FSDP else "replicated"
    gpu, host = memory_budget(accelerator.device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    layers = resolve_auto_offload(cfg, world, sharding, gpu, host)
    if accelerator.is_main_process:
        print(f"[lightseq] training.offload_checkpoints=auto: {layers} layers' checkpoints in host memory "
              f"(planner; {gpu / 2**30:.0f} GiB device, {host / 2**30:.0f} GiB host per rank)", flush=True)
    return layers


def apply_patch(model: torch.nn.Module, cfg: FinetuneConfig, sp_group: Any,
                offload: bool | int | None = None) -> torch.nn.Module:
    """Patch the model for sequence parallelism and set up checkpointing (``offload``: the resolved
    ``training.offload_checkpoints``)."""
    import lightseq_hf

    ckpt = cfg.training.checkpointing
    offload = cfg.training.offload_checkpoints if offload is None else offload
    model = lightseq_hf.patch_model(model, sp_group=sp_group, backend=cfg.training.backend,
                                    checkpointing="remat" if ckpt == "none" else ckpt,
                                    offload_checkpoints=offload,
                                    tiled_mlp=cfg.training.tiled_mlp)
    if ckpt != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model


def use_fsdp_cpu_offload(accelerator: Any) -> None:
    """``training.cpu_offload``: FSDP2's CPUOffloadPolicy (master weights, gradients and the optimizer
    step on the host, pinned); only under an FSDP2 accelerate config."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
        raise ConfigError(
            "training.cpu_offload needs FSDP2: launch with an accelerate config that has distributed_type: "
            "FSDP and fsdp_version: 2 (e.g. configs/accelerate/1node-8gpu-fsdp.yaml)"
        )
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin.cpu_offload = CPUOffloadPolicy(pin_memory=True)


def _warn(msg: str) -> None:
    print(f"[lightseq] warning: {msg}", flush=True)


_RUN_FILES = ("summary.json", "loss.png", "config.json")


def _existing_run(out_dir: Path, metrics_file: str) -> list[Path]:
    """What a previous run left in ``out_dir`` (metrics, summary, checkpoints, interrupted saves)."""
    found = [p for p in (out_dir / metrics_file, out_dir / "summary.json") if p.exists()]
    found += sorted(p for p in out_dir.glob("checkpoint-*") if checkpoint_step(p) is not None)
    found += sorted(out_dir.glob(".checkpoint-*.tmp"))
    return found


def _check_writable(out_dir: Path, dry_run: bool) -> None:
    try:
        if dry_run:
            parent = next(p for p in (out_dir, *out_dir.absolute().parents) if p.exists())
            if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
                raise PermissionError(f"{parent} is not a writable directory")
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output_dir: cannot write to {out_dir} ({e.strerror or e}); choose a writable "
                          "directory") from None


def prepare_output_dir(cfg: FinetuneConfig, dry_run: bool = False) -> Path | None:
    """Check ``output_dir`` is writable, pick the checkpoint to resume from, protect a previous run.

    Returns the checkpoint directory to load (verified complete and intact) or None for a fresh
    start. Raises ConfigError or CheckpointError naming the problem. Main process only;
    ``dry_run`` checks the same without creating, moving or printing anything.
    """
    out_dir = Path(cfg.output_dir)
    _check_writable(out_dir, dry_run)
    s = cfg.saving
    resume: Path | None = None
    if s.resume_from in (RESUME_LATEST, RESUME_LATEST_OR_FRESH):
        resume, skipped = find_latest_checkpoint(out_dir, s.checksums, require="state")
        for reason in skipped if not dry_run else ():
            _warn(f"skipped {reason}")
        if resume is None and s.resume_from == RESUME_LATEST:
            why = f" ({len(skipped)} skipped: {'; '.join(skipped)})" if skipped else ""
            raise ConfigError(
                f"saving.resume_from=latest: no complete checkpoint with training state in {out_dir}{why}. "
                "Pass a checkpoint path, or saving.resume_from=latest_or_fresh to start from step 0 when "
                "there is none"
            )
        if resume is None and not dry_run:
            print(f"[lightseq] saving.resume_from=latest_or_fresh: no complete checkpoint in {out_dir}; "
                  "starting from step 0", flush=True)
    elif s.resume_from is not None:
        resume = Path(s.resume_from)
        verify_checkpoint(resume, s.checksums)
    if resume is not None and not (resume / "state").is_dir():
        raise CheckpointError(
            f"{resume} holds weights only (saved with saving.save_optimizer=false): there is no state/ to "
            f"resume from. Start a new run from its weights with model.path={resume}"
        )
    if resume is None:
        previous = _existing_run(out_dir, cfg.logging.metrics_file)
        archive_ok = s.if_output_exists == "archive" or s.resume_from == RESUME_LATEST_OR_FRESH
        if previous and not archive_ok:
            names = ", ".join(p.name for p in previous[:4]) + (", ..." if len(previous) > 4 else "")
            raise ConfigError(
                f"output_dir {out_dir} already holds a run ({names}). Resume it with "
                "saving.resume_from=latest, choose another output_dir, or set saving.if_output_exists="
                "archive to move the old run into a subdirectory"
            )
        if previous and not dry_run:
            stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
            archive = out_dir / f"previous-{stamp}"
            while archive.exists():
                archive, n = out_dir / f"previous-{stamp}-{n}", n + 1
            archive.mkdir()
            for p in previous + [out_dir / n for n in _RUN_FILES if (out_dir / n).exists()]:
                if p.exists():
                    shutil.move(str(p), str(archive / p.name))
            print(f"[lightseq] moved the previous run (nothing to resume from) to {archive}", flush=True)
    return resume


class _Writer:
    """Metrics as JSON lines (main process only). Resuming keeps the records up to the resumed step;
    later ones (steps that will run again) are first copied to ``<metrics>.before-resume-<step>``."""

    def __init__(self, path: Path | None, keep_until_step: int | None) -> None:
        self.path = path
        if path is None or not path.exists():
            return
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if keep_until_step is None:  # prepare_output_dir moved or refused a previous run
            raise RuntimeError(f"{path} exists on a fresh start")
        kept = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut short by a crash
                continue
            if rec.get("step", 0) <= keep_until_step:
                kept.append(line)
        if len(kept) < len(lines):
            backup = path.with_name(f"{path.name}.before-resume-{keep_until_step}")
            shutil.copyfile(path, backup)
            print(f"[lightseq] {len(lines) - len(kept)} metrics records after step {keep_until_step} (they "
                  f"run again) are kept in {backup}", flush=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)

    def write(self, record: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def plot_metrics(metrics_path: Path, png_path: Path, title: str = "") -> None:
    """Loss curve (and retrieval accuracy with its chance level, when logged) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], color="tab:blue", lw=1,
            label="train loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss", color="tab:blue")
    if evals:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", color="tab:red",
                 label="retrieval accuracy")
        ax2.axhline(evals[-1]["chance"], color="tab:red", ls="--", lw=1, label="chance")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("retrieval accuracy (held-out)", color="tab:red")
        ax2.legend(loc="center right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


@torch.no_grad()
def evaluate_passkey(model: torch.nn.Module, cfg: FinetuneConfig, vocab_size: int, groups: Any,
                     device: torch.device, batch_size: int) -> dict:
    """Retrieval accuracy on held-out passkey samples (greedy prediction of each answer token).

    Data-parallel groups split the samples; each rank scores the answer positions inside its
    own slice of the sequence; counts are summed over all ranks.
    """
    from .synthetic import PasskeyDataset, answer_accuracy

    spec = passkey_spec(cfg, seed=cfg.data.synthetic.seed + 1_000_000, vocab_size=vocab_size)
    n_eval = cfg.data.synthetic.eval_samples
    ds = PasskeyDataset(spec, n_eval)
    mine = list(range(groups.dp_rank, n_eval, groups.dp_size))
    n = cfg.context_length
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


def _main_decides(accelerator: Any, fn: Any) -> Any:
    """Run ``fn`` on the main process and hand its result, or its ConfigError/CheckpointError, to every
    rank (so that all ranks stop together, with the same message)."""
    result: list[Any] = [None, None]
    if accelerator.is_main_process:
        try:
            result = [fn(), None]
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait
            result = [None, (type(e).__name__, str(e))]
    if accelerator.num_processes > 1:
        device = accelerator.device if dist.get_backend() == "nccl" else None
        dist.broadcast_object_list(result, src=0, device=device)
    if result[1] is not None:
        kind, msg = result[1]
        known = {"ConfigError": ConfigError, "CheckpointError": CheckpointError}
        raise known[kind](msg) if kind in known else RuntimeError(f"{kind}: {msg}")
    return result[0]


def _load_resume_state(accelerator: Any, resume: Path) -> None:
    try:
        accelerator.load_state(str(resume / "state"))
    except Exception as e:  # a file the completion record could not vouch for (checksums off, old version)
        raise CheckpointError(f"{resume}: loading the training state failed ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from e


def _reconcile_schedule(cfg: FinetuneConfig, state: TrainState, total_steps: int, scheduler: Any,
                        resume: Path) -> None:
    """A resumed run whose step count differs from the checkpoint's: error, or the configured choice."""
    saved = state.schedule_steps
    if saved is None or saved == total_steps:
        state.schedule_steps = total_steps
        return
    choice = cfg.saving.on_schedule_change
    old_lr = cfg.training.lr * lr_lambda(cfg, saved)(state.step)
    new_lr = cfg.training.lr * lr_lambda(cfg, total_steps)(state.step)
    if choice == "error":
        raise ConfigError(
            f"saving.on_schedule_change: {resume} was trained with a learning-rate schedule of {saved} "
            f"steps, this run has {total_steps}; resuming would move the learning rate at step {state.step} "
            f"from {old_lr:.3g} to {new_lr:.3g}. Set saving.on_schedule_change=keep (finish the old "
            "schedule, then hold its final rate) or =rebuild (stretch the schedule to the new length)"
        )
    if choice == "rebuild":
        state.schedule_steps = total_steps
        print(f"[lightseq] saving.on_schedule_change=rebuild: schedule of {saved} steps rebuilt for "
              f"{total_steps}; learning rate at step {state.step}: {old_lr:.3g} -> {new_lr:.3g}", flush=True)
    else:
        print(f"[lightseq] saving.on_schedule_change=keep: the {saved}-step schedule continues "
              f"(learning rate at step {state.step}: {old_lr:.3g}) for {total_steps} steps", flush=True)
    scheduler.lr_lambdas = [lr_lambda(cfg, state.schedule_steps)] * len(scheduler.lr_lambdas)


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


def train(cfg: FinetuneConfig) -> dict:
    """Run the fine-tune the config describes; return the summary (also written to summary.json).

    Raises ConfigError, CheckpointError, NonFiniteError or PeerFailure with a message naming the
    problem (the CLI prints it as one line)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    t = cfg.training
    use_cpu = t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available())
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device is 'cuda' but no CUDA device is available")
    timeout = datetime.timedelta(seconds=t.timeout_s)
    accelerator = Accelerator(cpu=use_cpu, mixed_precision=t.mixed_precision,
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])
    world = accelerator.num_processes
    validate(cfg, world_size=world)
    set_seed(t.seed)  # the same initial weights on every rank
    progress = Progress(accelerator.process_index, world, t.timeout_s)

    from ..parallel.groups import init_sequence_parallel

    with progress.phase("set-up", 0):
        groups = init_sequence_parallel(cfg.sp_size or world, timeout=timeout)
        out_dir = Path(cfg.output_dir)
        resume = _main_decides(accelerator, lambda: prepare_output_dir(cfg))
    if accelerator.is_main_process:
        (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    device = accelerator.device

    tokenizer = load_tokenizer(cfg.tokenizer, cfg.model.path)
    try:
        model = build_model(cfg, device)
    except Exception as e:
        refused = isinstance(e, (ValueError, TypeError, KeyError)) or \
            type(e).__module__.split(".")[0] in ("transformers", "huggingface_hub")
        if not refused:  # not transformers refusing the architecture entries
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model: transformers could not build the model from model.path/model.config: "
                          f"{msg}") from e
    vocab_size = model.config.vocab_size
    model = apply_patch(model, cfg, groups.sp_group, offload_setting(cfg, accelerator))
    n_params = flop_params(model)

    dataset = build_train_dataset(cfg, tokenizer, accelerator.main_process_first, vocab_size=vocab_size)
    sampler = ParallelSampler(len(dataset), groups.dp_size, groups.dp_rank, shuffle=True, seed=t.seed)
    micro_per_epoch = math.ceil(sampler.per_group / t.batch_size)
    steps_per_epoch = math.ceil(micro_per_epoch / t.grad_accum)
    total_steps = t.max_steps if t.max_steps is not None else steps_per_epoch * t.epochs

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr, betas=tuple(t.betas), fused=False,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    if t.cpu_offload:
        use_fsdp_cpu_offload(accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    accelerator.register_for_checkpointing(scheduler, state)

    if resume is not None:
        with progress.phase(f"loading {resume.name}", 0):
            _load_resume_state(accelerator, resume)
        _reconcile_schedule(cfg, state, total_steps, scheduler, resume)
        if accelerator.is_main_process:
            print(f"[lightseq] resumed from {resume}: step {state.step}, epoch {state.epoch}, "
                  f"{state.tokens} tokens trained; weights, optimizer, scheduler and RNG states loaded"
                  + (" (checksums verified)" if cfg.saving.checksums else ""), flush=True)
    else:
        state.schedule_steps = total_steps
    writer = _Writer(out_dir / cfg.logging.metrics_file if accelerator.is_main_process else None,
                     state.step if resume is not None else None)

    seqs_per_step = t.batch_size * t.grad_accum * groups.dp_size
    tokens_per_step = seqs_per_step * cfg.context_length
    flops_per_step = model_flops_per_step(accelerator.unwrap_model(model).config, n_params, seqs_per_step,
                                          cfg.context_length)
    peak = peak_tflops(device, cfg.logging.peak_tflops)
    is_synthetic = cfg.data.type == "synthetic"
    if accelerator.is_main_process:
        print(f"[lightseq] world {world} = {groups.dp_size} data-parallel x {groups.sp_size} "
              f"sequence-parallel; context {cfg.context_length} ({cfg.context_length // groups.sp_size} "
              f"tokens per rank); {n_params / 1e6:.2f}M non-embedding parameters; {total_steps} steps; "
              f"device {device}", flush=True)

    from tqdm.auto import tqdm

    bar = tqdm(total=total_steps, initial=state.step, disable=not (accelerator.is_main_process and
               cfg.logging.progress_bar), desc="fine-tune", dynamic_ncols=True)
    reset_peak_memory(device)
    last_eval: dict = {}
    t_start = time.perf_counter()
    train_time = 0.0
    last_loss = float("nan")
    rank = accelerator.process_index
    # fp16's gradient scaler skips steps with overflowed gradients itself: only the loss is checked then
    check_grad_norm = getattr(accelerator, "scaler", None) is None

    def run_eval() -> dict:
        with progress.phase("evaluation", state.step):
            res = evaluate_passkey(model, cfg, vocab_size, groups, device, t.batch_size)
        res.update(kind="eval", step=state.step)
        writer.write(res)
        return res

    def save() -> Path:
        with progress.phase("checkpoint save", state.step):
            return save_checkpoint(accelerator, model, tokenizer, cfg, state, out_dir)

    model.train()
    start_step = state.step
    done = state.step >= total_steps
    while not done:
        sampler.set_epoch(state.epoch, start=state.samples_in_epoch)
        loader = torch.utils.data.DataLoader(dataset, batch_size=t.batch_size, sampler=sampler,
                                             collate_fn=collate, num_workers=0)
        it = iter(loader)
        while True:
            batches = []
            for _ in range(t.grad_accum):
                b = next(it, None)
                if b is None:
                    break
                batches.append(b)
            if not batches:
                break
            step = state.step + 1
            tic = time.perf_counter()
            fault("step", rank, step)
            with progress.phase("forward/backward", step):
                loss_sum = torch.zeros((), device=device)
                for i, batch in enumerate(batches):
                    sync = i == len(batches) - 1
                    ctx = contextlib.nullcontext() if sync else accelerator.no_sync(model)
                    with ctx:
                        extra = {"position_ids": batch["position_ids"].to(device)} \
                            if "position_ids" in batch else {}  # packed documents (data.packing)
                        out = model(input_ids=batch["input_ids"].to(device),
                                    labels=batch["labels"].to(device), **extra)
                        accelerator.backward(out.loss / len(batches))
                    loss_sum += out.loss.detach().float()
                if fault("loss", rank, step):
                    loss_sum += float("nan")
                if state.step == start_step:
                    check_every_parameter_has_a_gradient(model)
            with progress.phase("loss all-reduce and gradient norm", step):
                loss = accelerator.reduce(loss_sum / len(batches), reduction="mean").item()
                grad_norm = None
                if t.max_grad_norm is not None or check_grad_norm:
                    max_norm = t.max_grad_norm if t.max_grad_norm is not None else float("inf")
                    grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), max_norm))
            skipped = not (_finite(loss) and (_finite(grad_norm) or not check_grad_norm))
            if skipped and t.on_nonfinite == "error":
                raise NonFiniteError(
                    f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); stopped before "
                    "the update, so no saved checkpoint holds it. Lower training.lr or check the data; "
                    "training.on_nonfinite=skip skips such steps instead"
                )
            if skipped:
                state.skipped_steps += 1
                if accelerator.is_main_process:
                    _warn(f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); update "
                          f"skipped (training.on_nonfinite=skip; {state.skipped_steps} skipped so far)")
            else:
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - tic
            train_time += dt
            state.step += 1
            state.samples_in_epoch += sum(len(b["input_ids"]) for b in batches)
            state.tokens += tokens_per_step
            last_loss = loss
            rec = {"kind": "train", "step": state.step, "epoch": state.epoch, "loss": loss,
                   "lr": scheduler.get_last_lr()[0], "step_time_s": dt, "tokens": state.tokens,
                   "tokens_per_s": tokens_per_step / dt, "elapsed_s": time.perf_counter() - t_start}
            if grad_norm is not None:
                rec["grad_norm"] = grad_norm
            if skipped:
                rec["skipped"] = True
            step_flops = flops_per_step
            if batches and "position_ids" in batches[0]:  # packed documents: count the pairs they see
                pairs = torch.tensor(float(sum(packed_attention_pairs(b["position_ids"]) for b in batches)),
                                     device=device)
                pairs = float(accelerator.reduce(pairs, reduction="sum")) / groups.sp_size
                step_flops = model_flops_per_step(accelerator.unwrap_model(model).config, n_params,
                                                  seqs_per_step, cfg.context_length, attention_pairs=pairs)
            tflops = tflops_per_device(step_flops, dt, world)
            if device.type == "cuda":
                rec["tflops_per_gpu"] = tflops
                if peak:
                    rec["mfu"] = tflops / peak
                mem = torch.tensor([memory_stats(device)["peak_allocated_gib"]], device=device)
                rec["peak_mem_gib_per_rank"] = [round(float(x), 2) for x in accelerator.gather(mem).cpu()]
            if state.step % cfg.logging.every == 0 or state.step == total_steps or skipped:
                writer.write(rec)
            post = {"loss": f"{loss:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
            if "mfu" in rec:
                post["mfu"] = f"{rec['mfu']:.1%}"
            if last_eval:
                post["acc"] = f"{last_eval['accuracy']:.2f}"
            bar.set_postfix(post)
            bar.update(1)
            if is_synthetic and cfg.logging.eval_every and state.step % cfg.logging.eval_every == 0 \
                    and state.step < total_steps:
                last_eval = run_eval()
                bar.set_postfix({**post, "acc": f"{last_eval['accuracy']:.2f}"})
            if cfg.saving.every and state.step % cfg.saving.every == 0 and state.step < total_steps:
                save()
            if state.step >= total_steps:
                done = True
                break
        if not done:
            state.epoch += 1
            state.samples_in_epoch = 0
            if t.max_steps is None and state.epoch >= t.epochs:
                done = True
    bar.close()
    if is_synthetic and cfg.data.synthetic.eval_samples:
        last_eval = run_eval()
    ckpt = None
    if cfg.saving.final:
        ckpt = save()
    wall = time.perf_counter() - t_start
    summary = {
        "steps": state.step, "final_loss": last_loss, "wall_s": wall, "train_s": train_time,
        "tokens": state.tokens, "world_size": world, "sp_size": groups.sp_size, "dp_size": groups.dp_size,
        "context_length": cfg.context_length, "device": _device_name(device), "date":
        datetime.date.today().isoformat(), "checkpoint": str(ckpt) if ckpt else None,
        "resumed_from": str(resume) if resume is not None else None, "skipped_steps": state.skipped_steps,
        "torch": torch.__version__, "host": platform.node(),
    }
    if last_eval:
        summary.update({k if k.startswith("eval") else f"eval_{k}": v for k, v in last_eval.items()
                        if k != "kind"})
    if accelerator.is_main_process:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if cfg.logging.plot:
            plot_metrics(out_dir / cfg.logging.metrics_file, out_dir / "loss.png",
                         f"{cfg.context_length} tokens, sp {groups.sp_size} x dp {groups.dp_size}")
        msg = f"[lightseq] done: {state.step} steps in {wall:.0f}s, loss {last_loss:.3f}"
        if last_eval:
            msg += (f", retrieval accuracy {last_eval['accuracy']:.3f} (chance {last_eval['chance']:.3f},"
                    f" {last_eval['eval_samples']} held-out samples)")
        print(msg + f"; outputs in {out_dir}", flush=True)
    with progress.phase("finish", state.step):
        accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def check_every_parameter_has_a_gradient(model: torch.nn.Module) -> None:
    """Raise if a trainable parameter got no gradient from the first step: it would silently never train."""
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise RuntimeError(
            f"{len(missing)} trainable parameters received no gradient in the first step ({shown}); they "
            "would never train. Freeze them (requires_grad=False) or report this with the wrapping used."
        )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def save_checkpoint(accelerator: Any, model: torch.nn.Module, tokenizer: Any, cfg: FinetuneConfig,
                    state: TrainState, out_dir: Path) -> Path:
    """``checkpoint-<step>/``: save_pretrained model (+ tokenizer) and, under ``state/``, everything
    needed to resume (weights, optimizer, scheduler, counters, RNG states of every rank).

    Written under ``.checkpoint-<step>.tmp``; once every rank has finished, the main process
    records every file (size, sha256) in ``checkpoint_complete.json`` and renames the directory,
    so a crash at any point leaves either no ``checkpoint-<step>`` or a complete one."""
    step = state.step
    final, tmp = out_dir / f"checkpoint-{step}", temporary_path(out_dir, step)
    rank = accelerator.process_index
    if accelerator.is_main_process:
        if tmp.exists():  # left by a save that crashed
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
    fault("save", rank, step)
    if cfg.saving.save_optimizer:
        accelerator.save_state(str(tmp / "state"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_completion_record(tmp, step, {"epoch": state.epoch, "tokens": state.tokens,
                                            "world_size": accelerator.num_processes,
                                            "schedule_steps": state.schedule_steps}, cfg.saving.checksums)
        aside = publish(tmp, final)
        if aside is not None:
            _warn(f"{final.name} already existed (from an earlier run); moved to {aside.name}")
    accelerator.wait_for_everyone()
    return final
