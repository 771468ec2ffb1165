"""What the fine-tune holds beyond a bare training step, measured on 2 CPU processes with FSDP2 (gloo).

Live bytes are counted from the test side: every tensor the garbage collector can reach, each storage
once (DTensors by their local shard). Two mechanisms, each against the library's choice:
- a list of the model's parameters from before sharding (the groups AdamW was built from) pins a full
  float32 copy of the model on every rank, because FSDP2 copies parameters into sharded storage;
  ``build_optimizer`` keeps none;
- FSDP2 with gradient sync off (``no_sync`` during accumulation) keeps every layer's unsharded gradient
  until the last micro-batch; the trainer reduces every micro-batch under FSDP.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from types import SimpleNamespace

import torch
from distributed import run_distributed


def _live_bytes() -> int:
    from torch.distributed.tensor import DTensor

    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch.distributed aliases warns
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                t = obj._local_tensor if isinstance(obj, DTensor) else obj
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    s = t.untyped_storage()
                    if s.nbytes():
                        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _unsharded_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the unsharded gradients FSDP2 holds for its modules (its internals, read from here)."""
    total = 0
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fp in group.fsdp_params if group is not None else ():
            unsharded = getattr(fp, "_unsharded_param", None)
            for g in (getattr(unsharded, "grad", None), fp.unsharded_accumulated_grad):
                total += g.numel() * g.element_size() if g is not None else 0
    return total


def _sharded_model(world: int, keep_parameter_lists: bool):
    """A Llama sharded the way accelerate's FSDP2 preparation does it, the optimizer built before."""
    import yaml
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightseq_hf.training.build import build_optimizer
    from lightseq_hf.training.config import config_from_dict

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=1024, tie_word_embeddings=False))
    held = None
    if keep_parameter_lists:  # the pattern of a trainer that builds AdamW's groups in its own frame
        held = [p for p in model.parameters()]
        optimizer = torch.optim.AdamW([{"params": held}])
    else:
        cfg = config_from_dict(yaml.safe_load(open("configs/tiny.yaml")), base_dir="configs")
        optimizer, _ = build_optimizer(model, cfg, 10)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    for g in optimizer.param_groups:  # accelerate drops the optimizer's references before sharding
        g["params"] = [torch.empty(1) for _ in g["params"]]
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    new = dict(model.named_parameters())
    for g, ns in zip(optimizer.param_groups, order):  # ... and maps them to the sharded ones after
        g["params"] = [new[n] for n in ns]
    return model, optimizer, held


def worker_memory(rank: int, world: int) -> list[str]:
    failures = []
    base = _live_bytes()
    model, optimizer, held = _sharded_model(world, keep_parameter_lists=True)
    full = sum(p.numel() * 4 for p in held)
    with_lists = _live_bytes() - base
    del model, optimizer, held
    base = _live_bytes()
    model, optimizer, _ = _sharded_model(world, keep_parameter_lists=False)
    ours = _live_bytes() - base
    if with_lists - ours != full:
        failures.append(f"rank {rank}: held lists pin {with_lists - ours} bytes, not the model's {full}")
    if not full / world <= ours <= full / world * 1.01:
        failures.append(f"rank {rank}: {ours} live bytes after sharding, not a shard ({full / world})")

    ids = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(rank))
    model.set_requires_gradient_sync(False)  # accumulation without reduce-scatter
    model(input_ids=ids, labels=ids).loss.backward()
    unsynced = _unsharded_gradient_bytes(model)
    model.set_requires_gradient_sync(True)
    model(input_ids=ids, labels=ids).loss.backward()  # the last micro-batch reduces what was kept
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()  # reduced at once
    synced = _unsharded_gradient_bytes(model)
    sharded = sum(p.grad.to_local().numel() * 4 for p in model.parameters() if p.grad is not None)
    if unsynced != full:
        failures.append(f"rank {rank}: unsynced micro-batch keeps {unsynced} bytes, not the model's {full}")
    if synced != 0 or not full / world <= sharded <= full / world * 1.01:
        failures.append(f"rank {rank}: a synced micro-batch keeps {synced} unsharded and {sharded} sharded "
                        "gradient bytes")
    return failures


def test_fine_tune_keeps_no_unsharded_copy_of_parameters_or_gradients() -> None:
    failures = [f for fs in run_distributed(worker_memory, 2) for f in fs]
    assert not failures, "\n".join(failures)


def test_fsdp_reduces_every_micro_batch_ddp_only_the_last() -> None:
    from accelerate.utils import DistributedType

    from lightseq_hf.training.loop import Trainer

    calls = []
    for kind in (DistributedType.FSDP, DistributedType.MULTI_GPU):
        trainer = Trainer.__new__(Trainer)
        trainer.model = object()
        trainer.accelerator = SimpleNamespace(distributed_type=kind,
                                              no_sync=lambda m, kind=kind: calls.append(kind) or
                                              contextlib.nullcontext())
        for last in (False, False, True):
            with trainer._gradient_sync(last=last):
                pass
    assert calls == [DistributedType.MULTI_GPU, DistributedType.MULTI_GPU]
