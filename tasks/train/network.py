"""The trained network and everything model-specific about it: LoRA layers on the family's frozen
transformer, or the whole transformer (`trainable_network`); which of its weights train and what a
checkpoint keeps of them (`Weights`); where backward's activations wait (`kept_activations`); the
module the family's sampling pipeline takes (`sampling_module`: PEFT's wrapper unwrapped); and
the name of the run's output folder (`output_name`: a PEFT adapter or a diffusers transformer).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from tasks.families import Family

log = logging.getLogger(__name__)


def trainable_network(model: ModelConfig, family: Family, training: TrainingConfig, init: dict | None = None,
                      transformer: torch.nn.Module | None = None):
    """`model`'s transformer (of `family`) with LoRA layers (only they train, in fp32; from `init`'s weights when
    given) on the frozen base held in `base_precision`, or the whole transformer for `method:
    full`; gradient checkpointing and compiled blocks as configured. Seeded: every process builds
    the same one. `transformer`: the model's, already built in the base's dtype (the memory plan's,
    on the meta device), instead of loaded."""
    torch.manual_seed(training.seed)
    if transformer is None:
        transformer = family.denoiser.load(model, base_dtype(training))
    if training.gradient_checkpointing != "none":
        transformer.enable_gradient_checkpointing()
    if training.method == "full":
        network = transformer.requires_grad_(True)
    else:
        from peft import get_peft_model, set_peft_model_state_dict

        transformer.requires_grad_(False)
        if training.base_precision in ("int8", "fp8"):
            from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

            quantize_(transformer, {"int8": Int8WeightOnlyConfig, "fp8": Float8WeightOnlyConfig}[training.base_precision]())
        with warnings.catch_warnings():  # int8/fp8: PEFT warns that merging needs the quantisation recipe; never merged here
            warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated without")
            # the adapter in fp32 on any base (autocast_adapter_dtype)
            network = get_peft_model(transformer, adapter_config(training, family.denoiser.target_modules(training)))
        if init is not None:
            try:
                loaded = set_peft_model_state_dict(network, init["tensors"])
            except RuntimeError as error:
                raise ValueError(f"init_from {init['url']} does not fit this LoRA config: {error}") from error
            # PEFT loads what fits and leaves the rest: a LoRA's pairs into a DoRA would keep the
            # magnitudes of a zero update, a DoRA's magnitudes would be dropped from a LoRA
            trained = {name for name, parameter in network.named_parameters() if parameter.requires_grad}
            if (missing := sorted(trained & set(loaded.missing_keys))) or loaded.unexpected_keys:
                what = (f"lacks {len(missing)} weights this run trains ({missing[0]}, ...)" if missing else
                        f"has {len(loaded.unexpected_keys)} this run has no place for ({loaded.unexpected_keys[0]}, ...)")
                raise ValueError(f"init_from {init['url']} does not fit this LoRA config: its adapter {what}; "
                                 f"adapters of other kinds (a LoRA, a DoRA: training.lora.dora, a LoHa or a LoKr: "
                                 f"training.lora.adapter) do not continue each other")
            log.info("continuing from %s", init["url"])
    if training.compile:  # each block once per input shape; the rest of the model stays eager
        for block in family.denoiser.blocks(transformer):
            block.compile()
    return network


def adapter_config(training: TrainingConfig, target_modules: list[str]):
    """PEFT's config of the run's adapter (`training.lora`): a LoRA (or DoRA), a LoHa or a LoKr."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    lora = training.lora
    if lora.adapter == "loha":
        return LoHaConfig(r=lora.rank, alpha=lora.alpha, rank_dropout=lora.dropout, target_modules=target_modules)
    if lora.adapter == "lokr":
        return LoKrConfig(r=lora.rank, alpha=lora.alpha, rank_dropout=lora.dropout, decompose_factor=lora.factor,
                          target_modules=target_modules)
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target_modules,
                      bias="none", use_dora=lora.dora)


def adapter_form(training: TrainingConfig, target_modules: list[str]) -> dict[str, Any] | None:
    """What names and shapes an adapter's weights (which finished runs `init_from: latest` can
    continue): its kind, rank, LoKr factor and the modules it adapts; None for a full fine-tune."""
    if training.method != "lora":
        return None
    lora = training.lora
    return {"adapter": lora.adapter, "dora": lora.dora, "rank": lora.rank, "factor": lora.factor,
            "target_modules": sorted(target_modules)}


def base_dtype(training: TrainingConfig) -> torch.dtype | None:
    """The dtype the frozen base is loaded in: bf16 or fp16 as `base_precision` says, else
    `from_pretrained`'s own (fp32; int8 and fp8 are quantised from it)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(training.base_precision)


def trainable_state(network: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights that train, by parameter name (the frozen base is the model's own)."""
    return {name: p.detach() for name, p in network.named_parameters() if p.requires_grad}


class Weights:
    """The network's trainable weights as a checkpoint keeps them (`weights/<parameter name>`)."""

    def __init__(self, network: torch.nn.Module):
        self.network = network

    def state_dict(self) -> dict[str, Any]:
        return trainable_state(self.network)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, parameter in trainable_state(self.network).items():
            parameter.copy_(state[name])


def kept_activations(checkpointing: str, device: torch.device):
    """Where the tensors backward needs wait during forward: on the device, or with `offload` in
    host memory (pinned beside an accelerator, copied there and back without holding the host:
    torch's saved-tensor hooks). With checkpointing these are the blocks' inputs only."""
    if checkpointing == "offload":
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
    return contextlib.nullcontext()


def attention_kernels():
    """SDPA's kernels in the order a training step asks for them: flash, then memory-efficient
    (neither keeps a score matrix for backward), cuDNN's, math last, each used where the one before
    it cannot serve. PyTorch puts cuDNN's first on Hopper with a recent cuDNN, whose backward keeps
    workspaces that grow with the square of the tokens: an 81-frame Wan 2.1 1.3B step (32,760
    tokens) ran out of 80 GB on an H100, where the memory plan counts 14.6 GiB with a flash kernel
    (docs/benchmarks.md)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH], set_priority=True)


def sampling_module(network: torch.nn.Module, training: TrainingConfig) -> torch.nn.Module:
    """The transformer the family's pipeline samples with: under LoRA, the model inside PEFT's
    wrapper (its LoRA layers applied, not merged)."""
    return network.base_model.model if training.method == "lora" else network


def output_name(training: TrainingConfig) -> str:
    """The run's weights folder: `adapter` (PEFT format) or `transformer` (the whole transformer in
    diffusers format)."""
    return "adapter" if training.method == "lora" else "transformer"
