"""What the demo's tiny Wan transformer learns of a direction of motion named by a word, without
the VAE, the text encoder or the video path: made-up latents a frame of 8 × 8 tokens (1 × 1 × 1
patches), a 3 × 3-token blob of fixed colours shifted 2 tokens between two frames the way a word
names (left, right, up, down; chance: a quarter), the word a random vector a direction (the text).

Two ways to train the same transformer (the wan demo's `transformer_shape`, by precast's own loss:
flow matching with Wan's published shift and 10% of the words dropped), each sampled with 20
Euler steps:
- `text to video`: both frames drawn from the same noise level, as Wan 2.1 T2V trains and samples;
- `image to video`: the first frame given clean at timestep 0, the loss on the second only, as
  Wan 2.2 TI2V trains (`training.image_to_video` 1) and `WanImageToVideoPipeline` samples.
Each reports, at every `every` steps, how many of 48 samples move the blob the named way and how
many another way (by the shift of the blob's centroid from the first frame to the second). It
locates why the video world's direction is not learned from text alone (benchmarks/results/demo-worlds.md), and why
the wan demo trains from first frames: reading the word is learned in a few thousand steps once a
frame is given; drawing two frames coupled by it out of one noise level is not. Run on a GPU it
shows how far `text to video` must go before it is.
"""

from __future__ import annotations

import time

import torch

from tasks.demo.flow_models import FAMILIES
from tasks.demo.videos import DIRECTIONS as NAMED
from tasks.families.flow import FlowMatching
from tasks.families.wan import FAMILIES as WAN
from tasks.train.loss import Objective, diffusion_loss

SIDE, BLOB, SHIFT, CHANNELS, COLOURED = 8, 3, 2, 16, 3  # tokens a side, blob side, tokens moved, latent channels
DIRECTIONS = torch.tensor([(dy, dx) for dx, dy in NAMED.values()])  # (rows, columns) each word moves the blob
FLOW_SHIFT, DROP = FAMILIES["wan"].scheduler["flow_shift"], 0.1


def shifted(sigmas: torch.Tensor) -> torch.Tensor:
    """Wan's fixed shift of uniform noise levels, as its scheduler applies it."""
    return FLOW_SHIFT * sigmas / (1 + (FLOW_SHIFT - 1) * sigmas)


def clips(directions: torch.Tensor, colours: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Two latent frames a direction: the blob anywhere its path stays inside, then shifted."""
    x = torch.zeros(len(directions), CHANNELS, 2, SIDE, SIDE)
    x[:, :COLOURED] = colours[0][None, :, None, None, None]
    for i, (dy, dx) in enumerate(DIRECTIONS[directions].tolist()):
        top = int(torch.randint(max(0, -dy * SHIFT), SIDE - BLOB - max(0, dy * SHIFT) + 1, (), generator=generator))
        left = int(torch.randint(max(0, -dx * SHIFT), SIDE - BLOB - max(0, dx * SHIFT) + 1, (), generator=generator))
        for frame in (0, 1):
            y, x0 = top + dy * SHIFT * frame, left + dx * SHIFT * frame
            x[i, :COLOURED, frame, y:y + BLOB, x0:x0 + BLOB] = colours[1][:, None, None]
    return x


def moved(x: torch.Tensor, colours: torch.Tensor, directions: torch.Tensor) -> tuple[int, int]:
    """Of the samples `x`: (moved the named way, moved another way), by the blob's centroid."""
    weight = (x[:, :COLOURED] - colours[0][None, :, None, None, None]).norm(dim=1)  # [n, 2, side, side]
    weight = weight / weight.sum(dim=(2, 3), keepdim=True).clamp_min(1e-6)
    rows, columns = torch.meshgrid(torch.arange(SIDE).float(), torch.arange(SIDE).float(), indexing="ij")
    centre = torch.stack([(weight * rows).sum(dim=(2, 3)), (weight * columns).sum(dim=(2, 3))], -1)
    shift = centre[:, 1] - centre[:, 0]
    named = (shift @ DIRECTIONS.float().T).argmax(1) == directions
    went = shift.norm(dim=1) > 0.5
    return int((named & went).sum()), int((~named & went).sum())


def train(first_given: bool, steps: int, every: int, device: torch.device, seed: int = 0, samples: int = 48) -> dict:
    """The transformer trained by precast's own loss (`diffusion_loss`: Wan 2.1's scalar timestep
    from text, or every clip image to video as Wan 2.2 TI2V trains it, `first_frame_given`) and
    sampled as the family's pipeline samples (the given frame's tokens at timestep 0)."""
    import diffusers

    torch.manual_seed(seed)
    shape = dict(FAMILIES["wan"].transformer_shape, patch_size=(1, 1, 1), rope_max_seq_len=64)
    net = diffusers.WanTransformer3DModel(**shape).to(device)
    words = torch.randn(len(DIRECTIONS) + 1, shape["text_dim"], device=device)  # the last: the dropped word
    colours = torch.randn(2, COLOURED, generator=torch.Generator().manual_seed(7))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(seed)
    family = WAN[1] if first_given else WAN[0]  # Wan 2.2 TI2V (a timestep a token) or Wan 2.1
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=FLOW_SHIFT)
    objective = Objective(family, FlowMatching.of(scheduler, family.name, lambda *sides: SIDE * SIDE), {},
                          image_to_video=1.0 if first_given else 0.0)

    def sample_scores() -> tuple[int, int]:
        draws = torch.Generator().manual_seed(123)
        directions = torch.arange(samples) % len(DIRECTIONS)
        condition = clips(directions, colours, draws).to(device)  # only its first frame is given
        x = torch.randn(samples, CHANNELS, 2, SIDE, SIDE, generator=draws).to(device)
        text = {"umt5_hidden": words[directions.to(device)][:, None, :]}
        sigmas = shifted(torch.linspace(1, 0, 21))
        with torch.no_grad():
            for now, after in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
                t = torch.full((samples,), now * 1000, device=device)
                if first_given:  # as WanImageToVideoPipeline's step: the frame given, its tokens at 0
                    given = torch.ones(samples, dtype=torch.bool, device=device)
                    model_input, t, _ = family.denoiser.first_frame_given(condition, x, t, given)
                else:
                    model_input = x
                x = x + (after - now) * family.denoiser.predict(net, model_input, text, t)
        if first_given:
            x[:, :, 0] = condition[:, :, 0]
        return moved(x.cpu(), colours, directions)

    scores, began = {}, time.perf_counter()
    for step in range(1, steps + 1):
        directions = torch.randint(0, len(DIRECTIONS), (16,), generator=data)
        x0 = clips(directions, colours, data).to(device)
        word = torch.where(torch.rand(16, generator=data) < DROP, len(DIRECTIONS), directions).to(device)
        loss = diffusion_loss(net, objective, x0, {"umt5_hidden": words[word][:, None, :]}, data, None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % every == 0:
            scores[step] = sample_scores()
            print(f"  {'image' if first_given else 'text'} to video, step {step}: {scores[step]} of {samples} "
                  f"(the named way, another way), {time.perf_counter() - began:.0f} s", flush=True)
    return {"steps": {str(step): list(score) for step, score in scores.items()},
            "seconds": round(time.perf_counter() - began, 1)}


def run(text_steps: int = 4000, image_steps: int = 3000, every: int = 1000) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"device": str(device), "samples": 48,
            "text to video": train(False, text_steps, every, device),
            "image to video": train(True, image_steps, every, device)}


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    out = []
    for mode in ("text to video", "image to video"):
        for step, (named, other) in result[mode]["steps"].items():
            out.append((f"word-named shift, {mode}, {step} steps ({result['device']})",
                        f"{named} of {result['samples']} samples move the named way", f"{other} another way",
                        f"chance: {result['samples'] // len(DIRECTIONS)} the named way"))
    return out
