"""Wan 2.x through the family seam, against `WanPipeline`'s own functions: umT5's states as
`encode_prompt` gives them (cleaned, masked, trimmed, zero-padded to max_sequence_length) rebuilt
from a cache of the real tokens, at another max_sequence_length; the 4N + 1 frame rule; the shifted
flow sigmas of its UniPC scheduler; image-to-video training as `WanImageToVideoPipeline` conditions
on a first frame; the experts of Wan 2.2 A14B (what every family must equal, the default lengths,
the transformer's call and the latents' preparation: tests/test_family_contracts.py)."""

from __future__ import annotations

import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline, WanVideoToVideoPipeline
from diffusers.training_utils import compute_density_for_timestep_sampling

from configs.schema import ModelConfig, PipelineConfig, StorageConfig, TextEncodingConfig, TrainingConfig
from tasks.train.loss import Objective, diffusion_loss
from storage.store import Store
from tasks.encode.latents import encode_pixels
from tasks.encode.models import build_vae
from tasks.encode.text import encode_prompts
from tasks.families import family_of
from tasks.families.wan import TI2V, WAN, frames_rule, latent_frames
from tasks.identity import text_fingerprints
from tasks.train.data import TextCaches
from storage.shards import collate
from tests.pipeline_calls import transformer_calls

PROMPTS = ["a red circle on a blue background", "  a &amp;lt;b&amp;gt;   green\n square  ", "stripes " * 600]


@pytest.fixture(scope="module")
def wan(tiny_family) -> ModelConfig:
    return ModelConfig(path=str(tiny_family("wan")))


@pytest.fixture(scope="module")
def ti2v(tiny_family) -> ModelConfig:
    """Wan 2.2 TI2V-5B's layout: the 48-channel Wan 2.2 VAE (16x), one timestep a token."""
    return ModelConfig(path=str(tiny_family("wan2.2-ti2v")))


@pytest.fixture(scope="module")
def a14b(tiny_family):
    """Wan 2.2 A14B's layout: two experts split at boundary_ratio 0.875; the model's folder."""
    return str(tiny_family("wan2.2-a14b"))


def cached_prompts(model: ModelConfig, root, prompts: list[str], **text) -> TextCaches:
    """The prompts encoded by the stage's own function into a store under `root`, read back as
    training reads them."""
    storage, config = StorageConfig(root=str(root)), TextEncodingConfig(dtype="fp32", device="cpu", **text)
    fingerprints = text_fingerprints(model, config)
    records = encode_prompts(storage, model, config, fingerprints, prompts)
    keys = {name: Store(storage).key(record["url"]) for name, record in records.items()}
    return TextCaches(Store(storage), family_of(model).text.encoders,
                      {keys[name]: record["sha256"] for name, record in records.items()}, keys)


@pytest.mark.parametrize("max_length", [64])  # at the default, 512: tests/test_family_contracts.py
def test_the_cache_keeps_the_real_tokens_and_the_reader_gives_what_encode_prompt_gives(wan, tmp_path, max_length):
    """fp32, each prompt cleaned by the pipeline's `prompt_clean` (HTML entities, whitespace), cut
    at max_sequence_length (512 by default), stored as its real tokens only and read back zero-padded
    to max_sequence_length, as `encode_prompt` gives it."""
    family = family_of(wan)
    assert family is WAN and family.text.default_max_length(wan) == 512
    length = max_length or 512
    caches = cached_prompts(wan, tmp_path, PROMPTS, **({"max_length": max_length} if max_length else {}))
    pipeline = WanPipeline.from_pretrained(wan.path)
    embeds, _ = pipeline.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=length,
                                       device=torch.device("cpu"))
    tokens = pipeline.tokenizer([pipeline_clean(p) for p in PROMPTS], max_length=length, truncation=True).input_ids
    for index, prompt in enumerate(PROMPTS):
        stored = caches.prompts[0].get(prompt)
        assert len(stored) == len(tokens[index]) < length or len(stored) == length  # the real tokens only
        ours = caches.prompt(prompt)["umt5_hidden"]
        assert ours.shape == (length, 64)
        torch.testing.assert_close(ours, embeds[index], rtol=1e-4, atol=5e-5)
        assert not ours[len(stored):].any()  # the pipeline's zeros, rebuilt


def pipeline_clean(text: str) -> str:
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(text)


def test_the_transformers_timestep_is_sigma_times_1000_as_the_pipeline_gives_it(wan):
    """σ · 1000, which the scheduler truncates to a whole timestep (the latents' normalisation and
    noising against `WanVideoToVideoPipeline.prepare_latents`: tests/test_family_contracts.py)."""
    pipeline = WanVideoToVideoPipeline.from_pretrained(wan.path)
    pipeline.scheduler.set_timesteps(4)
    timestep, sigma = pipeline.scheduler.timesteps[1:2], pipeline.scheduler.sigmas[1:2]
    schedule = family_of(wan).denoiser.schedule(wan)
    assert ((schedule.timesteps(sigma) - timestep) % 1 == schedule.timesteps(sigma) - timestep).all()


@pytest.mark.parametrize("frames", [1, 2, 5, 8, 17, 81, 83])
def test_clips_have_the_frame_counts_the_pipeline_makes(wan, frames):
    """`frames_rule` is the pipeline's 4N + 1 rounding, `latent_frames` its VAE's frames."""
    pipeline = WanPipeline.from_pretrained(wan.path)
    pipeline.set_progress_bar_config(disable=True)
    latents = pipeline(prompt_embeds=torch.zeros(1, 8, 64), negative_prompt_embeds=torch.zeros(1, 8, 64),
                       num_frames=frames, height=32, width=32, num_inference_steps=1, output_type="latent").frames
    assert latents.shape[2] == latent_frames(frames_rule(frames))
    assert frames_rule(frames) % 4 == 1 and abs(frames_rule(frames) - frames) <= 3


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal"])
def test_sigmas_are_the_schedulers_flow_sigmas_with_its_shift(wan, sampling):
    """σ drawn as the flow families draw it, from the sigmas of the model scheduler's own
    `flow_shift` (3.0 as published): the UniPC scheduler given the unshifted values shifts them to
    the same σ and timesteps."""
    family = family_of(wan)
    schedule = family.denoiser.schedule(wan, TrainingConfig(timestep_sampling=sampling))
    sigmas = schedule.draw(8, torch.Generator().manual_seed(2), torch.Size((8, 16, 1, 8, 8)))
    u = compute_density_for_timestep_sampling("none" if sampling == "uniform" else sampling, 8, 0.0, 1.0,
                                              generator=torch.Generator().manual_seed(2))
    unshifted = 1.0 - (u * 1000).long().clamp(max=999).double() / 1000  # the 1000 training sigmas, unshifted
    reference = UniPCMultistepScheduler.from_pretrained(wan.path, subfolder="scheduler")
    assert reference.config.flow_shift == 3.0
    reference.set_timesteps(sigmas=unshifted.numpy())
    torch.testing.assert_close(sigmas, reference.sigmas[:-1].float(), rtol=1e-5, atol=1e-6)
    assert ((schedule.timesteps(sigmas) - reference.timesteps) % 1 == schedule.timesteps(sigmas) - reference.timesteps).all()


def test_wan_2_2_ti2v_is_its_own_family_with_buckets_its_pipeline_can_draw(ti2v, wan):
    """`expand_timesteps` in model_index.json chooses Wan 2.2 TI2V; its buckets' sides are
    multiples of what the pipeline needs (the VAE's 16 times the transformer's patch of 2)."""
    family, pipeline = family_of(ti2v), WanPipeline.from_pretrained(ti2v.path)
    assert family is TI2V and family_of(wan) is WAN and pipeline.config.expand_timesteps
    step = pipeline.vae_scale_factor_spatial * pipeline.transformer.config.patch_size[1]
    assert step == 32 and all(side % step == 0 for sides in family.codec.bucket_table(512).values() for side in sides)


@pytest.mark.parametrize("family, resolution, size", [(WAN, 632, (480, 832)), (WAN, 960, (720, 1280)),
                                                    (TI2V, 944, (704, 1280))])
def test_the_published_video_sizes_are_buckets_and_samples_are_drawn_at_the_squarest(family, resolution, size):
    """Wan 2.1's 480p and 720p and Wan 2.2 TI2V's 720p are buckets at the resolution whose square
    has about their area, both ways up, so clips of those sizes are neither scaled nor cropped; the
    samples' size is the most nearly square bucket, its sides whole multiples of the step."""
    config = PipelineConfig.model_validate({"storage": {"root": "x"}, "dataset": {"sources": [{"path": "x"}]},
                                           "model": {"path": "x"}, "latent_encoding": {"resolution": resolution}})
    table = [tuple(map(int, sides)) for sides in family.codec.bucket_table(config.latent_encoding.resolution).values()]
    assert size in table and size[::-1] in table
    height, width = family.codec.sample_size(resolution)
    step = 32 if family is TI2V else 16
    assert height % step == width % step == 0 and abs(height / width - 1) < 0.06 and (height, width) in table
    assert family.codec.sample_size(512) == (512, 512)


def test_a_clip_trained_image_to_video_is_what_the_image_to_video_pipeline_gives_the_transformer(ti2v, tmp_path):
    """Given a clip's first frame, `WanImageToVideoPipeline` (`expand_timesteps`) gives TI2V's
    transformer that frame's latents as the first latent frame, at timestep 0 on its tokens, and
    noise after it at t; training a clip image to video (`first_frame_given` on the clip's cached
    latents) gives the same input and the same prediction."""
    from PIL import Image

    family = family_of(ti2v)
    caches = cached_prompts(ti2v, tmp_path, ["a green square moving left"])
    text = {k: v[:1] for k, v in collate([caches.prompt("a green square moving left"), caches.prompt("")]).items()}
    clip = torch.randint(0, 256, (1, 3, 5, 64, 96), generator=torch.Generator().manual_seed(0)).float() / 127.5 - 1
    vae = build_vae(ti2v, TI2V, "fp32", "cpu")
    shift, scale = (torch.tensor(f).view(-1, 1, 1, 1) for f in family.codec.latent_factors(vae))
    latents = (encode_pixels(vae, clip)[0] - shift) * scale  # the clip as the latent stage caches it

    pipeline = WanImageToVideoPipeline.from_pretrained(ti2v.path, image_encoder=None, image_processor=None)
    assert pipeline.config.expand_timesteps
    pipeline.set_progress_bar_config(disable=True)
    calls = transformer_calls(pipeline)
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(1))
    first = Image.fromarray(((clip[0, :, 0].permute(1, 2, 0) + 1) * 127.5).round().byte().numpy())
    pipeline(image=first, **family.sampler.embedding_kwargs(text, 1), latents=noise, num_frames=5, height=64, width=96,
             num_inference_steps=1, guidance_scale=1.0, output_type="latent")
    (seen, output), = calls

    sigma, t = pipeline.scheduler.sigmas[:1], pipeline.scheduler.timesteps[:1]  # t: σ·1000 as the scheduler rounds it
    noisy = family.denoiser.schedule(ti2v).noised(latents, noise, sigma)
    noisy, timesteps, scored = family.denoiser.first_frame_given(latents, noisy, t, torch.tensor([True]))
    torch.testing.assert_close(noisy, seen["hidden_states"], rtol=1e-4, atol=1e-4)
    assert (seen["timestep"][:, : 2 * 3] == 0).all() and (seen["timestep"][:, 2 * 3:] == t).all()
    assert scored.flatten().tolist() == [0.0, 1.0]  # the loss on the frames after the given one
    with torch.no_grad():
        torch.testing.assert_close(family.denoiser.predict(pipeline.transformer, noisy, text, timesteps), output,
                                   rtol=1e-4, atol=1e-4)


def test_image_to_video_training_is_refused_for_a_family_that_samples_from_text_alone(wan, ti2v):
    with pytest.raises(ValueError, match=r"training.image_to_video: Wan samples from text alone \(its pipeline takes "
                                         r"no first frame, as Wan 2.2 TI2V's does\); leave it out"):
        Objective.of(wan, TrainingConfig(image_to_video=0.5))
    with pytest.raises(ValueError, match=r"first frames: Wan samples from text alone .*; leave it out"):
        family_of(wan).sampler.image_pipeline(WanPipeline.from_pretrained(wan.path))
    assert Objective.of(ti2v, TrainingConfig(image_to_video=0.5)).image_to_video == 0.5
    with pytest.raises(ValueError, match=r"training.image_to_video_warmup: Wan samples from text alone"):
        Objective.of(wan, TrainingConfig(image_to_video_warmup=100))


@pytest.mark.parametrize("setting", ["image_to_video=0.2", "image_to_video_warmup=100", "sample_first_frames"])
def test_a_run_of_them_is_refused_before_any_stage_reads_or_encodes(wan, tmp_path, setting):
    """Refused when the run is planned (`check_training`), not by the train stage after ingest and
    both encoders ran for it: the store has nothing of it."""
    from PIL import Image

    from configs.schema import load_config
    from tasks.runner import run_direct

    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (64, 64), "red").save(data / "0.png")
    (data / "0.txt").write_text("a red background")
    Image.new("RGB", (64, 64), "blue").save(tmp_path / "first.png")
    first = [f"training.samples.first_frames=[{tmp_path / 'first.png'}]", "training.samples.prompts=[a red background]"]
    settings = first if setting == "sample_first_frames" else [f"training.{setting}"]
    config = load_config("configs/quickstart.yaml", [f"storage.root={tmp_path / 'store'}", f"model.path={wan.path}",
                                                     f"dataset.sources=[{{path: {data}}}]", *settings])
    name = settings[0].split("=")[0]
    with pytest.raises(ValueError, match=rf"{name}: Wan samples from text alone"):
        run_direct(config)
    assert [path for path in (tmp_path / "store").rglob("*") if path.is_file()] == []


def test_the_warm_up_is_part_of_a_run_id_only_when_set(ti2v, monkeypatch):
    """A run with `image_to_video_warmup` is another run; left at 0 it is not in what the id hashes,
    so the runs from before the setting keep their ids."""
    import tasks.identity

    hashed = []
    monkeypatch.setattr(tasks.identity, "hash_json", lambda value: hashed.append(value) or str(len(hashed)))

    def settings(**training):
        tasks.identity.run_id_for("a manifest", ti2v, TrainingConfig(image_to_video=0.2, **training), family_of(ti2v))
        return hashed[-1]["training"]

    assert "image_to_video_warmup" not in settings() and "image_to_video_warmup" not in settings(image_to_video_warmup=0)
    assert settings(image_to_video_warmup=100)["image_to_video_warmup"] == 100


def test_a_share_of_the_clips_is_given_its_first_frame_and_each_scored_on_the_frames_after_it(ti2v):
    """With `training.image_to_video` 0.5, about half the clips get their first frame clean at
    timestep 0; a transformer exact on every frame it is scored on and far off on the given ones
    has loss 0, and one off by 1 on the scored frames has loss 1 (each clip's loss the mean over
    its scored frames, whether one or both)."""
    objective = Objective.of(ti2v, TrainingConfig(image_to_video=0.5))
    latents = torch.randn(64, 48, 2, 2, 2, generator=torch.Generator().manual_seed(0))
    text = {"umt5_hidden": torch.zeros(64, 4, 64)}
    given = []

    class Exact(torch.nn.Module):  # recovers the target from its input, as only a perfect model could
        config = type("Config", (), {"patch_size": (1, 2, 2)})

        def __init__(self, off: float):
            super().__init__()
            self.off = off

        def forward(self, hidden_states, timestep, encoder_hidden_states):
            t = timestep.view(len(hidden_states), 1, 2, 1, 1) / 1000  # one token a frame here
            velocity = (hidden_states - latents) / t.clamp_min(1e-6)  # x_σ = x + σ(ε − x)
            out = torch.where(t > 0, velocity + self.off, torch.full_like(velocity, 100.0))
            given.append(int((t[:, 0, 0] == 0).sum()))
            return type("Output", (), {"sample": out})

    def loss(off):
        return diffusion_loss(Exact(off), objective, latents, text, torch.Generator().manual_seed(3), None).item()

    assert loss(0.0) == pytest.approx(0.0, abs=1e-6) and loss(1.0) == pytest.approx(1.0, rel=1e-4)
    assert 20 <= given[0] <= 44, f"{given[0]} of 64 clips given their first frame at a share of 0.5"
    assert Objective.of(ti2v, TrainingConfig()).image_to_video == 0.0  # the default trains from text

    # image_to_video_warmup: every clip given its first frame up to that step, then the share
    warm = Objective.of(ti2v, TrainingConfig(image_to_video=0.5, image_to_video_warmup=3))
    for step in (1, 3, 4, 1000):
        given.clear()
        diffusion_loss(Exact(0.0), warm.at(step), latents, text, torch.Generator().manual_seed(3), None)
        assert (given[0] == 64) == (step <= 3) and given[0] >= 20, f"step {step}: {given[0]} of 64 given their frame"


def test_the_image_to_video_pipeline_shares_the_modules_as_they_are(ti2v):
    """Sampling from first frames during training must not cast the training transformer: its
    half-precision base stays as it is, the same module."""
    pipeline = WanPipeline.from_pretrained(ti2v.path)
    pipeline.transformer.to(torch.bfloat16)
    before = {name: p.dtype for name, p in pipeline.transformer.named_parameters()}
    image = family_of(ti2v).sampler.image_pipeline(pipeline)
    assert type(image) is WanImageToVideoPipeline and image.config.expand_timesteps
    assert image.transformer is pipeline.transformer and image.vae is pipeline.vae
    assert {name: p.dtype for name, p in image.transformer.named_parameters()} == before


def test_a_two_expert_model_needs_its_expert_named_and_a_one_transformer_model_refuses_one(a14b, wan):
    with pytest.raises(ValueError, match=r"model.expert: .* has two experts, transformer/ .* boundary_ratio 0.875 .* "
                                         r"transformer_2/ below it: set model.expert to high_noise or low_noise"):
        family_of(ModelConfig(path=a14b)).denoiser.schedule(ModelConfig(path=a14b))
    with pytest.raises(ValueError, match=r"model.expert: .* has one transformer; leave model.expert unset"):
        family_of(wan).denoiser.load(ModelConfig(path=wan.path, expert="low_noise"))


def test_each_expert_trains_on_the_noise_levels_the_pipeline_gives_it(a14b):
    """The pipeline calls `transformer` at the timesteps at or above boundary_ratio × 1000 and
    `transformer_2` below: each expert's σ draws are the scheduler's training sigmas on its side,
    every one on one side or the other, and the expert's own transformer is what trains."""
    family = family_of(ModelConfig(path=a14b))
    pipeline = WanPipeline.from_pretrained(a14b)
    pipeline.set_progress_bar_config(disable=True)
    routed = {name: transformer_calls(pipeline, name) for name in ("transformer", "transformer_2")}
    pipeline(prompt_embeds=torch.zeros(1, 8, 64), num_frames=1, height=32, width=32, num_inference_steps=12,
             guidance_scale=1.0, output_type="latent")
    called = {name: [float(seen["timestep"][0]) / 1000 for seen, _ in calls] for name, calls in routed.items()}
    assert called["transformer"] and called["transformer_2"]
    spans = {}
    for expert, name in (("high_noise", "transformer"), ("low_noise", "transformer_2")):
        model = ModelConfig(path=a14b, expert=expert)
        schedule = family.denoiser.schedule(model, TrainingConfig(timestep_sampling="logit_normal"))
        drawn = schedule.draw(4000, torch.Generator().manual_seed(0), torch.Size((1, 16, 1, 4, 4)))
        low, high = float(drawn.min()), float(drawn.max())
        assert all(low - 1e-3 <= sigma <= high + 1e-3 for sigma in called[name]), (expert, called[name], low, high)
        assert schedule.plain().span == schedule.span  # validation loss stays on the expert's levels
        spans[expert] = schedule.span
        trained = family.denoiser.load(model)
        reference = getattr(pipeline, name)
        assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), reference.state_dict().values()))
    (first, high_count), (second, low_count) = spans["high_noise"], spans["low_noise"]
    assert first == 0 and second == high_count and high_count + low_count == 1000
