"""A held-out validation loss: a fixed set of the manifest's samples, never trained on, scored
with the same posterior draws, captions, noise and timesteps every time, so it moves only with
the weights (the training loss moves with each batch's draws too)."""

from __future__ import annotations

import hashlib

import torch

from configs.schema import TrainingConfig
from tasks.train.data import CachedFeatures
from tasks.train.loss import Objective, Weighing, diffusion_loss


class Validation:
    def __init__(self, features: CachedFeatures, count: int, every: int, batch_size: int, seed: int):
        # chosen by a hash of seed and sample id: the same samples whatever the manifest's order,
        # and a sample stays held out when new data arrives unless a new one hashes lower
        ranked = sorted(features.samples, key=lambda s: hashlib.sha256(f"{seed}/{s}".encode()).hexdigest())
        if count and count >= len(ranked):
            raise ValueError(f"training.validation.samples is {count}, which leaves none of the manifest's "
                             f"{len(ranked)} samples to train on")
        self.held = set(ranked[:count])
        self.features, self.every, self.seed = features, every, seed
        self.batches = [ids[i : i + batch_size] for ids in self._split(features.buckets, held=True).values()
                        for i in range(0, len(ids), batch_size)]

    @classmethod
    def from_config(cls, training: TrainingConfig, features: CachedFeatures) -> Validation:
        """Reads `validation_samples`, `validation_every`, `batch_size` and `seed`."""
        return cls(features, training.validation.samples, training.validation.every, training.batch_size, training.seed)

    def _split(self, buckets: dict[str, list[str]], held: bool) -> dict[str, list[str]]:
        kept = {name: [s for s in ids if (s in self.held) == held] for name, ids in sorted(buckets.items())}
        return {name: ids for name, ids in kept.items() if ids}

    def training_buckets(self) -> dict[str, list[str]]:
        """The manifest's buckets without the held-out samples."""
        return self._split(self.features.buckets, held=False)

    def due(self, step: int, steps: int) -> bool:
        return bool(self.batches) and (step == steps or bool(self.every) and step % self.every == 0)

    @torch.no_grad()
    def loss(self, network: torch.nn.Module, objective: Objective, device: torch.device,
             half: torch.dtype | None) -> float:
        """The mean loss over the held-out samples, with every random draw fixed by the seed, under
        the family's plain objective whatever the run trains with, so runs compare."""
        objective = objective.plain()
        generator = torch.Generator().manual_seed(self.seed + 7_919)
        was_training = network.training
        network.eval()
        total = 0.0
        for ids in self.batches:
            latents, text, masks = self.features.batch(ids, generator, caption_dropout=0.0)
            loss = diffusion_loss(network, objective, latents.to(device),
                                  {name: value.to(device) for name, value in text.items()}, generator, half,
                                  None if masks is None else Weighing(None, None, masks))
            total += loss.item() * len(ids)
        network.train(was_training)
        return total / len(self.held)
