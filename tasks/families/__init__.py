"""Model families: what precast trains, each in its own module, chosen by the model folder.

`family_of(model)` reads the folder's `model_index.json` (the file diffusers'
`DiffusionPipeline.from_pretrained` reads to choose a pipeline and its settings) and returns the
family that reads its `_class_name` with those settings (`Family.reads`: one pipeline may serve
several, as `WanPipeline` serves Wan 2.1 and Wan 2.2 TI2V). The record each family module declares is
`tasks.families.spec.Family`.
"""

from __future__ import annotations

import functools
import json
import os

from configs.schema import ModelConfig
from storage.fingerprint import check_hub_id, hub_cache_refused
from tasks.families import chroma, flux, flux2, kontext, pixart, qwenimage, sd3, wan, zimage
from tasks.families.spec import Family

__all__ = ["FAMILIES", "Family", "family_named", "family_of"]

FAMILIES: tuple[Family, ...] = (*pixart.FAMILIES, *flux.FAMILIES, *kontext.FAMILIES, *sd3.FAMILIES, *chroma.FAMILIES,
                                 *wan.FAMILIES, *zimage.FAMILIES, *qwenimage.FAMILIES, *flux2.FAMILIES)
# the pipeline of runs published before their lineage recorded one: precast then trained one family
UNRECORDED_PIPELINE = pixart.SIGMA.pipelines[0]


def family_of(model: ModelConfig) -> Family:
    index = model_index(model.path, model.revision)
    return family_named(index["_class_name"], model.path, index)


def family_named(pipeline: str, path: str = "the model", index: dict | None = None) -> Family:
    """The family of `pipeline` (with `index`'s settings; None: the first that reads it)."""
    for family in FAMILIES:
        if pipeline in family.pipelines and (index is None or family.reads(index)):
            return family
    known = ", ".join(f"{name} ({family.name})" for family in FAMILIES for name in family.pipelines)
    raise ValueError(f"model.path {path}: its model_index.json names {pipeline}, which precast does not train; "
                     f"it trains {known}")


def pipeline_of(path: str, revision: str | None) -> str:
    """The pipeline class a model folder (or hub id, through the hub cache) names."""
    return model_index(path, revision)["_class_name"]


def model_index(path: str, revision: str | None) -> dict:
    """A model folder's (or hub id's, through the hub cache) model_index.json."""
    return model_json(path, revision, "model_index.json", "which names the model's pipeline")


@functools.lru_cache(maxsize=32)
def model_json(path: str, revision: str | None, name: str, why: str) -> dict:
    """The JSON file `name` of a model folder (or hub id, through the hub cache); missing, an error
    that says `why` it is read."""
    if os.path.exists(path):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"model.path {path}: has no {name}, {why} (a model folder in the hub layout "
                                    f"has one)")
    else:
        from huggingface_hub import hf_hub_download

        check_hub_id(path)
        try:  # the hub cache has it once the model was fingerprinted (storage.fingerprint.hub_files)
            file = hf_hub_download(path, name, revision=revision)
        except Exception as error:
            if refused := hub_cache_refused(error):  # the machine's fault
                raise refused from error
            raise FileNotFoundError(f"model.path {path}: its {name}, {why}, could not be read "
                                    f"({type(error).__name__}: {error})") from error
    with open(file) as handle:
        return json.load(handle)
