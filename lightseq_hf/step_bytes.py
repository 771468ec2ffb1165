"""The tensors of one training step that the planner counts, each as bytes on one rank: a fixed part
plus a part per token of that rank.

Every function here names the tensors alive at one moment of a step, with the reason they are alive;
:mod:`lightseq_hf.planner` adds them up into moments and picks the peak. The names are what ``--plan``
prints. Symbols in the docstrings: ``c`` bytes of the compute dtype, ``h`` the hidden size, ``q`` query
heads x head dim (also the attention output's width), ``kv`` key/value heads x head dim, ``I`` the MLP's
intermediate size, ``V`` the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Bytes", "Dims", "attention_backward", "fixed", "kept", "layer_backward_moment",
           "layer_forward_moment", "layer_saved", "loss_forward", "mlp_backward", "per_token", "step_inputs",
           "total"]

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class Bytes:
    """``fixed + per_token x tokens`` bytes."""

    fixed: float = 0.0
    per_token: float = 0.0

    def __add__(self, other: Bytes) -> Bytes:
        return Bytes(self.fixed + other.fixed, self.per_token + other.per_token)

    def __mul__(self, k: float) -> Bytes:
        return Bytes(self.fixed * k, self.per_token * k)

    __rmul__ = __mul__

    def at(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


def per_token(b: float) -> Bytes:
    return Bytes(0.0, b)


def fixed(b: float) -> Bytes:
    return Bytes(b, 0.0)


def _rows(count: int, tokens: int, per_row: float) -> Bytes:
    """``min(count, tokens)`` rows of ``per_row`` bytes: fixed once the tokens reach ``count``."""
    return fixed(count * per_row) if tokens >= count else per_token(per_row)


def total(parts: dict[str, Bytes]) -> Bytes:
    out = Bytes()
    for b in parts.values():
        out = out + b
    return out


@dataclass(frozen=True)
class Dims:
    """The sizes the terms are made of (see the module docstring)."""

    c: int  # bytes of the compute dtype
    h: int
    q: int
    kv: int
    heads: int
    inter: int
    vocab: int
    lse: int  # bytes of one lse value (float32; float64 for float64 compute)
    upcast: int  # bytes of a norm's float32 copy of a compute-dtype tensor (0: it is the tensor itself)

    @classmethod
    def of(cls, shape: Any, compute_dtype: str) -> Dims:
        c = _BYTES[compute_dtype]
        return cls(c=c, h=shape.hidden, q=shape.heads * shape.head_dim, kv=shape.kv_heads * shape.head_dim,
                   heads=shape.heads, inter=shape.intermediate, vocab=shape.vocab, lse=8 if c == 8 else 4,
                   upcast=0 if c == 4 else 4)


# ----------------------------------------------------------------------------- one decoder layer


def kept(d: Dims, remat: bool) -> dict[str, Bytes]:
    """What checkpointing keeps of one layer from its forward to its backward: the layer's input (the
    checkpoint's saved argument) and, under remat, the distributed attention's output and lse
    (selective checkpointing's cache)."""
    parts = {"layer input": per_token(d.h * d.c)}
    if remat:
        parts["attention output + lse"] = per_token(d.q * d.c + d.heads * d.lse)
    return parts


def layer_saved(d: Dims, *, remat: bool, tiled_mlp: bool, tiled_norms: bool) -> dict[str, Bytes]:
    """What autograd holds for one layer's backward once its recompute ran, beyond :func:`kept` (the
    layer's own input, and under remat its attention output, are counted there): the output and lse the
    recompute made (plain recompute), the attention's q, k, v, the two norms' outputs (the inputs of the
    q/k/v projections and of the MLP), what each norm keeps, and the MLP's activations.

    A norm keeps its float32 copy of its input and its normalized output (the weight multiplies it); a
    tiled norm keeps only its input, which for the first norm is the layer input itself. Rotary keeps
    only cos/sin (counted once per step); residual sums keep nothing. An untiled MLP keeps gate, up,
    act(gate) and their product; a tiled one only its input (a norm output, counted).
    """
    parts: dict[str, Bytes] = {}
    if not remat:
        parts["attention output + lse (recomputed)"] = per_token(d.q * d.c + d.heads * d.lse)
    parts["q, k, v (attention inputs)"] = per_token((d.q + 2 * d.kv) * d.c)
    parts["norm outputs (projection and MLP inputs)"] = per_token(2 * d.h * d.c)
    if tiled_norms:
        parts["second norm's input (tiled norms)"] = per_token(d.h * d.c)
    else:
        parts["norms' float32 copies and normalized outputs"] = per_token(d.h * (d.upcast + 4 + 2 * d.c))
    if not tiled_mlp:
        parts["MLP activations (gate, up, act, product)"] = per_token(4 * d.inter * d.c)
    return parts


def _pre_attention_saved(d: Dims, *, remat: bool, tiled_norms: bool) -> dict[str, Bytes]:
    """Of :func:`layer_saved`, what is still alive when the attention's backward runs (the MLP's and the
    second norm's tensors are gone)."""
    parts: dict[str, Bytes] = {}
    if not remat:
        parts["attention output + lse (recomputed)"] = per_token(d.q * d.c + d.heads * d.lse)
    parts["q, k, v (attention inputs)"] = per_token((d.q + 2 * d.kv) * d.c)
    parts["first norm's output (q/k/v projection input)"] = per_token(d.h * d.c)
    if not tiled_norms:
        parts["first norm's float32 copy and normalized output"] = per_token(d.h * (d.upcast + d.c))
    return parts


def mlp_backward(d: Dims, tokens: int, tile: int | None) -> dict[str, Bytes]:
    """Temporaries of the MLP's backward: the incoming gradient of the layer output, the gradient of the
    MLP input, and (untiled) the product's gradient with its two factors' gradients, while the product
    itself is already released (two ``tokens x I`` tensors beyond the saved four), or (tiled) one tile
    recomputed and differentiated with its weights' gradients and their float32 sums."""
    parts = {"incoming and MLP-input gradients": per_token(2 * d.h * d.c)}
    if tile is None:
        parts["MLP backward temporaries"] = per_token(2 * d.inter * d.c)
    else:
        parts["MLP backward temporaries (one tile)"] = (_rows(tile, tokens, 5 * d.inter * d.c)
                                                        + fixed(3 * d.h * d.inter * (4 + d.c)))
    return parts


def _second_norm_backward(d: Dims, tokens: int, tile: int | None, *, tiled_norms: bool) -> dict[str, Bytes]:
    """The second norm's backward (after the MLP's): what the norm keeps, the incoming gradient and the
    norm output's, and the norm's float32 gradient temporaries (three ``tokens x h`` float32 tensors at
    once: the upcast gradient, the gradient through the rsqrt, the product for the rsqrt's gradient), or
    one tile's when the norm is tiled (its input gradient then written into one ``tokens x h`` buffer)."""
    parts = {"incoming and norm-output gradients": per_token(2 * d.h * d.c)}
    if tiled_norms:
        parts["second norm's input (tiled norms)"] = per_token(d.h * d.c)
        parts["norm-input gradient"] = per_token(d.h * d.c)
        parts["norm backward temporaries (one tile)"] = _rows(tile or tokens, tokens, 4 * d.h * 4)
    else:
        parts["second norm's float32 copy and normalized output"] = per_token(d.h * (4 + d.c))
        parts["norm backward temporaries (float32)"] = per_token(3 * d.h * 4)
    return parts


def attention_backward(d: Dims, tokens: int, *, sp_size: int, chunks: int, kernel: str,
                       batch: int) -> dict[str, Bytes]:
    """Temporaries of the distributed attention's backward: the residual's and the output's gradients;
    over a group, the float32 dq/dk/dv accumulators and the ring's buffers (the remote key/value chunk and
    its prefetch, and the dk/dv partials of a kernel that returns them in float32); and what the local
    kernel's backward allocates, as backend ``kernel`` declares it
    (:attr:`~lightseq_hf.kernels.Capabilities.backward_memory`: for the SDPA kernels the dq/dk/dv they
    return in the compute dtype and their GQA workspace, for the reference kernel its float32
    accumulators and one block pair). With ``chunks`` head groups the accumulators, ring buffers and
    kernel temporaries exist for one group at a time, beside the group's slices and the whole
    gradients."""
    from .kernels import backward_memory

    memory = backward_memory(kernel)
    parts = {"residual and attention-output gradients": per_token((d.h + d.q) * d.c)}
    grouped = {}
    if sp_size > 1:  # one rank's backward is the kernel's own (its memory declared below)
        grouped["dq/dk/dv float32 accumulators"] = per_token((d.q + 2 * d.kv) * 4)
        grouped["ring buffers (remote keys/values, dk/dv partials)"] = per_token(
            2 * 2 * d.kv * d.c + memory.partial_bytes_per_token(d.kv))
    for name, (fixed_bytes, per) in memory.terms(q=d.q, kv=d.kv, input_bytes=d.c, heads=d.heads, batch=batch,
                                                 tokens=tokens, gqa=d.kv < d.q, ring=sp_size > 1).items():
        grouped[name] = Bytes(fixed_bytes, per)
    if chunks > 1:
        grouped = {k: v * (1 / chunks) for k, v in grouped.items()}
        parts["head-group slices and whole gradients"] = per_token(
            (3 * d.q + 2 * d.kv) * d.c / chunks + (d.q + 2 * d.kv) * d.c)
    return {**parts, **grouped}


def _attention_forward(d: Dims, *, sp_size: int) -> dict[str, Bytes]:
    """The distributed attention's forward (run again in backward by a layer under plain recompute): its
    output and lse and, over a group, the float32 running output and lse the partial results merge
    into, and the ring's remote key/value chunk and its prefetch."""
    parts = {"attention output + lse (being recomputed)": per_token(d.q * d.c + d.heads * d.lse)}
    if sp_size > 1:
        parts["attention forward: float32 running output"] = per_token(d.q * 4 + d.heads * 4)
        parts["ring buffers (remote keys/values)"] = per_token(2 * 2 * d.kv * d.c)
    return parts


# ----------------------------------------------------------------------------- the rest of the step


def step_inputs(d: Dims, *, sp_size: int, head_dim: int) -> dict[str, Bytes]:
    """Alive through the whole step: the rotary cos/sin of this rank's positions (one copy every layer
    reads), and the int64 token ids, labels and positions (the full rows on every rank of the group, the
    shifted labels, this rank's slice)."""
    return {"rotary cos/sin": per_token(2 * head_dim * d.c),
            "token ids, labels, positions (int64)": per_token(8 * (3 * sp_size + 2))}


def loss_forward(d: Dims, tokens: int, *, chunk: int, norm_in_loss: bool) -> dict[str, Bytes]:
    """The loss's forward, at its largest point: the fused chunked loss has formed the hidden-state
    gradient of the shard; of one chunk at a time, the logits in the compute dtype, their float32 copy,
    exponentials and gradient, and that gradient in the compute dtype (copies that do not exist when the
    compute dtype is float32); the head's gradient from that chunk in the compute dtype, and its float32
    sum over the chunks. The final norm either runs on the whole shard first (its float32 copy and
    normalized output kept for its backward, its output the loss's input) or inside the loss, per chunk
    (only the decoder's output, the loss's input, is alive)."""
    narrow = d.c if d.upcast else 0  # a compute-dtype copy beside a float32 one
    parts = {"hidden-state gradient (fused loss)": per_token(d.h * d.c),
             "one chunk's logits and their gradient (fused loss)": _rows(
                 chunk, tokens, d.vocab * (d.c + d.upcast + 2 * 4 + narrow)),
             "head gradient: one chunk's and the float32 sum (fused loss)": fixed(d.vocab * d.h * (d.c + 4))}
    if norm_in_loss:
        parts["decoder output (the loss's input)"] = per_token(d.h * d.c)
    else:
        parts["final norm: float32 copy, normalized, output"] = per_token(d.h * (d.upcast + 4 + 2 * d.c))
    return parts


def layer_forward_moment(d: Dims, tokens: int, *, sp_size: int, embedding_held: bool) -> dict[str, Bytes]:
    """One checkpointed layer's forward at its largest point (no graph is kept: each temporary dies as
    the forward goes on): the queries' rotary embedding or the distributed attention. Alive in both: the
    layer input (the residual), the first norm's output and, from the second layer on, the embedding
    output that the decoder's loop holds until its end. Rotary: q, k, v and three query-sized
    temporaries (q x cos, the rotated half of q, that times sin); attention: the rotated q and k, v,
    and :func:`_attention_forward`'s tensors."""
    alive = {"this layer: layer input": per_token(d.h * d.c),
             "first norm's output (q/k/v projection input)": per_token(d.h * d.c)}
    if embedding_held:
        alive["embedding output (held by the decoder's loop)"] = per_token(d.h * d.c)
    qkv = {"q, k, v (attention inputs)": per_token((d.q + 2 * d.kv) * d.c)}
    rotary = {**alive, **qkv, "rotary embedding: three query-sized temporaries": per_token(3 * d.q * d.c)}
    attention = {**alive, **qkv, **_attention_forward(d, sp_size=sp_size)}
    return max((rotary, attention), key=lambda parts: total(parts).at(tokens))


def layer_backward_moment(d: Dims, tokens: int, opts: Any, *, remat: bool, chunks: int) -> dict[str, Bytes]:
    """One layer's needs at the largest point of its backward (its MLP's backward, its second norm's or its
    attention's, whichever holds more; under plain recompute also the recompute's attention forward): its own
    :func:`kept` tensors, what its recompute saved, and that phase's temporaries."""
    tiled_norms = opts.norms_tiled
    own = {f"this layer: {k}": v for k, v in kept(d, remat).items()}
    saved = layer_saved(d, remat=remat, tiled_mlp=opts.tiled_mlp is not None, tiled_norms=tiled_norms)
    pre = _pre_attention_saved(d, remat=remat, tiled_norms=tiled_norms)
    phases = [{**own, **saved, **mlp_backward(d, tokens, opts.tiled_mlp)},
              {**own, **pre, **_second_norm_backward(d, tokens, opts.tiled_mlp, tiled_norms=tiled_norms)},
              {**own, **pre, **attention_backward(d, tokens, sp_size=opts.sp_size, chunks=chunks,
                                                  kernel=opts.attention_kernel, batch=opts.batch)}]
    if not remat:  # the recompute's attention forward, the incoming gradient waiting
        before = {k: v for k, v in pre.items() if "recomputed" not in k}
        phases.append({**own, **before, "incoming gradient": per_token(d.h * d.c),
                       **_attention_forward(d, sp_size=opts.sp_size)})
    return max(phases, key=lambda parts: total(parts).at(tokens))
