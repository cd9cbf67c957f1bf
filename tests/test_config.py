"""The config schema: YAML files, --set overrides and the Prefect form are one model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prefect.utilities.callables import parameter_schema

from configs.schema import CONFIG_DIR, QUICKSTART, PipelineConfig, Section, load_config
from flows.pipeline import pipeline, stage

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_yaml_config_validates(path):
    assert isinstance(load_config(path), PipelineConfig)


def test_overrides_are_typed_and_unknown_keys_are_refused():
    config = load_config(QUICKSTART, ["training.steps=7", "training.sample_prompts=[a, b]", "storage.root=s3://b/p"])
    assert config.training.steps == 7 and config.training.sample_prompts == ["a", "b"]
    assert config.storage.root == "s3://b/p"
    with pytest.raises(ValueError, match="trainig"):
        load_config(QUICKSTART, ["trainig.steps=7"])
    with pytest.raises(ValueError, match="resolution"):
        load_config(QUICKSTART, ["latent_encoding.resolution=32"])


def test_a_config_without_a_model_or_sources_is_refused_naming_the_field(tmp_path):
    """No demo defaults: a production config that forgets the model or the data must not quietly
    train the demo's tiny model on the demo's images."""
    full = yaml.safe_load(QUICKSTART.read_text())
    for section, field in (("model", "path"), ("dataset", "sources")):
        config = {**full, section: {key: value for key, value in full[section].items() if key != field}}
        path = tmp_path / "my-run.yaml"
        path.write_text(yaml.safe_dump(config))
        with pytest.raises(ValueError, match=f"my-run.yaml: {section}.{field}: Field required"):
            load_config(path)
    with pytest.raises(ValueError, match="dataset.sources: List should have at least 1 item"):
        load_config(QUICKSTART, ["dataset.sources=[]"])


def test_a_clip_policy_no_video_could_follow_is_refused_naming_the_field():
    refused = {
        ("dataset.video.frames=17", "dataset.video.frame_buckets=[9, 33]"):
            "dataset.video: .*frame_buckets \\[33\\]: clip lengths for videos too short for frames \\(17\\)",
        ("dataset.video.frames=81", "dataset.video.max_seconds=3"):
            "dataset.video: .*a clip of 81 frames at fps 16 takes 5.0625 s of video, more than max_seconds \\(3\\)",
        ("dataset.video.frames=17", "dataset.video.max_seconds=1"): "takes 1.0625 s",  # 17 frames at 16 fps: 17/16 s
    }
    for overrides, message in refused.items():
        with pytest.raises(ValueError, match=message):
            load_config(QUICKSTART, list(overrides))
    video = load_config(QUICKSTART, ["dataset.video.fps=null", "dataset.video.max_seconds=3"]).dataset.video
    assert video.fps is None  # the video's own rate: not known up front
    # musubi-tuner's target_frames and diffusion-pipe's frame_buckets list the longest length too
    assert load_config(QUICKSTART, ["dataset.video.frames=33", "dataset.video.frame_buckets=[17, 33]"])


def test_training_modes_that_do_not_fit_together_are_refused_by_name():
    config = load_config(QUICKSTART, ["training.gradient_checkpointing=true"])  # the former boolean reads as recompute
    assert config.training.gradient_checkpointing == "recompute"
    assert load_config(QUICKSTART, ["training.gradient_checkpointing=false"]).training.gradient_checkpointing == "none"
    refused = {
        ("training.base_precision=bf16",): "base_precision bf16 needs mixed_precision bf16 \\(it is no\\)",
        ("training.base_precision=fp16", "training.mixed_precision=bf16"): "base_precision fp16 needs mixed_precision fp16",
        ("training.base_precision=int8", "training.method=full"): "base_precision int8 is for LoRA",
        ("training.batch_tokens=1024", "training.global_batch=8"): "set global_batch or batch_tokens, not both",
        ("training.gradient_checkpointing=sometimes",): "gradient_checkpointing",
    }
    for overrides, message in refused.items():
        with pytest.raises(ValueError, match=message):
            load_config(QUICKSTART, list(overrides))


def test_every_field_has_a_description():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, Section):
                walk(annotation, f"{prefix}{name}.")

    walk(PipelineConfig)


def test_flow_parameters_are_the_config_schema():
    schema = parameter_schema(pipeline).model_dump_for_openapi()
    assert schema["properties"]["config"]["$ref"].endswith("PipelineConfig")
    definitions = schema["definitions"]
    assert "description" in definitions["TrainingConfig"]["properties"]["rank"]
    assert parameter_schema(stage).model_dump_for_openapi()["properties"]["name"]["enum"] == [
        "ingest", "encode-text", "encode-latents", "manifest", "train"]


def test_prefect_yaml_entrypoints_exist():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        module, _, name = deployment["entrypoint"].partition(":")
        assert (ROOT / module).exists() and f"def {name}(" in (ROOT / module).read_text()
        assert deployment["enforce_parameter_schema"] is True


def test_gpu_work_pool_templates_request_gpus_and_define_every_variable():
    import json
    import re

    for name in ["kubernetes-gpu.json", "docker-gpu.json"]:
        template = json.loads((ROOT / "infra" / "work-pools" / name).read_text())
        used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", json.dumps(template["job_configuration"])))
        assert used <= set(template["variables"]["properties"]), (name, used - set(template["variables"]["properties"]))
        assert template["variables"]["properties"]["image"]["default"] == "precast-gpu-worker:latest"
    k8s = json.loads((ROOT / "infra" / "work-pools" / "kubernetes-gpu.json").read_text())
    container = k8s["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    docker = json.loads((ROOT / "infra" / "work-pools" / "docker-gpu.json").read_text())
    assert docker["variables"]["properties"]["container_create_kwargs"]["default"]["device_requests"]
