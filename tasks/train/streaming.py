"""Transformer blocks streamed from host memory (`training.blocks_to_swap`): the frozen weights of
the first blocks wait in pinned host memory and are copied to the device just ahead of the block
that needs them, forward and backward, so a LoRA run trains a transformer larger than its card.

Under gradient checkpointing a block keeps nothing for backward but its input; backward recomputes
it, which calls it again. So one rule serves both passes: when a streamed block is entered, it and
the block that runs after it (the next in forward, the one before it in backward, which
recomputes in reverse) are on the device, or being copied there on a side stream; every other
streamed block is back in host memory. Only the frozen weights move (plain or torchao's int8 and
fp8): the LoRA weights, their gradients and the optimizer stay on the device. Peers do the same
(musubi-tuner's and diffusion-pipe's `blocks_to_swap`); the memory plan (tasks/train/plan.py) says
what it saves and what the copies cost a step at a link's bandwidth.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class BlockStreamer:
    """The first `count` of `blocks` streamed to `device`: their frozen weights leave the modules
    (held here in host memory, pinned beside an accelerator) until a block is entered."""

    def __init__(self, blocks: list[torch.nn.Module], count: int, device: torch.device):
        if count > len(blocks):
            raise ValueError(f"training.blocks_to_swap {count}: the transformer has {len(blocks)} blocks")
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # per streamed block: (module, parameter name, host copy) of each frozen weight
        self.weights: list[list[tuple[torch.nn.Module, str, torch.Tensor]]] = []
        for index, block in enumerate(blocks[:count]):
            held = []
            for module in block.modules():
                for name, parameter in list(module._parameters.items()):
                    if parameter is not None and not parameter.requires_grad:
                        held.append((module, name, self._host(parameter.detach())))
                        del module._parameters[name]
            self.weights.append(held)
            block.register_forward_pre_hook(partial(self._enter, index))
        self.on_device: dict[int, torch.cuda.Event | None] = {}

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to("cpu")
        if self.device.type == "cuda" and type(tensor) is torch.Tensor:
            tensor = tensor.pin_memory()  # copied without holding the host thread
        return tensor

    def _enter(self, index: int, module: torch.nn.Module, args) -> None:
        backward = torch._C._current_graph_task_id() != -1  # a checkpointed block recomputing
        after = index - 1 if backward else index + 1
        for other in [i for i in self.on_device if i not in (index, after)]:
            self._evict(other)
        self._fetch(index)
        if self.stream is not None:  # the copy done before the block's kernels run
            torch.cuda.current_stream(self.device).wait_event(self.on_device[index])
            for held_module, name, _ in self.weights[index]:
                used_by(held_module._parameters[name], torch.cuda.current_stream(self.device))
        if 0 <= after < len(self.weights):
            self._fetch(after)

    def _fetch(self, index: int) -> None:
        if index in self.on_device:
            return
        context = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with context:
            for module, name, host in self.weights[index]:
                module._parameters[name] = torch.nn.Parameter(host.to(self.device, non_blocking=True),
                                                              requires_grad=False)
            self.on_device[index] = self.stream.record_event() if self.stream is not None else None

    def _evict(self, index: int) -> None:
        """Its weights leave the device (a backward that still holds them keeps its own reference)."""
        for module, name, _ in self.weights[index]:
            del module._parameters[name]
        del self.on_device[index]


def used_by(tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Tell the allocator `stream` uses `tensor` (copied on another stream): its memory is not
    reused before that stream's work is done. A torchao weight: each tensor inside it."""
    if is_traceable_wrapper_subclass(tensor):
        for inner in tensor.__tensor_flatten__()[0]:
            used_by(getattr(tensor, inner), stream)
    else:
        tensor.record_stream(stream)
