"""lightseq_hf.metrics: model FLOPs (whole causal rows and packed documents), parameter counts, MFU."""

from types import SimpleNamespace

import pytest
import torch

from lightseq_hf.metrics import (
    PEAK_BF16_TFLOPS,
    flop_params,
    matmul_params,
    memory_stats,
    mfu,
    model_flops_per_step,
    packed_attention_pairs,
    peak_tflops,
)


def test_model_flops_count_the_pairs_packed_documents_see() -> None:
    cfg = SimpleNamespace(num_attention_heads=4, hidden_size=64, num_hidden_layers=2)
    whole = model_flops_per_step(cfg, 1000, 2, 512)
    assert whole == 6.0 * 1000 * 2 * 512 + 3.5 * 2 * 2 * 4 * 512**2 * 16 * 2  # 2 B H N^2 D per layer
    # two rows packed from documents of 3, 5 and 504 tokens and of 512: their causal pairs
    pos = torch.stack([torch.cat([torch.arange(3), torch.arange(5), torch.arange(504)]), torch.arange(512)])
    pairs = packed_attention_pairs(pos)
    assert pairs == 3 * 4 // 2 + 5 * 6 // 2 + 504 * 505 // 2 + 512 * 513 // 2
    packed = model_flops_per_step(cfg, 1000, 2, 512, attention_pairs=pairs)
    assert 6.0 * 1000 * 2 * 512 < packed < whole * 1.01
    short = packed_attention_pairs(torch.arange(8).repeat(64)[None])  # 64 documents of 8 tokens
    assert short == 64 * 36 and model_flops_per_step(cfg, 1000, 1, 512, attention_pairs=short) < whole / 2


@pytest.mark.parametrize("tied", [False, True])
def test_flop_params_match_the_config_count_and_keep_a_tied_head(tied: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=97, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    hidden, inter, d = 48, 80, 8
    by_hand = 3 * (2 * hidden * 6 * d + 2 * hidden * 2 * d + 3 * hidden * inter) + hidden * 97
    assert flop_params(model) == matmul_params(cfg) == by_hand


def test_peaks_and_mfu() -> None:
    assert peak_tflops("cpu") is None and peak_tflops("cpu", override=100.0) == 100.0
    assert PEAK_BF16_TFLOPS["H100"] == PEAK_BF16_TFLOPS["H200"] == 989.0
    # the first listed kind a device name contains wins: a longer name before its prefix
    names = list(PEAK_BF16_TFLOPS)
    for i, a in enumerate(names):
        assert not any(a in b for b in names[i + 1:]), f"{a} listed before a longer name containing it"
    assert mfu(4e15, 2.0, 2, 1000.0) == pytest.approx(1.0) and mfu(1.0, 1.0, 1, None) is None
    assert memory_stats("cpu") == {}
