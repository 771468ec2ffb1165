"""patch_llama on 2 and 3 gloo processes against the unpatched model on one process (full sequence).

For every case: the loss (relative error <= 1e-5) and every parameter's gradient (<= 1e-4, after
the data-parallel average over the group that DDP would do), with checkpointing off, "remat" and
"hf"; the attention-forward op count (once per layer per step, twice under "hf"); the logits of
forward-only use; and each bad input's ValueError.
"""

from __future__ import annotations

import pytest
import torch
from distributed import rel_err, run_distributed

#: (architecture, batch, length, ignored label prefix, num_items_in_batch)
CASES = {
    2: [("llama", 2, 37, 3, None), ("llama", 1, 32, 0, 50), ("mistral", 2, 21, 0, None),
        ("qwen2", 1, 30, 5, None), ("qwen3", 2, 19, 0, None)],
    3: [("llama", 2, 37, 3, None), ("qwen2", 1, 30, 0, 17)],
}
MODES = ("off", "remat", "hf")
LAYERS = 2


def _average(grads, world):
    import torch.distributed as dist

    for g in grads.values():
        dist.all_reduce(g)
        g /= world
    return grads


def worker_exactness(rank, world):
    from kernel_checks import OpCalls
    from tiny_models import loss_and_grads, make_batch, make_model

    import lightseq_hf
    from lightseq_hf.parallel.sharding import shard_for

    failures = []
    refs = []
    for i, (arch, batch, seq, prefix, items) in enumerate(CASES[world]):  # references, unpatched
        ids, labels = make_batch(batch, seq, seed=10 + i, ignore_prefix=prefix)
        model = make_model(arch, layers=LAYERS, seed=i)
        extra = {} if items is None else {"num_items_in_batch": items}
        loss, grads, _ = loss_and_grads(model, input_ids=ids, labels=labels, **extra)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        refs.append((ids, labels, extra, loss, grads, logits))

    lightseq_hf.patch_llama()
    for i, (arch, batch, seq, _, items) in enumerate(CASES[world]):
        ids, labels, extra, ref_loss, ref_grads, ref_logits = refs[i]
        for mode in MODES:
            tag = f"{arch} batch {batch} length {seq} items {items} checkpointing {mode}"
            model = make_model(arch, layers=LAYERS, seed=i)
            lightseq_hf.patch_llama(model, checkpointing="hf" if mode == "off" else mode)
            if mode != "off":  # activation_checkpointing_enable from transformers 5.2x, before: the old name
                getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
            mask = torch.ones_like(ids) if i == 0 else None  # an all-ones mask is accepted
            with OpCalls() as seen:
                loss, grads, logits = loss_and_grads(model, input_ids=ids, labels=labels, attention_mask=mask,
                                                     **extra)
            calls = seen.calls
            grads = _average(grads, world)
            if logits is not None:
                failures.append(f"{tag}: training with labels should return logits=None")
            if rel_err(loss, ref_loss) > 1e-5:
                failures.append(f"{tag}: loss {loss.item()} vs {ref_loss.item()}")
            if set(grads) != set(ref_grads):
                failures.append(f"{tag}: gradients of {sorted(set(ref_grads) ^ set(grads))} missing")
            worst = max((rel_err(grads[n], ref_grads[n]), n) for n in ref_grads)
            if worst[0] > 1e-4:
                failures.append(f"{tag}: gradient of {worst[1]} rel err {worst[0]:.2e}")
            want = LAYERS * (2 if mode == "hf" else 1)
            if calls != {"forward": want, "backward": LAYERS}:
                failures.append(f"{tag}: attention op calls {calls}, want forward {want}, backward {LAYERS}")
        # forward-only: the whole sequence's logits on every rank (default), or this rank's slice
        model.eval()
        shard = shard_for(seq, rank, world)
        for layout, want in (("full", ref_logits), ("shard", ref_logits[:, shard.start:shard.real_end])):
            with torch.no_grad():
                logits = model(input_ids=ids, lightseq_logits=layout).logits
            if logits.shape != want.shape or rel_err(logits, want) > 1e-5:
                failures.append(f"{arch} length {seq}: eval logits ({layout}) {tuple(logits.shape)} err "
                                f"{rel_err(logits, want) if logits.shape == want.shape else 'shape'}")
    failures += _bad_inputs(rank, world)
    lightseq_hf.unpatch_llama()
    return failures


def _expect(failures, what, needle, fn):
    try:
        fn()
    except ValueError as exc:
        if needle not in str(exc):
            failures.append(f"{what}: ValueError without {needle!r}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001
        failures.append(f"{what}: {type(exc).__name__} instead of ValueError: {exc}")
        return
    failures.append(f"{what}: no error")


def _bad_inputs(rank, world):
    from tiny_models import make_batch, make_model

    import lightseq_hf
    from lightseq_hf.parallel import init_sequence_parallel

    failures = []
    ids, labels = make_batch(2, 24, seed=3)
    model = lightseq_hf.patch_llama(make_model("llama"))
    holes = torch.ones_like(ids)
    holes[0, 5:8] = 0  # not padding: packed documents go through position_ids (test_patch_packed.py)
    _expect(failures, "mask with zeros inside a row", "zeros between ones",
            lambda: model(input_ids=ids, labels=labels, attention_mask=holes))
    padded = torch.ones_like(ids)
    padded[0, -4:] = 0
    _expect(failures, "right padding with labels on the padding", "labels of padding positions",
            lambda: model(input_ids=ids, labels=labels, attention_mask=padded))
    _expect(failures, "4-D mask", "attention_mask",
            lambda: model(input_ids=ids, attention_mask=torch.ones(2, 1, 24, 24)))
    other = ids if rank == 0 else (ids + 1) % 128
    _expect(failures, "different batches on the ranks", "received different batches",
            lambda: model(input_ids=other, labels=labels))
    shorter = ids if rank == 0 else ids[:, :20]
    _expect(failures, "different lengths on the ranks", "received different batches",
            lambda: model(input_ids=shorter))
    _expect(failures, "labels of another length", "expected length",
            lambda: model(input_ids=ids, labels=labels[:, :20]))
    _expect(failures, "unknown checkpointing", "checkpointing='layers'",
            lambda: lightseq_hf.patch_llama(model, checkpointing="layers"))
    _expect(failures, "unknown backend", "unknown backend",
            lambda: lightseq_hf.patch_llama(model, backend="cuda-magic"))
    _expect(failures, "bad sp_group", "sp_group must be",
            lambda: lightseq_hf.patch_llama(model, sp_group=2))

    import transformers

    bloom_config = transformers.BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=64)
    bloom = transformers.BloomForCausalLM(bloom_config)
    _expect(failures, "unsupported architecture", "cannot patch BloomForCausalLM",
            lambda: lightseq_hf.patch_llama(bloom))
    dropout = lightseq_hf.patch_llama(make_model("llama", attention_dropout=0.1))
    dropout.train()
    _expect(failures, "attention dropout", "attention dropout",
            lambda: dropout(input_ids=ids, labels=labels))
    if world == 3:
        _expect(failures, "sp size not dividing the world", "does not divide the world size 3",
                lambda: init_sequence_parallel(2))
    # after all these errors the group still works
    out = model(input_ids=ids, labels=labels)
    if not torch.isfinite(out.loss):
        failures.append("loss after the bad inputs is not finite")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_patched_model_matches_single_process(world):
    results = run_distributed(worker_exactness, world)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------- one process, no torch.distributed


@pytest.fixture
def unpatch():
    yield
    import lightseq_hf

    lightseq_hf.unpatch_llama()


def test_single_process_exact_generate_and_idempotent(unpatch):
    from tiny_models import loss_and_grads, make_batch, make_model

    import lightseq_hf

    ids, labels = make_batch(2, 23, seed=5, ignore_prefix=2)
    ref = make_model("qwen3")
    ref_loss, ref_grads, _ = loss_and_grads(ref, input_ids=ids, labels=labels)
    ref.eval()
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
        ref_gen = ref.generate(ids[:1, :8], max_new_tokens=5, do_sample=False)

    lightseq_hf.patch_llama()
    lightseq_hf.patch_llama()  # idempotent
    model = make_model("qwen3")
    assert lightseq_hf.patch_llama(model) is model and lightseq_hf.patch_model(model) is model
    forward = type(model).forward
    assert forward.__wrapped__.__name__ == "forward" and not hasattr(forward.__wrapped__, "_lightseq_patched")
    loss, grads, logits = loss_and_grads(model, input_ids=ids, labels=labels)
    assert logits is None
    assert rel_err(loss, ref_loss) <= 1e-5
    assert max(rel_err(grads[n], ref_grads[n]) for n in ref_grads) <= 1e-4
    model.eval()
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, ref_logits) <= 1e-5
        loss_eval = model(input_ids=ids, labels=labels)  # eval with labels: loss and the logits
        assert rel_err(loss_eval.loss, ref_loss) <= 1e-5 and loss_eval.logits.shape == ref_logits.shape
        assert torch.equal(model.generate(ids[:1, :8], max_new_tokens=5, do_sample=False), ref_gen)
        tup = model(input_ids=ids, return_dict=False)
        assert isinstance(tup, tuple) and rel_err(tup[0], ref_logits) <= 1e-5
    assert model.config._attn_implementation == "lightseq_dist"
    lightseq_hf.unpatch_llama()
    assert type(model).forward is forward.__wrapped__
    assert model.config._attn_implementation == "eager"


def test_peft_wrapped_model(unpatch):
    peft = pytest.importorskip("peft")
    from tiny_models import make_batch, make_model

    import lightseq_hf

    ids, labels = make_batch(1, 20, seed=6)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ref = peft.get_peft_model(make_model("llama"), lora)
    ref.train()
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}

    model = peft.get_peft_model(make_model("llama"), lora)
    assert lightseq_hf.patch_llama(model) is model
    assert model.get_base_model().config._attn_implementation == "lightseq_dist"
    model.train()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads) and len(grads) == 8  # only the LoRA matrices train
    assert rel_err(loss, ref_loss) <= 1e-5
    assert max(rel_err(grads[n], ref_grads[n]) for n in ref_grads) <= 1e-4


def test_unknown_transformers_version_is_refused(monkeypatch, unpatch):
    import transformers

    import lightseq_hf

    monkeypatch.setattr(transformers, "__version__", "4.46.3")
    with pytest.raises(RuntimeError, match=r"supports transformers 5\.x"):
        lightseq_hf.patch_llama()


def test_sharding_helpers():
    from lightseq_hf.parallel import sharding

    labels = torch.tensor([[5, 6, 7, 8, 9]])
    assert sharding.shift_labels(labels).tolist() == [[6, 7, 8, 9, -100]]
    shards = [sharding.shard_for(5, r, 3) for r in range(3)]
    assert [(s.start, s.end, s.real_end) for s in shards] == [(0, 2, 2), (2, 4, 4), (4, 6, 5)]
    pieces = [sharding.take_shard(sharding.shift_labels(labels), s, value=-100) for s in shards]
    assert torch.cat(pieces, 1).tolist() == [[6, 7, 8, 9, -100, -100]]
    pos = [sharding.global_position_ids(None, 2, s, torch.device("cpu")) for s in shards]
    assert torch.cat(pos, 1).tolist() == [[0, 1, 2, 3, 4, 4]] * 2  # the pad repeats the last position
    offset = torch.arange(3, 8).unsqueeze(0)
    assert sharding.global_position_ids(offset, 1, shards[2], torch.device("cpu")).tolist() == [[7, 7]]
    # the chunked loss equals the one-shot cross-entropy sum, value and gradient
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 11, 8, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 13, bias=False)
    target = torch.randint(0, 13, (2, 11), generator=g)
    target[0, :4] = -100
    full = torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), target.flatten(), reduction="sum")
    chunked = sharding.chunked_loss_sum(hidden, target, head, 13, chunk_size=6)
    assert rel_err(chunked, full) <= 1e-6
    assert rel_err(torch.autograd.grad(chunked, hidden)[0], torch.autograd.grad(full, hidden)[0]) <= 1e-6
