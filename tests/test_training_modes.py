"""Training at the memory and speed limits: each mode against the plain one on the same cached
features — checkpointing with or without offloading, a low-precision frozen base, token-budget
batches, the loss weightings and timestep samplings — bit-identical where the math is, within
float tolerance where it is not; each resumes exactly and is recorded in the lineage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load

from storage.store import Store
from tasks.families import family_of
from tasks.train import train
from tests.conftest import SAMPLE_PROMPT as PROMPT
from tests.test_manifest_and_train import kill_training_at


def _run(cached_manifest, root: Path, crash_at: int | None = None, model: Path | None = None, **training) -> dict:
    """Train on a copy of the cached store (killed when it asks for its `crash_at`-th batch, then
    re-run to resume; with another `model` folder); returns the run's record, losses, adapter
    tensors and config."""
    base, manifest_key = cached_manifest
    shutil.copytree(base.storage.root, root)
    raw = base.model_dump()
    if model is not None:
        raw["model"] = {"path": str(model)}
    values = {"rank": 4, "alpha": 4, "steps": 6, "batch_size": 2, "learning_rate": 1e-3, "sample_prompts": [],
              "validation_samples": 4, "validation_every": 3, "checkpoint_every": 2, "caption_dropout": 0.2,
              **training}
    config = type(base).model_validate({**raw, "storage": {"root": str(root)}, "training": values})
    store = Store(config.storage)
    url = store.url(manifest_key)
    if crash_at is not None:
        kill_training_at(config, url, crash_at)
    record = train(config.storage, config.model, config.training, url)
    metrics = [json.loads(line) for line in store.read_bytes(store.key(record["run"]) + "/metrics.jsonl").splitlines()]
    adapter = load(store.read_bytes(store.key(record["adapter"]) + "/adapter_model.safetensors"))
    lineage = store.read_json(store.key(record["run"]) + "/lineage.json")
    return {"record": record, "metrics": metrics, "adapter": adapter, "lineage": lineage, "config": config,
            "id": record["run"].rsplit("/", 1)[1]}


def _same_bits(a: dict, b: dict) -> None:
    assert [m["loss"] for m in a["metrics"]] == [m["loss"] for m in b["metrics"]]
    assert [m.get("validation_loss") for m in a["metrics"]] == [m.get("validation_loss") for m in b["metrics"]]
    assert a["adapter"].keys() == b["adapter"].keys()
    assert all(torch.equal(a["adapter"][k], b["adapter"][k]) for k in a["adapter"])


def _close(a: dict, b: dict, rtol: float) -> None:
    torch.testing.assert_close(torch.tensor([m["loss"] for m in a["metrics"]]),
                               torch.tensor([m["loss"] for m in b["metrics"]]), rtol=rtol, atol=0)
    # the adapters as a whole (Adam's sign-like steps may flip a weight whose gradient is near zero)
    first, second = (torch.cat([run["adapter"][key].flatten() for key in sorted(run["adapter"])]) for run in (a, b))
    assert (first - second).norm() <= rtol * second.norm()


@pytest.mark.parametrize("family", ["pixart", "flux", "sd3"])
def test_checkpointing_and_offloading_train_the_plain_run_bit_for_bit_and_resume_exactly(
        cached_manifest, family_manifests, family, tmp_path):
    """Recompute and offload keep the math: the same run id, bit-identical losses and adapter as
    no checkpointing (also when the losses leave the device only every 4 steps and the loader reads
    3 batches ahead), and an offloaded run killed mid-way resumes to the same bits; for PixArt's
    blocks, FLUX.1's double and single blocks and SD3's joint blocks, each with its own objective."""
    if family != "pixart":
        cached_manifest = family_manifests(family)
    plain = _run(cached_manifest, tmp_path / "plain", log_every=1)
    recompute = _run(cached_manifest, tmp_path / "recompute", gradient_checkpointing="recompute", log_every=4, prefetch=3)
    offload = _run(cached_manifest, tmp_path / "offload", crash_at=9, gradient_checkpointing="offload", log_every=4)
    assert offload["record"]["resumed_from"] == 4
    assert plain["id"] == recompute["id"] == offload["id"]  # memory settings are not the run
    _same_bits(plain, recompute)
    _same_bits(plain, offload)
    assert offload["lineage"]["training"]["gradient_checkpointing"] == "offload"
    # each step's samples as read (a bucket's last micro-batch may be short) and its gradient norm
    assert {m["batch"] for m in plain["metrics"]} <= {1, 2} and all(m["grad_norm"] > 0 for m in plain["metrics"])


@pytest.mark.parametrize("checkpointing,base", [("recompute", "fp32"), ("offload", "int8")])
def test_streamed_blocks_train_the_resident_run_bit_for_bit(cached_manifest, tmp_path, checkpointing, base):
    """Blocks whose frozen weights wait in host memory (`blocks_to_swap`: here both of the tiny
    transformer's) keep the math: the same run id, bit-identical losses and adapter as the run with
    every block resident, under recompute and offload, with a plain and an int8 base; and
    `gradient_checkpointing: auto` trains the same run with the setting the plan chose for the host."""
    settings = {"gradient_checkpointing": checkpointing, "base_precision": base}
    resident = _run(cached_manifest, tmp_path / "resident", **settings)
    streamed = _run(cached_manifest, tmp_path / "streamed", blocks_to_swap=2, **settings)
    assert resident["id"] == streamed["id"] and streamed["lineage"]["training"]["blocks_to_swap"] == 2
    _same_bits(resident, streamed)
    if checkpointing == "recompute":  # auto: the memory plan's choice for this host, in the lineage
        auto = _run(cached_manifest, tmp_path / "auto", gradient_checkpointing="auto", base_precision=base)
        assert auto["id"] == resident["id"] and auto["lineage"]["training"]["gradient_checkpointing"] == "none"
        _same_bits(resident, auto)


def test_a_streamed_block_is_on_the_device_only_around_its_own_turn():
    """Of eight checkpointed blocks streamed, at any block's entry only it and the block that runs
    after it (forward: the next; backward's recompute: the one before) hold their frozen weights;
    the gradients are the resident network's."""
    from torch.utils.checkpoint import checkpoint

    from tasks.train.streaming import BlockStreamer

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
            self.lora = torch.nn.Parameter(torch.randn(8) * 0.1)

        def forward(self, x):
            return torch.tanh(self.frozen(x) + self.lora)

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block() for _ in range(8))
    x = torch.randn(4, 8)

    def gradients() -> torch.Tensor:
        h = x
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False)
        h.square().sum().backward()
        grads = torch.cat([block.lora.grad for block in blocks])
        blocks.zero_grad(set_to_none=True)
        return grads

    expected = gradients()
    streamer = BlockStreamer(list(blocks), 8, torch.device("cpu"))
    seen = []
    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(  # after the streamer's own hook
            lambda module, args, index=index: seen.append((index, {i for i, b in enumerate(blocks)
                                                                   if "weight" in b.frozen._parameters})))
    assert not any("weight" in block.frozen._parameters for block in blocks)  # all in host memory
    for _ in range(2):  # a second step starts from what the first left
        assert torch.equal(gradients(), expected)
    forward, backward = seen[:8], seen[8:16]
    assert all(on == ({i, i + 1} & set(range(8))) for i, on in forward)
    assert [i for i, _ in backward] == list(range(7, -1, -1))
    assert all(on == ({i, i - 1} & set(range(8))) for i, on in backward)
    assert streamer.weights[0][0][2].device.type == "cpu"


def test_offload_keeps_the_checkpointed_activations_in_host_memory(cached_manifest):
    """What backward keeps on the device: every activation (none), the blocks' inputs
    (recompute), nothing with offload (the saved-tensor hooks take every tensor to host memory and
    bring it back in backward); the gradients are the same in every mode."""
    from tasks.train.loss import Objective, diffusion_loss
    from tasks.train.network import kept_activations, trainable_network

    base, _ = cached_manifest
    kept, grads = {}, {}
    for mode in ("none", "recompute", "offload"):
        training = base.training.updated({"lora.rank": 4, "lora.alpha": 4, "gradient_checkpointing": mode})
        network = trainable_network(base.model, family_of(base.model), training)
        draws = torch.Generator().manual_seed(0)
        latents = torch.randn(2, 4, 32, 32, generator=draws)
        text = {"t5_hidden": torch.randn(2, 7, network.config.caption_channels, generator=draws),
                "t5_hidden_mask": torch.ones(2, 7)}
        saved = []

        def pack(tensor):  # sees what no inner hook (checkpointing's, offloading's) took
            saved.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            with kept_activations(mode, torch.device("cpu")):
                loss = diffusion_loss(network, Objective.of(base.model, training), latents, text,
                                      torch.Generator().manual_seed(1), None)
        loss.backward()
        kept[mode] = sum(saved)
        grads[mode] = torch.cat([p.grad.flatten() for p in network.parameters() if p.requires_grad])
    assert kept["none"] > 2 * kept["recompute"] > 0 and kept["offload"] == 0
    assert torch.equal(grads["none"], grads["recompute"]) and torch.equal(grads["none"], grads["offload"])


def test_a_low_precision_frozen_base_trains_the_fp32_adapter_within_tolerance_and_resumes_exactly(cached_manifest, tmp_path):
    """bf16 and fp16 (under autocast of their type) and int8 and fp8 weight-only frozen bases: the LoRA
    weights, their optimizer state and the loss stay fp32, the losses and adapter follow the fp32
    base's within the base's rounding, a killed bf16-base run resumes to the same bits, and the
    precision is in the run id and the lineage."""
    from tasks.train.network import trainable_network

    base, _ = cached_manifest
    reference = _run(cached_manifest, tmp_path / "fp32", mixed_precision="bf16")
    whole = _run(cached_manifest, tmp_path / "bf16", mixed_precision="bf16", base_precision="bf16", sample_prompts=[PROMPT],
                 sample_steps=2)
    resumed = _run(cached_manifest, tmp_path / "bf16-resumed", crash_at=9, mixed_precision="bf16", base_precision="bf16")
    int8 = _run(cached_manifest, tmp_path / "int8", base_precision="int8")
    fp8 = _run(cached_manifest, tmp_path / "fp8", base_precision="fp8")
    plain = _run(cached_manifest, tmp_path / "plain")
    fp16 = _run(cached_manifest, tmp_path / "fp16", mixed_precision="fp16", base_precision="fp16")  # loss scaled
    reference16 = _run(cached_manifest, tmp_path / "fp32-fp16", mixed_precision="fp16")
    assert resumed["record"]["resumed_from"] == 4
    _same_bits(whole, resumed)
    _close(whole, reference, rtol=0.05)
    _close(int8, plain, rtol=0.05)
    _close(fp8, plain, rtol=0.1)  # e4m3 keeps 3 mantissa bits to int8's 7 in a channel's range
    _close(fp16, reference16, rtol=0.05)
    assert len({reference["id"], whole["id"], int8["id"], fp8["id"], plain["id"], fp16["id"]}) == 6
    assert whole["lineage"]["training"]["base_precision"] == "bf16"
    assert len(whole["record"]["samples"]) == 1  # its sample grid renders through the pipeline
    assert all(tensor.dtype == torch.float32 for tensor in whole["adapter"].values())
    for precision, mixed, frozen in (("bf16", "bf16", {torch.bfloat16}), ("int8", "no", {"Int8Tensor"}),
                                     ("fp8", "no", {"Float8Tensor"})):
        training = base.training.updated({"lora.rank": 4, "lora.alpha": 4, "base_precision": precision,
                                          "mixed_precision": mixed})
        network = trainable_network(base.model, family_of(base.model), training)
        lora = [p for p in network.parameters() if p.requires_grad]
        assert lora and all(p.dtype == torch.float32 for p in lora)
        linears = [m.base_layer.weight for m in network.modules() if hasattr(m, "lora_A")]
        assert {w.dtype if precision == "bf16" else type(w).__name__ for w in linears} == frozen


def test_token_budget_batches_size_each_bucket_by_its_image_tokens(cached_manifest, tmp_path):
    """A micro-batch holds as many images as batch_tokens tokens fit (the transformer's own patch
    embedding counts them): a bucket of a quarter the tokens gets four times the samples; on the
    demo's one-resolution buckets a budget of two images trains what batch_size 2 trains, bit for
    bit, as another run."""
    from diffusers import PixArtTransformer2DModel

    from tasks.train.data import CachedFeatures, batch_sizes

    base, manifest_key = cached_manifest
    from diffusers import PixArtTransformer2DModel

    transformer = PixArtTransformer2DModel.from_pretrained(base.model.path, subfolder="transformer")
    store = Store(base.storage)
    family = family_of(base.model)
    features = CachedFeatures(store, store.read_json(manifest_key), family)
    counted_tokens = lambda height, width: family.denoiser.image_tokens(transformer.config, height, width)  # noqa: E731

    def tokens(name: str) -> int:
        height, width = (int(side) for side in name.split("x"))
        return transformer.pos_embed(torch.zeros(1, 4, height, width)).shape[1]

    mixed = {"32x32": ["a"], "16x16": ["b"], "16x64": ["c"], "64x64": ["d"]}
    sizes = batch_sizes(mixed, 2, 8 * tokens("32x32"), counted_tokens)
    assert sizes == {"32x32": 8, "16x16": 32, "16x64": 8, "64x64": 2}
    assert all(size * tokens(name) <= 8 * tokens("32x32") for name, size in sizes.items())
    assert batch_sizes(mixed, 3, None, counted_tokens) == dict.fromkeys(mixed, 3)

    budget = 2 * max(tokens(name) for name in features.buckets)
    assert set(batch_sizes(features.buckets, 1, budget, counted_tokens).values()) == {2}
    counted = _run(cached_manifest, tmp_path / "count", batch_size=2)
    budgeted = _run(cached_manifest, tmp_path / "tokens", batch_size=1, batch_tokens=budget)
    assert counted["id"] != budgeted["id"]
    _same_bits(counted, budgeted)
    assert budgeted["lineage"]["training"]["batch_tokens"] == budget


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction", "sample"])
def test_min_snr_weights_and_logit_normal_timesteps_are_diffusers_training_recipes(tiny_models, tmp_path, prediction):
    """The loss with min-SNR-γ weighting and logit-normal timesteps equals diffusers' recipe on the
    same draws: timesteps from `compute_density_for_timestep_sampling` (as its SD3 script), weights
    from `compute_snr` as its text-to-image script weighs them for each prediction type."""
    from types import SimpleNamespace

    from diffusers import DPMSolverMultistepScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_snr

    from configs.schema import ModelConfig, TrainingConfig
    from tasks.train.loss import Objective, diffusion_loss

    folder = tmp_path / "models"
    shutil.copytree(tiny_models, folder)
    config_file = folder / "scheduler" / "scheduler_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "prediction_type": prediction}))
    model = ModelConfig(path=str(folder))
    seen = {}

    def network(noisy, encoder_hidden_states, encoder_attention_mask, timestep, added_cond_kwargs):
        seen.update(timestep=timestep)
        return SimpleNamespace(sample=torch.zeros(len(noisy), 2 * noisy.shape[1], *noisy.shape[2:]))

    latents = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    text = {"t5_hidden": torch.randn(4, 5, 32), "t5_hidden_mask": torch.ones(4, 5, dtype=torch.long)}
    training = TrainingConfig(timestep_sampling="logit_normal", logit_mean=0.3, logit_std=1.2, loss_weighting="min_snr",
                              min_snr_gamma=5.0)
    objective = Objective.of(model, training)
    noise_scheduler = objective.schedule.scheduler
    loss = diffusion_loss(network, objective, latents, text, torch.Generator().manual_seed(7), None)

    generator = torch.Generator().manual_seed(7)
    noise = torch.randn(latents.shape, generator=generator)
    u = compute_density_for_timestep_sampling("logit_normal", 4, logit_mean=0.3, logit_std=1.2, generator=generator)
    timesteps = (u * 1000).long()
    assert torch.equal(seen["timestep"], timesteps)
    reference = DPMSolverMultistepScheduler.from_pretrained(folder, subfolder="scheduler")
    alpha = reference.alphas_cumprod[timesteps].sqrt().view(-1, 1, 1, 1)
    sigma = (1 - reference.alphas_cumprod[timesteps]).sqrt().view(-1, 1, 1, 1)
    target = {"epsilon": noise, "v_prediction": alpha * noise - sigma * latents, "sample": latents}[prediction]
    snr = compute_snr(noise_scheduler, timesteps)
    weights = torch.stack([snr, 5.0 * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
    if prediction == "epsilon":
        weights = weights / snr
    elif prediction == "v_prediction":
        weights = weights / (snr + 1)
    torch.testing.assert_close(loss, ((target ** 2).mean(dim=(1, 2, 3)) * weights).mean())


def test_loss_weighting_and_timestep_sampling_are_runs_of_their_own_that_resume_exactly(cached_manifest, tmp_path):
    """For a noise-predicting model, min-SNR with a γ above every SNR weighs every sample 1: the
    plain loss within float tolerance. Min-SNR-5 with logit-normal timesteps is another run,
    recorded in its lineage, and a killed one resumes to the same bits."""
    base, _ = cached_manifest
    epsilon = tmp_path / "epsilon-model"
    shutil.copytree(base.model.path, epsilon)
    config_file = epsilon / "scheduler" / "scheduler_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "prediction_type": "epsilon"}))
    noise = _run(cached_manifest, tmp_path / "noise", model=epsilon)
    unbounded = _run(cached_manifest, tmp_path / "unbounded", model=epsilon, loss_weighting="min_snr", min_snr_gamma=1e12)
    _close(unbounded, noise, rtol=1e-4)
    plain = _run(cached_manifest, tmp_path / "plain")
    recipe = {"loss_weighting": "min_snr", "sampling": "logit_normal"}
    whole = _run(cached_manifest, tmp_path / "whole", timesteps=recipe)
    resumed = _run(cached_manifest, tmp_path / "resumed", crash_at=9, timesteps=recipe)
    assert resumed["record"]["resumed_from"] == 4
    _same_bits(whole, resumed)
    assert len({plain["id"], unbounded["id"], whole["id"]}) == 3
    assert {key: whole["lineage"]["training"]["timesteps"][key] for key in recipe} == recipe
    assert [m["loss"] for m in whole["metrics"]] != [m["loss"] for m in plain["metrics"]]


def test_a_dora_trains_a_magnitude_per_output_channel_and_resumes_exactly(cached_manifest, tmp_path):
    """`training.lora.dora`: PEFT's DoRA layers, whose magnitudes (one per output channel of each
    adapted module, starting at the base weight's row norms) train beside the low-rank pairs; a run
    of its own, recorded in its lineage, and a killed one resumes to the same bits."""
    plain = _run(cached_manifest, tmp_path / "plain")
    dora = {"lora": {"dora": True}, "mixed_precision": "bf16", "base_precision": "bf16"}  # as users train it
    whole = _run(cached_manifest, tmp_path / "whole", **dora)
    resumed = _run(cached_manifest, tmp_path / "resumed", crash_at=9, **dora)
    assert resumed["record"]["resumed_from"] == 4
    _same_bits(whole, resumed)
    magnitudes = {key: value for key, value in whole["adapter"].items() if key.endswith("lora_magnitude_vector")}
    assert len(magnitudes) == len(plain["adapter"]) // 2  # one beside each pair
    from diffusers import PixArtTransformer2DModel

    transformer = PixArtTransformer2DModel.from_pretrained(cached_manifest[0].model.path, subfolder="transformer")
    base = transformer.state_dict()
    for key, value in magnitudes.items():  # trained away from the base's row norms: by about 1.4% in 6 steps
        # here, where the bf16 base's rounding moves them by 0.04%
        norms = base[key.removeprefix("base_model.model.").replace("lora_magnitude_vector", "weight")].norm(dim=1)
        assert ((value - norms).abs() / norms).max() > 0.005, key
    assert whole["id"] != plain["id"] and whole["lineage"]["training"]["lora"]["dora"] is True
    # PEFT would load a LoRA's pairs into a DoRA and keep the magnitudes of a zero update
    with pytest.raises(ValueError, match=r"its adapter lacks \d+ weights this run trains .*lora_magnitude_vector"):
        _run(cached_manifest, tmp_path / "continued", lora={"dora": True}, init_from=plain["record"]["run"])
    with pytest.raises(ValueError, match="lora.dora with base_precision int8: PEFT's DoRA dequantises"):
        type(whole["config"].training).model_validate({"lora": {"dora": True}, "base_precision": "int8"})


@pytest.mark.parametrize("adapter", ["loha", "lokr"])
def test_a_loha_and_a_lokr_train_their_own_weights_and_resume_exactly(cached_manifest, tmp_path, adapter):
    """`training.lora.adapter`: PEFT's LoHa and LoKr layers, with a bf16 base under bf16 autocast
    and rank dropout (seeded by the micro-batch, as LoRA's dropout is): a run of its own, recorded in
    its lineage, that a killed run resumes to the same bits; a LoRA does not continue it."""
    settings = {"lora": {"adapter": adapter, "dropout": 0.1}, "mixed_precision": "bf16", "base_precision": "bf16"}
    whole = _run(cached_manifest, tmp_path / "whole", **settings)
    resumed = _run(cached_manifest, tmp_path / "resumed", crash_at=9, **settings)
    assert resumed["record"]["resumed_from"] == 4
    _same_bits(whole, resumed)
    prefix = {"loha": "hada_", "lokr": "lokr_"}[adapter]
    assert whole["adapter"] and all(key.rsplit(".", 1)[1].startswith(prefix) for key in whole["adapter"])
    assert any(value.abs().max() > 0 for value in whole["adapter"].values())
    assert whole["lineage"]["training"]["lora"]["adapter"] == adapter
    with pytest.raises(ValueError, match=r"does not fit this LoRA config: its adapter .*a LoHa or a LoKr"):
        _run(cached_manifest, tmp_path / "continued", init_from=whole["record"]["run"])
    training = type(whole["config"].training)
    with pytest.raises(ValueError, match=f"lora.adapter {adapter} with base_precision int8"):
        training.model_validate({"lora": {"adapter": adapter}, "base_precision": "int8"})
    with pytest.raises(ValueError, match=f"lora.dora with lora.adapter {adapter}"):
        training.model_validate({"lora": {"adapter": adapter, "dora": True}})


def test_the_loop_reads_the_device_only_every_log_every_steps(cached_manifest, tmp_path):
    """No value leaves the device per micro-step: in 10 steps of 2 micro-batches with log_every 5,
    training's own code reads tensors twice (one read of every pending step each time)."""
    import sys

    reads = []

    def counted(real):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.endswith(("tasks/train/trainer.py", "tasks/train/metrics.py",
                                            "tasks/train/loss.py")):
                reads.append(f"{caller.co_name}:{sys._getframe(1).f_lineno}")
            return real(self, *args, **kwargs)
        return read

    with mock.patch.multiple(torch.Tensor, **{name: counted(getattr(torch.Tensor, name))
                                              for name in ("item", "tolist", "__bool__", "__float__", "__int__")}):
        run = _run(cached_manifest, tmp_path / "run", steps=10, gradient_accumulation=2, log_every=5, validation_samples=0,
                   checkpoint_every=0)
    assert len(run["metrics"]) == 10
    assert len(reads) == 2 and all(read.startswith("flush:") for read in reads), reads


def test_compiled_blocks_train_the_plain_run_within_float_tolerance(cached_manifest, tmp_path):
    """torch.compile of every transformer block (inductor, on this CPU): the same run id and the
    plain run's losses and adapter within float tolerance."""
    plain = _run(cached_manifest, tmp_path / "plain", steps=1, validation_samples=0)  # one step: one shape to compile
    compiled = _run(cached_manifest, tmp_path / "compiled", steps=1, validation_samples=0, compile=True)
    assert compiled["id"] == plain["id"]
    _close(compiled, plain, rtol=1e-4)
