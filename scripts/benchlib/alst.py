"""ALST as a peer, at its best: DeepSpeed Ulysses sequence parallelism + ZeRO-3 + the sequence-tiled MLP +
the tiled logits and loss + non-reentrant checkpointing (optionally offloaded to pinned host memory) + the
optimizer on the host where the length needs it, set up as DeepSpeed's ALST tutorial and ArcticTraining's
SFT trainer set it up (DeepSpeed 0.19.8, Transformers 5).

- :func:`unavailable`: why ALST cannot run here (``None`` when it can).
- :class:`AlstOptions`: the recipe's switches; :func:`options_from_variant` reads them from a
  ``bench_train.py`` variant (``alst+tiled+offload+cpuadam``).
- :func:`deepspeed_config`: the DeepSpeed configuration a run uses (recorded in every results row).
- :func:`prepare`: the engine and its training step, as ``bench_train.prepare_variant`` returns them.
- :func:`shard_batch`: this rank's batch, as ``UlyssesSPDataLoaderAdapter`` gives it.
- :func:`ulysses_refusal`: the head counts Ulysses cannot split, as its own constructor states them
  (:class:`UlyssesRefusal`).

Its packages are an optional benchmark install, never a dependency of lightseq_hf
(``scripts/install_peers.sh``; ``benchmarks/README.md``, "Peers").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types

import torch
import torch.distributed as dist

__all__ = ["RECIPE", "AlstOptions", "UlyssesRefusal", "deepspeed_config", "options_from_variant", "prepare",
           "shard_batch", "ulysses_refusal", "unavailable"]

#: what the harness takes from ALST's recipe, recorded beside every row
RECIPE = (
    "DeepSpeed's 'Arctic Long Sequence Training' tutorial and ArcticTraining's SFTTrainer.loss: "
    "UlyssesSPAttentionHF.register_with_transformers over the whole world (core attention: SDPA, cuDNN "
    "first), batches as UlyssesSPDataLoaderAdapter shards them (pre-shifted labels, global position_ids), "
    "ZeRO-3 (bf16, fp32 master weights), seq_parallel_communication_data_type bf16, non-reentrant "
    "checkpointing of every layer, the loss as TiledFusedLogitsLoss with ArcticTraining's 1 GiB float32 "
    "logit tiles (Liger, the recipe's other loss, is not part of DeepSpeed) and the group's token mean "
    "through a differentiable all_gather, its 1/tokens factor inside the tiles so that the head's "
    "gradient is exact; +tiled: TiledMLP with ceil(seq / hidden) shards; +offload: DeepSpeed's checkpoint "
    "hidden-state offload to pinned host memory on side streams; +cpuadam: offload_optimizer to the host "
    "with DeepSpeed's CPU Adam (else torch's fused AdamW on the GPU); "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")

_LOGIT_SHARD_BYTES = 2**30  # ArcticTraining: about 1 GiB of float32 logits per loss shard


def unavailable() -> str | None:
    """Why ALST cannot run in this environment, or None."""
    try:
        import deepspeed  # noqa: F401
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means the peer is absent
        return (f"ALST needs DeepSpeed >= 0.19 ({type(err).__name__}: {str(err).splitlines()[0][:120]}); "
                "install the peers with `bash scripts/install_peers.sh`")
    return None


class UlyssesRefusal(ValueError):
    """Head counts Ulysses cannot split over the group (its own constructor's check, raised before any
    memory is allocated)."""


@dataclasses.dataclass(frozen=True)
class AlstOptions:
    """ALST's memory switches: ``tiled_mlp`` (TiledMLP), ``offload_checkpoints`` (checkpointed layer inputs
    in pinned host memory), ``cpu_optimizer`` (ZeRO-3 ``offload_optimizer`` with CPU Adam)."""

    tiled_mlp: bool = False
    offload_checkpoints: bool = False
    cpu_optimizer: bool = False


def options_from_variant(options: set[str]) -> AlstOptions:
    """``{"tiled", "offload", "cpuadam"}`` (any subset) -> :class:`AlstOptions`; others are refused."""
    unknown = options - {"tiled", "offload", "cpuadam"}
    if unknown:
        raise SystemExit(f"alst options are tiled, offload and cpuadam, not {sorted(unknown)}")
    return AlstOptions(tiled_mlp="tiled" in options, offload_checkpoints="offload" in options,
                       cpu_optimizer="cpuadam" in options)


def deepspeed_config(options: AlstOptions, world: int, cuda: bool, lr: float = 1e-5) -> dict:
    """The DeepSpeed configuration of one run: ZeRO-3 over ``world`` ranks, Ulysses over all of them, bf16
    on GPUs (float32 on the CPU), the optimizer on the host with ``cpu_optimizer``."""
    zero: dict = {"stage": 3, "overlap_comm": cuda, "contiguous_gradients": True}
    config: dict = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                    "sequence_parallel_size": world, "zero_optimization": zero,
                    "gradient_clipping": 0.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if cuda:
        config["bf16"] = {"enabled": True}
        config["seq_parallel_communication_data_type"] = "bf16"
    if options.cpu_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}}
    return config


def ulysses_refusal(heads: int, kv_heads: int, world: int) -> str | None:
    """What ``UlyssesSPAttentionHF`` raises for these head counts (its own checks), or None."""
    if heads % world:
        return f"Attention head count {heads} is not divisible by SP size {world}"
    if kv_heads % world and world % kv_heads:
        return f"KV attention head count {kv_heads} is not divisible by SP size {world} or vice versa"
    return None


def shard_batch(ids: torch.Tensor, rank: int, world: int,
                positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """This rank's contiguous slice of ``input_ids``, ``position_ids`` (default ``0..n-1``; a packed row's
    restart at each document) and labels shifted over the whole row before slicing (``shift_labels``; the
    last is -100), as ``UlyssesSPDataLoaderAdapter`` gives a batch of ``input_ids``, ``position_ids`` and
    ``labels=input_ids``."""
    n = ids.shape[1]
    if n % world:
        raise ValueError(f"ALST needs a length divisible by the SP size: {n} tokens on {world} ranks")
    shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    if positions is None:
        positions = torch.arange(n, device=ids.device).unsqueeze(0).expand_as(ids)
    piece = slice(rank * n // world, (rank + 1) * n // world)
    return {"input_ids": ids[:, piece], "position_ids": positions[:, piece], "shift_labels": shift[:, piece]}


def _tile_mlps(model, world: int) -> None:
    """ALST's TiledMLP on every layer: ``ceil(seq / hidden)`` shards, agreed over the ranks (the maximum),
    around the layer's own MLP forward."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def tiled_forward(self, x):
        shards = torch.tensor(math.ceil(x.shape[-2] / x.shape[-1]), device=x.device)
        if world > 1:
            dist.all_reduce(shards, op=dist.ReduceOp.MAX)
        params = [p for p in self.parameters()]
        return TiledMLP.apply(lambda module, part: module.untiled_forward(part), self, x, int(shards), params)

    for layer in model.model.layers:
        layer.mlp.untiled_forward = layer.mlp.forward
        layer.mlp.forward = types.MethodType(tiled_forward, layer.mlp)


def _tiled_loss(model, hidden: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    """The shard's summed token losses times ``scale``, through DeepSpeed's TiledFusedLogitsLoss with about
    1 GiB of float32 logits per tile (ArcticTraining's choice). The scale sits inside the tiles because
    TiledFusedLogitsLoss computes the head's gradient in its forward: a factor applied to its output
    afterwards reaches the hidden states' gradient but not the head's."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    vocab = model.config.vocab_size
    shards = max(1, math.ceil(labels.numel() * vocab * 4 / _LOGIT_SHARD_BYTES))

    def tile_loss(module, x, y):
        logits = module.lm_head(x).float()
        if not bool((y != -100).any()):
            return logits.sum() * 0.0
        return torch.nn.functional.cross_entropy(logits.view(-1, vocab), y.reshape(-1), ignore_index=-100,
                                                 reduction="sum") * scale

    return TiledFusedLogitsLoss.apply(tile_loss, model, hidden, labels, None, shards,
                                      [model.lm_head.weight], "sum")


def _group_loss(model, hidden: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
    """The group's token mean. Each rank's tiles carry ``world / tokens of the group``; the ranks' terms
    are gathered differentiably and averaged, so the loss's gradient reaching each rank is 1 and
    DeepSpeed's average over the group gives every parameter, the head's included, the whole row's
    gradient."""
    import torch.distributed.nn.functional as dist_fn

    count = (labels != -100).sum()
    world = 1 if group is None else dist.get_world_size(group)
    if group is not None:
        dist.all_reduce(count, group=group)
    local = _tiled_loss(model, hidden, labels, world / max(int(count), 1))
    if group is None:
        return local
    return sum(dist_fn.all_gather(local, group=group)) / world


def _build(shape, n: int, device: torch.device, config: dict, init_state: dict | None):
    """The model under ``deepspeed.zero.Init`` on GPUs (each rank makes only its partition); on the CPU in
    float32, loaded from ``init_state`` when given (the tests' reference weights)."""
    import deepspeed
    from transformers import LlamaForCausalLM

    from benchlib.workloads import llama_config

    model_config = llama_config(shape, n)
    if device.type == "cuda":
        with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
            return LlamaForCausalLM(model_config)
    model = LlamaForCausalLM(model_config)
    if init_state is not None:
        model.load_state_dict(init_state)
    return model


def prepare(shape, n: int, device: torch.device, options: AlstOptions, *, seed_ids: int = 1,
            init_state: dict | None = None, ids: torch.Tensor | None = None):
    """ALST's engine for a Llama of ``shape`` at ``n`` tokens over the whole world, and its training step
    ``step(probe) -> loss`` on one random row of ``n`` tokens (``ids``: that row; default the one
    ``bench_train`` draws with ``seed_ids``). Returns a namespace: ``engine``, ``step``,
    ``forward_backward(probe=None, rows=None) -> loss`` (no optimizer step), ``config`` (the run's full
    configuration), this rank's ``batch`` and ``close()`` (Transformers' SDPA attention restored, the
    engine freed)."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    world, rank, cuda = dist.get_world_size(), dist.get_rank(), device.type == "cuda"
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    config = deepspeed_config(options, world, cuda)
    refusal = ulysses_refusal(shape[3], shape[4], world)
    if refusal:
        raise UlyssesRefusal(refusal)
    torch.manual_seed(0)
    model = _build(shape, n, device, config, init_state)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]  # Ulysses replaces it process-wide; close() puts it back
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world,
        micro_batch_size=1, seq_length=n, seq_length_is_variable=False)
    if options.tiled_mlp:
        _tile_mlps(model, world)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = None if options.cpu_optimizer else torch.optim.AdamW(
        model.parameters(), lr=1e-5, weight_decay=0.0, **({"fused": True} if cuda else {}))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    group = mpu.get_sequence_parallel_group() if mpu is not None else None
    if ids is None:
        g = torch.Generator().manual_seed(seed_ids)
        ids = torch.randint(0, shape[5], (1, n), generator=g)
    batch = {k: v.to(device) for k, v in shard_batch(ids, rank, world).items()}
    offload = get_checkpoint_hidden_states_offloading_ctx_manager() if options.offload_checkpoints else None

    def forward_backward(probe=None, rows: dict | None = None) -> torch.Tensor:
        """The group's mean loss of the row (``rows``: another batch of :func:`shard_batch`'s form), and its
        backward (gradients in the engine's partitions)."""
        rows = batch if rows is None else rows
        with _sdpa_cudnn_first(cuda), (offload or contextlib.nullcontext()):
            out = engine.module.model(input_ids=rows["input_ids"], position_ids=rows["position_ids"],
                                      use_cache=False)
            loss = _group_loss(engine.module, out.last_hidden_state, rows["shift_labels"], group)
            if probe is not None:
                probe.mark("forward")
            engine.backward(loss)
        return loss

    def step(probe):
        loss = forward_backward(probe)
        probe.mark("backward")
        engine.step()
        probe.mark("optimizer")
        return loss

    config = {**config, "recipe": RECIPE, "loss": "TiledFusedLogitsLoss", "tiled_mlp": options.tiled_mlp,
              "offload_checkpoints": options.offload_checkpoints,
              "optimizer_impl": "DeepSpeedCPUAdam (host)" if options.cpu_optimizer else
              ("torch.optim.AdamW(fused=True)" if cuda else "torch.optim.AdamW")}
    def close() -> None:
        """Give Transformers its SDPA attention back and free the engine's memory."""
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        engine.destroy()

    return types.SimpleNamespace(engine=engine, step=step, forward_backward=forward_backward, config=config,
                                 batch=batch, close=close)


@contextlib.contextmanager
def _sdpa_cudnn_first(cuda: bool):
    """SDPA's kernels in the order fastest on Hopper (cuDNN, then flash, then memory-efficient); the CPU
    keeps torch's choice."""
    if not cuda:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(order, set_priority=True):
        yield
