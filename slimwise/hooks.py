"""One way to act on a module's forward: wrap it (replace it for a while) or hook it (observe it), and undo
both.

Why one helper: the expert mask, a distilled delta, the calibration observer, the traffic meter and the
testbed's router capture all sit on the same modules of one model, often several at once (an engine's mask
under its delta, two engines sharing a model). Wrappers stack, so they must come off in the reverse order they
went on: removing one from under another would silently drop the one on top. `ForwardWrappers.remove` refuses
that with one clear message instead. llm-compressor's `HooksMixin` plays the same role for its modifiers.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from slimwise.errors import SlimWiseError

Forward = Callable[..., object]


class ForwardWrappers:
    """The forward wrappers and forward hooks one owner (a mask, a delta, an observer) installed on a
    model."""

    def __init__(self, what: str):
        self.what = what
        # (module, its own forward attribute, ours)
        self._wrapped: list[tuple[nn.Module, object, Forward]] = []
        self._handles: list = []

    def wrap(self, module: nn.Module, make: Callable[[Forward], Forward]) -> Forward:
        """Replace `module.forward` with `make(previous)`, where `previous` is the forward it replaces (the
        stock one, or the wrapper installed before it); returns the new forward."""
        ours = make(module.forward)
        self._wrapped.append((module, module.__dict__.get("forward"), ours))
        module.forward = ours
        return ours

    def hook(self, module: nn.Module, fn: Callable) -> None:
        """`module.register_forward_hook(fn)`, removed with the rest. Hooks see the output of whatever forward
        runs, wrapped or not (nn.Module.__call__ runs them around an instance forward too)."""
        self._handles.append(module.register_forward_hook(fn))

    def on_top(self) -> bool:
        """True while each of our wrappers is still its module's outermost forward."""
        return all(module.__dict__.get("forward") is ours for module, _, ours in self._wrapped)

    def remove(self) -> None:
        """Restore every wrapped forward (newest first) and remove the hooks; refuse if another owner wrapped
        the same modules after us and is still installed."""
        if not self.on_top():
            raise SlimWiseError(
                f"cannot remove this {self.what}: another mask or delta was installed on the same "
                "model after it; close engines in the reverse order of creation"
            )
        for module, previous, _ in reversed(self._wrapped):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._wrapped.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __len__(self) -> int:
        return len(self._wrapped) + len(self._handles)


def first_output(output):
    """The tensor a forward hook acts on: a module's output, or its first item when the module returns a tuple
    (vLLM's linear layers return (output, bias); norms with a fused add (normed, residual))."""
    return output[0] if isinstance(output, tuple) else output


def with_first_output(output, new):
    """`output` with `new` in place of what `first_output` read: the rest of a tuple kept as it was. Both are
    plain Python on the output's structure, fixed per module, so a traced hook (torch.compile) stays one
    graph."""
    return (new, *output[1:]) if isinstance(output, tuple) else new


__all__ = ["ForwardWrappers", "first_output", "with_first_output"]
