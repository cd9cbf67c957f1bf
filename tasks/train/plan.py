"""The memory plan: what a run's training step holds on its device at the model's real shapes,
counted on any machine before the run, and the settings that fit a card.

$ precast plan configs/quickstart.yaml --gpu-memory 24GiB

No weights are read and no GPU is needed. The transformer is built from its config.json on the
meta device and gets the run's LoRA layers from the trainer's own `trainable_network`; its
parameters then become fake tensors (torch's `FakeTensorMode`: shapes, dtypes and devices, no
data), and the trainer's own step runs on them: `diffusion_loss` under autocast, then backward, on
a micro-batch of the largest bucket's latents (their shape from the VAE's own encoder, run the same
way) and captions as long as the text cache holds. `Ledger` counts every storage an op makes while
it is alive: the step's peak, and what is alive at the peak by the op and module that made it. The
resident parts are added by count: the frozen base (int8 and fp8 as torchao holds them: a byte a
linear weight and an fp32 scale a row, int8 a zero point too; their activations are the
half-precision base's), the
trainable weights in fp32, AdamW's two states and the moving average.

What a CPU cannot show: the fake device is the CPU, so autocast follows CPU's op lists (CUDA's
keep layer norms and softmax outputs in fp32, which a step without checkpointing holds more of),
and attention is PyTorch's flash kernel, which keeps no score matrix (a GPU kernel that falls back
to math, or keeps a workspace, needs more). docs/benchmarks.md sets the plan beside measured steps.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from configs.schema import ModelConfig, PipelineConfig, TrainingConfig
from storage.shards import bucket_sides
from tasks.families import Family, family_of, model_json
from tasks.loading import DTYPES, library
from tasks.train.network import base_dtype, sampling_module, trainable_network

GIB = 2**30
# what a card needs besides the allocator's peak: the CUDA context, cuBLAS's workspaces and the
# allocator's rounding (max_memory_allocated, which the plan counts, sees none of it)
RESERVE = int(1.5 * GIB)
CHECKPOINTING = ("none", "recompute", "offload")  # from the fastest to the one that holds least
ROW_BYTES = {"int8": 5, "fp8": 4}  # what a quantised weight's row holds besides its bytes
# where streamed blocks come from, GB/s one way: what pinned host-to-device copies reach over PCIe
# in practice; a GH200's host link by its specification (900 GB/s both ways)
LINKS = {"PCIe 4.0 x16": 25.0, "PCIe 5.0 x16": 50.0, "NVLink-C2C (GH200)": 450.0}


class Ledger(TorchDispatchMode):
    """The storages ops make while it is active, each counted as long as it is alive: on the device
    (the peak of their sum, the largest, and what is alive at the peak by op and module) or, once
    `to_host` moved it, in host memory. A mask's `nonzero` is every position: the plan's captions
    fill the cache's length."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = self.largest = self.host = self.host_peak = 0
        self.alive: dict[int, tuple[int, tuple[str, str]]] = {}
        self.on_host: set[int] = set()
        self.at_peak: Counter = Counter()
        self.modules = _Modules()
        self.resident: set[int] = set()  # the network's weights: counted apart, and their views are no new bytes

    def watch(self, network: torch.nn.Module) -> None:
        self.modules.watch(network)
        self.resident = {t.untyped_storage()._cdata for t in (*network.parameters(), *network.buffers())}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.nonzero.default and isinstance(args[0], FakeTensor):
            (mask,) = args
            out = torch.empty(mask.numel(), mask.ndim, dtype=torch.long, device=mask.device)
        elif func in MASK_INDEXED and any(_is_fake_mask(index) for index in args[1]):
            out = func(args[0], _every_position(args[1]), *args[2:], **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            key = tensor.untyped_storage()._cdata if isinstance(tensor, torch.Tensor) else None
            if key is not None and key not in self.alive and key not in self.resident:
                self._made(tensor.untyped_storage(), (func.__name__.split(".")[0], self.modules.current()))
        return out

    def _made(self, storage, where: tuple[str, str]) -> None:
        key, size = storage._cdata, storage.nbytes()
        self.alive[key] = (size, where)
        self.now += size
        self.largest = max(self.largest, size)
        if self.now > self.peak:
            self.peak, self.at_peak = self.now, None  # what is alive is read when the first storage goes
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        size, made = self.alive.pop(key)
        if key in self.on_host:
            self.on_host.discard(key)
            self.host -= size
            return
        if self.at_peak is None:  # the peak ends here: what made it
            self.at_peak = Counter()
            for other, (nbytes, where) in self.alive.items():
                if other not in self.on_host:
                    self.at_peak[where] += nbytes
            self.at_peak[made] += size
        self.now -= size

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` counted in host memory (what `save_on_cpu` keeps for backward)."""
        copy = tensor.clone()
        key = copy.untyped_storage()._cdata
        if key in self.alive and key not in self.on_host:
            self.on_host.add(key)
            size = self.alive[key][0]
            self.now -= size
            self.host += size
            self.host_peak = max(self.host_peak, self.host)
        return copy


# ops that index by a mask: what they are given, the positions the mask would give (every one)
MASK_INDEXED = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                torch.ops.aten._unsafe_index_put.default)


def _is_fake_mask(index: Any) -> bool:
    return isinstance(index, FakeTensor) and index.dtype in (torch.bool, torch.uint8)


def _every_position(indices: list) -> list:
    """Indices with each fake mask of k dimensions replaced by k index tensors of all its positions."""
    out = []
    for index in indices:
        if _is_fake_mask(index):
            out += [torch.empty(index.numel(), dtype=torch.long, device=index.device)] * index.ndim
        else:
            out.append(index)
    return out


class _Modules:
    """The module running now, its block index replaced by `*` (`blocks.*.attn1`): forward hooks on
    every module, re-entered when a checkpointed block recomputes."""

    def __init__(self):
        self.stack: list[str] = []

    def watch(self, network: torch.nn.Module) -> None:
        for name, module in network.named_modules():
            short = re.sub(r"\.\d+(\.|$)", r".*\1", name.replace("base_model.model.", ""))
            module.register_forward_pre_hook(lambda *_, short=short: self.stack.append(short))
            module.register_forward_hook(self.leave)

    def leave(self, *_) -> None:  # None: a forward hook's result would replace the module's output
        if self.stack:
            self.stack.pop()

    def current(self) -> str:
        return self.stack[-1] if self.stack else "(outside the transformer)"


@dataclass(frozen=True)
class Shapes:
    """What a step of the run is planned on: a sample's latents [C, (F,) h, w] (the largest
    bucket's), each text encoder's positions per caption as the reader hands them over, and an
    edit pair's references' latents (each its own shape, the transformer's tokens beside the sample's)."""

    latent: tuple[int, ...]
    lengths: dict[str, int]
    pixels: tuple[int, int, int] = (1, 0, 0)  # frames, height, width of that sample (the VAE's input)
    references: tuple[tuple[int, ...], ...] = ()
    # the VAE's latent sides of the sample, then of each reference, before the family packs them:
    # what the trainer counts image tokens from (its bucket names), for `training.batch_tokens`
    sides: tuple[tuple[int, ...], ...] = ()


@dataclass
class Footprint:
    """One setting's bytes on the device (and in host memory) at the step's peak."""

    checkpointing: str
    base_precision: str
    batch: int
    tokens: int  # a sample's image tokens
    weights: int  # the frozen base (or, full, the whole transformer), every block resident
    trainable: int  # trainable weights (fp32), AdamW's two states and the moving average
    step: int  # the step's own peak: the batch, activations kept for backward, gradients, workspaces
    kept_on_host: int  # kept activations (offload) in host memory
    largest: int  # the step's largest tensor
    ledger: list[tuple[str, str, int]] = field(default_factory=list)  # at the peak: op, module, bytes
    blocks: list[int] = field(default_factory=list)  # each block's frozen weights, in the order they run
    blocks_to_swap: int = 0  # the first blocks streamed from host memory

    @property
    def streamed(self) -> int:
        """The streamed blocks' weights: in host memory, and copied to the device twice a step
        (forward, then backward's recompute)."""
        return sum(self.blocks[:self.blocks_to_swap])

    @property
    def device_weights(self) -> int:
        """The frozen weights on the device: the resident blocks', and two streamed blocks' at a time."""
        return self.weights - self.streamed + sum(sorted(self.blocks[:self.blocks_to_swap])[-2:])

    @property
    def host(self) -> int:
        return self.kept_on_host + self.streamed

    @property
    def total(self) -> int:
        return self.device_weights + self.trainable + self.step

    def fits(self, gpu_memory: int) -> bool:
        return self.total + RESERVE <= gpu_memory

    def streaming(self, gpu_memory: int) -> Footprint | None:
        """The same with the fewest blocks streamed that fit `gpu_memory` (None: none do). Streaming
        needs checkpointing: a block then keeps nothing of its own for backward."""
        if self.checkpointing == "none" or not self.blocks:
            return None
        for count in range(1, len(self.blocks) + 1):
            if (streamed := replace(self, blocks_to_swap=count)).fits(gpu_memory):
                return streamed
        return None

    def seconds_streaming(self, gigabytes_per_second: float) -> float:
        """What the copies take a step at a link's bandwidth (hidden where a block's compute is longer)."""
        return 2 * self.streamed / (gigabytes_per_second * 1e9)


def plan_for(config: PipelineConfig, gpu_memory: int) -> dict[str, Any]:
    """Each checkpointing mode at the run's base precision and at the cheaper bases (a LoRA run's:
    its autocast dtype's, int8, fp8), counted at the config's largest sample; at the run's base,
    where a checkpointed step does not fit, the fewest blocks streamed that make it fit; the run's
    choice (`choose`); and each encode stage's own footprint under the config's settings."""
    family = family_of(config.model)
    training = config.training
    shapes = config_shapes(config, family)
    half = [training.mixed_precision] if training.mixed_precision in ("bf16", "fp16") else []  # a half base needs it
    bases = [training.base_precision] + [base for base in (*half, "int8", "fp8")
                                         if base != training.base_precision and training.method == "lora"]
    steps: dict[tuple[str, str], Any] = {}  # int8's and fp8's steps are the half base's: counted once
    counted = [footprint(config.model, training, family, shapes, base, mode, steps) for base in bases
               for mode in CHECKPOINTING]
    if training.method == "lora":
        own = [f for f in counted if f.base_precision == training.base_precision and not f.fits(gpu_memory)]
        counted += [streamed for f in own if (streamed := f.streaming(gpu_memory)) is not None]
    return {"family": family.name, "gpu_memory": gpu_memory, "shapes": shapes, "footprints": counted,
            "choice": choose(counted, training, gpu_memory), "encoders": encoder_footprints(config, family, shapes)}


def choose(footprints: list[Footprint], training: TrainingConfig, gpu_memory: int) -> Footprint | None:
    """The fastest footprint that fits at the run's own base precision (the base changes what is
    trained; checkpointing and streamed blocks do not): every block resident before any streamed,
    then none before recompute before offload, then the fewest blocks streamed."""
    same = [f for f in footprints if f.base_precision == training.base_precision and f.fits(gpu_memory)]
    return min(same, key=lambda f: (f.blocks_to_swap > 0, CHECKPOINTING.index(f.checkpointing), f.blocks_to_swap),
               default=None)


def auto_settings(model: ModelConfig, training: TrainingConfig, family: Family, shapes: Shapes,
                  gpu_memory: int) -> TrainingConfig:
    """`training` with `gradient_checkpointing: auto` made the setting `choose` takes for
    `gpu_memory` at its base precision (and `blocks_to_swap`), counting only as far as it must:
    none, recompute, offload, then the fewest blocks streamed. Nothing fits: refused, naming the
    least the plan found and what else can be changed."""
    steps: dict[tuple[str, str], Any] = {}
    counted = []
    for mode in CHECKPOINTING:
        counted.append(footprint(model, training, family, shapes, training.base_precision, mode, steps))
        if counted[-1].fits(gpu_memory):
            break
    if training.method == "lora" and not counted[-1].fits(gpu_memory):
        counted += [streamed for f in counted if (streamed := f.streaming(gpu_memory)) is not None]
    pick = choose(counted, training, gpu_memory)
    if pick is None:
        least = min(counted, key=lambda f: f.total)
        every = replace(least, blocks_to_swap=len(least.blocks)) if least.checkpointing != "none" else least
        raise ValueError(f"training.gradient_checkpointing auto: no setting fits {gpu_memory / GIB:.1f} GiB at "
                         f"base_precision {training.base_precision}; the least, {every.checkpointing} with "
                         f"{every.blocks_to_swap} blocks streamed, needs {(every.total + RESERVE) / GIB:.1f} GiB: "
                         f"use a cheaper base_precision (int8, fp8), a smaller batch_size or batch_tokens, or smaller "
                         f"buckets or clips (`precast plan` shows each)")
    return training.model_copy(update={"gradient_checkpointing": pick.checkpointing,
                                       "blocks_to_swap": pick.blocks_to_swap})


def reader_shapes(model: ModelConfig, family: Family, features: Any) -> Shapes:
    """What a run's cached features hand the transformer at most: the latents of its bucket with
    the most image tokens (a sample of it read as training reads it) and each text cache's length."""
    from functools import partial

    from tasks.train.data import group_tokens

    config = family.denoiser.transformer_class().load_config(model.path, subfolder=family.denoiser.folder(model),
                                                             revision=model.revision)
    bucket = max(features.buckets, key=lambda name: group_tokens(name, partial(family.denoiser.image_tokens, config)))
    latents, text, _ = features.batch(features.buckets[bucket][:1], torch.Generator().manual_seed(0), 0.0)
    references = tuple(tuple(text[f"reference_{n}"].shape[1:]) for n in range(len(bucket.split("+")) - 1))
    # (an encoder that sees the references: their tokens beside the caption's)
    lengths = {spec.name: shard.meta["max_length"] + spec.picture_tokens(model, len(references))
               for spec, shard in zip(family.text.encoders, features.text.prompts)}
    return Shapes(tuple(latents.shape[1:]), lengths, references=references,
                  sides=tuple(bucket_sides(part) for part in bucket.split("+")))


def footprint(model: ModelConfig, training: TrainingConfig, family: Family, shapes: Shapes, base_precision: str,
              gradient_checkpointing: str, steps: dict[tuple[str, str], Any] | None = None) -> Footprint:
    """The device bytes of one training step of `training` on `model` with these settings (`steps`:
    the steps counted so far, by the base they ran on and the checkpointing)."""
    half = {"bf16": "bf16", "fp16": "fp16"}.get(training.mixed_precision)
    # int8 and fp8 weights are widened to the autocast dtype as each layer runs: their step is a half base's
    counted_base = (half or "fp32") if base_precision in ("int8", "fp8") else base_precision
    run = training.model_copy(update={"base_precision": counted_base, "gradient_checkpointing": gradient_checkpointing,
                                      "compile": False})
    steps = {} if steps is None else steps
    if (counted_base, gradient_checkpointing) not in steps:
        mode = FakeTensorMode(allow_non_fake_inputs=True)  # the schedule's own tables are real tensors
        network = fake_network(model, family, run, mode)
        tokens = sum(family.denoiser.image_tokens(network.config, *sides) for sides in shapes.sides)
        batch = max(1, training.batch_tokens // tokens) if training.batch_tokens else training.batch_size
        steps[counted_base, gradient_checkpointing] = (network, batch, tokens,
                                                       step_ledger(model, family, run, network, mode, shapes, batch))
    network, batch, tokens, ledger = steps[counted_base, gradient_checkpointing]
    weights, trainable = resident(network, training, base_precision)
    blocks = [frozen_bytes(block, base_precision)
              for block in family.denoiser.blocks(sampling_module(network, training))]
    return Footprint(gradient_checkpointing, base_precision, batch, tokens, weights, trainable, ledger.peak,
                     ledger.host_peak, ledger.largest,
                     [(op, module, nbytes) for (op, module), nbytes in (ledger.at_peak or Counter()).most_common(8)],
                     blocks)


def fake_network(model: ModelConfig, family: Family, training: TrainingConfig, mode: FakeTensorMode) -> torch.nn.Module:
    """The run's trainable network from the trainer's own `trainable_network`, on a transformer
    built from its config on the meta device in the base's dtype (the modules its class keeps in
    fp32 kept so), its parameters and buffers then fake tensors on the CPU."""
    cls = family.denoiser.transformer_class()
    with torch.device("meta"):
        transformer = cls.from_config(cls.load_config(model.path, subfolder=family.denoiser.folder(model),
                                                      revision=model.revision))
        dtype = base_dtype(training)
        if dtype is not None:  # torch's own `to`: diffusers' warns of the modules kept in fp32, kept below
            torch.nn.Module.to(transformer, dtype)
            keep = getattr(transformer, "_keep_in_fp32_modules", None) or []
            for name, module in transformer.named_modules():
                if any(part in name.split(".") for part in keep):
                    module.float()
        network = trainable_network(model, family, training, transformer=transformer)
    return faked(network, mode)


def faked(module: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    """`module` (on the meta device) with fake CPU tensors for its parameters and buffers."""
    cpu = torch.device("cpu")
    for part in module.modules():
        for name, parameter in part._parameters.items():
            if parameter is not None:
                part._parameters[name] = torch.nn.Parameter(FakeTensor(mode, parameter.data, cpu),
                                                             requires_grad=parameter.requires_grad)
        for name, buffer in part._buffers.items():
            if buffer is not None:
                part._buffers[name] = FakeTensor(mode, buffer, cpu)
    return module


def config_shapes(config: PipelineConfig, family: Family) -> Shapes:
    """The config's largest sample: the bucket with the most pixels at `latent_encoding.resolution`
    or a source's, the largest (the longest clip the dataset keeps, for a family that trains clips),
    its latents' shape from the family's VAE encoder run on fake pixels, as the training reader
    shapes them; and each text encoder's length under `text_encoding`."""
    model = config.model
    tables = [family.codec.bucket_table(config.latent_encoding.resolution),
              *(family.codec.bucket_table(s.resolution, f"dataset source {s.path!r}: resolution")
                for s in config.dataset.sources if s.resolution)]
    # the most pixels, the squarest of those, of any table
    height, width = max((sides for table in tables for sides in table.values()),
                        key=lambda sides: (sides[0] * sides[1], -abs(sides[0] - sides[1])))
    video = config.dataset.video
    frames = max([video.frames, *video.frame_buckets])
    if family.codec.clip_problem(frames) is not None:
        frames = 1
    mode = FakeTensorMode()
    vae = faked(meta_vae(model, family), mode)
    shape = (1, 3, int(height), int(width)) if frames == 1 else (1, 3, frames, int(height), int(width))
    # an edit family's references: as many as a source's reference folders (a column's: one, as
    # a one-reference pipeline takes), each sized by the family's rule (a square one at the resolution: about its area)
    count = max([len(s.reference_folders()) or int(s.references == "column") for s in config.dataset.sources
                 if family.codec.references is not None], default=0)
    with mode, torch.no_grad():
        def latent_of(pixels: tuple[int, ...]) -> tuple[torch.Size, torch.Size]:
            """As the reader shapes it (patches), and its sides as the VAE gives them."""
            latent = vae.encode(family.codec.vae_pixels(torch.empty(pixels))).latent_dist.mean[0]
            return family.codec.normalised(latent, torch.zeros(()), torch.ones(())).shape, latent.shape[1:]

        latent, sides = latent_of(shape)
        box = family.codec.references.box(*[config.latent_encoding.reference_resolution
                                            or config.latent_encoding.resolution] * 3) if count else None
        reference, reference_sides = latent_of((1, 3, box[5] - box[3], box[4] - box[2])) if count else ((), ())
        references = (tuple(reference),) * count
    lengths = {spec.name: family.text.length(model, spec, config.text_encoding) + spec.picture_tokens(model, count)
               for spec in family.text.encoders}
    return Shapes(tuple(latent), lengths, (frames, int(height), int(width)), references,
                  (tuple(sides), *(tuple(reference_sides),) * count))


def step_ledger(model: ModelConfig, family: Family, training: TrainingConfig, network: torch.nn.Module,
                mode: Any, shapes: Shapes, batch: int) -> Ledger:
    """The trainer's step (`diffusion_loss` under autocast, then backward) on a micro-batch of
    `batch` samples of `shapes` (fake under `mode`, a `FakeTensorMode`, for a fake network), counted
    by a `Ledger`. Offload keeps what autograd saves in host
    memory, as `save_on_cpu` does."""
    from tasks.train.loss import Objective, diffusion_loss

    objective = Objective.of(model, training, family)
    configs = {spec.name: model_json(model.path, model.revision, f"{spec.folder}/config.json",
                                     f"the width of {spec.name}'s features") for spec in family.text.encoders}
    ledger = Ledger()
    ledger.watch(network)
    offloaded = training.gradient_checkpointing == "offload"
    with mode, ledger:
        text = {}
        for spec in family.text.encoders:
            for output, key in zip(spec.outputs, spec.keys()):
                width = spec.width(configs[spec.name], output)
                if output == "pooled":
                    text[key] = torch.empty(batch, width)
                else:
                    text[key] = torch.empty(batch, shapes.lengths[spec.name], width)
                    text[f"{key}_mask"] = torch.ones(batch, shapes.lengths[spec.name], dtype=torch.long)
        text.update({f"reference_{n}": torch.empty(batch, *shape) for n, shape in enumerate(shapes.references)})
        latents = torch.empty(batch, *shapes.latent)
        hooks = (torch.autograd.graph.saved_tensors_hooks(ledger.to_host, lambda kept: kept) if offloaded
                 else contextlib.nullcontext())
        with hooks:
            loss = diffusion_loss(network, objective.at(1), latents, text, torch.Generator(),
                                  DTYPES.get(training.mixed_precision))
        loss.backward()
    return ledger


@dataclass
class EncoderFootprint:
    """One encode stage's bytes on its device, alone (the stages run one after another, and never
    beside training): the weights it holds there and its call's own peak."""

    name: str
    setting: str  # dtype, offload (text) or batch, tiling, slicing (VAE)
    weights: int  # on the device: all of them, or (sequential offload) the largest layer's
    call: int  # the peak of one call: its input, activations and output
    batch: int  # captions or samples a call
    length: int  # positions a caption (text) or pixels a side, the longest (VAE)

    @property
    def total(self) -> int:
        return self.weights + self.call

    def fits(self, gpu_memory: int) -> bool:
        return self.total + RESERVE <= gpu_memory


def meta_vae(model: ModelConfig, family: Family) -> torch.nn.Module:
    """The family's VAE built from the model's vae/config.json on the meta device (no weights read)."""
    cls = library("diffusers", family.codec.vae)
    with torch.device("meta"):
        return cls.from_config(cls.load_config(model.path, subfolder="vae", revision=model.revision))


def encoder_footprints(config: PipelineConfig, family: Family, shapes: Shapes) -> list[EncoderFootprint]:
    """Each text encoder under `text_encoding` (its dtype, offload and batch_tokens: a batch of
    the longest captions) and the VAE under `latent_encoding` (its dtype, batch_size, tiling and
    slicing, on the largest sample), each built from its config on the meta device and called on
    fake tensors as the stage calls it, counted by a `Ledger`."""
    from tasks.encode.models import TEXT_ACTIVATIONS

    model, text, latent = config.model, config.text_encoding, config.latent_encoding
    out = []
    for spec in family.text.encoders:
        cls = library("transformers", spec.model_class)
        settings = cls.config_class.from_pretrained(model.path, subfolder=spec.folder, revision=model.revision)
        with torch.device("meta"):
            encoder = cls._from_config(settings, dtype=TEXT_ACTIVATIONS[text.dtype]).eval().requires_grad_(False)
        base = "int8" if text.dtype == "int8" else text.dtype
        held = (max(frozen_bytes(module, base) for module in encoder.modules() if list(module.parameters(False)))
                if text.offload == "sequential" else frozen_bytes(encoder, base))
        length = shapes.lengths[spec.name] + getattr(spec, "drop", 0)  # before the template's tokens are dropped
        batch = max(1, text.batch_tokens // length)
        call, inputs = spec.planned(model, settings, batch, length, len(shapes.references))
        setting = f"{text.dtype}, offload {text.offload}"
        out.append(EncoderFootprint(spec.name, setting, held, call_peak(encoder, call, inputs), batch, length))
    vae = torch.nn.Module.to(meta_vae(model, family), DTYPES[latent.dtype])
    held = frozen_bytes(vae.requires_grad_(False), latent.dtype)
    vae.enable_tiling() if latent.tiling else vae.disable_tiling()
    vae.enable_slicing() if latent.slicing else vae.disable_slicing()
    frames, height, width = shapes.pixels
    shape = (latent.batch_size, 3, height, width) if frames == 1 else (latent.batch_size, 3, frames, height, width)
    peak = call_peak(vae, lambda vae: vae.encode(family.codec.vae_pixels(
        torch.empty(shape, dtype=DTYPES[latent.dtype]))).latent_dist.mean)
    setting = f"{latent.dtype}, batch {latent.batch_size}" + ", tiled" * latent.tiling + ", sliced" * latent.slicing
    out.append(EncoderFootprint("vae", setting, held, peak, latent.batch_size, max(height, width)))
    return out


def call_peak(module: torch.nn.Module, call: Callable[..., Any], inputs: dict[str, Any] | None = None) -> int:
    """The peak bytes of `call(module, **inputs)` without autograd, beyond the module's own weights
    (and views of them): `module`, on the meta device, made fake, and the call's tensors made under
    that mode: each `Blank` of `inputs` made there (counted), each real tensor made a constant of the
    mode, whose values the call may read (as ops on constants alone give constants, up to
    `CONSTANT_NUMEL_LIMIT` elements: one, unless raised here to hold them)."""
    from unittest import mock

    from torch._subclasses import fake_tensor

    from tasks.families.spec import Blank

    mode, ledger = FakeTensorMode(), Ledger()
    module = faked(module, mode)
    ledger.watch(module)
    dtype = next(module.parameters()).dtype
    inputs = inputs or {}
    limit = max([fake_tensor.CONSTANT_NUMEL_LIMIT, *(v.numel() for v in inputs.values() if torch.is_tensor(v))])
    with mock.patch.object(fake_tensor, "CONSTANT_NUMEL_LIMIT", limit), mode, ledger, torch.no_grad():
        made = {name: torch.empty(value.shape, dtype=value.dtype or dtype) if isinstance(value, Blank)
                else mode.fake_tensor_converter.from_real_tensor(mode, value, make_constant=True)
                if torch.is_tensor(value) else value for name, value in inputs.items()}
        call(module, **made)
    return ledger.peak


def resident(network: torch.nn.Module, training: TrainingConfig, base_precision: str) -> tuple[int, int]:
    """The frozen base's bytes as `base_precision` holds them (or the whole transformer, full), and
    the trainable weights' with AdamW's two states and the moving average (fp32 each)."""
    copies = 3 + (1 if training.optimizer.ema_decay else 0)  # weights, exp_avg, exp_avg_sq, average
    trainable = copies * sum(p.numel() * 4 for p in network.parameters() if p.requires_grad)
    return frozen_bytes(network, base_precision), trainable


def frozen_bytes(module: torch.nn.Module, base_precision: str) -> int:
    """A module's frozen weights and buffers as `base_precision` holds them: as built, or the
    frozen nn.Linear weights quantised as torchao holds them (a byte a weight; a row's fp32 scale,
    and int8's zero point: its Int8Tensor and Float8Tensor), the rest bf16."""
    frozen = [p for p in module.parameters() if not p.requires_grad]
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    if base_precision not in ("int8", "fp8"):
        return sum(p.numel() * p.element_size() for p in frozen) + buffers
    linear = [m for m in module.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    quantised = sum(m.weight.numel() + ROW_BYTES[base_precision] * m.out_features for m in linear)
    others = sum(p.numel() for p in frozen) - sum(m.weight.numel() for m in linear)
    return quantised + 2 * others + buffers


def device_memory(device: torch.device) -> int:
    """The memory a training device has for this run: what an accelerator has free (another
    process may hold some of it), or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def parse_memory(text: str) -> int:
    """`24GiB`, `24GB`, `80G` or `24` (GiB) in bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*(GiB|GB|G|MiB|MB)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"--gpu-memory {text!r}: give a size such as 24GiB, 24GB or 80G")
    unit = (match.group(2) or "GiB").lower()
    scale = {"gib": GIB, "g": GIB, "gb": 1e9, "mib": 2**20, "mb": 1e6}[unit]
    return int(float(match.group(1)) * scale)


def plan_text(plan: dict[str, Any]) -> str:
    """The plan as `precast plan` prints it: the shapes, a row a setting, the choice and what is
    alive at its peak."""
    first = plan["footprints"][0]
    shapes, gib = plan["shapes"], lambda nbytes: f"{nbytes / GIB:.2f}"
    lengths = ", ".join(f"{name} {length}" for name, length in shapes.lengths.items())
    paired = " (its references' among them)" if shapes.references else ""
    lines = [f"{plan['family']}: micro-batches of {first.batch} × latents {'×'.join(map(str, shapes.latent))} "
             f"({first.tokens:,} image tokens a sample{paired}), captions of {lengths} positions",
             f"card: {gib(plan['gpu_memory'])} GiB, of which {gib(RESERVE)} GiB is left to the CUDA context and "
             f"allocator; GiB below ('streamed': blocks_to_swap of the transformer's {len(first.blocks)} blocks)",
             "",
             f"{'base':6} {'checkpointing':14} {'streamed':>8} {'weights':>8} {'trained':>8} {'step':>8} "
             f"{'total':>8} {'host':>7}  fits"]
    for f in plan["footprints"]:
        lines.append(f"{f.base_precision:6} {f.checkpointing:14} {f.blocks_to_swap:>8} {gib(f.device_weights):>8} "
                     f"{gib(f.trainable):>8} {gib(f.step):>8} {gib(f.total):>8} {gib(f.host):>7}  "
                     f"{'yes' if f.fits(plan['gpu_memory']) else 'no'}")
    lines += ["", "the encode stages, each alone on its device (text_encoding's and latent_encoding's settings):"]
    for e in plan["encoders"]:
        what = (f"{e.batch} captions of {e.length} positions" if e.name != "vae" else
                f"{e.batch} samples of {e.length} px")
        lines.append(f"  {e.name:12} {e.setting:24} weights {gib(e.weights)} + a call of {what} {gib(e.call)} = "
                     f"{gib(e.total)} GiB  {'fits' if e.fits(plan['gpu_memory']) else 'does not fit'}")
    choice = plan["choice"]
    lines.append("")
    if choice is None:
        lines.append(f"nothing fits at base_precision {first.base_precision}, even with every block streamed: a "
                     f"row above that fits names the base to use, or a smaller training.batch_size / batch_tokens, "
                     f"latent_encoding.resolution or frames")
        return "\n".join(lines)
    lines.append(f"choice: training.gradient_checkpointing {choice.checkpointing}, blocks_to_swap "
                 f"{choice.blocks_to_swap} (base_precision {choice.base_precision}): {gib(choice.total)} GiB")
    if choice.blocks_to_swap:
        cost = ", ".join(f"{link} {choice.seconds_streaming(rate):.2f} s" for link, rate in LINKS.items())
        lines.append(f"streaming copies {2 * choice.streamed / 1e9:.1f} GB a step to the device, where a block's "
                     f"compute does not hide it: {cost}")
    lines.append(f"alive at its peak (op, module, MiB; the largest tensor {choice.largest / 2**20:,.1f} MiB):")
    lines += [f"  {op:44} {module:48} {nbytes / 2**20:9,.1f}" for op, module, nbytes in choice.ledger]
    return "\n".join(lines)
