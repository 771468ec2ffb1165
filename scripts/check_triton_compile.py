"""Compile the Triton attention kernels for a GPU architecture on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which executes their Python semantics but
never lowers them. This script lowers every kernel variant (forward, delta, dK/dV, dQ; causal,
full, or with per-row key ranges (document / window masks); fresh or accumulating) to PTX with
Triton's own compiler and ptxas, for ``--arch`` (90: H100
and H200, 80: A100), so a change that would not compile on a GPU fails here. ``--digest`` prints
one hash per variant of the PTX instructions (debug lines and labels dropped): equal digests before
and after a refactor mean the GPU runs identical code. ``--compare FILE`` checks the digests against
a saved ``--digest`` listing and fails on any difference; ``--only`` restricts the variants.

    python scripts/check_triton_compile.py --arch 90 --all-configs --digest > ptx90.txt
    python scripts/check_triton_compile.py --arch 90 --all-configs --compare ptx90.txt
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's kernels cannot be lowered
    raise SystemExit("unset TRITON_INTERPRET: this script compiles the kernels, it does not interpret them")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lightseq_hf._testing.kernel_knobs import triton_kernels  # noqa: E402
from lightseq_hf.kernels import triton_bwd, triton_fwd  # noqa: E402

FLOAT_ARGS = ("qk_scale", "scale")


def signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Triton signature of ``fn``: the given pointer types, fp32 scales, i32 for every other integer."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in FLOAT_ARGS else "i32"
    return sig


def instructions(ptx: str) -> str:
    """The PTX without what only debug information changes: .loc/.file lines, debug sections, labels."""
    ptx = ptx.split("\t.section\t.debug")[0]
    lines = []
    for line in ptx.splitlines():
        stripped = line.strip()
        if not stripped or re.match(r"\.(loc|file)\b", stripped) or re.fullmatch(r"\$L__\w+:", stripped):
            continue
        lines.append(re.sub(r"\$L__\w+", "L", line))
    return "\n".join(lines)


def variants(dtype: str, head_dim: int, all_configs: bool):
    """(name, jit function, pointer types, constexprs, num_warps, num_stages) of every variant."""
    el = {"bf16": "*bf16", "fp16": "*fp16"}[dtype]
    d_pad = triton.next_power_of_2(head_dim)
    handles = triton_kernels()
    yield ("delta", handles["delta"], {"Out": el, "DOut": el, "Delta": "*fp32"},
           {"HEAD_DIM": head_dim, "D_PAD": d_pad, "BLOCK_M": 64}, 4, 3)
    grads = {"DK": "*fp32", "DV": "*fp32", "DQ": "*fp32"}
    kernels = (("fwd", handles["fwd"], triton_fwd.FWD_CONFIGS),
               ("dkdv", handles["dkdv"], triton_bwd.DKDV_CONFIGS),
               ("dq", handles["dq"], triton_bwd.DQ_CONFIGS))
    ranges = ("KLo", "KHi", "QLo", "QHi")
    # (causal, ranged): the causal / full kernels (range pointers None), and the document-mask ones
    for causal, ranged in ((True, False), (False, False), (False, True)):
        for accum in (False, True):
            base = {"HEAD_DIM": head_dim, "D_PAD": d_pad, "CAUSAL": causal, "ACCUM": accum, "PREC": "tf32",
                    "RANGED": ranged}
            pointers = {"Q": el, "K": el, "V": el, "DO": el, "Lse": "*fp32", "Delta": "*fp32",
                        "Out": "*fp32" if accum else el, **grads}
            if ranged:
                pointers.update(dict.fromkeys(ranges, "*i32"))
            else:
                base.update(dict.fromkeys(ranges, None))
            for name, kernel, configs in kernels:
                for cfg in configs if all_configs else configs[:1]:
                    kw = cfg.kwargs
                    tiles = f"{kw['BLOCK_M']}x{kw['BLOCK_N']} w{cfg.num_warps} s{cfg.num_stages}"
                    label = f"{name} causal={causal} accum={accum}{' ranged' if ranged else ''} {tiles}"
                    present = {k: v for k, v in base.items() if k in kernel.fn.arg_names}
                    yield label, kernel.fn, pointers, {**present, **cfg.kwargs}, cfg.num_warps, cfg.num_stages


def saved_digests(path: Path) -> dict[str, str]:
    """``{label: digest}`` of a saved ``--digest`` listing (its summary line skipped)."""
    pairs = (line.split(" ", 1) for line in path.read_text().splitlines())
    return {label: digest for digest, label in (p for p in pairs if len(p) == 2 and not p[0].endswith(":"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90,
                        help="compute capability x 10 (90: Hopper, 80: Ampere)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--all-configs", action="store_true",
                        help="every autotune config, not only the first")
    parser.add_argument("--digest", action="store_true",
                        help="print a hash of each variant's PTX instructions")
    parser.add_argument("--compare", type=Path, metavar="FILE",
                        help="fail unless each digest equals its variant's in a saved --digest listing")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="compile only the variants whose label contains TEXT (repeatable: any of them)")
    args = parser.parse_args()
    saved = saved_digests(args.compare) if args.compare else None
    target = GPUTarget("cuda", args.arch, 32)
    count, differ = 0, []
    for label, fn, pointers, constexprs, warps, stages in variants(args.dtype, args.head_dim,
                                                                   args.all_configs):
        if args.only and not any(text in label for text in args.only):
            continue
        source = ASTSource(fn, signature(fn, pointers, constexprs), constexprs=constexprs)
        options = {"num_warps": warps, "num_stages": stages}
        try:
            compiled = triton.compile(source, target=target, options=options)
        except Exception as err:  # noqa: BLE001 - report which variant and stop
            raise SystemExit(f"sm_{args.arch}: {label} does not compile: {err}") from err
        count += 1
        digest = hashlib.sha256(instructions(compiled.asm["ptx"]).encode()).hexdigest()[:16]
        if args.digest:
            print(digest, label, flush=True)
        if saved is not None and saved.get(label) != digest:
            differ.append(f"{label}: {saved.get(label, 'absent')} -> {digest}")
    print(f"sm_{args.arch}: {count} kernel variants compiled ({args.dtype}, head dim {args.head_dim})")
    if differ:
        listing = "\n".join(differ)
        raise SystemExit(f"{len(differ)} of {count} digests differ from {args.compare}:\n{listing}")
    if saved is not None:
        print(f"all {count} digests equal those in {args.compare}")


if __name__ == "__main__":
    main()
