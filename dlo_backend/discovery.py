"""Find the transformer block stacks of a DiT.

Resolution order (first that yields something wins):

1. ``blocks_attr`` given by the caller: one attribute name or a sequence of them; dotted paths
   (``"transformer.blocks"``) are followed. A missing attribute is an ``InvalidRequest``.
2. The class attribute ``_layerwise_offload_blocks_attrs`` (a sequence of names, the upstream
   vLLM-Omni declaration), resolved the same way.
3. Fallback scan: every ``nn.ModuleList``/``nn.Sequential`` in ``model.named_modules()`` order
   whose children are at least two modules of one class that own parameters, skipping lists
   nested inside a stack already found. Good for ordinary DiTs (``blocks``,
   ``transformer_blocks`` + ``single_transformer_blocks``); models with unusual layouts should
   declare their stacks.

Limits: a stack attribute that is a single module (not iterable) counts as a one-block stack.
Blocks of one stack may differ in size. A module listed in two stacks is an ``InvalidRequest``.
The order of stacks and of blocks inside them is the streaming order (the ring predicts that
the model runs them in that order; other orders stay correct but lose the prefetch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hwr.client.errors import InvalidRequest

__all__ = ["DECLARATION_ATTR", "BlockStack", "find_block_stacks"]

DECLARATION_ATTR = "_layerwise_offload_blocks_attrs"


@dataclass(frozen=True)
class BlockStack:
    """One stack of blocks: its attribute path on the model and the blocks in run order."""

    attr: str
    blocks: tuple[nn.Module, ...]


def _resolve(model: nn.Module, path: str) -> object:
    node: object = model
    for part in path.split("."):
        if not hasattr(node, part):
            raise InvalidRequest(
                f"block attribute {path!r} does not exist on {type(model).__name__}",
                details={"blocks_attr": path},
            )
        node = getattr(node, part)
    return node


def _stack_from_attr(model: nn.Module, path: str) -> BlockStack:
    value = _resolve(model, path)
    if isinstance(value, (nn.ModuleList, nn.Sequential, list, tuple)):
        blocks = tuple(value)
    elif isinstance(value, nn.Module):
        blocks = (value,)
    else:
        raise InvalidRequest(
            f"block attribute {path!r} is a {type(value).__name__}, not a module or module list",
            details={"blocks_attr": path},
        )
    if not all(isinstance(block, nn.Module) for block in blocks):
        raise InvalidRequest(f"block attribute {path!r} holds something that is not a module")
    return BlockStack(attr=path, blocks=blocks)


def _looks_like_stack(container: nn.Module) -> bool:
    children = list(container.children())
    if len(children) < 2:
        return False
    kinds = {type(child) for child in children}
    return len(kinds) == 1 and all(any(True for _ in child.parameters()) for child in children)


def _scan(model: nn.Module) -> list[BlockStack]:
    stacks: list[BlockStack] = []
    for name, module in model.named_modules():
        if not name or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        if any(name.startswith(stack.attr + ".") for stack in stacks):
            continue
        if _looks_like_stack(module):
            stacks.append(BlockStack(attr=name, blocks=tuple(module.children())))
    return stacks


def find_block_stacks(model: nn.Module, blocks_attr: str | Sequence[str] | None = None) -> tuple[BlockStack, ...]:
    """Return the model's block stacks in streaming order (see the module docstring)."""
    if isinstance(blocks_attr, str):
        names: list[str] | None = [blocks_attr]
    elif blocks_attr is not None:
        names = list(blocks_attr)
    else:
        declared = getattr(type(model), DECLARATION_ATTR, None)
        names = [declared] if isinstance(declared, str) else (list(declared) if declared else None)
    stacks = [_stack_from_attr(model, name) for name in names] if names else _scan(model)
    seen: set[int] = set()
    for stack in stacks:
        for block in stack.blocks:
            if id(block) in seen:
                raise InvalidRequest(f"a block of {stack.attr!r} appears in two stacks or twice in one")
            seen.add(id(block))
    return tuple(stacks)
