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
from .saving import read_completion_record


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


def _resume_checks(cfg: FinetuneConfig, resume: Path, world: int | None) -> str:
    """The data and the schedule against the checkpoint's; what was compared, in words."""
    record = read_completion_record(resume)
    meta = record.get("meta", {})
    check_same_data(meta.get("data_fingerprint"), data_fingerprint(cfg), resume)
    steps = None
    if cfg.training.max_steps is not None:
        steps = cfg.training.max_steps
    elif cfg.data.type == "synthetic" and world:
        steps = count_steps(cfg, cfg.data.synthetic.num_samples, world // (cfg.sp_size or world))
    if steps is None:
        return "resume data matches (the step count is known once the data is tokenized)"
    changed = check_schedule(cfg, meta.get("schedule_steps"), steps, record["step"], resume)
    return ("resume data matches, schedule " + (f"changes ({cfg.saving.on_schedule_change})" if changed
                                                else "matches"))


def preflight(cfg: FinetuneConfig, world: int | None, resume: Path | None) -> list[str]:
    """Run the checks; what passed, in words. Raises ConfigError (or CheckpointError) as the run would."""
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
        done.append(_resume_checks(cfg, resume, world))
    return done
