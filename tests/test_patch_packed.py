"""The patched tiny models with packed rows, padding masks and sliding windows on 2 gloo processes,
against the unpatched model run on each document separately (or on the same padded batch)."""

from __future__ import annotations

import torch
from distributed import rel_err, run_distributed


def packed_batch(doc_lens, seed):
    """One packed row as DataCollatorWithFlattening makes it: ids, labels (-100 at each document's
    first token), restarting position_ids, cu_seq_lens."""
    from tiny_models import VOCAB

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(doc_lens)), generator=g)
    labels = ids.clone()
    pos, cu = [], [0]
    for n in doc_lens:
        labels[0, cu[-1]] = -100
        pos.append(torch.arange(n))
        cu.append(cu[-1] + n)
    return ids, labels, torch.cat(pos)[None], torch.tensor(cu, dtype=torch.int32)


def per_document_reference(model, ids, labels, doc_lens):
    """Loss over all real tokens and parameter gradients, each document run on its own."""
    model.train()
    model.zero_grad(set_to_none=True)
    total, count, start = 0.0, 0, 0
    for n in doc_lens:
        doc_ids, doc_labels = ids[:, start:start + n], labels[:, start:start + n]
        items = int((doc_labels[:, 1:] != -100).sum())
        if items:
            total = total + model(input_ids=doc_ids, labels=doc_labels).loss * items
            count += items
        start += n
    loss = total / count
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def worker_packed_model(rank, world):
    return packed_model_cases(world)


def packed_model_cases(world):
    """The cases against their references, and the mask every distributed attention call got: packed
    documents (and the window) wherever the rows hold documents or padding."""
    from kernel_checks import OpCalls
    from tiny_models import VOCAB, loss_and_grads, make_model

    import lightseq_hf

    failures = []
    cases = [  # (tag, arch, config overrides, doc lengths, inputs, checkpointing)
        ("packed position_ids", "llama", {}, [5, 1, 13, 9, 4], "position_ids", "off"),
        ("packed position_ids, remat", "llama", {}, [7, 17, 1, 7], "position_ids", "remat"),
        ("cu_seq_lens kwargs, odd length", "qwen2", {}, [11, 2, 16], "cu_seq_lens", "off"),
        ("sliding window 6", "mistral", {"sliding_window": 6}, [20, 3, 9], "position_ids", "off"),
    ]
    g = torch.Generator().manual_seed(7)
    pad_ids = torch.randint(0, VOCAB, (3, 26), generator=g)
    mask = torch.ones_like(pad_ids)
    mask[0, 19:] = 0  # right padding
    mask[1, :9] = 0  # left padding
    pad_labels = pad_ids.masked_fill(mask == 0, -100)
    # the last left-pad token would predict the first real one from no context (HF's fully masked row
    # attends uniformly to everything, ours to nothing): an undefined loss term, so it is ignored
    pad_labels[1, 9] = -100
    # references first: patch_llama patches the classes, so every model built after it is patched
    refs = []
    for i, (_, arch, overrides, doc_lens, _, _) in enumerate(cases):
        ids, labels, pos, cu = packed_batch(doc_lens, seed=40 + i)
        refs.append(per_document_reference(make_model(arch, seed=i, **overrides), ids, labels, doc_lens))
    # padding masks: against the unpatched model on the same padded batch
    pad_ref = loss_and_grads(make_model("qwen2", seed=9), input_ids=pad_ids, labels=pad_labels,
                             attention_mask=mask)[:2]

    for i, (tag, arch, overrides, doc_lens, how, mode) in enumerate(cases):
        ids, labels, pos, cu = packed_batch(doc_lens, seed=40 + i)
        model = make_model(arch, seed=i, **overrides)
        lightseq_hf.patch_llama(model, checkpointing="hf" if mode == "off" else mode)
        if mode != "off":
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        inputs = dict(input_ids=ids, labels=labels, position_ids=pos)
        if how == "cu_seq_lens":
            inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(doc_lens),
                          max_length_k=max(doc_lens))
        with OpCalls() as calls:
            loss, grads, _ = loss_and_grads(model, **inputs)
        failures += compare(tag, loss, grads, *refs[i], world)
        want_window = overrides.get("sliding_window", 0)
        if not calls.masks or any(m != (True, want_window) for m in calls.masks):
            failures.append(f"{tag}: attention got (segments, window) {set(calls.masks)}, want {want_window}")

    model = lightseq_hf.patch_llama(make_model("qwen2", seed=9))
    with OpCalls() as calls:
        loss, grads, _ = loss_and_grads(model, input_ids=pad_ids, labels=pad_labels, attention_mask=mask)
    failures += compare("padding masks", loss, grads, *pad_ref, world)
    if not calls.masks or not all(packed for packed, _ in calls.masks):
        failures.append("padding masks: attention got no segments")
    lightseq_hf.unpatch_llama()
    return failures


def compare(tag, loss, grads, ref_loss, ref_grads, world):
    import torch.distributed as dist

    failures = []
    for g in grads.values():  # the data-parallel average DDP would do over the group
        dist.all_reduce(g)
        g /= world
    if rel_err(loss, ref_loss) > 1e-5:
        failures.append(f"{tag}: loss {loss.item()} vs {ref_loss.item()}")
    if set(grads) != set(ref_grads):
        failures.append(f"{tag}: gradients of {sorted(set(ref_grads) ^ set(grads))} missing")
        return failures
    worst = max((rel_err(grads[n], ref_grads[n]), n) for n in ref_grads)
    if worst[0] > 1e-4:
        failures.append(f"{tag}: gradient of {worst[1]} rel err {worst[0]:.2e}")
    return failures


def test_packed_model_matches_unpatched_per_document():
    failures = [f for r in run_distributed(worker_packed_model, 2) for f in r]
    assert not failures, "\n".join(failures)
