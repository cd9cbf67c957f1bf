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
    config = load_config(QUICKSTART, ["training.steps=7", "training.samples.prompts=[a, b]", "storage.root=s3://b/p"])
    assert config.training.steps == 7 and config.training.samples.prompts == ["a", "b"]
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
        ("training.batch_tokens=1024", "training.distribution.global_batch=8"):
            "set global_batch or batch_tokens, not both",
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
    assert "description" in definitions["LoraConfig"]["properties"]["rank"]
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
# what a field's other values need of fields that count in no identity (blocks_to_swap: checkpointing)
# fields the schema takes only beside another setting: that setting, in the base as in the change
COMPANIONS = {"blocks_to_swap": {"gradient_checkpointing": "recompute"}, "lora.factor": {"adapter": "lokr"},
              "sources.mask_path": {"masks": "files", "mask_path": "/masks"}, "sources.mask_column": {"masks": "column"},
              "sources.reference_path": {"references": "files", "reference_path": "/references"},
              "sources.reference_column": {"references": "column"}}


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
            values += [kind(base * 2), kind(base + 1), kind(base / 2) if kind is float else base - 1, 8, 16, 1024]
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
    if isinstance(section, DatasetConfig):  # what ingest reads, and how training draws from it (the manifest's)
        return identity.config_hash(section), identity.mix_identity(section)
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

    from configs.schema import (
        DatasetConfig, LatentEncodingConfig, SourceConfig, TextEncodingConfig, TrainingConfig, VideoConfig, groups_of,
    )
    from tasks.identity import DECLARED, counted, declaration

    for section in DECLARED:
        for name in section.model_fields:
            declaration(section, name)

    class Later(TrainingConfig):
        later: int = Field(0, description="a field added without a declaration")

    with pytest.raises(TypeError, match=r"Later\.later declares no identity rule"):
        counted(Later())

    tops = (DatasetConfig, TextEncodingConfig, LatentEncodingConfig, TrainingConfig)
    assert set(DECLARED) == {*tops, SourceConfig, VideoConfig, *groups_of(TrainingConfig).values()}
    untried = []
    for section in tops:
        base = section.model_validate({"sources": [{"path": "/data"}]} if section is DatasetConfig else {})
        before = _identity_of(base, tiny_models)
        # a field of its own (outer None), or of a section inside it: dataset.sources[0], training.lora, …
        inside = {name: next(kind for kind in DECLARED if kind.__name__ == inner) for name, inner in
                  {"sources": "SourceConfig", "video": "VideoConfig"}.items() if section is DatasetConfig}
        inside |= groups_of(section)
        fields = [(None, name) for name in section.model_fields if name not in inside]
        fields += [(outer, name) for outer, kind in inside.items() for name in kind.model_fields]
        for outer, name in fields:
            companion = COMPANIONS.get(f"{outer}.{name}" if outer else name, {})
            with_companion = base.model_dump()
            if outer is None:
                with_companion.update(companion)
            elif outer == "sources":
                with_companion["sources"] = [{**with_companion["sources"][0], **companion}]
            else:
                with_companion[outer] = {**with_companion[outer], **companion}
            field_base = section.model_validate(with_companion) if companion else base
            field_before = _identity_of(field_base, tiny_models) if companion else before
            for value in _other_values(inside[outer] if outer else section, name):
                raw = field_base.model_dump()
                if outer is None:
                    raw[name] = value
                elif outer == "sources":
                    raw["sources"] = [{**raw["sources"][0], name: value}]
                else:
                    raw[outer] = {**raw[outer], name: value}
                try:
                    changed = section.model_validate(raw)
                    after = _identity_of(changed, tiny_models)
                except (ValidationError, ValueError):
                    continue
                where = (changed if outer is None else changed.sources[0] if outer == "sources"
                         else getattr(changed, outer))
                rule = declaration(type(where), name)
                counts = (rule.applies(where, name) if rule.through is None else
                          getattr(changed, rule.through) != getattr(field_base, rule.through)) and (
                    outer is None or declaration(section, outer).applies(changed, outer))
                assert (after != field_before) == counts, f"{type(where).__name__}.{name} = {value!r}: declared " \
                                                    f"{'counted' if counts else 'not counted'}"
                break
            else:
                untried.append(f"{section.__name__}.{outer + '.' if outer else ''}{name}")
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


def test_training_settings_written_flat_as_before_the_grouping_load_as_the_same_config(tmp_path):
    """Configs and deployments written before training's settings were grouped (training.rank,
    training.sample_prompts) load as the grouped ones (training.lora.rank, training.samples.prompts),
    mixed spellings too; a setting given both ways is refused by both names."""
    from configs.schema import TrainingConfig, flat, groups_of

    names = [name for kind in groups_of(TrainingConfig).values() for name in kind.flat_names().values()]
    assert len(names) == len(set(names)) and not set(names) & set(TrainingConfig.model_fields) - {"optimizer"}
    grouped = TrainingConfig.model_validate({
        "lora": {"rank": 8, "dropout": 0.1, "target_modules": ["to_q"]},
        "optimizer": {"name": "adamw8bit", "learning_rate": 1e-3, "warmup_steps": 3},
        "timesteps": {"sampling": "mode", "mode_scale": 1.1}, "samples": {"prompts": ["a"], "every": 4, "fps": 8},
        "validation": {"samples": 2, "every": 5}, "distribution": {"processes": 2, "global_batch": 16},
        "tracking": {"trackers": ["mlflow"], "project": "p"}, "steps": 9})
    written_flat = flat(TrainingConfig, grouped.model_dump())
    assert written_flat["rank"] == 8 and written_flat["optimizer"] == "adamw8bit" and written_flat["sample_fps"] == 8
    assert TrainingConfig.model_validate(written_flat) == grouped
    assert TrainingConfig.model_validate({"rank": 8, "lora": {"alpha": 4}}).lora.model_dump() == {
        "rank": 8, "alpha": 4.0, "dropout": 0.0, "dora": False, "adapter": "lora", "factor": -1, "target_modules": None}
    with pytest.raises(ValueError, match="rank given twice: flat and as lora.rank"):
        TrainingConfig.model_validate({"rank": 8, "lora": {"rank": 4}})
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"dataset": {"sources": [{"path": "/d"}]}, "model": {"path": "/m"},
                                   "training": {"rank": 4, "sample_prompts": ["b"], "nodes": 2}}))
    loaded = load_config(old, ["training.alpha=2"])
    assert (loaded.training.lora.rank, loaded.training.lora.alpha, loaded.training.samples.prompts,
            loaded.training.distribution.nodes) == (4, 2.0, ["b"], 2)
