"""Every decoder architecture the patch serves, on 2 and 3 gloo processes against the unpatched model on
one process; the others refused by name at patch time; the support tables (docs/models.md, the README's
summary) checked against both.

Each model type of SUPPORTED is a tiny random model (``tiny_models.tiny_config``: 3 layers, 6 query
heads over 2 key/value heads where the architecture has GQA, sliding-window and chunked layers where it
has them, 4 experts with the router aux loss on) taking one training step on two rows of 23 tokens, the
second right-padded (attention mask), with rematerialization-aware checkpointing, checkpoint offload and
the tiled MLP on; the models of PACKED also take a row of packed documents. Checked: the loss, the aux
loss and every parameter's gradient against the unpatched model (float64 with an SDPA reference where
the model runs in float64, else float32 against eager), and the mechanism, from the test side: every
attention ran once through the distributed attention on this rank's slice length, the fused loss ran
for plain heads and not for heads that change the logits, no dense-MLP projection saw more rows than a
tile, the checkpoints went to the offloader.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings

import pytest
import torch
from distributed import rel_err, run_distributed
from model_table import MODELS_PAGE, README, expected_row, parse_rows, refusal_message
from tiny_models import make_tiny

from lightseq_hf.parallel.api import dist_flash_attn

SEQ, PAD_FROM, TILE = 23, 19, 5  # padding shorter than the window: no row of the reference is all masked
PACKED_DOCS = (7, 1, 9, 6)
#: relative tolerance by the dtype a model runs in (expert kernels of some MoE models take no float64;
#: float32 inside float64 models, such as Gemma's norms, leaves about 1e-7)
TOLERANCE = {torch.float64: 1e-5, torch.float32: 5e-5}

#: model types run on 2 and 3 processes
SUPPORTED = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "phi3", "olmo", "olmo2", "olmo3",
    "granite", "cohere", "cohere2", "starcoder2", "ministral", "glm", "glm4", "helium", "smollm3",
    "exaone4", "seed_oss", "ernie4_5", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss",
    "granitemoe", "deepseek_v2", "deepseek_v3", "llama4_text", "phimoe",
)
#: model types whose training routes tokens to experts by random sampling: their MoE blocks run in
#: eval mode (deterministic routing) in both runs
SAMPLED_ROUTING = {"phimoe": "PhimoeSparseMoeBlock"}
#: model types whose head changes the logits (scaling): the model's own head runs on each slice; every
#: other type takes the fused chunked loss
MODEL_HEAD = ("granite", "cohere", "cohere2", "granitemoe", "gemma2")
#: model types that also take a packed row (documents from restarting position_ids)
PACKED = ("gemma3_text", "gpt_oss", "llama4_text", "qwen2")
#: model type -> (config overrides, what the refusal names besides the model type)
REFUSED = {
    "qwen3_next": ({}, "linear-attention"),
    "qwen3_5_text": ({}, "linear-attention"),
    "jamba": ({}, "linear-attention"),
    "falcon_h1": ({}, "hybrid attention + state-space"),
    "nemotron_h": ({}, "linear-attention"),
    "zamba2": ({}, "hybrid attention + state-space"),
    "lfm2": ({}, "short-convolution"),
    "granitemoehybrid": ({}, "linear-attention"),
    "recurrent_gemma": ({}, "linear-attention"),
    "minimax": ({}, "linear-attention"),
    "bart": ({}, "encoder-decoder"),
    "bert": ({}, "bidirectional attention"),
    "bloom": ({}, "does not go through Transformers' AttentionInterface"),
    "gemma3": ({}, "composite (multimodal)"),
    "phi4_multimodal": ({}, "multimodal model (its forward takes image_pixel_values"),
    "deepseek_v32": ({}, "sparse indexed attention"),
    "llama4_text": (dict(attn_temperature_tuning=True, no_rope_layers=[1, 0, 1]), "temperature tuning"),
}


if "softcap" in inspect.signature(dist_flash_attn).parameters:  # attention logit soft-capping in the kernels
    SUPPORTED += ("gemma2",)
else:
    REFUSED["gemma2"] = ({}, "soft-capping")


def _inputs(packed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if packed:  # one row of documents, as DataCollatorWithFlattening makes it
        ids = torch.randint(3, 120, (1, SEQ), generator=g)
        labels, starts = ids.clone(), torch.tensor([0, *PACKED_DOCS]).cumsum(0)[:-1]
        labels[0, starts] = -100
        positions = torch.cat([torch.arange(n) for n in PACKED_DOCS])[None]
        return {"input_ids": ids, "position_ids": positions, "labels": labels}
    ids = torch.randint(3, 120, (2, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, PAD_FROM:] = 0
    labels = ids.clone()
    labels[1, PAD_FROM:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _cases() -> tuple[tuple[str, bool], ...]:
    return tuple((t, False) for t in SUPPORTED) + tuple((t, True) for t in PACKED)


def _train(model, model_type: str) -> None:
    model.train()
    for module in model.modules():
        if type(module).__name__ == SAMPLED_ROUTING.get(model_type):
            module.eval()


def _attention_modules(model) -> list[torch.nn.Module]:
    from lightseq_hf.patches.architectures import uses_attention_interface

    return [m for m in model.modules() if uses_attention_interface(type(m))]


def _dtype(model_type: str) -> torch.dtype:
    """float64 where the model runs in it, else float32."""
    model = make_tiny(model_type, dtype=torch.float64)
    try:
        model(input_ids=torch.ones(1, 4, dtype=torch.long))
    except (RuntimeError, ValueError):
        return torch.float32
    return torch.float64


def _reference_attention(model_type: str, dtype: torch.dtype) -> str:
    """SDPA (its float64 softmax) unless the model's attention needs eager: sinks, soft-capping."""
    model = make_tiny(model_type)
    special = getattr(model.config, "attn_logit_softcapping", None) or any(
        isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules())
    return "eager" if dtype == torch.float32 or special or not model._supports_sdpa else "sdpa"


def _make(model_type: str, packed: bool, dtype: torch.dtype, attn: str = "eager"):
    """The case's tiny model; packed rows run without the router aux loss (the per-document reference
    cannot form the packed row's)."""
    overrides = {"output_router_logits": False} if packed else {}
    return make_tiny(model_type, dtype=dtype, attn=attn, **overrides)


def _documents(inputs: dict) -> list[dict]:
    """The packed row's documents as separate rows (labels of each as in the row)."""
    bounds = torch.tensor([0, *PACKED_DOCS]).cumsum(0).tolist()
    return [{k: inputs[k][:, a:b] for k in ("input_ids", "labels")} for a, b in zip(bounds, bounds[1:])]


@functools.cache
def references(cases: tuple[tuple[str, bool], ...]) -> dict[tuple[str, bool], dict]:
    """The unpatched model's loss, aux loss, gradients and attention calls per forward, per case, on this
    process; a packed row's documents run one at a time (Transformers' eager and SDPA attention do not
    separate packed documents)."""
    refs = {}
    for case in cases:
        try:
            refs[case] = _reference(*case)
        except Exception as exc:  # noqa: BLE001  (a tiny config of the survey that does not run)
            refs[case] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"}
    return refs


def _reference(model_type: str, packed: bool) -> dict:
    """One case of :func:`references`."""
    dtype = _dtype(model_type)
    model = _make(model_type, packed, dtype, _reference_attention(model_type, dtype))
    _train(model, model_type)
    rows = _documents(_inputs(True)) if packed else [_inputs(False)]
    total, count, aux = 0.0, 0, None
    for row in rows:
        labels = torch.nn.functional.pad(row.pop("labels")[:, 1:], (0, 1), value=-100)
        with _counting_attention(model) as calls:
            out = model(**row)
        logits = out.logits.reshape(-1, out.logits.shape[-1])
        total = total + torch.nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="sum")
        count += int((labels != -100).sum())
        aux = getattr(out, "aux_loss", None)
    loss = total / count
    if aux is not None:  # one row: the model's own coefficient, from its loss with and without aux
        loss = loss + _aux_coefficient(model) * aux
    loss.backward()
    grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
    return dict(dtype=dtype, loss=loss.detach(), aux=None if aux is None else aux.detach(),
                calls=len(calls), grads=grads,
                grad_scale=torch.cat([g.double().flatten() for g in grads.values()]).norm().item())


@contextlib.contextmanager
def _counting_attention(model):
    """Count the calls of the reference's attention function while the context is open (eager: the
    function of the model's own module; SDPA: the registered one); some layers attend twice (DiffLlama)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []

    def counting(function):
        def count(*args, **kwargs):
            calls.append(1)
            return function(*args, **kwargs)
        return count

    modules = {sys.modules[type(m).__module__] for m in _attention_modules(model)}
    saved = [(m, m.eager_attention_forward) for m in modules if hasattr(m, "eager_attention_forward")]
    sdpa = ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"]
    for module, function in saved:
        module.eager_attention_forward = counting(function)
    ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = counting(sdpa)
    try:
        yield calls
    finally:
        for module, function in saved:
            module.eager_attention_forward = function
        ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = sdpa


def _aux_coefficient(model) -> float:
    for name in ("router_aux_loss_coef", "aux_loss_coef"):
        value = getattr(model, name, None)
        if value is not None:
            return value
    raise AssertionError(f"{type(model).__name__}: no aux loss coefficient attribute")


# ----------------------------------------------------------------------------- the distributed runs


def _grad_err(grad: torch.Tensor, ref: torch.Tensor, scale: float) -> float:
    """Relative error, against at least 1e-6 of the norm of all gradients: some gradients are zero up to
    rounding (a key bias without rotary embeddings, the gate of a top-1 router) and their rounding noise
    is no relative error."""
    return (grad.double() - ref.double()).norm().item() / max(ref.double().norm().item(), 1e-6 * scale)


def _average(grads: dict, world: int) -> dict:
    import torch.distributed as dist

    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= world
    return grads


def _watch(model, seen: dict) -> list:
    """Forward hooks recording the most token rows a dense-MLP projection received."""
    from lightseq_hf.patches.tiled_mlp import layer_mlps

    def hook(module, args, out):
        seen["mlp_rows"] = max(seen["mlp_rows"], args[0].numel() // args[0].shape[-1])

    dense, _ = layer_mlps(model)
    return [m.register_forward_hook(hook) for mlp in dense for m in mlp.modules()
            if isinstance(m, torch.nn.Linear)]


def _check(case: tuple[str, bool], ref: dict, rank: int, world: int, seen: dict) -> tuple[dict, list[str]]:
    import lightseq_hf
    from lightseq_hf.parallel.sharding import shard_for
    from lightseq_hf.patches import describe
    from lightseq_hf.patches.tiled_mlp import TiledForward, layer_mlps

    model_type, packed = case
    tag = f"{model_type}{' (packed)' if packed else ''} on {world}"
    model = _make(model_type, packed, ref["dtype"])
    lightseq_hf.patch(model, offload_checkpoints=True, tiled_mlp=TILE)
    checkpointed = model.supports_gradient_checkpointing
    if checkpointed:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model.lightseq_offloader.min_bytes = 0
    handles = _watch(model, seen)
    seen.update(attention=[], fused=0, mlp_rows=0)
    _train(model, model_type)
    out = model(**_inputs(packed))
    out.loss.backward()
    for handle in handles:
        handle.remove()
    grads = _average({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
                     world)
    failures = []
    if set(grads) != set(ref["grads"]):
        return {}, [f"{tag}: gradients of {sorted(set(grads) ^ set(ref['grads']))[:4]} missing"]
    worst = max((_grad_err(grads[n], g, ref["grad_scale"]), n) for n, g in ref["grads"].items())
    numbers = {"loss": rel_err(out.loss, ref["loss"]), "grad": worst[0]}
    if ref["aux"] is not None:
        numbers["aux"] = rel_err(out.aux_loss, ref["aux"]) if out.aux_loss is not None else float("inf")
    tolerance = TOLERANCE[ref["dtype"]]
    failures += [f"{tag}: {k} off by {v:.2e}" + (f" ({worst[1]})" if k == "grad" else "")
                 for k, v in numbers.items() if not v <= tolerance]
    local = shard_for(SEQ, rank, world).local_len
    if seen["attention"] != [local] * ref["calls"]:
        failures.append(f"{tag}: distributed attention saw {seen['attention']}, want {ref['calls']} x "
                        f"{local}")
    arch = describe(model)
    if seen["fused"] != int(arch.fused_head) or (model_type in SUPPORTED and arch.fused_head == (
            model_type in MODEL_HEAD)):
        failures.append(f"{tag}: the fused loss ran {seen['fused']} times ({arch.head_extras!r})")
    dense, _ = layer_mlps(model)
    if not all(isinstance(m.__dict__.get("forward"), TiledForward) for m in dense) or seen["mlp_rows"] > TILE:
        failures.append(f"{tag}: dense MLPs saw {seen['mlp_rows']} rows (tile {TILE})")
    if checkpointed and model.lightseq_offloader.stats.offloaded_tensors == 0:
        failures.append(f"{tag}: nothing was offloaded")
    lightseq_hf.unpatch()
    return numbers, failures


def _worker(rank: int, world: int, cases: list, refs: dict) -> dict:
    from lightseq_hf.parallel import ops
    from lightseq_hf.parallel.sharding import chunked_loss_sum

    loss_module = sys.modules[chunked_loss_sum.__module__]  # where the fused loss lives
    seen = {"attention": [], "fused": 0, "mlp_rows": 0}
    attention, fused = ops.dist_attn_forward, loss_module._HeadCrossEntropySum.apply

    def recording_attention(q, *args, **kwargs):
        seen["attention"].append(q.shape[1])
        return attention(q, *args, **kwargs)

    def counting_fused(*args):
        seen["fused"] += 1
        return fused(*args)

    ops.dist_attn_forward, loss_module._HeadCrossEntropySum.apply = recording_attention, counting_fused
    numbers, failures = {}, {}
    try:
        for case in cases:
            try:
                numbers[case], failures[case] = _check(case, refs[case], rank, world, seen)
            except Exception as exc:  # keep going: the peers run the same cases in the same order
                failures[case] = [f"{case} on {world} raised {type(exc).__name__}: {exc}"]
        if world == 2 and ("llama", False) in cases:
            failures["fingerprint"] = _fingerprint_failures(rank)
    finally:
        ops.dist_attn_forward, loss_module._HeadCrossEntropySum.apply = attention, fused
    return {"numbers": numbers, "failures": failures}


def _fingerprint_failures(rank: int) -> list[str]:
    """Ranks given batches that differ in embeddings, positions, masks or dtypes, or weights of another
    dtype, all stop with one error naming what differs."""
    from tiny_models import make_batch, make_model

    import lightseq_hf

    failures = []
    model = lightseq_hf.patch(make_model("llama"))
    ids, labels = make_batch(2, 24, seed=3)
    embeds = model.get_input_embeddings()(ids).detach()
    other = embeds.clone()
    if rank == 1:
        other.view(-1)[100] = torch.nextafter(other.view(-1)[100], torch.tensor(1.0))  # one bit
    mask = torch.ones_like(ids)
    mask[1, (20 if rank == 0 else 21):] = 0
    cases = [("inputs_embeds one bit apart", dict(inputs_embeds=other), "inputs_embeds"),
             ("position_ids offset", dict(input_ids=ids, position_ids=torch.arange(24)[None] + rank),
              "position_ids"),
             ("attention masks", dict(input_ids=ids, attention_mask=mask), "attention_mask"),
             ("input_ids dtypes", dict(input_ids=ids.int() if rank else ids), "input_ids dtype")]
    for what, inputs, needle in cases:
        _expect_error(failures, rank, what, lambda: model(**inputs), needle)
    bf16 = lightseq_hf.patch(make_model("llama").to(torch.bfloat16 if rank else torch.float32))
    _expect_error(failures, rank, "weights of different dtypes", lambda: bf16(input_ids=ids), "weight dtypes")
    if not torch.isfinite(model(input_ids=ids, labels=labels).loss):  # the group still works
        failures.append(f"rank {rank}: the loss after the refused batches is not finite")
    lightseq_hf.unpatch()
    return failures


def _expect_error(failures: list, rank: int, what: str, call, needle: str) -> None:
    try:
        call()
        failures.append(f"rank {rank}: {what} was accepted")
    except ValueError as exc:
        if "received different batches" not in str(exc) or needle not in str(exc):
            failures.append(f"rank {rank}: {what}: {exc}")


@functools.cache
def measured(world: int, cases: tuple[tuple[str, bool], ...] = _cases()) -> tuple[dict, dict]:
    """Per case, the worst numbers over the ranks of one spawned group of ``world``, and the failures."""
    refs = references(cases)
    failures: dict = {case: [f"{case} reference raised {ref['error']}"] for case, ref in refs.items()
                      if "error" in ref}
    numbers: dict = {}
    runnable = [case for case in cases if case not in failures]
    for result in run_distributed(_worker, world, runnable, {c: refs[c] for c in runnable}):
        if isinstance(result, list):  # a rank raised outside the cases
            failures.setdefault("worker", []).extend(result)
            continue
        for case, found in result["numbers"].items():
            numbers[case] = {k: max(v, numbers.get(case, {}).get(k, 0.0)) for k, v in found.items()}
        for case, found in result["failures"].items():
            if found:
                failures[case] = list(dict.fromkeys(failures.get(case, []) + found))
    return numbers, failures


@pytest.mark.parametrize("world", [2, 3])
def test_architectures_match_unpatched(world):
    numbers, failures = measured(world)
    assert not failures, "\n".join(f for found in failures.values() for f in found)
    assert set(numbers) == set(_cases())


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_by_name_at_patch_time(model_type):
    """Built on the meta device (no memory): patch() names the feature and the model type."""
    import lightseq_hf
    from lightseq_hf.patches import UnsupportedModel

    overrides, needle = REFUSED[model_type]
    with torch.device("meta"):
        model = make_tiny(model_type, **overrides)
    with pytest.raises(UnsupportedModel) as refused:
        lightseq_hf.patch(model)
    lightseq_hf.unpatch()
    message = str(refused.value)
    assert f"(model_type {model_type!r})" in message and needle in message, message


def test_own_attention_mask_refused_at_the_first_step():
    """Doge builds a dynamic mask inside its attention: the first forward refuses it by name."""
    import lightseq_hf

    model = lightseq_hf.patch(make_tiny("doge"))
    with pytest.raises(ValueError, match="doge: .* passes an attention mask of its own"):
        model(**_inputs(False))
    lightseq_hf.unpatch()


def test_class_patch_leaves_refused_models_alone():
    """patch() before any model exists: a refused causal LM built afterwards stays unpatched, logged."""
    import logging

    import lightseq_hf

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines = Lines()
    logging.getLogger("lightseq_hf").addHandler(lines)
    lightseq_hf.patch()
    try:
        model = make_tiny("bloom")
        out = model(input_ids=torch.ones(1, 5, dtype=torch.long))
    finally:
        lightseq_hf.unpatch()
        logging.getLogger("lightseq_hf").removeHandler(lines)
    assert out.logits.shape == (1, 5, 128)
    assert any("(model_type 'bloom'): its attention does not go through" in line for line in lines.lines)


# ----------------------------------------------------------------------------- the README table


def test_support_tables():
    """docs/models.md has a row for every causal-LM model type of the installed Transformers, as
    ``benchmarks/results/architectures.json`` (the generator's data) has them, and the README its summary;
    the test's own types work within the tolerance, with the memory options the code applies; its refused
    types carry the refusal the code gives now; no row fails."""
    from model_table import load_results, render, render_summary, table_between_markers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    page = MODELS_PAGE.read_text()
    rows = parse_rows(page)
    by_type = {row["model type"]: row for row in rows}
    assert sorted(by_type) == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    results = load_results()
    listed = [{"model type": t, **r} for t, r in sorted(results["rows"].items())]
    assert render(listed, results["transformers"]) == table_between_markers(page), "docs/models.md is stale"
    summary = render_summary(listed, results["transformers"])
    assert summary == table_between_markers(README.read_text()), "the README's model summary is stale"
    assert not [row for row in rows if row["status"] not in ("works", "refused", "not run")]
    for model_type in SUPPORTED:
        row = by_type[model_type]
        assert row["status"] == "works" and "test, 2 and 3 ranks" in row["parity"], row
        assert row["memory options"] == expected_row(model_type)["memory options"], row
        tolerance = TOLERANCE[torch.float64 if "float64" in row["parity"] else torch.float32]
        assert row["numbers"] and max(row["numbers"].values()) <= tolerance, row
    for model_type, (overrides, _) in REFUSED.items():
        if model_type not in SUPPORTED:
            assert by_type[model_type]["status"] == "refused", by_type[model_type]
            assert by_type[model_type]["parity"] == refusal_message(model_type, overrides)
