"""``lightseq-finetune CONFIG.yaml [key.sub=value ...]`` (also ``scripts/finetune.py``)."""

from __future__ import annotations

import argparse
import os
import sys

from .config import ConfigError, load_config


def _world_size() -> int | None:
    ws = os.environ.get("WORLD_SIZE")
    return int(ws) if ws else None


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, validate the config, and train. Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="lightseq-finetune",
        description="Sequence-parallel long-context fine-tuning (DistFlashAttn). Launch with `accelerate "
                    "launch [--config_file configs/accelerate/...] scripts/finetune.py CONFIG.yaml`.",
    )
    parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*",
                        help="dotted overrides, e.g. training.max_steps=20 output_dir=/tmp/x")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, world_size=_world_size())
    except ConfigError as e:
        print(f"lightseq-finetune: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    from .loop import train

    try:
        train(cfg)
    except ConfigError as e:
        print(f"lightseq-finetune: config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
