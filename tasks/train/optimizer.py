"""The optimiser parts: AdamW over the trainable weights (fused on CUDA, foreach elsewhere, or bitsandbytes'
8-bit AdamW), its linear warm-up, the loss scaler fp16 needs, and the form a checkpoint keeps the
optimiser's state in (`OptimizerState`)."""

from __future__ import annotations

from typing import Any

import torch

from configs.schema import TrainingConfig


def build_optimizer(training: TrainingConfig, parameters: list[torch.nn.Parameter],
                    device: torch.device) -> torch.optim.Optimizer:
    """Reads `optimizer`, `learning_rate` and `weight_decay`."""
    if training.optimizer.name == "adamw8bit":
        import bitsandbytes

        adamw, options = bitsandbytes.optim.AdamW8bit, {}
    else:
        # fused on CUDA; elsewhere foreach, which on a CPU gives the per-tensor loop's bits in half its time
        adamw, options = torch.optim.AdamW, {"fused": True} if device.type == "cuda" else {"foreach": True}
    return adamw(parameters, lr=training.optimizer.learning_rate, weight_decay=training.optimizer.weight_decay,
                 **options)


def build_schedule(training: TrainingConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate rising linearly over `warmup_steps`, then constant."""
    warmup = max(1, training.optimizer.warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))


def build_scaler(training: TrainingConfig, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling under fp16 autocast (whose small gradients would flush to zero); a no-op otherwise."""
    return torch.amp.GradScaler(device.type, enabled=training.mixed_precision == "fp16")


class OptimizerState:
    """The optimiser's state as a checkpoint keeps it: each parameter's state under its index (its
    tensors are `optimizer/<index>/<name>`, nested for 8-bit optimizers' quantisation state) and the
    param groups, flattened as torchtitan flattens an optimiser's state."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        return {**{str(index): values for index, values in state["state"].items()},
                "param_groups": state["param_groups"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict({
            "state": {int(index): values for index, values in state.items() if index != "param_groups"},
            "param_groups": state["param_groups"]})
