"""The memory plan (tasks/train/plan.py, `precast plan`): what it counts on fake tensors is what the
trainer's own step holds on real ones, its quantised bases are what torchao makes, and it chooses
the fastest setting that fits the card."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from configs.schema import PipelineConfig
from flows.cli import main
from tasks.families import family_of
from tasks.train.network import trainable_network
from tasks.train.plan import (GIB, RESERVE, Footprint, Ledger, auto_settings, choose, config_shapes, encoder_footprints,
                              footprint, parse_memory, plan_for, plan_text, step_ledger)

# a family of each kind of call, each in another checkpointing mode: PixArt's cross-attention,
# FLUX.1's packed tokens and pooled CLIP, Z-Image's captions as lists cut by their masks, Wan's clips
CASES = [("pixart-sigma", "none"), ("flux", "offload"), ("zimage", "recompute"), ("wan", "recompute")]


def config(folder, **training) -> PipelineConfig:
    resolution = 256 if "pixart" in str(folder) else 64  # PixArt's buckets start at 256
    return PipelineConfig(dataset={"sources": [{"path": "unused"}], "video": {"frames": 9}},
                          model={"path": str(folder)}, latent_encoding={"resolution": resolution},
                          training={"batch_size": 2, "mixed_precision": "bf16", "base_precision": "bf16", **training})


@pytest.mark.parametrize("name,checkpointing", CASES)
def test_the_plan_counts_what_the_trainers_own_step_holds(name, checkpointing, tiny_family):
    run = config(tiny_family(name), gradient_checkpointing=checkpointing)
    family = family_of(run.model)
    shapes = config_shapes(run, family)
    planned = footprint(run.model, run.training, family, shapes, "bf16", checkpointing)
    # the same step on the real transformer, loaded as the trainer loads it, on real tensors
    network = trainable_network(run.model, family, run.training)
    real = step_ledger(run.model, family, run.training, network, contextlib.nullcontext(), shapes, planned.batch)
    assert planned.step == pytest.approx(real.peak, rel=0.02)
    assert planned.host == real.host_peak
    assert (planned.host > 0) == (checkpointing == "offload")
    trained = sum(p.numel() for p in network.parameters() if p.requires_grad)
    assert planned.trainable == 3 * 4 * trained  # fp32 weights and AdamW's two states
    if name == "wan":  # a clip: the VAE's own encoder gave its latent frames (9 frames: 1 + 2 × 4)
        assert len(shapes.latent) == 4 and shapes.latent[1] == 3


@pytest.mark.parametrize("name", ["flux", "flux2-klein"])
def test_the_plan_batches_the_image_tokens_the_trainer_counts(name, tiny_family):
    """`training.batch_tokens` is divided by a sample's tokens as the trainer counts them: a token a
    16×16 patch of pixels for FLUX.1 and FLUX.2 alike (the pipelines' packed latents), though FLUX.2's
    reader hands over latents already patched 2×2 into channels."""
    run = config(tiny_family(name), batch_tokens=64)
    family = family_of(run.model)
    shapes = config_shapes(run, family)  # the largest bucket's
    planned = footprint(run.model, run.training, family, shapes, "bf16", "none")
    _, height, width = shapes.pixels
    assert planned.tokens == (height // 16) * (width // 16) and planned.batch == 64 // planned.tokens


@pytest.mark.parametrize("name", ["pixart-sigma", "qwen-image"])
def test_each_encode_stage_is_counted_as_the_stage_loads_and_calls_it(name, tiny_family):
    """A text encoder as the text stage loads it (`build_text_encoder`: its dtype, the whole model
    on the device) and calls it (the prompt function on a batch of the longest captions, some
    padded: a mask with no padding lets transformers skip building it, which fake tensors cannot
    tell), and the VAE as the latent stage calls it: the plan's fake count is the real one. PixArt's T5 and 2-D
    VAE; Qwen-Image's Qwen2.5-VL language model (its template's dropped tokens read too) and 3-D VAE."""
    from tasks.encode.models import build_text_encoder, build_vae

    run = config(tiny_family(name))
    family = family_of(run.model)
    planned = {e.name: e for e in encoder_footprints(run, family, config_shapes(run, family))}
    for spec in family.text.encoders:
        loaded = build_text_encoder(run.model, family, spec, "bf16", "cpu", "none").model
        assert planned[spec.name].weights == sum(p.numel() * p.element_size() for p in loaded.parameters()) + \
            sum(b.numel() * b.element_size() for b in loaded.buffers())
        real = Ledger()
        real.watch(loaded)
        with real, torch.no_grad():  # a batch of captions of several lengths, as the stage's are: some padding
            ids = torch.randint(0, 100, (planned[spec.name].batch, planned[spec.name].length))
            mask = torch.ones_like(ids)
            mask[0, -1] = 0
            spec.encode(loaded, ids, mask)
        assert planned[spec.name].call == pytest.approx(real.peak, rel=0.02)
    vae = build_vae(run.model, family, "fp32", "cpu")
    frames, height, width = config_shapes(run, family).pixels
    shape = (8, 3, height, width) if frames == 1 else (8, 3, frames, height, width)
    real = Ledger()
    real.watch(vae)
    with real, torch.no_grad():
        vae.encode(family.codec.vae_pixels(torch.rand(shape))).latent_dist.mean
    assert planned["vae"].call == pytest.approx(real.peak, rel=0.02)


@pytest.mark.parametrize("name,folders", [("qwen-image-edit", "refs"), ("qwen-image-edit-plus", ["near", "far"])])
def test_an_encoder_that_sees_the_references_is_counted_with_its_vision_tower(name, folders, tiny_family):
    """Qwen-Image-Edit's encoder reads each caption with its references, cut into patches for its
    vision tower: the plan counts each caption's pictures at the family's area (Edit's one, Plus's
    two) through the tower and the language model, as the real call on real pictures holds them
    (the patches on the device and every activation; the image processor's own copies stay on the host)."""
    from PIL import Image

    from tasks.encode.models import build_text_encoder
    from tasks.families.spec import area_sides

    run = config(tiny_family(name)).model_copy(deep=True)
    run.dataset.sources[0] = run.dataset.sources[0].model_copy(update={"references": "files", "reference_path": folders})
    family = family_of(run.model)
    (spec,) = family.text.encoders
    shapes = config_shapes(run, family)
    planned = {e.name: e for e in encoder_footprints(run, family, shapes)}[spec.name]
    count = len(shapes.references)
    assert count == (1 if isinstance(folders, str) else 2)
    loaded = build_text_encoder(run.model, family, spec, "bf16", "cpu", "none")
    side, _ = area_sides(1, 1, spec.area)
    # a square picture of its own for each reference of each caption, as the plan counts them
    vision = [[Image.new("RGB", (side, side), (9 * n, 40, 200)) for n in range(i * count, (i + 1) * count)]
              for i in range(planned.batch)]
    cut = spec.cut(vision, loaded.images, loaded.model.dtype, "cpu")
    tokens = spec.picture_tokens(run.model, count)
    assert len(cut["pixel_values"]) == planned.batch * tokens * loaded.images.merge_size ** 2
    ids = torch.randint(0, 100, (planned.batch, planned.length))
    ids[:, 3:3 + tokens] = loaded.model.config.image_token_id
    mask = torch.ones_like(ids)
    mask[0, -1] = 0
    real = Ledger()
    real.watch(loaded.model)
    with real, torch.no_grad():
        pictures = {key: value.clone() for key, value in cut.items()}  # the copy on the device
        states = super(type(spec), spec).encode(loaded.model, ids, mask, **pictures)
    assert states["hidden"].shape[1] == planned.length - spec.drop
    assert planned.call == pytest.approx(real.peak, rel=0.02)


@pytest.mark.parametrize("base", ["int8", "fp8"])
def test_a_quantised_base_is_counted_as_torchao_holds_it(base, tiny_family):
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    run = config(tiny_family("flux"))
    family = family_of(run.model)
    transformer = family.denoiser.load(run.model, torch.bfloat16)
    quantize_(transformer, {"int8": Int8WeightOnlyConfig, "fp8": Float8WeightOnlyConfig}[base]())
    storages: dict[int, int] = {}

    def count(tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):  # torchao's tensors: their bytes, scales and zero points
            for inner in tensor.__tensor_flatten__()[0]:
                count(getattr(tensor, inner))
        else:
            storages[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()

    for tensor in (*transformer.parameters(), *transformer.buffers()):
        count(tensor)
    planned = footprint(run.model, run.training, family, config_shapes(run, family), base, "recompute")
    assert planned.weights == sum(storages.values())


def test_precast_plan_prints_each_setting_and_chooses_the_fastest_that_fits(tiny_family, capsys, tmp_path):
    folder = tiny_family("pixart-sigma")
    run = config(folder)
    plan = plan_for(run, 24 * GIB)
    rows = {(f.base_precision, f.checkpointing): f for f in plan["footprints"]}
    assert set(rows) == {(base, mode) for base in ("bf16", "int8", "fp8") for mode in ("none", "recompute", "offload")}
    none, recompute, offload = (rows["bf16", mode] for mode in ("none", "recompute", "offload"))
    assert none.step > recompute.step > offload.step and offload.host > 0 == recompute.host
    assert rows["int8", "none"].weights < none.weights and rows["int8", "none"].step == none.step
    # the fastest that fits, at the run's own base: none on a card that holds it, then recompute, then offload
    assert plan["choice"].checkpointing == "none"
    between = (recompute.total + none.total) // 2 + RESERVE
    assert choose(plan["footprints"], run.training, between).checkpointing == "recompute"
    assert choose(plan["footprints"], run.training, offload.total + RESERVE).checkpointing == "offload"
    assert choose(plan["footprints"], run.training, offload.total + RESERVE - 1) is None

    # gradient_checkpointing auto: the trainer's choice for its device, the same as the plan's
    auto = run.training.model_copy(update={"gradient_checkpointing": "auto"})
    family, shapes = family_of(run.model), plan["shapes"]
    assert auto_settings(run.model, auto, family, shapes, between).gradient_checkpointing == "recompute"
    with pytest.raises(ValueError, match="auto: no setting fits .* at base_precision bf16; the least, offload"):
        auto_settings(run.model, auto, family, shapes, offload.total + RESERVE - 1)

    text = plan_text(plan)
    assert "choice: training.gradient_checkpointing none, blocks_to_swap 0 (base_precision bf16)" in text
    assert text.count("\nbf16 ") == 3 and "alive at its peak" in text
    assert "  t5 " in text and "  vae " in text and "the encode stages" in text

    yaml = tmp_path / "run.yaml"
    yaml.write_text(run.model_dump_json())  # JSON is YAML
    assert main(["plan", str(yaml), "--gpu-memory", f"{(offload.total + RESERVE) // 2**20 - 1}MiB"]) == 1
    out = capsys.readouterr().out
    assert out.count("\nfp8 ") == 3 and "nothing fits at base_precision bf16, even with every block streamed" in out


def test_streamed_blocks_fit_a_card_with_the_fewest_blocks_and_cost_their_copies():
    """Of 40 blocks of 1 GB, streaming n leaves 40 − n on the device and two streamed ones at a time;
    the plan streams the fewest that fit, never without checkpointing, and prefers every block
    resident, then the faster checkpointing."""
    gb = 10**9
    base = Footprint("recompute", "int8", 1, 4096, weights=41 * gb, trainable=gb, step=4 * gb, kept_on_host=0,
                     largest=0, blocks=[gb] * 40)
    card = 30 * gb + RESERVE  # 46 GB resident: 16 blocks less, two of them back on the device
    streamed = base.streaming(card)
    assert streamed.blocks_to_swap == 18 and streamed.total == 30 * gb and streamed.host == 18 * gb
    assert streamed.seconds_streaming(25.0) == pytest.approx(36 / 25)  # 18 GB in, twice a step
    assert replace(base, checkpointing="none").streaming(card) is None
    assert base.streaming(4 * gb) is None  # not even with all 40 streamed
    offload = replace(base, checkpointing="offload", step=3 * gb)
    training = PipelineConfig(dataset={"sources": [{"path": "unused"}]}, model={"path": "unused"},
                              training={"base_precision": "int8", "mixed_precision": "bf16"}).training
    candidates = [base, offload, streamed, offload.streaming(card)]
    assert choose(candidates, training, card).blocks_to_swap == 18  # recompute streaming 18 before offload's 17
    assert choose(candidates, training, 46 * gb + RESERVE).checkpointing == "recompute"


def test_card_sizes_read_as_written():
    assert parse_memory("24GiB") == 24 * GIB and parse_memory("80GB") == 80 * 10**9 and parse_memory("48") == 48 * GIB
    with pytest.raises(ValueError, match="--gpu-memory 'lots'"):
        parse_memory("lots")
