"""Watch, from outside the library, which attention layers ran the distributed attention, where.

:class:`AttentionWatch` hooks the forward of each attention module (class name ending in
``Attention``), counts the calls each makes of the attention function registered in Transformers'
``AttentionInterface`` under ``"lightseq_dist"`` (a module may attend more than once per forward, or run
more than once: DiffLlama, recurrent models), and, as a ``TorchDispatchMode``, sees every call of the
distributed attention op ``lightseq_hf::dist_attn_fwd`` with its arguments: the process group it ran over
and this rank's query length. Each call is charged to the attention module whose forward it ran in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..patches.state import ATTN_IMPLEMENTATION

__all__ = ["AttentionWatch"]

#: the distributed attention forward, as a torch custom op (namespace, name)
_DIST_ATTENTION_OP = ("lightseq_hf", "dist_attn_fwd")


@dataclass
class _AttentionCall:
    """One run of the distributed attention: this rank's query tokens, its group's name, q's dtype."""

    local_length: int
    group: str
    dtype: torch.dtype


class AttentionWatch(TorchDispatchMode):
    """Records, per attention module (by name), the distributed attention calls made in its forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.calls: dict[str, list[_AttentionCall]] = {}
        self.interface_calls: dict[str, int] = {}  # calls of the registered attention function per module
        self._current: str | None = None
        self._hooks: list = []
        self._registered = None

    def __enter__(self):
        from transformers.modeling_utils import AttentionInterface

        for name, module in _attention_modules(self.model):
            self.calls[name] = []
            self.interface_calls[name] = 0
            self._hooks.append(module.register_forward_pre_hook(self._entered(name)))
        mapping = AttentionInterface._global_mapping
        self._registered = registered = mapping.get(ATTN_IMPLEMENTATION)
        if registered is not None:
            def counted(*args, **kwargs):
                if self._current is not None:
                    self.interface_calls[self._current] += 1
                return registered(*args, **kwargs)
            mapping[ATTN_IMPLEMENTATION] = counted
        return super().__enter__()

    def __exit__(self, *exc):
        from transformers.modeling_utils import AttentionInterface

        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._registered is not None:
            AttentionInterface._global_mapping[ATTN_IMPLEMENTATION] = self._registered
        return super().__exit__(*exc)

    def _entered(self, name: str):
        def hook(module, args):
            self._current = name
        return hook

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._current is not None and func.namespace == _DIST_ATTENTION_OP[0] \
                and func.name().split(".")[0] == "::".join(_DIST_ATTENTION_OP):
            named = dict(zip((a.name for a in func._schema.arguments), args))
            named.update(kwargs)
            query = named.get("q", args[0])
            self.calls[self._current].append(_AttentionCall(int(query.shape[1]), str(named.get("group", "")),
                                                            query.dtype))
        return func(*args, **kwargs)


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The attention modules of ``model`` (class name ending in ``Attention``, innermost), by name."""
    found = [(name, m) for name, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    inner = [(name, m) for name, m in found
             if not any(other is not m and other_name.startswith(name + ".") for other_name, other in found)]
    return inner
