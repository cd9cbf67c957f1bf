"""FLUX.1 Kontext: FLUX.1's text encoders, VAE and transformer, trained on edit pairs. The
reference's latents are packed 2×2 as the target's and appended to its tokens, their image ids'
first coordinate 1 (the target's 0); the transformer's output for the target's tokens alone is the
prediction. The reference is resized (not cropped) to the preferred Kontext resolution nearest its
aspect ratio, sides floored to 16, and encoded to its posterior's mean (`argmax`).

Read from diffusers' `FluxKontextPipeline` (`PREFERRED_KONTEXT_RESOLUTIONS`, `prepare_latents`,
its transformer call); the tests call the pipeline on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks.families.flux import FLUX, FluxDenoiser, FluxSampler, image_ids, pack
from tasks.families.spec import Buckets, Codec, Conditioning, Family, References

MULTIPLE = 16  # the pipeline's `vae_scale_factor * 2`: latents packed 2×2


@dataclass(frozen=True)
class KontextReferences(References):
    rule: str = "kontext/preferred"
    most: int | None = 1  # the pipeline takes one image

    def box(self, width: int, height: int, resolution: int) -> list[int]:
        """Resized whole (no crop) to the preferred resolution nearest the reference's aspect ratio
        (the first of equals, as the pipeline's `min` takes it), scaled to `resolution`, sides
        floored to 16."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        ratio = width / height
        _, wide, high = min((abs(ratio - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        scale = resolution / 1024
        wide, high = (max(MULTIPLE, round(side * scale) // MULTIPLE * MULTIPLE) for side in (wide, high))
        return [wide, high, 0, 0, wide, high]


def references_of(text: Conditioning) -> list[torch.Tensor]:
    """A batch's reference latents [B, C, h, w], in order (`reference_0`, `reference_1`, …)."""
    return [text[f"reference_{n}"] for n in range(sum(name.startswith("reference_") for name in text))]


@dataclass(frozen=True)
class KontextDenoiser(FluxDenoiser):
    """FLUX.1's transformer with the reference's tokens after the target's, as Kontext's pipeline
    calls it."""

    def tokens(self, noisy: torch.Tensor, text: Conditioning, dtype: torch.dtype
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The noisy latents' tokens, then each reference's (Kontext's pipeline takes one), their
        ids' first coordinate 1."""
        tokens, ids = super().tokens(noisy, text, dtype)
        for reference in references_of(text):
            tokens.append(pack(reference.to(noisy.dtype)))
            ids.append(image_ids(*reference.shape[2:], noisy.device, dtype))
            ids[-1][:, 0] = 1
        return tokens, ids


@dataclass(frozen=True)
class KontextSampler(FluxSampler):
    """`FluxKontextPipeline`, drawing from a reference a prompt as training saw its references."""

    pipeline_name: str = "FluxKontextPipeline"
    reference_option: str | None = "image"

    def picture_options(self, picture, size: tuple[int, int] | None) -> dict:
        """The reference as sized already; the pipeline's own resize (for 1024²) left off."""
        return {"image": picture, "_auto_resize": False}

    def size_options(self, height: int, width: int) -> dict:
        """The size, and the area the pipeline would otherwise move it to (1024² by default)."""
        return {"height": height, "width": width, "max_area": height * width}


KONTEXT = Family("FLUX.1 Kontext", ("FluxKontextPipeline",), FLUX.text,
                 Codec(Buckets(step=16), references=KontextReferences()), KontextDenoiser(), KontextSampler(),
                 FLUX.export)
FAMILIES = (KONTEXT,)
