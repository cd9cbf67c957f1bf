"""A trained adapter where users run it: diffusers' pipeline as the README shows, and ComfyUI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from diffusers import PixArtTransformer2DModel
from peft import PeftModel
from safetensors.torch import load_file

from flows.cli import main
from storage.store import Store
from tests.comfyui_pixart import apply_lora, comfy_weights, lora_key_map
from tasks.runner import run_direct


@pytest.fixture(scope="module", params=["lora", "dora", "loha", "lokr"])
def trained(request, tmp_path_factory, tiny_models, demo_data):
    from configs.schema import PipelineConfig

    root = tmp_path_factory.mktemp(f"export-{request.param}")
    # alpha != rank: an export that lost the alphas would scale the update wrongly in ComfyUI
    config = PipelineConfig.model_validate({
        "storage": {"root": str(root / "store")}, "model": {"path": tiny_models},
        "dataset": {"sources": [{"path": demo_data}], "shard_size": 10},
        "latent_encoding": {"resolution": 256}, "text_encoding": {"dtype": "fp32"},
        "training": {"lora": {"rank": 4, "alpha": 2, "dora": request.param == "dora",
                              "adapter": "lora" if request.param == "dora" else request.param}, "steps": 3, "batch_size": 2,
                     "learning_rate": 1e-2, "sample_prompts": [], "checkpoint_every": 0}})
    return config, run_direct(config)["train"]


def test_the_readme_snippet_loads_the_adapter_into_the_pipeline(trained, tiny_models):
    config, run = trained
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "PixArtSigmaPipeline" in block)
    scope = {"MODEL": tiny_models, "ADAPTER": Store(config.storage).path(Store(config.storage).key(run["url"]))}
    exec(snippet, scope)
    assert scope["image"].size == (256, 256)
    base = PixArtTransformer2DModel.from_pretrained(tiny_models, subfolder="transformer").state_dict()
    merged = scope["pipe"].transformer.state_dict()
    assert any(not torch.equal(merged[k], base[k]) for k in base)  # the adapter changed the weights


def test_comfyui_export_patches_what_peft_merges(trained, tiny_models, tmp_path, capsys):
    config, run = trained
    out = tmp_path / "lora.safetensors"
    if config.training.lora.dora:  # ComfyUI divides a DoRA's magnitudes by other norms than PEFT trained with
        assert main(["export", run["run"], "--format", "comfyui", "--out", str(out)]) == 1 and not out.exists()
        assert "DoRA, whose magnitudes ComfyUI's LoRA loader applies against" in capsys.readouterr().err
        return
    if config.training.lora.adapter != "lora":  # the pipelines' load_lora_weights reads LoRA alone
        kind = {"loha": "LoHa", "lokr": "LoKr"}[config.training.lora.adapter]
        assert main(["export", run["run"], "--format", "diffusers", "--out", str(tmp_path / "d.safetensors")]) == 1
        assert f"the adapter is a {kind}, and PixArtSigmaPipeline's load_lora_weights reads LoRA weights alone" \
            in capsys.readouterr().err
    assert main(["export", run["run"], "--format", "comfyui", "--out", str(out)]) == 0
    lora = load_file(out)
    base = PixArtTransformer2DModel.from_pretrained(tiny_models, subfolder="transformer")
    depth, hidden = base.config.num_layers, base.config.num_attention_heads * base.config.attention_head_dim
    before = comfy_weights(base.state_dict(), depth, hidden)
    weights = comfy_weights(base.state_dict(), depth, hidden)
    assert apply_lora(weights, lora, lora_key_map(depth, hidden)) == []  # every key is read
    store = Store(config.storage)
    merged = PeftModel.from_pretrained(base, store.path(store.key(run["url"]))).merge_and_unload()
    expected = comfy_weights(merged.state_dict(), depth, hidden)
    assert set(weights) == set(expected)
    assert any(not torch.equal(expected[k], before[k]) for k in before)  # the adapter changes them
    for key in weights:
        torch.testing.assert_close(weights[key], expected[key], rtol=1e-5, atol=1e-6)


def test_export_refuses_a_run_without_an_adapter_and_an_unknown_format(trained, tmp_path):
    _, run = trained
    with pytest.raises(SystemExit):
        main(["export", run["run"], "--format", "kohya", "--out", str(tmp_path / "x")])
    from tasks.runs.export import export_adapter

    with pytest.raises(FileNotFoundError, match="is not a finished run"):
        export_adapter(str(tmp_path / "runs" / "nothing"), "comfyui")
