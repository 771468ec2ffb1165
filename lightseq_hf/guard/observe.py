"""Watch, from outside the library, which attention layers ran the distributed attention, where.

:class:`AttentionWatch` hooks the forward of each attention module (class name ending in
``Attention``) and, as a ``TorchDispatchMode``, sees every call of the distributed attention op
``lightseq_hf::dist_attn_fwd`` with its arguments: the process group it ran over and this rank's
query length. Each op call is charged to the attention module whose forward it ran in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: the distributed attention forward, as a torch custom op (namespace, name)
DIST_ATTENTION_OP = ("lightseq_hf", "dist_attn_fwd")


@dataclass
class AttentionCall:
    """One run of the distributed attention: this rank's query tokens, its group's name, q's dtype."""

    local_length: int
    group: str
    dtype: torch.dtype


class AttentionWatch(TorchDispatchMode):
    """Records, per attention module (by name), the distributed attention calls made in its forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.calls: dict[str, list[AttentionCall]] = {}
        self._current: str | None = None
        self._hooks: list = []

    def __enter__(self):
        for name, module in attention_modules(self.model):
            self.calls[name] = []
            self._hooks.append(module.register_forward_pre_hook(self._entered(name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def _entered(self, name: str):
        def hook(module, args):
            self._current = name
        return hook

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._current is not None and func.namespace == DIST_ATTENTION_OP[0] \
                and func.name().split(".")[0] == "::".join(DIST_ATTENTION_OP):
            named = dict(zip((a.name for a in func._schema.arguments), args))
            named.update(kwargs)
            query = named.get("q", args[0])
            self.calls[self._current].append(AttentionCall(int(query.shape[1]), str(named.get("group", "")),
                                                           query.dtype))
        return func(*args, **kwargs)


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The attention modules of ``model`` (class name ending in ``Attention``, innermost), by name."""
    found = [(name, m) for name, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    inner = [(name, m) for name, m in found
             if not any(other is not m and other_name.startswith(name + ".") for other_name, other in found)]
    return inner
