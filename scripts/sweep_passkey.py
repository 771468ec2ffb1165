"""Learnability sweep of the passkey task on one GPU (no sequence parallelism: the same math).

Held-out retrieval accuracy every 25 steps for needle_repeat x lr x batch x layers x filler on the
configs/tiny.yaml model shape at 4096 tokens; it chose tiny.yaml's settings. Results of the run quoted
in the README: benchmarks/results/passkey-sweep-h100-2026-11-22.jsonl.

    python scripts/sweep_passkey.py --out /tmp --steps 400

``--device cpu --configs 1 --steps 25 --length 512`` is the smoke run (the first configuration, shorter rows).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightseq_hf.training.synthetic import PasskeySpec, answer_accuracy, make_passkey_sample  # noqa: E402


def run(rep: int, lr: float, bs: int, layers: int, filler: str, steps: int = 400, n: int = 4096,
        device: str = "cuda") -> dict[int, float]:
    """Train from scratch; return {step: held-out accuracy}."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=n,
                      rope_theta=1e6, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(device)
    spec = PasskeySpec(n, 256, 16, 1, 0.5, seed=1234, filler=filler, needle_repeat=rep)
    held = PasskeySpec(n, 256, 16, 1, 0.5, seed=1234 + 1_000_000, filler=filler, needle_repeat=rep)
    ev = [make_passkey_sample(held, j) for j in range(64)]
    eids = torch.stack([x["input_ids"] for x in ev]).to(device)
    elab = torch.stack([x["labels"] for x in ev])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1, (s + 1) / 10) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    accs = {}
    for s in range(steps):
        batch = [make_passkey_sample(spec, s * bs + j) for j in range(bs)]
        ids = torch.stack([x["input_ids"] for x in batch]).to(device)
        lab = torch.stack([x["labels"] for x in batch]).to(device)
        model(input_ids=ids, labels=lab).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if (s + 1) % 25 == 0:
            model.eval()
            with torch.no_grad():
                hit = tot = 0
                for i in range(0, 64, 16):
                    logits = model(input_ids=eids[i:i + 16]).logits
                    pred = torch.full_like(elab[i:i + 16], -1)
                    pred[:, 1:] = logits[:, :-1].argmax(-1).cpu()
                    c, t, _, _ = answer_accuracy(pred, elab[i:i + 16])
                    hit, tot = hit + c, tot + t
            model.train()
            accs[s + 1] = round(hit / tot, 3)
    return accs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp", help="folder of sweep.jsonl (appended to)")
    parser.add_argument("--steps", type=int, default=400, help="training steps per configuration")
    parser.add_argument("--configs", type=int, default=None, help="only the first N configurations")
    parser.add_argument("--length", type=int, default=4096, help="tokens per row")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the smoke run")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the sweep trains 16 configurations on one GPU; no CUDA GPU is visible "
                         "(--device cpu: the smoke run)")
    grid = [(rep, lr, bs, 2, "repeat") for rep in (1, 8, 32) for lr in (3e-3, 1e-2) for bs in (2, 4)]
    grid += [(8, 3e-3, 2, 1, "repeat"), (8, 1e-2, 2, 1, "repeat"), (8, 3e-3, 2, 2, "random"),
             (32, 3e-3, 2, 2, "random")]
    out = Path(args.out) / "sweep.jsonl"
    t0 = time.time()
    for g in grid[:args.configs]:
        accs = run(*g, steps=args.steps, n=args.length, device=args.device)
        rec = {"rep": g[0], "lr": g[1], "bs": g[2], "layers": g[3], "filler": g[4], "accs": accs,
               "t": round(time.time() - t0)}
        print(json.dumps(rec), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
