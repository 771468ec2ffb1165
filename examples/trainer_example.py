"""The same sequence-parallel fine-tune with a plain Hugging Face ``Trainer`` and one line of lightseq_hf.

    accelerate launch --config_file configs/accelerate/cpu-2proc.yaml examples/trainer_example.py \\
        [--max-steps N]

``lightseq_hf.patch()`` before building the model/Trainer is the only change to an ordinary
Trainer script: every rank of the (default: whole-world) sequence-parallel group gets the same batch,
the patched model keeps its slice of each 4096-token sequence, and attention runs as DistFlashAttn
across the ranks. The data is the synthetic passkey task of ``configs/tiny.yaml``.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import lightseq_hf
from lightseq_hf.training.synthetic import PasskeyDataset, PasskeySpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--output-dir", default="runs/trainer_example")
    parser.add_argument("--context-length", type=int, default=4096)
    args = parser.parse_args()

    lightseq_hf.patch()  # the one line: sequence parallelism across all launched ranks

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=args.context_length, rope_theta=1e6)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    train_data = PasskeyDataset(PasskeySpec(context_length=args.context_length, vocab_size=256), 100_000)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=2,
        learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=5, weight_decay=0.0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0, disable_tqdm=True, seed=0, ddp_find_unused_parameters=False,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_data)
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"trainer_example: {result.global_step} steps, final train loss {result.training_loss:.4f}")
    # Trainer leaves the process group alive; torch's gloo backend can abort at interpreter exit
    # ("terminate called without an active exception") unless it is destroyed, after a barrier.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
