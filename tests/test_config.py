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


# --- identities: each field declares whether it counts -------------------------------------------
def _other_values(section: type[Section], name: str) -> list:
    """Values of field `name` other than its default, to try (the first that validates is used)."""
    from typing import Literal, get_args, get_origin

    field = section.model_fields[name]
    default = field.get_default(call_default_factory=True)
    lists = [["to_q"], ["tensorboard", "mlflow"], ["a prompt"], [17]]
    if get_origin(field.annotation) is list:
        return lists
    if get_origin(field.annotation) is Literal:
        return [value for value in get_args(field.annotation) if value != default]
    values = [] if default is None else [None]
    for kind in get_args(field.annotation) or (field.annotation,):
        if get_origin(kind) is Literal:
            values += list(get_args(kind))
        elif kind is bool:
            values.append(not default)
        elif kind in (int, float):
            base = default or 1
            values += [kind(base * 2), kind(base + 1), kind(base / 2) if kind is float else base - 1, 8, 16]
        elif kind is str:
            values += ["cpu", "latest", "x"]
        elif get_origin(kind) is list:
            values += lists
    return [value for value in values if value != default]


def _identity_of(section: Section, tiny_models: str) -> object:
    from configs.schema import DatasetConfig, LatentEncodingConfig, ModelConfig, TextEncodingConfig
    from tasks import identity
    from tasks.families import family_of

    model = ModelConfig(path=tiny_models)
    if isinstance(section, DatasetConfig):
        return identity.config_hash(section)
    if isinstance(section, TextEncodingConfig):
        return identity.text_fingerprints(model, section)
    if isinstance(section, LatentEncodingConfig):
        return identity.vae_fingerprint(model, section)
    return identity.run_id_for("m" * 20, model, section, family_of(model))


def test_every_field_an_identity_is_made_of_declares_whether_it_counts_and_the_identity_follows(tiny_models):
    """Every field of the sections identities hash says, beside it, whether it counts (a field
    added without saying so fails here and in the first identity made); and each identity changes
    with a field exactly when that field's declaration says it counts."""
    from pydantic import Field, ValidationError

    from configs.schema import DatasetConfig, TrainingConfig
    from tasks.identity import DECLARED, counted, declaration

    for section in DECLARED:
        for name in section.model_fields:
            declaration(section, name)

    class Later(TrainingConfig):
        later: int = Field(0, description="a field added without a declaration")

    with pytest.raises(TypeError, match=r"Later\.later declares no identity rule"):
        counted(Later())

    bases = {section: section.model_validate({"sources": [{"path": "/data"}]} if section is DatasetConfig else {})
             for section in DECLARED if section.__name__ not in ("SourceConfig", "VideoConfig")}
    untried = []
    for section, base in bases.items():
        before = _identity_of(base, tiny_models)
        nested = {"sources": "SourceConfig", "video": "VideoConfig"} if section is DatasetConfig else {}
        fields = [(name, None) for name in section.model_fields if name not in nested]
        for outer, inner_name in nested.items():
            inner = next(kind for kind in DECLARED if kind.__name__ == inner_name)
            fields += [(outer, name) for name in inner.model_fields]
        for name, inner in fields:
            for value in (_other_values(section, name) if inner is None else
                          _other_values(next(k for k in DECLARED if k.__name__ == nested[name]), inner)):
                raw = base.model_dump()
                if inner is None:
                    raw[name] = value
                elif name == "sources":
                    raw["sources"] = [{**raw["sources"][0], inner: value}]
                else:
                    raw["video"] = {**raw["video"], inner: value}
                try:
                    changed = section.model_validate(raw)
                    after = _identity_of(changed, tiny_models)
                except (ValidationError, ValueError):
                    continue
                where, field = (changed, name) if inner is None else (
                    changed.sources[0] if name == "sources" else changed.video, inner)
                rule = declaration(type(where), field)
                counts = (rule.applies(where, field) if rule.through is None else
                          getattr(changed, rule.through) != getattr(base, rule.through)) and (
                    inner is None or declaration(section, name).applies(changed, name))
                assert (after != before) == counts, f"{type(where).__name__}.{field} = {value!r}: declared " \
                                                    f"{'counted' if counts else 'not counted'}"
                break
            else:
                untried.append(f"{section.__name__}.{name}{'.' + inner if inner else ''}")
    assert untried == [], untried


def test_the_declared_rules_give_every_identity_the_rules_before_them_gave(tiny_models, monkeypatch):
    """Identities made by the declarations beside the fields are those the rules written out in
    tasks/identity.py gave (computed at 7e61420, the model's files held fixed): no cache is
    encoded again and no run retrained for the move."""
    from configs.schema import DatasetConfig, LatentEncodingConfig, ModelConfig, TextEncodingConfig, TrainingConfig
    from tasks import identity
    from tasks.families import family_of

    monkeypatch.setattr(identity, "component_fingerprint",
                        lambda path, folders, revision=None: {folder: {"f": "0" * 64} for folder in folders})
    model = ModelConfig(path=tiny_models)
    family = family_of(model)
    datasets = [
        {"sources": [{"path": "/d"}]},
        {"sources": [{"path": "/d", "format": "jsonl", "caption_column": "c"}], "shard_size": 9,
         "read_concurrency": 3, "partition_size": 7},
        {"sources": [{"path": "/d"}], "video": {"frames": 33}},
        {"sources": [{"path": "/d"}], "video": {"frames": 33, "frame_buckets": [17, 9]}},
        {"sources": [{"path": "/d"}, {"path": "s3://b/x"}], "min_side": 32, "max_pixels": 1000000,
         "video": {"fps": None, "clips": "uniform", "max_clips": 3}}]
    texts = [{}, {"dtype": "bf16"}, {"max_length": 77, "offload": "model", "batch_tokens": 99, "numerics_samples": 3,
                                     "device": "cpu"}, {"caption_preprocessing": "none"}]
    latents = [{}, {"crop": "random", "crop_seed": 3}, {"crop_seed": 5, "batch_size": 2, "slicing": True, "device": "cpu"},
               {"resolution": 512, "flip": True, "tiling": True, "dtype": "bf16", "storage_dtype": "fp32",
                "posterior": "mean"}]
    trainings = [{}, {"timestep_sampling": "mode", "mode_scale": 1.5}, {"mode_scale": 1.5}, {"true_cfg_scale": 2.0},
                 {"image_to_video_warmup": 5}, {"device": "cpu", "checkpoint_every": 3, "compile": True,
                                                "trackers": ["mlflow"], "sample_fps": 8},
                 {"method": "full", "rank": 4, "alpha": 4, "target_modules": ["to_q"], "global_batch": 8,
                  "processes": 2},
                 {"init_from": "latest", "steps": 7, "batch_tokens": 4096, "gradient_accumulation": 2}]
    made = {
        "datasets": [identity.config_hash(DatasetConfig.model_validate(raw)) for raw in datasets],
        "texts": [identity.text_fingerprints(model, TextEncodingConfig.model_validate(raw))["t5"] for raw in texts],
        "latents": [identity.vae_fingerprint(model, LatentEncodingConfig.model_validate(raw)) for raw in latents],
        "runs": [identity.run_id_for("m" * 20, model, TrainingConfig.model_validate(raw), family) for raw in trainings]
        + [identity.run_id_for("m" * 20, model, TrainingConfig(init_from="file:///x"), family, {"sha256": "ab"})]}
    assert made == {
        "datasets": ["d85fa3f5361c3402debf", "b0f2ae569a79f17cdc7c", "508d60aedcbf81a1ee1d", "890a4965d549567a3307",
                     "0cad8a5694b0104efe96"],
        "texts": ["635d1cbeabe26b8233b8", "635d1cbeabe26b8233b8", "28bef8c6000b2455e63d", "9418ccfe2d3e5548a273"],
        "latents": ["d2bb7a7fb52d3df6cf9e", "b7abca6714a2355d1416", "d2bb7a7fb52d3df6cf9e", "235ee892e2cbe96d5936"],
        "runs": ["43d17c05a56550166f5f", "e7a323e8faf735abe7f9", "43d17c05a56550166f5f", "e6f7efd756b7d6bbef32",
                 "453435a0223a23400bab", "43d17c05a56550166f5f", "48a8a7c73898f157dddc", "94e5baa6bb4f3c4f97eb",
                 "121866ef5af252a407cd"]}
