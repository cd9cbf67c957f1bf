"""The tiny flow-matching families load and run through their own diffusers pipelines, as the
published FLUX.1 [dev]/[schnell], FLUX.2 [dev]/[klein], SD3.5, Chroma, Z-Image Turbo, Qwen-Image, Wan 2.1 T2V and
Wan 2.2 TI2V-5B and A14B repositories do."""

from __future__ import annotations

import inspect
import json
import random

import diffusers
import pytest
import torch
from diffusers import AutoencoderKL, DiffusionPipeline

from tasks.demo.data import draw_scene
from tasks.demo.flow_models import CLIP_SHAPES, FAMILIES, T5_SHAPE, write_tiny_family
from tasks.demo.models import WORDS, _pixels, palette_confusions
from tests.pipeline_calls import loaded_components

PROMPTS = ["a red circle on a blue background", "Zebra café, 42 stripes!"]  # a demo caption; text outside WORDS
D_T5, D_L, D_G = T5_SHAPE["d_model"], CLIP_SHAPES["clip-l"]["hidden_size"], CLIP_SHAPES["clip-g"]["hidden_size"]


@pytest.fixture(scope="module")
def folders(tiny_family):
    """Each family with a random VAE (with the published factors)."""
    return {family: tiny_family(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def pipes(folders):
    return {family: getattr(diffusers, FAMILIES[family].pipeline).from_pretrained(folder, **loaded_components(folder))
            for family, folder in folders.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_model_index_names_the_pipeline_that_loads_it(folders, family):
    pipeline = FAMILIES[family].pipeline
    index = json.loads((folders[family] / "model_index.json").read_text())
    assert index["_class_name"] == pipeline
    loaded = DiffusionPipeline.from_pretrained(folders[family], **loaded_components(folders[family]))
    assert type(loaded).__name__ == pipeline
    # every component the pipeline's __init__ requires is in the folder, and nothing else but the
    # transformers where optional and the pipeline's settings (WanPipeline's: Wan 2.2 A14B has two
    # transformers and a boundary between them, TI2V one and a timestep a token; FLUX.2 [klein]'s
    # `is_distilled`), as published
    parameters = inspect.signature(type(loaded).__init__).parameters.items()
    required = {name for name, parameter in parameters if name != "self" and parameter.default is inspect.Parameter.empty}
    assert set(index) - {"_class_name", "_diffusers_version"} - required <= {
        "transformer", "transformer_2", "boundary_ratio", "expand_timesteps", "is_distilled"}
    assert all(getattr(loaded.config, name) == value for name, value in (FAMILIES[family].settings or {}).items()
               if name != "transformer_2")
    assert required <= set(index)
    assert all(getattr(loaded, name) is not None for name in required)


@pytest.mark.parametrize("family", ["flux", "flux-schnell"])
def test_flux_encode_prompt_gives_t5_states_a_clip_pooled_vector_and_text_ids(pipes, family):
    embeds, pooled, text_ids = pipes[family].encode_prompt(PROMPTS, prompt_2=None, max_sequence_length=32)
    assert embeds.shape == (2, 32, D_T5) and pooled.shape == (2, D_L) and text_ids.shape == (32, 3)
    assert not torch.equal(pooled[0], pooled[1])  # read at each prompt's own end token
    assert pipes[family].transformer.config.guidance_embeds == (family == "flux")


def test_sd3_encode_prompt_pads_both_clips_to_t5s_width_before_t5s_tokens(pipes):
    embeds, negative, pooled, negative_pooled = pipes["sd3"].encode_prompt(
        PROMPTS, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False, max_sequence_length=32)
    assert embeds.shape == (2, 16 + 32, D_T5) and pooled.shape == (2, D_L + D_G)  # the tiny SD3's CLIP: 16
    assert negative is None and negative_pooled is None
    assert D_L + D_G < D_T5 and torch.all(embeds[:, :16, D_L + D_G:] == 0)  # the padding the pipeline adds


def test_chroma_encode_prompt_masks_all_padding_but_the_first_token(pipes):
    embeds, text_ids, mask, *_ = pipes["chroma"].encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                                               max_sequence_length=32)
    assert embeds.shape == (2, 32, D_T5) and text_ids.shape == (32, 3) and mask.shape == (2, 32)
    real = pipes["chroma"].tokenizer(PROMPTS, return_tensors="pt", padding=True).attention_mask.sum(1)
    assert mask.sum(1).tolist() == (real + 1).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_pipeline_samples_a_picture(pipes, family):
    from tasks.families import family_named

    from PIL import Image

    video = FAMILIES[family].pipeline == "WanPipeline"
    options = {"guidance_scale": 3.5} if family == "flux" else {"num_frames": 1} if video else {}
    if family.startswith("qwen-image-edit"):  # an edit pipeline's picture (it takes no prompt alone)
        options["image"] = Image.new("RGB", (48, 32), (200, 30, 30))
    # (as the family's sampler asks for 64 × 64: Kontext's pipeline would move it to 1024²)
    sizes = family_named(FAMILIES[family].pipeline).sampler.size_options(64, 64)
    output = pipes[family](prompt=PROMPTS[0], num_inference_steps=2, output_type="pt",
                           generator=torch.Generator().manual_seed(0), **sizes, **options)
    images = output.frames[:, 0] if video else output.images  # a video's first frame
    assert images.shape == (1, 3, 64, 64) and not images.isnan().any()


def test_schedulers_are_the_published_ones(pipes):
    configs = {family: pipe.scheduler.config for family, pipe in pipes.items()}
    assert configs["flux"].use_dynamic_shifting and configs["flux"].base_shift == 0.5
    assert configs["flux"].max_shift == 1.15 and configs["flux"].max_image_seq_len == 4096
    for family in ("flux-schnell", "chroma"):
        assert not configs[family].use_dynamic_shifting and configs[family].shift == 1.0
    for family in ("sd3", "zimage"):
        assert not configs[family].use_dynamic_shifting and configs[family].shift == 3.0
    qwen = configs["qwen-image"]  # an exponential shift from 0.5 at 256 tokens to 0.9 at 8,192, ending at 0.02
    assert qwen.use_dynamic_shifting and qwen.time_shift_type == "exponential" and qwen.shift_terminal == 0.02
    assert (qwen.base_shift, qwen.max_shift, qwen.base_image_seq_len, qwen.max_image_seq_len) == (0.5, 0.9, 256, 8192)
    assert type(pipes["wan"].scheduler).__name__ == "UniPCMultistepScheduler"
    assert configs["wan"].use_flow_sigmas and configs["wan"].flow_shift == 3.0
    assert configs["wan"].prediction_type == "flow_prediction"


def test_the_qwen_tokenizer_reads_demo_words_whole_any_text_by_bytes_and_renders_qwen3s_template(pipes):
    """Z-Image's Qwen3 tokenizer: a Qwen2Tokenizer whose byte-level BPE keeps each demo word (after
    a space) one token and gives back any text, and whose chat template renders a system and a user
    message, the assistant's opening and (enable_thinking false) the empty thinking block, as
    Qwen3's published template renders them."""
    tokenizer = pipes["zimage"].tokenizer
    assert type(tokenizer).__name__ == "Qwen2Tokenizer" and tokenizer.padding_side == "right"
    assert all(len(tokenizer(" " + word).input_ids) == 1 for word in WORDS)
    assert tokenizer.decode(tokenizer(PROMPTS[1]).input_ids) == PROMPTS[1]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": PROMPTS[0]}]
    turn = f"<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n{PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n"
    render = lambda **options: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                             **options)
    assert render() == render(enable_thinking=True) == turn
    assert render(enable_thinking=False) == turn + "<think>\n\n</think>\n\n"
    assert tokenizer.convert_ids_to_tokens(tokenizer(turn).input_ids)[:3] == ["<|im_start|>", "system", "Ċ"]


def test_qwen_images_template_prefix_is_the_34_tokens_its_pipeline_drops(pipes):
    """Qwen-Image's pipeline drops the first 34 tokens of its template, its system message and the
    user's turn's opening, as Qwen2.5's published tokenizer makes them: the tiny tokenizer makes the
    same 34, so the demo's captions lose none of their words."""
    pipe = pipes["qwen-image"]
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    assert type(pipe.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"  # as published: vision tower too


@pytest.mark.parametrize("family", ["qwen-image-edit", "qwen-image-edit-plus"])
def test_qwen_image_edits_template_prefix_is_the_64_tokens_its_pipelines_drop(pipes, family):
    """The edit pipelines' system message and the user's turn's opening are 64 tokens in Qwen2.5's
    published tokenizer (" (", "'s" and ")," each one token): the tiny processor's tokenizer makes the same 64."""
    pipe = pipes[family]
    prefix = pipe.prompt_template_encode.split("<|vision_start|>")[0].split("{}")[0]
    assert len(pipe.processor.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 64


def test_the_mistral_tokenizer_renders_mistral_small_3_1s_template_and_begins_each_text_once(pipes):
    """FLUX.2 [dev]'s Mistral tokenizer: its control tokens first (the image token 10, the padding
    11, as published), the system message (a text block) and the user's turn (a string or text
    blocks alike) as Mistral Small 3.1's published template renders them, after one <s>, which the
    pipeline's own tokenizing of the template keeps single; a system message as a plain string
    fails in that template (which is why the pipeline, and precast, give text blocks); the encoder
    saved whole, its vision tower too."""
    import jinja2

    pipe = pipes["flux2-dev"]
    tokenizer = pipe.tokenizer
    assert tokenizer.convert_tokens_to_ids(["[IMG]", "<pad>", "<s>"]) == [10, 11, 1]
    assert tokenizer.decode(tokenizer(PROMPTS[1], add_special_tokens=False).input_ids) == PROMPTS[1]
    turn = f"<s>[SYSTEM_PROMPT]S[/SYSTEM_PROMPT][INST]{PROMPTS[0]}[/INST]"
    system = {"role": "system", "content": [{"type": "text", "text": "S"}]}
    for content in (PROMPTS[0], [{"type": "text", "text": PROMPTS[0]}]):
        messages = [system, {"role": "user", "content": content}]
        assert tokenizer.apply_chat_template(messages, tokenize=False) == turn
    with pytest.raises(jinja2.exceptions.UndefinedError):
        tokenizer.apply_chat_template([{"role": "system", "content": "S"}, messages[1]], tokenize=False)
    ids = tokenizer.apply_chat_template([messages], tokenize=True, return_dict=True)["input_ids"][0]
    assert ids == tokenizer(turn, add_special_tokens=False).input_ids and ids.count(1) == 1
    assert type(pipe.text_encoder).__name__ == "Mistral3ForConditionalGeneration"


def test_clip_tokenizers_read_demo_words_whole_and_any_text_by_bytes(pipes):
    clip_l, clip_g = pipes["sd3"].tokenizer, pipes["sd3"].tokenizer_2
    assert clip_l.model_max_length == clip_g.model_max_length == 16 and pipes["flux"].tokenizer.model_max_length == 77
    assert all(len(clip_l(word, add_special_tokens=False).input_ids) == 1 for word in WORDS)
    ids = clip_l(PROMPTS[1]).input_ids
    assert ids[0] == clip_l.bos_token_id and ids[-1] == clip_l.eos_token_id and clip_l.eos_token_id not in ids[1:-1]
    # every character comes back (CLIP's decoding ends each word and digit with a space)
    assert clip_l.decode(ids, skip_special_tokens=True).replace(" ", "") == PROMPTS[1].lower().replace(" ", "")
    # CLIP-L pads with its end token, SD3's CLIP-G with "!" (token 0), as the published tokenizers do
    assert clip_l("a", padding="max_length", max_length=5).input_ids[-1] == clip_l.eos_token_id
    assert clip_g("a", padding="max_length", max_length=5).input_ids[-1] == clip_g.convert_tokens_to_ids("!") == 0


def test_the_vae_has_16_channels_and_an_untrained_one_the_published_factors(folders):
    for family, folder in folders.items():
        if family == "wan2.2-ti2v":  # Wan 2.2's: 48 channels, 2 x 2 pixel patches in, 16x in space
            config = diffusers.AutoencoderKLWan.from_pretrained(folder / "vae").config
            assert (config.z_dim, config.patch_size, config.scale_factor_spatial) == (48, 2, 16)
            assert len(config.latents_mean) == len(config.latents_std) == 48
            continue
        if family in ("flux2-dev", "flux2-klein"):  # FLUX.2's: 32 channels, 2 x 2 patches batch-normalised
            vae = diffusers.AutoencoderKLFlux2.from_pretrained(folder / "vae")
            assert vae.config.latent_channels == 32 and vae.bn.num_features == 128
            assert not torch.allclose(vae.bn.running_var, torch.ones(128))
            continue
        if FAMILIES[family].vae in ("AutoencoderKLWan", "AutoencoderKLQwenImage"):  # a 3-D VAE, normalised by the
            vae = getattr(diffusers, FAMILIES[family].vae)  # published per-channel mean and std (Wan's, Qwen-Image's)
            config = vae.from_pretrained(folder / "vae").config
            published = inspect.signature(vae).parameters
            assert config.z_dim == 16 and config.latents_mean == published["latents_mean"].default
            assert config.latents_std == published["latents_std"].default
            continue
        config = AutoencoderKL.from_pretrained(folder / "vae").config
        assert config.latent_channels == 16 and (config.shift_factor, config.scaling_factor) == (
            FAMILIES["flux" if family != "sd3" else "sd3"].vae_factors)
    for family in ("flux-schnell", "chroma"):  # FLUX.1's VAE, as the published folders have it
        assert (folders[family] / "vae" / "diffusion_pytorch_model.safetensors").read_bytes() == \
            (folders["flux"] / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()


def test_the_hand_set_vae_gives_back_the_palette_and_gets_the_shift_and_scale_that_normalise_its_latents(tmp_path):
    vae = AutoencoderKL.from_pretrained(write_tiny_family(tmp_path / "sd3", "sd3", seed=2) / "vae")
    assert palette_confusions(vae) == []
    rng = random.Random(1)  # other pictures than the ones the factors were fitted on
    pictures = torch.stack([_pixels(draw_scene(rng, 256, 256)[0]) for _ in range(32)])
    with torch.no_grad():
        latents = (vae.encode(pictures).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
    assert (vae.config.shift_factor, vae.config.scaling_factor) != FAMILIES["sd3"].vae_factors
    assert abs(latents.mean().item()) < 0.1 and abs(latents.std().item() - 1) < 0.1


def test_the_hand_set_flux2_vae_gives_back_the_palette_and_its_batch_norm_normalises_its_patches():
    from tasks.demo.flow_models import flux2_block_vae
    from tasks.families.flux2 import Flux2Codec, patchify

    vae = flux2_block_vae(seed=2)
    assert palette_confusions(vae) == []
    rng = random.Random(1)  # other pictures than the ones the statistics were fitted on
    pictures = torch.stack([_pixels(draw_scene(rng, 256, 256)[0]) for _ in range(32)])
    shift, scale = Flux2Codec().latent_factors(vae)
    with torch.no_grad():
        patches = (patchify(vae.encode(pictures).latent_dist.mean) - torch.tensor(shift)[:, None, None]) * \
            torch.tensor(scale)[:, None, None]
    assert abs(patches.mean().item()) < 0.1 and abs(patches.std().item() - 1) < 0.1


@pytest.mark.parametrize("family, layers", [("flux2-klein", (9, 18, 27)), ("flux2-dev", (10, 20, 30))])
def test_flux2_s_encoders_carry_each_word_and_the_one_before_it_into_the_layers_the_pipeline_reads(
        pipes, family, layers):
    """FLUX.2's tiny encoders (`previous_word_heads`): a random causal LM would blur each word into
    the words before it, and "blue" of "a blue background" would not be told from "a red circle"'s
    colour; here the state at each position is its word's and the previous word's, at each of the
    layers the pipeline reads, after [dev]'s system message too. [klein]'s later layers pass their
    input on; [dev]'s each add a little of their own, so a cache that read other layers would differ."""
    from tasks.families.flux2 import SYSTEM_MESSAGE

    pipe = pipes[family]
    captions = ["a red circle on a blue background", "a green circle on a blue background",
                "a red circle on a green background"]
    if family == "flux2-dev":  # as Flux2Pipeline templates a caption; its own words are tokens of the vocabulary
        captions = [pipe.tokenizer.apply_chat_template(
            [{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
             {"role": "user", "content": [{"type": "text", "text": caption}]}], tokenize=False) for caption in captions]
        assert len(pipe.tokenizer(captions[0]).input_ids) < 50
    tokens = pipe.tokenizer(captions, return_tensors="pt")
    with torch.no_grad():
        states = pipe.text_encoder(**tokens, output_hidden_states=True).hidden_states
    words = [pipe.tokenizer.convert_ids_to_tokens(ids) for ids in tokens.input_ids]
    circle, background = words[0].index("Ġcircle"), words[0].index("Ġbackground")
    close = dict(atol=1e-5 if family == "flux2-klein" else 5e-4)
    for layer in layers:
        assert torch.equal(states[layer], states[1]) == (family == "flux2-klein")
        at = states[layer]
        # "background" after "blue" is the same whatever the shape's colour, and not after "green"
        assert torch.allclose(at[0, background], at[1, background], **close)
        assert not torch.allclose(at[0, background], at[2, background], atol=1e-3)
        assert not torch.allclose(at[0, circle], at[1, circle], atol=1e-3)  # "circle" after "red" or "green"


def test_a_write_is_deterministic_by_seed(tmp_path):
    first, second = (write_tiny_family(tmp_path / name, "sd3", seed=3) for name in ("a", "b"))
    files = sorted(path.relative_to(first) for path in first.rglob("*") if path.is_file())
    assert files == sorted(path.relative_to(second) for path in second.rglob("*") if path.is_file())
    assert all((first / name).read_bytes() == (second / name).read_bytes() for name in files)


def test_an_unknown_family_is_refused_naming_the_families(tmp_path):
    with pytest.raises(ValueError, match="flux, flux-kontext, flux-schnell, sd3, chroma"):
        write_tiny_family(tmp_path / "x", "sdxl")
