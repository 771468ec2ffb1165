"""The memory options: checkpoint offload to host memory and the sequence-tiled MLP.

Each gives the loss and gradients of the plain model — on one process bit for bit (offload) or
within float32 rounding (tiling), on 2 and 3 gloo processes against the unpatched model on one
process — and the tests assert the mechanism: what was offloaded per layer, the order backward
fetched the layers back in and that each was prefetched before its turn, the largest token count
an MLP projection ever saw.
"""

from __future__ import annotations

import collections
import contextlib
import warnings

import pytest
import torch
from distributed import rel_err, run_distributed

LAYERS = 3


@pytest.fixture(autouse=True)
def _unpatch():
    yield
    import lightseq_hf

    lightseq_hf.unpatch_llama()


def _enable(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)(**kwargs)


def _step(model, ids):
    from kernel_checks import OpCalls
    from tiny_models import loss_and_grads

    with OpCalls() as seen:
        loss, grads, _ = loss_and_grads(model, input_ids=ids, labels=ids)
    return loss, grads, seen.calls


def _rows_seen(model):
    """Record the most token rows any MLP projection received (forward hooks)."""
    seen = [0]

    def hook(module, args, out):
        seen[0] = max(seen[0], args[0].numel() // args[0].shape[-1])

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules()
               if n.endswith(("gate_proj", "up_proj", "down_proj"))]
    return seen, handles


@pytest.mark.parametrize("mode", ["remat", "hf"])
def test_transformers_offload_flag_uses_our_offload(mode):
    """activation_checkpointing_enable(offload=True) keeps our policy and offloads the layer inputs
    and (remat) the attention out/lse; backward fetches the layers last to first, each prefetched."""
    from tiny_models import make_batch, make_model

    import lightseq_hf
    from lightseq_hf.checkpoint import OffloadingCheckpoint

    ids, _ = make_batch(2, 40, seed=1)
    lightseq_hf.patch_llama(checkpointing=mode)
    model = make_model("llama", layers=LAYERS)
    loss0, grads0, _ = _step(model, ids)
    try:
        _enable(model, offload=True)
    except TypeError:
        pytest.skip("this transformers has no offload flag")
    funcs = [m._gradient_checkpointing_func for m in model.modules()
             if hasattr(m, "_gradient_checkpointing_func")]
    assert funcs and all(isinstance(f, OffloadingCheckpoint) and f.remat == (mode == "remat") for f in funcs)
    offloader = model.lightseq_offloader
    loss1, grads1, calls = _step(model, ids)
    assert calls == {"forward": LAYERS * (1 if mode == "remat" else 2), "backward": LAYERS}
    assert torch.equal(loss0, loss1)
    for name, grad in grads0.items():
        assert torch.equal(grad, grads1[name]), name
    stats = offloader.stats
    per_layer_cache = 2 if mode == "remat" else 0  # out (2, 40, 4, 16) fp32 and lse (2, 4, 40) fp32
    assert stats.cache_tensors == LAYERS * per_layer_cache
    assert stats.offloaded_tensors == LAYERS * (1 + per_layer_cache)
    hidden = 2 * 40 * 64 * 4
    cache = (2 * 40 * 4 * 16 * 4 + 2 * 4 * 40 * 4) if mode == "remat" else 0
    assert stats.offloaded_bytes == LAYERS * (hidden + cache)
    assert stats.host_bytes_peak == LAYERS * (hidden + cache)
    assert stats.fetch_order == list(range(LAYERS - 1, -1, -1))
    assert stats.prefetched_groups == LAYERS - 1  # every layer but the last was fetched a layer ahead
    assert stats.prefetched_bytes_peak == 2 * 40 * 64 * 4  # ahead of its turn: one layer's input only
    assert stats.host_bytes_live == 0  # all host buffers released after the backward
    # a second step: new groups, same behaviour
    loss2, grads2, _ = _step(model, ids)
    assert torch.equal(loss0, loss2)
    assert stats.fetch_order == list(range(2 * LAYERS - 1, LAYERS - 1, -1))  # this step's only
    # unpatching gives Transformers' own offloading function back
    lightseq_hf.unpatch_llama()
    assert all(not isinstance(m._gradient_checkpointing_func, OffloadingCheckpoint)
               for m in model.modules() if hasattr(m, "_gradient_checkpointing_func"))


def test_patch_option_and_kwargs_route():
    """patch_llama(offload_checkpoints=True) offloads with HF's plain checkpoint function and its
    gradient_checkpointing_kwargs kept; a checkpoint function of the user's own is refused by name."""
    import functools

    from tiny_models import make_batch, make_model

    import lightseq_hf
    from lightseq_hf.checkpoint import OffloadingCheckpoint

    ids, _ = make_batch(1, 24, seed=2)
    model = lightseq_hf.patch_model(make_model("qwen3", layers=2))
    loss0, grads0, _ = _step(model, ids)
    _enable(model, activation_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False})
    lightseq_hf.patch_model(model, offload_checkpoints=True)
    funcs = [m._gradient_checkpointing_func for m in model.modules()
             if hasattr(m, "_gradient_checkpointing_func")]
    assert all(isinstance(f, OffloadingCheckpoint) and f.kwargs["preserve_rng_state"] is False for f in funcs)
    loss1, grads1, calls = _step(model, ids)
    assert calls == {"forward": 2, "backward": 2}
    assert torch.equal(loss0, loss1)
    for name, grad in grads0.items():
        assert torch.equal(grad, grads1[name]), name
    stats = model.lightseq_offloader.stats  # per layer: the input and out; lse (384 bytes) stays put
    assert (stats.offloaded_tensors, stats.cache_tensors) == (2 * 2, 2)
    lightseq_hf.unpatch_llama()

    def own(function, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = functools.partial(own, use_reentrant=False)
    with pytest.raises(ValueError, match="checkpoint offload needs the checkpoint function Transformers"):
        lightseq_hf.patch_model(model, offload_checkpoints=True)


def _count_tiles(monkeypatch, mlp_cls) -> dict[str, int]:
    """Count, from outside the library, the forwards of the model's own MLP class: per tile in the tiled
    forward (no grad) and in its backward's recompute (grad enabled)."""
    counts = {"tile_forwards": 0, "tile_backwards": 0}
    forward = mlp_cls.forward

    def counting_forward(self, x):
        counts["tile_backwards" if torch.is_grad_enabled() else "tile_forwards"] += 1
        return forward(self, x)

    monkeypatch.setattr(mlp_cls, "forward", counting_forward)
    return counts


@contextlib.contextmanager
def _norm_rows(model):
    """Yield the largest token-row count any norm of the decoder layers computed on (their class
    forwards, which the tiled function calls per tile)."""
    from lightseq_hf.patches.tiled_mlp import layer_norms

    norms = layer_norms(model)
    seen = [0]
    with pytest.MonkeyPatch.context() as patches:
        for cls in {type(m) for m in norms}:
            original = cls.forward

            def recording(self, x, *args, _original=original, **kwargs):
                if any(self is m for m in norms):
                    seen[0] = max(seen[0], x.numel() // x.shape[-1])
                return _original(self, x, *args, **kwargs)

            patches.setattr(cls, "forward", recording)
        yield seen


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiled_mlp_matches_untiled(arch, monkeypatch):
    """Tiled MLP and norms (7 tokens per tile over 2 x 45 tokens) against untiled, with and without remat
    checkpointing: loss and gradients within float32 rounding; no projection and no norm (Qwen3's
    per-head q/k norms included) sees more than 7 rows."""
    from tiny_models import make_batch, make_model

    import lightseq_hf

    ids, _ = make_batch(2, 45, seed=4)
    model = make_model(arch, layers=2)
    loss0, grads0, _ = _step(model, ids)
    for checkpointed in (False, True):
        model = make_model(arch, layers=2)
        lightseq_hf.patch_model(model, tiled_mlp=7)
        if checkpointed:
            _enable(model)
        seen, handles = _rows_seen(model)
        with monkeypatch.context() as patched, _norm_rows(model) as norm_rows:
            counts = _count_tiles(patched, type(model.model.layers[0].mlp))
            loss1, grads1, _ = _step(model, ids)
        for h in handles:
            h.remove()
        from lightseq_hf.patches.tiled_mlp import TiledForward, layer_norms

        norms = layer_norms(model)
        assert len(norms) == 2 * (4 if arch == "qwen3" else 2)  # per layer: 2 norms (+ q/k norms)
        assert all(isinstance(m.__dict__.get("forward"), TiledForward) for m in norms)
        assert norm_rows[0] == 7 * (4 if arch == "qwen3" else 1)  # a tile of tokens (x heads for q norms)
        tiles = -(-2 * 45 // 7)
        forwards = 2 * (2 if checkpointed else 1)  # layers x (forward + recompute)
        assert counts == {"tile_forwards": forwards * tiles, "tile_backwards": 2 * tiles}, counts
        assert seen[0] == 7
        assert rel_err(loss1, loss0) < 1e-6
        for name, grad in grads0.items():
            assert rel_err(grads1[name], grad) < 1e-5, name
    lightseq_hf.unpatch_llama()
    assert all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match="tiled_mlp must be a positive number"):
        lightseq_hf.patch_model(model, tiled_mlp=0)


def _average(grads, world):
    import torch.distributed as dist

    for g in grads.values():
        dist.all_reduce(g)
        g /= world
    return grads


#: (checkpointing, offload through, tiled_mlp): "transformers" offloads every layer through Transformers'
#: flag, "patch" through patch(), an int the first N layers, a mapping a per-layer plan (of the first
#: ``recompute`` layers only the input is kept: plain recompute)
OPTIONS = [("remat", "transformers", None), ("remat", None, 5), ("remat", "patch", 5),
           ("hf", "transformers", 5), ("remat", 2, None), ("remat", {"layers": 3, "recompute": 2}, 5),
           ("remat", {"layers": 1, "recompute": 2}, None)]


def _expected_layers(mode: str, offload) -> list[tuple[bool, bool]]:
    """``(offloaded, remat)`` per layer for an OPTIONS entry."""
    if isinstance(offload, dict):
        layers, plain = offload["layers"], offload["recompute"]
    else:
        layers, plain = (offload if isinstance(offload, int) else LAYERS if offload else 0), 0
    return [(i < layers, mode == "remat" and i >= plain) for i in range(LAYERS)]


def _offload_failures(tag: str, stats, layers: list[tuple[bool, bool]]) -> list[str]:
    """What the offloader did against the plan: per offloaded layer its input (and under remat the
    cached out and lse), fetched back last to first, the next layer's input prefetched; pooled host
    buffers all returned."""
    offloaded = [remat for off, remat in layers if off]
    failures = []
    if (stats.offloaded_tensors, stats.cache_tensors) != (sum(1 + 2 * r for r in offloaded),
                                                          sum(2 * r for r in offloaded)):
        failures.append(f"{tag}: offloaded {stats.offloaded_tensors}, from the cache {stats.cache_tensors}")
    if stats.fetch_order != list(range(len(offloaded) - 1, -1, -1)):
        failures.append(f"{tag}: fetch order {stats.fetch_order}")
    if stats.prefetched_groups != max(len(offloaded) - 1, 0) or stats.host_bytes_live != 0:
        failures.append(f"{tag}: prefetched {stats.prefetched_groups}, live {stats.host_bytes_live}")
    return failures


def worker_memory_options(rank, world):
    from lightseq_hf.parallel import ops

    backward_heads = []  # query heads of every schedule backward (the op runs one per head group)
    schedule_backward = ops.dist_attn_backward

    def recording_backward(dout, q, *args, **kwargs):
        backward_heads.append(q.shape[2])
        return schedule_backward(dout, q, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patches:
        patches.setattr(ops, "dist_attn_backward", recording_backward)
        return memory_option_cases(world, patches, backward_heads)


def memory_option_cases(world, patches, backward_heads):
    """Every memory option against the unpatched model; ``patches`` sets the backward's head-group limit,
    ``backward_heads`` collects the query heads of every schedule backward."""
    from kernel_checks import OpCalls
    from tiny_models import loss_and_grads, make_batch, make_model

    import lightseq_hf
    from lightseq_hf.parallel import ops

    failures = []
    ids, labels = make_batch(2, 37, seed=7, ignore_prefix=2)
    ref_loss, ref_grads, _ = loss_and_grads(make_model("llama", layers=LAYERS), input_ids=ids, labels=labels)
    lightseq_hf.patch_llama()
    for mode, offload, tile in OPTIONS:
        tag = f"checkpointing {mode} offload {offload} tiled_mlp {tile}"
        model = make_model("llama", layers=LAYERS)
        layers = _expected_layers(mode, offload)
        partial = offload if isinstance(offload, int) else None
        # the partial-offload case also runs the attention backward one key/value head at a time
        patches.setattr(ops, "BACKWARD_CHUNK_BYTES", 1 if partial else 2**30)
        backward_heads.clear()
        given = offload if isinstance(offload, (int, dict)) else offload == "patch"
        lightseq_hf.patch_model(model, checkpointing=mode, offload_checkpoints=given, tiled_mlp=tile)
        _enable(model, **({"offload": True} if offload == "transformers" else {}))
        if offload:
            model.lightseq_offloader.min_bytes = 0  # the tiny lse too (608 bytes)
        seen, handles = _rows_seen(model)
        with OpCalls() as op_calls, _norm_rows(model) as norm_rows:
            loss, grads, _ = loss_and_grads(model, input_ids=ids, labels=labels)
        calls = op_calls.calls
        for h in handles:
            h.remove()
        grads = _average(grads, world)
        if rel_err(loss, ref_loss) > 1e-5:
            failures.append(f"{tag}: loss {loss.item()} vs {ref_loss.item()}")
        worst = max((rel_err(grads[n], ref_grads[n]), n) for n in ref_grads)
        if worst[0] > 1e-4:
            failures.append(f"{tag}: gradient of {worst[1]} rel err {worst[0]:.2e}")
        want = LAYERS + sum(not remat for _, remat in layers)  # plain recompute runs the attention again
        if calls != {"forward": want, "backward": LAYERS}:
            failures.append(f"{tag}: attention calls {calls}")
        local = -(-37 // world)
        if seen[0] != (min(tile, 2 * local) if tile else 2 * local):
            failures.append(f"{tag}: an MLP projection saw {seen[0]} token rows")
        if norm_rows[0] != (min(tile, 2 * local) if tile else 2 * local):
            failures.append(f"{tag}: a layer norm saw {norm_rows[0]} token rows")
        heads = model.config.num_attention_heads  # head groups per backward -> backwards that used them
        chunks = {heads // h: n // (heads // h) for h, n in collections.Counter(backward_heads).items()}
        if chunks != ({2: LAYERS} if partial else {1: LAYERS}):
            failures.append(f"{tag}: backward head chunks {chunks}")
        if any(off for off, _ in layers):
            stats = model.lightseq_offloader.stats
            failures += _offload_failures(tag, stats, layers)
            allocated = stats.host_buffers_allocated
            loss_again, _, _ = loss_and_grads(model, input_ids=ids, labels=labels)
            if stats.host_buffers_allocated != allocated:  # the second step reuses the pool
                failures.append(f"{tag}: second step allocated host buffers ({allocated} first)")
            if not torch.equal(loss_again, loss):
                failures.append(f"{tag}: second step loss {loss_again.item()} vs {loss.item()}")
    lightseq_hf.unpatch_llama()
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_memory_options_distributed(world):
    results = run_distributed(worker_memory_options, world)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)


@contextlib.contextmanager
def _record_rows(module: torch.nn.Module):
    """Yield a list of the token rows of every call of ``module`` (through its class's forward)."""
    cls, rows = type(module), []
    original = cls.forward

    def recording(self, x, *args, **kwargs):
        if self is module:
            rows.append(x.numel() // x.shape[-1])
        return original(self, x, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patches:
        patches.setattr(cls, "forward", recording)
        yield rows


def worker_final_norm_in_loss(rank, world):
    """The final norm inside the fused loss (Llama's RMSNorm, Gemma's (1 + w) one): loss and gradients of
    the unpatched model; the norm ran on one chunk of rows at a time (and one probe row), never on the
    whole slice."""
    from lightseq_hf.patches import forward as patched_forward

    failures = []
    chunk, seq = 4, 29
    with pytest.MonkeyPatch.context() as patches:
        patches.setattr(patched_forward, "LOSS_CHUNK_TOKENS", chunk)
        for model_type in ("llama", "gemma"):
            failures += _final_norm_case(model_type, chunk, seq, world)
    return failures


def _final_norm_case(model_type, chunk, seq, world):
    from tiny_models import loss_and_grads, make_batch, make_tiny

    import lightseq_hf

    failures = []
    ids, labels = make_batch(2, seq, seed=11, ignore_prefix=2)
    ref_loss, ref_grads, _ = loss_and_grads(make_tiny(model_type), input_ids=ids, labels=labels)
    model = lightseq_hf.patch_model(make_tiny(model_type))
    _enable(model)
    with _record_rows(model.model.norm) as rows:
        loss, grads, _ = loss_and_grads(model, input_ids=ids, labels=labels)
    grads = _average(grads, world)
    if rel_err(loss, ref_loss) > 1e-5:
        failures.append(f"{model_type}: loss {loss.item()} vs {ref_loss.item()}")
    worst = max((rel_err(grads[n], ref_grads[n]), n) for n in ref_grads)
    if worst[0] > 1e-4:
        failures.append(f"{model_type}: gradient of {worst[1]} rel err {worst[0]:.2e}")
    slice_rows = 2 * -(-seq // world)
    if rows != [1] + [min(chunk, slice_rows - i) for i in range(0, slice_rows, chunk)]:
        failures.append(f"{model_type}: the final norm saw {rows} rows (slice {slice_rows})")
    lightseq_hf.unpatch()
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_final_norm_in_loss_distributed(world):
    results = run_distributed(worker_final_norm_in_loss, world)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)


def test_final_norm_stays_when_hidden_states_are_asked_for():
    """output_hidden_states=True: the norm runs in the decoder stack (the last hidden state is the
    normalized one, as unpatched) and the loss is the same."""
    from tiny_models import make_batch, make_model

    import lightseq_hf
    ids, labels = make_batch(1, 17, seed=3)
    ref = make_model("llama")(input_ids=ids, labels=labels, output_hidden_states=True)
    model = lightseq_hf.patch_model(make_model("llama"))
    with _record_rows(model.model.norm) as rows:
        out = model(input_ids=ids, labels=labels, output_hidden_states=True)
    assert rows == [17]
    assert rel_err(out.loss, ref.loss) < 1e-6
    assert rel_err(out.hidden_states[-1], ref.hidden_states[-1]) < 1e-6
    lightseq_hf.unpatch()
    assert "forward" not in model.model.norm.__dict__ and "_lightseq_final_norm" not in model.model.__dict__


def test_head_chunked_backward_on_one_process(monkeypatch):
    """Without a process group the attention backward also runs one key/value head group at a time once
    its float32 dq passes the limit; the gradients are the unchunked ones."""
    from tiny_models import make_batch, make_model

    import lightseq_hf
    from lightseq_hf.kernels import ReferenceKernel
    from lightseq_hf.parallel import ops

    ids, _ = make_batch(1, 31, seed=5)
    loss0, grads0, _ = _step(lightseq_hf.patch_model(make_model("llama")), ids)
    heads = []
    kernel_backward = ReferenceKernel.backward  # the kernel one process's backward calls directly

    def recording_backward(self, dout, q, *args, **kwargs):
        heads.append(q.shape[2])
        return kernel_backward(self, dout, q, *args, **kwargs)

    monkeypatch.setattr(ReferenceKernel, "backward", recording_backward)
    monkeypatch.setattr(ops, "BACKWARD_CHUNK_BYTES", 1)
    loss1, grads1, _ = _step(lightseq_hf.patch_model(make_model("llama")), ids)
    assert heads == [2] * 4  # 2 layers x 2 key/value head groups of 2 query heads
    assert torch.equal(loss0, loss1)
    for name, grad in grads0.items():
        assert rel_err(grads1[name], grad) < 1e-6, name


def test_cached_attention_copy_waited_for_at_first_read(monkeypatch):
    """A cached attention tensor handed back while its host-to-device copy runs: the compute stream waits
    for the copy only when the recompute first reads the cache entry (once), not when it is handed back."""
    from torch.utils.checkpoint import _VersionWrapper

    from lightseq_hf._testing.offload_cache import refill_cache_entry

    waits = []

    class Stream:
        def wait_event(self, event):
            waits.append(event)

    class Copied(torch.Tensor):  # a device tensor: record_stream takes the fake stream
        def record_stream(self, stream):
            waits.append(("record", stream))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    entry = _VersionWrapper(torch.zeros(3))
    refill_cache_entry(entry, torch.ones(3).as_subclass(Copied), "copied")
    assert waits == []
    value = entry.get_val(False)
    assert torch.equal(value, torch.ones(3)) and waits[0] == "copied" and len(waits) == 2
    assert torch.equal(entry.get_val(False), torch.ones(3)) and len(waits) == 2  # waited once
