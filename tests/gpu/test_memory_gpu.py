"""The memory options on CUDA: checkpoint offload through pinned host buffers and a side
stream, partial offload, the head-chunked distributed backward and the tiled MLP, on 2 GPUs (NCCL)
against the unpatched model on one GPU (float32, TF32 off).

Asserted per option: loss and gradients; what was offloaded per layer and in which order backward
fetched it; that the host buffers are page-locked, exact-sized and reused by the second step (no new
ones); that the backward ran in the expected number of head chunks.

Run on a machine with at least 2 GPUs: ``python -m pytest tests/gpu/test_memory_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

from distributed import rel_err, run_distributed  # noqa: E402

LAYERS = 3
SEQ = 2048


def worker(rank, world):
    with pytest.MonkeyPatch.context() as patches:  # undone when the worker ends, even by an exception
        return check_memory_options(rank, world, patches)


def check_memory_options(rank, world, patches):
    import collections

    import torch.distributed as dist
    from tiny_models import VOCAB, loss_and_grads, make_batch

    import lightseq_hf
    from lightseq_hf._testing.views import pooled_host_buffers
    from lightseq_hf.parallel import ops

    backward_heads = []  # query heads of every schedule backward (the op runs one per head group)
    schedule_backward = ops.dist_attn_backward

    def recording_backward(dout, q, *args, **kwargs):
        backward_heads.append(q.shape[2])
        return schedule_backward(dout, q, *args, **kwargs)

    patches.setattr(ops, "dist_attn_backward", recording_backward)
    patches.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    patches.setattr(torch.backends.cudnn, "allow_tf32", False)
    device = torch.device("cuda", rank)
    failures = []
    ids, labels = make_batch(1, SEQ, seed=3, ignore_prefix=1)
    ids, labels = ids.to(device), labels.to(device)

    def model():
        from tiny_models import make_model

        return make_model("llama", layers=LAYERS, hidden_size=256, intermediate_size=512,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
                          vocab_size=VOCAB).to(device)

    ref_loss, ref_grads, _ = loss_and_grads(model(), input_ids=ids, labels=labels)
    lightseq_hf.patch_llama()
    # (offload_checkpoints, tiled_mlp, backward chunk bytes -> expected chunks)
    for offload, tile, chunk_bytes, chunks in [(True, 512, 2**30, 1), (2, None, 1, 4), (False, 256, 1, 4)]:
        tag = f"offload {offload} tiled {tile} chunks {chunks}"
        patches.setattr(ops, "BACKWARD_CHUNK_BYTES", chunk_bytes)
        backward_heads.clear()
        m = lightseq_hf.patch_model(model(), backend="auto", offload_checkpoints=offload, tiled_mlp=tile)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for step in range(2):
            loss, grads, _ = loss_and_grads(m, input_ids=ids, labels=labels)
            torch.cuda.synchronize()
            for g in grads.values():
                dist.all_reduce(g)
                g /= world
            if rel_err(loss, ref_loss) > 1e-5:
                failures.append(f"{tag} step {step}: loss {loss.item()} vs {ref_loss.item()}")
            worst = max((rel_err(grads[n], ref_grads[n]), n) for n in ref_grads)
            if worst[0] > 1e-4:
                failures.append(f"{tag} step {step}: gradient of {worst[1]} rel err {worst[0]:.2e}")
            if step == 0 and offload:
                stats = m.lightseq_offloader.stats
                layers = LAYERS if offload is True else offload
                if (stats.offloaded_tensors, stats.cache_tensors) != (3 * layers, 2 * layers):
                    failures.append(f"{tag}: offloaded {stats.offloaded_tensors}, "
                                    f"cache {stats.cache_tensors}")
                if stats.fetch_order != list(range(layers - 1, -1, -1)):
                    failures.append(f"{tag}: fetch order {stats.fetch_order}")
                allocated = stats.host_buffers_allocated
                buffers = pooled_host_buffers(m.lightseq_offloader.pool(device))
                if not buffers or not all(b.is_pinned() for b in buffers):
                    failures.append(f"{tag}: host buffers not page-locked")
                if stats.host_bytes_reserved != stats.offloaded_bytes:  # exact sizes, no rounding
                    failures.append(f"{tag}: {stats.host_bytes_reserved} bytes reserved for "
                                    f"{stats.offloaded_bytes} offloaded")
        if offload and m.lightseq_offloader.stats.host_buffers_allocated != allocated:
            failures.append(f"{tag}: the second step allocated host buffers")
        got = {8 // h: n // (8 // h) for h, n in collections.Counter(backward_heads).items()}  # 8 heads
        if got != {chunks: 2 * LAYERS}:
            failures.append(f"{tag}: backward head chunks {got}")
        if offload:
            m.lightseq_offloader.release_host_memory()
    lightseq_hf.unpatch_llama()
    return failures


def test_memory_options_on_two_gpus():
    failures = [f for r in run_distributed(worker, 2, backend="nccl") for f in r]
    assert not failures, "\n".join(failures)
