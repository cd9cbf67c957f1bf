"""Which run a train stage trains, and the adapter it starts from: the run folder is named by the
run id (the manifest, the training config, the transformer's weights and an explicit initial
adapter; `tasks.identity.run_id_for`), so the same run is never trained twice."""

from __future__ import annotations

import hashlib
import logging

from safetensors.torch import load as load_safetensors

from configs.schema import ModelConfig, TrainingConfig
from storage import layout
from storage.store import Store
from tasks.families import Family
from tasks.identity import run_id_for
from tasks.runs.folder import FinishedRun, run_record, weights_of
from tasks.train.network import adapter_form

log = logging.getLogger(__name__)


def initial_adapter(store: Store, model: ModelConfig, training: TrainingConfig, family: Family) -> dict | None:
    """The adapter `init_from` names: None, the newest finished run of this model in the store
    whose adapter has this run's form (`adapter_form`: a nightly run that changed its rank or kind
    starts anew, then continues its own; "latest"; None if there is none yet), or a finished run's
    (or its adapter's) URL. Returns its URL, sha256 and tensors."""
    if training.init_from == "none":
        return None
    if training.init_from == "latest":
        finished, other = [], 0
        form = adapter_form(training, family.denoiser.target_modules(training))
        for key in store.list(layout.RUNS):
            record = run_record(store, key)
            if record and weights_of(record) == "adapter" and record.get("model") == model.model_dump():
                if record.get("adapter_form", form) == form:  # runs published before it was recorded: as before
                    finished.append((record["finished"], key))
                else:
                    other += 1
        if not finished:
            log.info("init_from latest: no finished run of this model with this adapter yet (%d of other adapters: "
                     "kind, rank, LoKr factor or modules), starting from scratch", other)
            return None
        run = FinishedRun.read(store, max(finished)[1])
    else:
        try:
            run = FinishedRun.at(training.init_from, like=store.config)
        except (ValueError, FileNotFoundError) as error:
            raise FileNotFoundError(f"init_from: no adapter_model.safetensors at {training.init_from}: {error}") \
                from error
    _, data = run.adapter()  # the URL it was read from now, wherever the store was when it was published
    return {"url": run.store.url(layout.run_part(run.run, "adapter")), "sha256": hashlib.sha256(data).hexdigest(), "tensors": load_safetensors(data)}


def run_for(store: Store, model: ModelConfig, training: TrainingConfig, manifest_id: str,
            family: Family) -> tuple[str, dict | None]:
    """The run folder these inputs train, and the adapter an explicit `init_from` names (for
    "latest" the newest run is looked up only when training starts: it is not part of the id)."""
    explicit = training.init_from not in ("none", "latest")
    init = initial_adapter(store, model, training, family) if explicit else None
    return layout.run(run_id_for(manifest_id, model, training, family, init)), init
