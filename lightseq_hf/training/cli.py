"""``lightseq-finetune CONFIG.yaml [key.sub=value ...]`` (also ``scripts/finetune.py``).

Exit status: 0 done, 2 a configuration problem (one line, printed by rank 0 only), 1 a run that
stopped on a checkpoint, non-finite or peer failure (one line per rank that saw it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from .config import ConfigError, load_config

EXIT_CONFIG, EXIT_FAILED = 2, 1


def _world_size() -> int | None:
    ws = os.environ.get("WORLD_SIZE")
    return int(ws) if ws else None


def _is_reporting_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _fail(msg: str, code: int, every_rank: bool = False) -> int:
    if every_rank or _is_reporting_rank():
        print(f"lightseq-finetune: {msg}", file=sys.stderr, flush=True)
    return code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line (no usage block), exit status 2
        raise ConfigError(f"{message} (see lightseq-finetune --help)")


def plan_inputs(cfg: Any, world: int, sharding: str) -> tuple[Any, Any]:
    """The planner's ``(ModelShape, PlanOptions)`` for a config run on ``world`` processes."""
    from ..planner import ModelShape, PlanOptions

    sp = cfg.sp_size or world
    entries = {}
    if cfg.model.path is not None:
        config_file = Path(cfg.model.path) / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model.path: {config_file} does not exist (the planner reads the "
                              "architecture from it)")
        entries.update(json.loads(config_file.read_text()))
    entries.update(cfg.model.config or {})
    t = cfg.training
    compute = {"bf16": "bfloat16", "fp16": "float16"}.get(t.mixed_precision or "", cfg.model.dtype)
    opts = PlanOptions(context=cfg.context_length, sp_size=sp, world=world, batch=t.batch_size,
                       sharding=sharding if world > 1 else "replicated", master_dtype=cfg.model.dtype,
                       compute_dtype=compute, checkpointing=t.checkpointing,
                       offload_checkpoints=t.offload_checkpoints, tiled_mlp=t.tiled_mlp,
                       cpu_offload=t.cpu_offload,
                       attention_kernel="reference" if t.backend == "reference" else "flash")
    return ModelShape.from_config(entries), opts


def resolve_auto_offload(cfg: Any, world: int, sharding: str, gpu_bytes: float, host_bytes: float) -> int:
    """``training.offload_checkpoints: auto``: the fewest layers to offload for the step to fit
    ``gpu_bytes`` per rank, by the planner; every layer when even that does not fit (the run then
    shows where memory ends). Raises ConfigError when the host cannot hold what must go there."""
    from ..planner import GIB, layers_to_offload

    shape, opts = plan_inputs(cfg, world, sharding)
    layers = layers_to_offload(shape, opts, gpu_bytes, host_bytes)
    if layers is None:
        if layers_to_offload(shape, opts, gpu_bytes) is not None:
            raise ConfigError(
                f"training.offload_checkpoints=auto: at context_length {cfg.context_length} the checkpoints "
                f"the device cannot keep do not fit {host_bytes / GIB:.0f} GiB of host memory per rank "
                "either; shorten the context, use more GPUs, or add training.tiled_mlp (see "
                "lightseq-finetune CONFIG --plan)")
        return shape.layers
    return layers


def plan_text(cfg: Any, world: int | None, sharding: str, gpu_gib: float | None,
              host_gib: float | None) -> str:
    """The ``--plan`` report: predicted peaks at the config's context and the longest that fits."""
    from dataclasses import replace

    from ..planner import GIB, layers_to_offload, longest_context, plan_memory

    world = world or cfg.sp_size or 1
    sp = cfg.sp_size or world
    shape, opts = plan_inputs(cfg, world, sharding)
    t = cfg.training
    if gpu_gib is None:
        import torch

        cuda = torch.cuda.is_available()
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB if cuda else 139.0
    if host_gib is None:
        host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB / world
    offload_note = ""
    if t.offload_checkpoints == "auto":
        layers = layers_to_offload(shape, opts, gpu_gib * GIB, host_gib * GIB)
        offload_note = (f"offload_checkpoints auto: {layers} of {shape.layers} layers offloaded at this "
                        "context" if layers is not None else
                        "offload_checkpoints auto: no number of offloaded layers fits at this context")
        chosen = shape.layers if layers is None else layers
        plan = plan_memory(shape, replace(opts, offload_checkpoints=chosen))
    else:
        plan = plan_memory(shape, opts)
    longest = longest_context(shape, opts, gpu_gib * GIB, host_gib * GIB)
    options = (f"checkpointing {t.checkpointing}, offload_checkpoints {t.offload_checkpoints}, tiled_mlp "
               f"{t.tiled_mlp}, cpu_offload {t.cpu_offload}, {opts.sharding} over {world} ranks, sp {sp}, "
               f"{opts.compute_dtype} activations, {cfg.model.dtype} master weights, AdamW")
    return "\n".join([
        f"plan for {cfg.context_length} tokens ({cfg.context_length // sp} per rank), "
        f"{shape.params / 1e9:.2f}B parameters; {options}",
        *([offload_note] if offload_note else []),
        plan.describe(),
        f"longest context that fits {gpu_gib:.0f} GiB device and {host_gib:.0f} GiB host memory per rank: "
        f"{longest} tokens ({longest // 1024}K)" if longest else
        f"nothing fits {gpu_gib:.0f} GiB device / {host_gib:.0f} GiB host memory per rank",
    ])


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, validate the config, and train. Returns the exit status."""
    parser = _Parser(
        prog="lightseq-finetune",
        description="Sequence-parallel long-context fine-tuning (DistFlashAttn). Launch with `accelerate "
                    "launch [--config_file configs/accelerate/...] scripts/finetune.py CONFIG.yaml`.",
    )
    parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*",
                        help="dotted overrides, e.g. training.max_steps=20 output_dir=/tmp/x")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--check", action="store_true",
                        help="validate the config and output_dir (no changes made) and exit; with "
                             "--world-size, as a launch of that many processes would")
    parser.add_argument("--world-size", "--world", type=int, default=None,
                        help="processes the run will launch (--check, --plan; default WORLD_SIZE)")
    parser.add_argument("--plan", action="store_true",
                        help="print the predicted peak device and host memory per rank and the longest "
                             "context that fits, then exit (nothing is allocated)")
    parser.add_argument("--sharding", choices=("fsdp", "replicated"), default="fsdp",
                        help="--plan: FSDP (parameters, gradients, optimizer state sharded) or DDP")
    parser.add_argument("--gpu-gib", type=float, default=None,
                        help="--plan: device memory per rank (default: this machine's GPU, else 139 = H200)")
    parser.add_argument("--host-gib", type=float, default=None,
                        help="--plan: host memory per rank (default: this machine's RAM / world)")
    try:
        args = parser.parse_intermixed_args(argv)  # options may come after the overrides
        cfg = load_config(args.config, args.overrides, world_size=args.world_size or _world_size())
        if args.check:
            from .loop import prepare_output_dir

            prepare_output_dir(cfg, dry_run=True)
    except ConfigError as e:
        return _fail(f"config error: {e}", EXIT_CONFIG)
    except RuntimeError as e:  # CheckpointError from --check
        return _fail(str(e), EXIT_FAILED)
    if args.plan:
        try:
            world = args.world_size or _world_size()
            print(plan_text(cfg, world, args.sharding, args.gpu_gib, args.host_gib))
        except (ConfigError, ValueError) as e:
            return _fail(f"--plan: {e}", EXIT_CONFIG)
        return 0
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    if args.check:
        return 0
    from .guards import NonFiniteError, PeerFailure
    from .loop import train
    from .saving import CheckpointError

    try:
        train(cfg)
    except ConfigError as e:
        return _fail(f"config error: {e}", EXIT_CONFIG)
    except (CheckpointError, NonFiniteError) as e:
        return _fail(f"stopped: {e}", EXIT_FAILED)
    except PeerFailure as e:
        return _fail(f"stopped: {e}", EXIT_FAILED, every_rank=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
