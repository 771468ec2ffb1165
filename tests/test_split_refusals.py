"""Mistakes the split used to take silently, each refused on every rank with one line that names the fix,
and the fix then working (2 gloo processes): labels of tokens after the last ``cu_seq_lens`` boundary,
ranks that start from different weights in a plain loop, attention dropout on a loaded Llama and GPT-2
(the message's advice is applied as written); ``cu_seq_lens_q/k`` given as Python lists; and
``dist_flash_attn`` given Transformers' ``(batch, heads, seq, dim)`` layout where the shapes show it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from distributed import rel_err, run_distributed
from tiny_models import VOCAB, make_batch, make_model

import lightseq_hf


def _refused(call, needle: str, rank: int, tag: str) -> list[str]:
    """[] when ``call()`` raises a one-line ValueError containing ``needle``."""
    try:
        call()
    except ValueError as e:
        text = str(e)
        return [] if needle in text and "\n" not in text else [f"rank {rank}: {tag}: {text}"]
    return [f"rank {rank}: {tag}: not refused"]


def _packed_worker(rank: int, world: int) -> list[str]:
    """cu_seq_lens as lists give the tensors' result; labels after the last boundary are refused."""
    failures = []
    ids, labels = make_batch(1, 12, 2)
    model = make_model(layers=1)
    lightseq_hf.patch(model)
    try:
        model.eval()
        with torch.no_grad():
            as_tensor = model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 5, 12]),
                              cu_seq_lens_k=torch.tensor([0, 5, 12])).logits
            as_list = model(input_ids=ids, cu_seq_lens_q=[0, 5, 12], cu_seq_lens_k=[0, 5, 12]).logits
        if not torch.equal(as_tensor, as_list):
            failures.append(f"rank {rank}: cu_seq_lens as lists differ from tensors")
        model.train()
        tail = [0, 5, 9]  # tokens 9-11 are in no document
        failures += _refused(
            lambda: model(input_ids=ids, labels=labels, cu_seq_lens_q=tail, cu_seq_lens_k=tail),
            "the label of token 9 of row 0 predicts a token, but token 9 lies in no document", rank,
            "labels after the last boundary")
        ignored = labels.clone()
        ignored[:, 10:] = -100  # shifted: positions 9, 10, 11 predict nothing
        loss = model(input_ids=ids, labels=ignored, cu_seq_lens_q=tail, cu_seq_lens_k=tail).loss
        if not torch.isfinite(loss):
            failures.append(f"rank {rank}: with those labels ignored the loss is {loss}")
    finally:
        lightseq_hf.unpatch()
    return failures


def _weights_worker(rank: int, world: int) -> list[str]:
    """Different initial weights are refused at the first forward; the same weights then pass."""
    failures = []
    ids, labels = make_batch(1, 10, 1)
    model = lightseq_hf.patch(make_model(layers=1, seed=rank))  # each rank seeded differently
    try:
        failures += _refused(lambda: model(input_ids=ids, labels=labels),
                             "the ranks of a sequence-parallel group hold different weights at their first "
                             "forward", rank, "different initial weights")
        same = lightseq_hf.patch(make_model(layers=1, seed=0))
        same(input_ids=ids, labels=labels).loss.backward()
        if "_lightseq_weights_checked" not in same.__dict__:
            failures.append(f"rank {rank}: equal weights were not checked at the first forward")
    finally:
        lightseq_hf.unpatch()
    return failures


def _dropout_models():
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.1))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, attn_pdrop=0.1, embd_pdrop=0.0, resid_pdrop=0.0))
    return {"llama": (llama, transformers.models.llama.modeling_llama.LlamaAttention, "attention_dropout"),
            "gpt2": (gpt2, transformers.models.gpt2.modeling_gpt2.GPT2Attention, "attn_dropout.p")}


def _dropout_worker(rank: int, world: int) -> list[str]:
    """The refusal's advice for a loaded model, followed as written, lets the same model train."""
    failures = []
    ids, labels = make_batch(1, 10, 1)
    for name, (model, attention, attr) in _dropout_models().items():
        reference = copy.deepcopy(model)
        lightseq_hf.patch(model)
        try:
            needle = (f"set it to 0 in the model (for m in model.modules(): if isinstance(m, "
                      f"{attention.__name__}): m.{attr} = 0.0)")
            failures += _refused(lambda m=model: m(input_ids=ids, labels=labels), needle, rank, name)
            for m in model.modules():  # the advice
                if isinstance(m, attention):
                    if attr.endswith(".p"):
                        m.attn_dropout.p = 0.0
                    else:
                        m.attention_dropout = 0.0
            loss = model(input_ids=ids, labels=labels).loss
            for m in reference.modules():
                if isinstance(m, attention):
                    setattr(m, "attention_dropout", 0.0) if not attr.endswith(".p") else setattr(
                        m.attn_dropout, "p", 0.0)
            reference.eval()  # the other dropouts are 0: evaluation mode computes the same loss
            with torch.no_grad():
                want = reference(input_ids=ids, labels=labels).loss
            if rel_err(loss, want) > 1e-5:
                failures.append(f"rank {rank}: {name} after the advice: loss {loss.item()} vs {want.item()}")
        finally:
            lightseq_hf.unpatch()
    return failures


def _all_workers(rank: int, world: int) -> list[str]:
    return _packed_worker(rank, world) + _weights_worker(rank, world) + _dropout_worker(rank, world)


def test_mistakes_are_refused_on_every_rank_and_the_fix_works() -> None:
    assert run_distributed(_all_workers, 2) == [[], []]


def test_dist_flash_attn_names_transformers_layout_when_the_shapes_show_it() -> None:
    q = torch.randn(1, 4, 12, 8)  # (batch, heads, seq, dim) with 4 query heads
    kv = torch.randn(1, 2, 12, 8)  # 2 key/value heads
    with pytest.raises(ValueError, match=r"Transformers' \(batch, heads, seq, head_dim\) layout") as e:
        lightseq_hf.dist_flash_attn(q, kv, kv)
    assert "\n" not in str(e.value)
    segs = lightseq_hf.Segments(12, (((0, 5), (5, 12)),))  # documents of the 12-token row
    with pytest.raises(ValueError, match="pass q.transpose") as e:
        lightseq_hf.dist_flash_attn(q, q, q, segments=segs)
    got = lightseq_hf.dist_flash_attn(q.transpose(1, 2), kv.transpose(1, 2), kv.transpose(1, 2))
    assert got.shape == (1, 12, 4, 8)  # the fix the message names runs
