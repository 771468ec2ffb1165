"""Inputs whose split used to differ from the unpatched model, each against the unpatched model in float64
on 2 or 3 gloo processes (loss and every gradient after the group average):

* rotary embeddings whose frequencies follow the call's length (dynamic NTK, LongRoPE): every rank
  rotates with the whole sequence's frequencies, not its slice's;
* OPT with left padding: the positions OPT counts along the mask, not ``arange``;
* GPT-2 at exactly ``n_positions`` tokens on ranks that do not divide it, and a ``pad_token_id`` of -1:
  the padding of the last slice stays inside the position and token tables;

and LayerDrop, which draws different layers on each rank, refused by name on every rank.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers
from distributed import rel_err, run_distributed
from tiny_models import VOCAB, loss_and_grads, make_batch

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")


def _rope_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "dynamic":  # frequencies grow past 8 positions
        config = transformers.LlamaConfig(max_position_embeddings=8, rope_parameters={
            "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, **SMALL)
        return transformers.LlamaForCausalLM(config).double()
    config = transformers.Phi3Config(  # long factors past 16 positions, short ones below
        max_position_embeddings=64, original_max_position_embeddings=16, pad_token_id=0, eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                         "long_factor": [3.0, 5.0, 7.0, 9.0]}, **SMALL)
    return transformers.Phi3ForCausalLM(config).double()


def _opt_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=48, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                    dropout=0.0, attention_dropout=0.0, pad_token_id=1,
                                    attn_implementation="sdpa")  # eager gives padding rows NaN
    return transformers.OPTForCausalLM(config).double()


def _gpt2_model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                                     attn_implementation="eager", **overrides)
    return transformers.GPT2LMHeadModel(config).double()


def _compare(tag: str, build, world: int, **inputs) -> list[str]:
    """The patched model against the unpatched one on ``inputs``: loss and every averaged gradient."""
    import lightseq_hf

    ref_loss, ref_grads, _ = loss_and_grads(build(), **inputs)
    model = lightseq_hf.patch(build())
    try:
        loss, grads, _ = loss_and_grads(model, **inputs)
    finally:
        lightseq_hf.unpatch()
    for g in grads.values():
        dist.all_reduce(g)
        g /= world
    worst = max((rel_err(grads[n], ref_grads[n], floor=1e-4), n) for n in ref_grads)  # floor: k_proj.bias
    if rel_err(loss, ref_loss) > 1e-6 or worst[0] > 1e-5:
        return [f"{tag}: loss {rel_err(loss, ref_loss):.1e}, gradient of {worst[1]} {worst[0]:.1e}"]
    return []


def _left_padded(batch: int, seq: int) -> dict:
    ids, labels = make_batch(batch, seq, 5)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # row 0 has 4 padding tokens on the left
    ids[0, :4] = 1
    labels[0, :5] = -100  # padding and the token the last padding position would predict
    return dict(input_ids=ids, labels=labels, attention_mask=mask)


def _two_ranks(rank: int, world: int) -> list[str]:
    from lightseq_hf.patches.rope import length_dependent_embeddings

    failures = []
    ids, labels = make_batch(1, 24, 3)
    for kind in ("dynamic", "longrope"):
        if len(length_dependent_embeddings(_rope_model(kind))) != 1:
            failures.append(f"{kind}: its rotary embedding is not found as length-dependent")
        failures += _compare(f"rope {kind}", lambda k=kind: _rope_model(k), world, input_ids=ids,
                             labels=labels)
    failures += _compare("opt left padding", _opt_model, world, **_left_padded(2, 14))
    failures += _compare("gpt2 pad_token_id -1", lambda: _gpt2_model(pad_token_id=-1), world,
                         **dict(zip(("input_ids", "labels"), make_batch(1, 15, 4))))
    return failures


def _three_ranks(rank: int, world: int) -> list[str]:
    import lightseq_hf

    failures = _compare("gpt2 at n_positions on 3 ranks", _gpt2_model, world,
                        **dict(zip(("input_ids", "labels"), make_batch(1, 16, 4))))
    model = _opt_model()
    model.model.decoder.layerdrop = 0.2
    lightseq_hf.patch(model)
    ids, labels = make_batch(1, 12, 0)
    try:
        model(input_ids=ids, labels=labels)
        failures.append(f"rank {rank}: layerdrop 0.2 in training was not refused")
    except ValueError as e:
        text = str(e)
        if not text.startswith("model.decoder.layerdrop = 0.2: LayerDrop skips") or "\n" in text:
            failures.append(f"rank {rank}: {text}")
    model.eval()  # no layer is dropped in evaluation: allowed, and exact
    with torch.no_grad():
        got = model(input_ids=ids).logits
    lightseq_hf.unpatch()
    with torch.no_grad():
        want = copy.deepcopy(model).eval()(input_ids=ids).logits
    if rel_err(got, want) > 1e-6:
        failures.append(f"rank {rank}: layerdrop model in evaluation: logits {rel_err(got, want):.1e}")
    return failures


def test_length_dependent_rope_opt_padding_and_gpt2_padding_are_exact() -> None:
    assert run_distributed(_two_ranks, 2) == [[], []]


def test_full_position_table_on_three_ranks_and_layerdrop_refused() -> None:
    assert run_distributed(_three_ranks, 3) == [[], [], []]
