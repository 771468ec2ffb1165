"""``lightseq-finetune --check``: the checks a run makes before its first step, without a process group,
weights or training.

Beyond the config and ``output_dir`` (:func:`~lightseq_hf.training.output.prepare_output_dir`), a run
loads the tokenizer, builds the model (here on the meta device, so nothing is allocated) and has the
patch describe it, fits the tokenizer to the embeddings, reads the data and its text column, and, when it
resumes, compares the data and the learning-rate schedule with the checkpoint's. Each failure is the
same ConfigError the run would raise.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .build import check_tokenizer_fits, count_steps, model_config
from .checkpoints import check_same_data, check_schedule
from .config import ConfigError, FinetuneConfig
from .data import data_fingerprint, load_raw_dataset, load_tokenizer, require_tokenizer
from .layout import DataLayout, check_resume_layout, place_resume
from .saving import read_completion_record
from .shape import RunShape

__all__ = ["preflight"]


def _model(cfg: FinetuneConfig) -> torch.nn.Module:
    """The model the run builds, on the meta device; ConfigError when Transformers or the patch refuse it."""
    from transformers import AutoModelForCausalLM

    from ..patches.architectures import UnsupportedModel, describe

    try:
        hf_config = model_config(cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception as e:  # noqa: BLE001 - Transformers' refusal, in one line
        text = " ".join(str(e).split())[:300] or type(e).__name__
        raise ConfigError(f"model: transformers could not build the model from model.path/model.config: "
                          f"{text}") from None
    try:
        describe(model)
    except UnsupportedModel as e:
        raise ConfigError(f"model: {e}") from None
    return model


def _resume_checks(cfg: FinetuneConfig, resume: Path, run: RunShape | None) -> str:
    """The data, the layout and the schedule against the checkpoint's; what was compared, in words."""
    record = read_completion_record(resume)
    saved = {"step": record["step"], **record.get("meta", {})}
    check_same_data(saved.get("data_fingerprint"), data_fingerprint(cfg.data, cfg.context_length), resume)
    if run is None:
        return "resume data matches (add --world-size N to check the layout and the schedule)"
    t = cfg.training
    now = DataLayout.of(run, t.seed)
    samples = cfg.data.synthetic.num_samples if cfg.data.type == "synthetic" else None
    if t.max_steps is None and samples is None:
        note = check_resume_layout(saved.get("layout"), now, saved.get("samples_in_epoch", 0),
                                   saved.get("epoch", 0), resume)
        return f"resume data matches, {note} (the step count is known once the data is tokenized)"
    total = count_steps(t, samples, now.dp_size) if samples is not None else t.max_steps
    place = place_resume(saved, now, samples or 0, t.max_steps, t.epochs, total, resume)
    changed = check_schedule(t, cfg.saving, saved.get("schedule_steps"), place.total_steps, record["step"],
                             resume, place.why)
    return (f"resume data matches, {place.note}, schedule "
            + (f"changes ({cfg.saving.on_schedule_change})" if changed else "matches"))


def preflight(cfg: FinetuneConfig, run: RunShape | None, resume: Path | None) -> list[str]:
    """Run the checks for a run in the shape ``run`` (None: the world size is not known); what passed, in
    words. Raises ConfigError (or CheckpointError) as the run would."""
    done = []
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.model.path)
    if cfg.data.type != "synthetic":
        require_tokenizer(tokenizer)
        done.append("tokenizer loads")
    model = _model(cfg)
    check_tokenizer_fits(cfg, tokenizer, model.config.vocab_size)
    done.append(f"model builds ({type(model).__name__}) and the patch serves it")
    if cfg.data.type == "files":
        load_raw_dataset(cfg.data)
        done.append(f"data readable, column {cfg.data.text_field!r} present")
    if resume is not None:
        done.append(_resume_checks(cfg, resume, run))
    return done
