"""``lightseq-finetune CONFIG.yaml [key.sub=value ...]`` (also ``scripts/finetune.py``).

Exit status: 0 done, 2 a configuration problem (one line, printed by rank 0 only), 1 a run that
stopped on a checkpoint, non-finite or peer failure (one line per rank that saw it).
"""

from __future__ import annotations

import argparse
import os
import sys

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
    parser.add_argument("--world-size", type=int, default=None, help="processes the run will launch")
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
