"""An exponential moving average of the trainable weights, as diffusers' `EMAModel`: updated once
per optimizer step, checkpointed like the optimizer (`state_dict`/`load_state_dict`: the averages
by parameter name, `ema/<name>` in a checkpoint), and copied into the network at the end (the
averaged weights are the run's result when `training.optimizer.ema_decay` > 0)."""

from __future__ import annotations

import torch

from tasks.train.network import trainable_state


class Ema:
    def __init__(self, network: torch.nn.Module, decay: float):
        self.decay = decay
        self.averages = {name: t.clone() for name, t in trainable_state(network).items()}

    @torch.no_grad()
    def update(self, network: torch.nn.Module) -> None:
        for name, parameter in trainable_state(network).items():
            self.averages[name].lerp_(parameter, 1.0 - self.decay)

    @torch.no_grad()
    def copy_to(self, network: torch.nn.Module) -> None:
        for name, parameter in trainable_state(network).items():
            parameter.copy_(self.averages[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.averages)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, average in self.averages.items():
            average.copy_(state[name])
