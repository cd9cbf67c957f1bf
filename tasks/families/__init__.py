"""Model families: what precast trains, each in its own module, chosen by the model folder.

`family_of(model)` reads the `_class_name` of the folder's `model_index.json` (the file diffusers'
`DiffusionPipeline.from_pretrained` reads to choose a pipeline) and returns the family that reads
that pipeline. The spec every family fills in is `tasks.families.spec.Family`.
"""

from __future__ import annotations

import functools
import json
import os

from configs.schema import ModelConfig
from storage.fingerprint import check_hub_id
from tasks.families import chroma, flux, pixart, sd3, wan
from tasks.families.spec import Family

__all__ = ["FAMILIES", "Family", "family_named", "family_of"]

FAMILIES: tuple[Family, ...] = (*pixart.FAMILIES, *flux.FAMILIES, *sd3.FAMILIES, *chroma.FAMILIES, *wan.FAMILIES)
# the pipeline of runs published before their lineage recorded one: precast then trained one family
UNRECORDED_PIPELINE = pixart.PixArtSigma.pipelines[0]


def family_of(model: ModelConfig) -> Family:
    return family_named(pipeline_of(model.path, model.revision), model.path)


def family_named(pipeline: str, path: str = "the model") -> Family:
    for family in FAMILIES:
        if pipeline in family.pipelines:
            return family
    known = ", ".join(f"{name} ({family.name})" for family in FAMILIES for name in family.pipelines)
    raise ValueError(f"model.path {path}: its model_index.json names {pipeline}, which precast does not train; "
                     f"it trains {known}")


@functools.lru_cache(maxsize=16)
def pipeline_of(path: str, revision: str | None) -> str:
    """The pipeline class a model folder (or hub id, through the hub cache) names."""
    if os.path.exists(path):
        index = os.path.join(path, "model_index.json")
        if not os.path.isfile(index):
            raise FileNotFoundError(f"model.path {path}: has no model_index.json, which names the model's pipeline "
                                    f"(a model folder in the hub layout has one)")
    else:
        from huggingface_hub import hf_hub_download

        check_hub_id(path)
        try:  # the hub cache has it once the model was fingerprinted (storage.fingerprint.hub_files)
            index = hf_hub_download(path, "model_index.json", revision=revision)
        except Exception as error:
            raise FileNotFoundError(f"model.path {path}: its model_index.json, which names the model's pipeline, "
                                    f"could not be read ({type(error).__name__}: {error})") from error
    with open(index) as handle:
        return json.load(handle)["_class_name"]
