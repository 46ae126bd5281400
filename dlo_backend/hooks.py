"""The hook registry: mechanism only (install, remove), no policy and no transfer.

``HookRegistry.attach(module, pre, post)`` registers a forward pre-hook and a forward hook on
``module`` and remembers both handles (``attach_pre``: a pre-hook only); ``remove()`` takes every
hook off (idempotent, safe on a half-built registry), leaving ``forward`` exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HookRegistry"]


class HookRegistry:
    """Forward hooks installed by one backend."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def __len__(self) -> int:
        return len(self._handles)

    def attach(self, module: nn.Module, pre: Callable[[], None], post: Callable[[], None]) -> None:
        """Run ``pre()`` before and ``post()`` after every ``module(...)`` call."""

        def before(_module: nn.Module, _args: Any) -> None:
            pre()

        def after(_module: nn.Module, _args: Any, _output: Any) -> None:
            post()

        self._handles.append(module.register_forward_pre_hook(before))
        self._handles.append(module.register_forward_hook(after))

    def attach_pre(self, module: nn.Module, pre: Callable[[], None]) -> None:
        """Run ``pre()`` before every ``module(...)`` call (before the hooks registered so far)."""

        def before(_module: nn.Module, _args: Any) -> None:
            pre()

        self._handles.append(module.register_forward_pre_hook(before, prepend=True))

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()
