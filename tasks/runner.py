"""The stage order and what passes between the stages, Prefect-free: `run_stages` runs
`configs.schema.STAGES` through an executor, one method per stage, handing each the records it
needs (`INPUTS`). The executor decides where a stage runs: `Direct`, every stage in this process
(`precast run --direct`, and the reference that benchmarks and test fixtures run), or the Prefect
flow's (flows/stages.py), which calls the same stage functions as tasks, with retries, caching,
placement and artifacts around them; both return the same records and the same outputs.

The encoders do not wait for the whole dataset: the latent encoder starts on each image shard as
ingest commits it (`Shards`), and the text encoders, which need the dataset's first shard for
their precision check, start beside it when ingest returns. What each stage writes does not
depend on the order: every shard is encoded alone and committed last.

    precast run configs/quickstart.yaml --direct
"""

from __future__ import annotations

import contextvars
import functools
import queue
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol

from configs.schema import STAGES, PipelineConfig, Stage
from storage import layout
from storage.store import Store
from tasks.encode.latents import check_latent_encoding, encode_latents_shard, latent_cache_record
from tasks.encode.text import encode_prompts, encode_text_shard, measure_numerics, text_cache_record
from tasks.ingest.stage import ingest
from tasks.manifest import build_manifest
from tasks.encode.models import encoding_work, model_loads
from tasks.identity import mix_identity, sample_prompts, text_fingerprints, vae_fingerprint
from tasks.records import (
    CacheRecord, DatasetRecord, EncodingWork, ManifestRecord, Record, Records, RunRecord,
)
from tasks.train import check_training, train


class NoDataset(RuntimeError):
    """What an encoder waiting for ingest's shards raises when ingest failed."""


class Shards:
    """The image shards an encoder is given: each new shard's URL as ingest commits it
    (`committed`), then the dataset's others (committed by earlier ingests) once ingest has its
    record (`finish`); iterated once, each URL once. `dataset()` and `urls()` wait for the record."""

    END = object()

    def __init__(self, store: Store):
        self.store, self.queue, self.record = store, queue.SimpleQueue(), Future()

    @classmethod
    def of(cls, store: Store, dataset: DatasetRecord) -> Shards:
        """The shards of a dataset ingested already."""
        shards = cls(store)
        shards.finish(dataset)
        return shards

    def committed(self, url: str) -> None:
        self.queue.put(url)

    def finish(self, dataset: DatasetRecord) -> None:
        for url in image_shard_urls(self.store, dataset):
            self.queue.put(url)
        self.record.set_result(dataset)
        self.queue.put(self.END)

    def fail(self, error: BaseException) -> None:
        """Ingest failed: an encoder waiting for shards stops (`NoDataset`)."""
        self.record.set_exception(NoDataset(f"ingest failed ({type(error).__name__}: {error}): no dataset to encode"))
        self.queue.put(self.END)

    def __iter__(self) -> Iterator[str]:
        seen = set()
        while (url := self.queue.get()) is not self.END:
            if url not in seen:
                seen.add(url)
                yield url
        self.dataset()  # raises ingest's error

    def dataset(self) -> DatasetRecord:
        return self.record.result()

    def urls(self) -> list[str]:
        """The dataset's shard URLs, in its order."""
        return image_shard_urls(self.store, self.dataset())

    def in_order(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Shard records (each with its `shard` id) in the dataset's order, however they arrived."""
        position = {shard["id"]: index for index, shard in enumerate(self.dataset()["shards"])}
        return sorted(records, key=lambda record: position[record["shard"]])


class Executor(Protocol):
    """Where the stages run: one method per stage (its name with `_` for `-`), given the records of
    the earlier stages it reads (`INPUTS`; the encoders get them as `Shards`)."""

    config: PipelineConfig
    store: Store

    def ingest(self, committed: Callable[[str], None] | None = None) -> DatasetRecord: ...

    def encode_text(self, shards: Shards) -> CacheRecord: ...

    def encode_latents(self, shards: Shards) -> CacheRecord: ...

    def manifest(self, dataset: DatasetRecord) -> ManifestRecord: ...

    def train(self, manifest: ManifestRecord) -> RunRecord: ...


# the earlier records each stage is given; the order the stages run in is STAGES'
INPUTS: dict[Stage, tuple[Stage, ...]] = {
    "ingest": (), "encode-text": ("ingest",), "encode-latents": ("ingest",), "manifest": ("ingest",),
    "train": ("manifest",),
}
ENCODERS: tuple[Stage, ...] = ("encode-text", "encode-latents")
# wraps each stage's call: `watch(name, call)` returns `call()` (the flow's logs a failing stage's name)
Watch = Callable[[Stage, Callable[[], Record]], Record]


def stage_method(executor: Executor, name: Stage) -> Callable[..., Record]:
    return getattr(executor, name.replace("-", "_"))


def run_stages(executor: Executor, until: Stage = "train", watch: Watch = lambda name, call: call()) -> Records:
    """Run the stages up to `until` through `executor`: ingest with the latent encoder taking each
    shard as it is committed, the text encoders beside it once the dataset is known, then the
    manifest and training. Both encoders run at once also on one CPU: an encoder waiting on the
    store leaves the cores to the other (docs/design.md, "Overlapping stages"). Returns
    each stage's record by name (every one has `url`, `amount` and `committed_at`) and `seconds`,
    each stage's wall time. A failure is raised once every stage already running has ended, the
    earliest stage's first."""
    records: Any = {"seconds": {}}
    names = STAGES[: STAGES.index(until) + 1]
    if "train" in names:  # what training would refuse, before ingest and the encoders work for it
        check_training(executor.config.model, executor.config.training)
    if "encode-latents" in names:
        check_latent_encoding(executor.config.model, executor.config.latent_encoding, executor.config.dataset)
    executor.store.check_reachable()  # only now: a refused config leaves nothing behind, not even the root
    shards = Shards(executor.store)

    def run(name: Stage, call: Callable[[], Record]) -> Record:
        started = time.perf_counter()
        records[name] = watch(name, call)
        records["seconds"][name] = time.perf_counter() - started
        return records[name]

    def ingest() -> None:
        try:
            shards.finish(run("ingest", partial(executor.ingest, shards.committed)))
        except BaseException as error:
            shards.fail(error)
            raise

    encoders = [partial(run, name, partial(stage_method(executor, name), shards)) for name in ENCODERS if name in names]
    together([ingest, *reversed(encoders)])
    for name in names[names.index("manifest"):] if "manifest" in names else ():
        run(name, partial(stage_method(executor, name), *[records[earlier] for earlier in INPUTS[name]]))
    records["seconds"] = {name: records["seconds"][name] for name in names}
    return records


def together(calls: list[Callable[[], Any]]) -> None:
    """Each call in a thread of its own (with a copy of this thread's context: a flow's task runs
    stay in its flow run), all at once; raises the first call's failure once all have ended."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(contextvars.copy_context().run, call) for call in calls]
    for future in futures:
        future.result()


def image_shard_urls(store: Store, dataset: DatasetRecord) -> list[str]:
    """The URLs of a dataset's image shards, what the encoders take."""
    return [store.url(layout.image_shard(shard["id"])) for shard in dataset["shards"]]


class Direct:
    """Every stage in this process, an encoder's shards one after another; the encoders'
    fingerprints computed once."""

    def __init__(self, config: PipelineConfig):
        self.config, self.store = config, Store(config.storage)
        self.text_fps = text_fingerprints(config.model, config.text_encoding)
        self.vae_fp = vae_fingerprint(config.model, config.latent_encoding)

    @functools.cached_property
    def prompts(self) -> list[str]:
        """The sample prompts as the caches name them (read once, by the stages that need them)."""
        return sample_prompts(self.config)

    def ingest(self, committed: Callable[[str], None] | None = None) -> DatasetRecord:
        return ingest(self.config.storage, self.config.dataset, committed=committed)

    def encode_text(self, shards: Shards) -> CacheRecord:
        config, urls, prompts = self.config, shards.urls(), {}
        text = (config.storage, config.model, config.text_encoding, self.text_fps)

        def prepare() -> None:  # the prompts, then the precision check before any shard, as in the flow
            prompts.update(encode_prompts(*text, self.prompts, config.training.samples.references or None))
            measure_numerics(*text, shards.dataset()["id"], urls[0] if urls else None)

        records, work = self.encoded("encode-text", lambda url: encode_text_shard(*text, shards.dataset()["id"], url),
                                     urls, prepare)
        return {**text_cache_record(self.store, self.text_fps, prompts, records), "work": work}

    def encode_latents(self, shards: Shards) -> CacheRecord:
        config = self.config
        encode = partial(encode_latents_shard, config.storage, config.model, config.latent_encoding, self.vae_fp)
        records, work = self.encoded("encode-latents", lambda url: [encode(url)], shards)
        return {**latent_cache_record(self.store, self.vae_fp, shards.in_order(records)), "work": work}

    @staticmethod
    def encoded(stage: Stage, encode: Callable[[str], list[Any]], urls: Iterable[str],
                prepare: Callable[[], None] = lambda: None) -> tuple[list[Any], EncodingWork]:
        """`prepare()`, then `encode(url)` for every shard, here (its records: one per encoder);
        all the records and the stage's encoding_work, counted from before `prepare` as the flow
        counts it."""
        started, before = time.time(), model_loads()[stage]
        prepare()
        records = [record for url in urls for record in encode(url)]
        return records, encoding_work(records, started, 1, model_loads()[stage] - before)

    def manifest(self, dataset: DatasetRecord) -> ManifestRecord:
        config = self.config
        return build_manifest(config.storage, dataset["id"], self.text_fps, self.vae_fp,
                              self.prompts, mix_identity(config.dataset, dataset.get("members")))

    def train(self, manifest: ManifestRecord) -> RunRecord:
        config = self.config
        return train(config.storage, config.model, config.training, manifest["url"])


def one_after_another(executor: Direct, server: Any = None
                      ) -> tuple[dict[str, float], dict[str, float]]:
    """The data stages, each whole before the next (what overlapping them is measured and tested
    against): each one's seconds, and its CPU seconds (this process's, and `server`'s where given)."""
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def timed(name: str, call: Any) -> Any:
        began, used = time.perf_counter(), cpu_seconds(server)
        result = call()
        seconds[name], cpu[name] = time.perf_counter() - began, cpu_seconds(server) - used
        return result

    dataset = timed("ingest", executor.ingest)
    timed("encode-text", lambda: executor.encode_text(Shards.of(executor.store, dataset)))
    timed("encode-latents", lambda: executor.encode_latents(Shards.of(executor.store, dataset)))
    timed("manifest", lambda: executor.manifest(dataset))
    return seconds, cpu


def cpu_seconds(server: Any) -> float:
    """CPU seconds used so far by this process and by `server` (a `psutil.Process`, if any) with its
    children."""
    import psutil

    others = [server, *server.children(True)] if server else []
    return sum(sum(process.cpu_times()[:2]) for process in (psutil.Process(), *others))


def run_direct(config: PipelineConfig, until: Stage = "train") -> Records:
    """Run the stages up to `until` in this process (`Direct`); returns `run_stages`' records and
    the encoders' fingerprints."""
    executor = Direct(config)
    return {"text_fingerprints": executor.text_fps, "vae_fingerprint": executor.vae_fp,
            **run_stages(executor, until)}


def outputs(records: Records) -> dict[str, Any]:
    """What a whole pipeline run reports, from its stages' records (the flow's return value)."""
    run = records["train"]
    return {
        "dataset": records["ingest"]["url"],
        "quarantined": records["ingest"]["quarantined"],  # files or rows ingest refused; the report says why
        "ingest_report": records["ingest"]["report"],
        "text_cache": records["encode-text"]["url"],
        "latent_cache": records["encode-latents"]["url"],
        "manifest": records["manifest"]["url"],
        "run": run["run"],
        "weights": run["url"],  # the adapter, or the transformer of a full fine-tune
        "samples": run["samples"],  # the sample grids (a run on clips: its videos' first frames)
        **({"sample_videos": run["sample_videos"]} if run.get("sample_videos") else {}),
        "loss_curve": layout.run_part(run["run"], "loss_curve"),
        "final_loss": run["final_loss"],
        "first_loss": run["first_loss"],
        "loss_window": run.get("loss_window"),  # the steps each of the two is the mean of
        # what each stage cost: its seconds, and an encoder's workers, model loads, shards and storage retries
        "stages": {name: {"seconds": round(seconds, 2), **(records[name].get("work") or {})}
                   for name, seconds in records["seconds"].items()},
    }
