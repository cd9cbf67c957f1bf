"""A finished run on one page: its sample grid, training curves, weights and how to load them, its
lineage, and what each pipeline stage that made it cost. Markdown with the pictures inline for the
Prefect artifact (the UI renders data URIs), text for the terminal (`precast inspect RUN_URL`); the
same sections, read from the run folder alone, so any machine that reaches the store shows it."""

from __future__ import annotations

import base64
import io
import re
from dataclasses import dataclass
from typing import Any

from PIL import Image

from storage import layout
from storage.store import Store
from tasks.families import Family
from tasks.runs.folder import FinishedRun, read_metrics

PAGE_IMAGE_WIDTH = 1024  # the sample grid as the page shows it (the file keeps every pixel)


@dataclass
class RunPage:
    url: str
    record: dict[str, Any]  # the lineage's commit record: steps, losses, samples, weights
    lineage: dict[str, Any]  # what trained it: manifest, model, training config, text, code, versions
    weights: str  # "adapter" or "transformer"
    family: Family
    metrics: list[dict[str, Any]]
    stages: list[dict[str, Any]] | None  # the pipeline summary of the run that trained it
    samples: bytes | None  # the final sample grid
    curves: bytes

    @classmethod
    def of(cls, run: FinishedRun) -> RunPage:
        store, key, record = run.store, run.run, run.record
        stages = store.read_json(layout.run_part(key, "stages")) if store.exists(layout.run_part(key, "stages")) \
            else None
        samples = store.read_bytes(store.key(record["samples"][-1])) if record["samples"] else None
        curves = store.read_bytes(layout.run_part(key, "loss_curve"))  # drawn when the run was published
        return cls(run.url, record, run.lineage, run.weights, run.family, read_metrics(store, key), stages, samples, curves)

    @classmethod
    def read(cls, store: Store, run: str) -> RunPage:
        return cls.of(FinishedRun.read(store, run))

    @classmethod
    def at(cls, url: str, options: dict | None = None) -> RunPage:
        return cls.of(FinishedRun.at(url, options))

    def _weights(self) -> tuple[str, str]:
        """Where the trained weights are (relative to the store), and Python that renders with
        them, one path a line (a line longer than the page is clipped in the UI)."""
        model, url = self.record["model"]["path"], self.record[self.weights]
        pipeline, transformer = self.family.sampler.pipeline_name, self.family.denoiser.transformer
        # the component it trained: an expert's of a two-expert model, the transformer else
        slot = "transformer_2" if self.record["model"].get("expert") == "low_noise" else "transformer"
        relative = self._in_store(url)
        # a local store's folder loads as it is; a remote one's is copied first
        where = (f"{_assign('store', self.root.removeprefix('file://'))}\nweights = store + {'/' + relative!r}"
                 if url.startswith("file://") else f"weights = {self.weights!r}  # {relative}, copied locally")
        load = (f"base = {transformer}.from_pretrained(model, subfolder=\"{slot}\")\n"
                f"transformer = PeftModel.from_pretrained(base, weights).merge_and_unload()"
                if self.weights == "adapter" else f"transformer = {transformer}.from_pretrained(weights)")
        imports = f"from diffusers import {pipeline}, {transformer}\n" + \
            ("from peft import PeftModel\n" if self.weights == "adapter" else "")
        code = (f"{imports}\n{_assign('model', model)}\n{where}\n{load}\n"
                f"pipeline = {pipeline}.from_pretrained(model, {slot}=transformer)")
        return relative, code

    def _facts(self) -> list[tuple[str, str]]:
        record = self.record
        resumed = f" (resumed at step {record['resumed_from']})" if record["resumed_from"] else ""
        samples = sum(m.get("batch", 0) for m in self.metrics)
        speed = f", {samples / record['seconds']:,.1f} samples/s" if samples and record["seconds"] else ""
        validation = record["validation_loss"]
        return [
            ("steps", f"{record['steps']}{resumed} in {record['seconds']:,.0f} s{speed}"),
            ("loss", loss_text(record)),
            ("validation loss", f"{validation:.4f}" if validation is not None else "none (validation_samples is 0)"),
            ("model", record["model"]["path"] + (f" @ {record['model']['revision']}" if record["model"]["revision"]
                                                  else "")),
            ("manifest", self.lineage["manifest"]),
            *([("sources", "; ".join(_mixed(source) for source in self.lineage["mix"]))] if self.lineage.get("mix") else []),
        ]

    @property
    def root(self) -> str:
        """The URL of the store that holds this run."""
        return layout.parse_run(self.url)[0]

    def _in_store(self, url: str) -> str:
        """`url` relative to the store that holds this run (a URL is one unbreakable word: in a
        table it pushed the page sideways), else as it is."""
        return url.removeprefix(self.root + "/")

    def _lineage(self) -> list[tuple[str, str]]:
        lineage = self.lineage
        training = lineage["training"]
        # a full run has no adapter
        lora = ("lora.rank", "lora.alpha") if training.get("method", "lora") == "lora" else ()
        keys = ("method", *lora, "steps", "batch_size", "batch_tokens", "optimizer.learning_rate", "mixed_precision",
                "base_precision", "gradient_checkpointing", "timesteps.sampling", "timesteps.loss_weighting", "seed")

        def value(key: str) -> Any:
            group, _, name = key.rpartition(".")
            return (training.get(group, {}) if group else training).get(name)

        init = lineage.get("init_from")
        return [("training", ", ".join(f"{key} {value(key)}" for key in keys if value(key) is not None)),
                ("continued from", f"{self._in_store(init['url'])} (sha256 {init['sha256'][:12]})" if init else "none"),
                ("text", ", ".join(f"{k} {v}" for k, v in lineage["text"].items())),
                ("code", lineage["code"]),
                ("versions", ", ".join(f"{k} {v}" for k, v in lineage["versions"].items()))]

    def markdown(self) -> str:
        """The Prefect artifact: pictures inline as data URIs."""
        weights, code = self._weights()
        lines = [f"# Training run `{self.url.rsplit('/', 1)[1]}`", "",
                 f"`{self.url}`: the paths below are under `{self.root}/`", ""]
        if self.samples is not None:
            lines += [f"![sample grid]({_data_uri(self.samples, PAGE_IMAGE_WIDTH)})", "",
                      "Prompts: " + "; ".join(f"“{p}”" for p in self.lineage["training"]["samples"]["prompts"]), ""]
            if self.record.get("sample_videos"):  # a run on clips: the grid is its videos' first frames
                lines += [f"The videos (animated WebP): `{self._in_store(self.record['sample_videos'][-1])}`", ""]
        lines += [f"![training curves: loss, validation loss, learning rate]({_data_uri(self.curves)})", ""]
        lines += [f"- {name}: {value}" for name, value in self._facts()]  # a list, not a table: it wraps in both UIs
        lines += ["", "## Weights", "", f"`{weights}`", "", "```python", code, "```", "",
                  f"Or `precast sample {self.url} --prompt \"…\"`; `precast export {self.url}` writes the LoRA in "
                  f"ComfyUI's layout.", ""]
        lines += ["## Lineage", ""] + [f"- {name}: {value}" for name, value in self._lineage()]
        lines += ["", "## Stages", ""] + (stage_table(self.stages) if self.stages else
                                          ["Not recorded: trained outside the pipeline flow."])
        return "\n".join(lines)

    def text(self) -> str:
        """The same page for a terminal: the pictures by URL, the curve as a table of steps."""
        weights, code = self._weights()
        record = self.record
        out = [f"training run {self.url} (paths below under {self.root}/)"]
        out += [f"  {name}: {value}" for name, value in self._facts()]
        if record["samples"]:
            out.append(f"  sample grid: {record['samples'][-1]}")
        if record.get("sample_videos"):
            out.append(f"  sample videos: {record['sample_videos'][-1]}")
        out.append(f"  training curves: {self.url}/{layout.RUN_PARTS['loss_curve']}")
        out += ["", "loss by step:", "  step        loss  validation        lr"]
        for row in _milestones(self.metrics):
            validation = f"{row['validation_loss']:.4f}" if "validation_loss" in row else ""
            out.append(f"  {row['step']:>4}  {row['loss']:>10.4f}  {validation:>10}  {row['lr']:>8.2e}")
        out += ["", f"weights: {weights}", *("  " + line for line in code.splitlines()), "", "lineage:"]
        out += [f"  {name}: {value}" for name, value in self._lineage()]
        out += ["", "stages:"]
        out += [f"  {s['stage']:<15} {s['status']:<7} {s['seconds']:>8}  {s['amount']}" + (f"; {s['work']}" if s["work"]
                                                                                          else "")
                for s in self.stages] if self.stages else ["  not recorded: trained outside the pipeline flow"]
        return "\n".join(out)


def _milestones(metrics: list[dict[str, Any]], count: int = 10) -> list[dict[str, Any]]:
    """About `count` evenly spaced steps, the last and every validated one included."""
    every = max(1, len(metrics) // count)
    return [m for i, m in enumerate(metrics) if i % every == every - 1 or i == len(metrics) - 1 or "validation_loss" in m]


def loss_text(record: dict[str, Any]) -> str:
    """The run's loss as every reader is told it: means over a window of steps, said so (a single
    step's loss is noisier than the change it shows)."""
    window = record.get("loss_window")
    over = f"each the mean of {window} steps" if window else "each a mean over steps"
    return f"{record['first_loss']:.4f} at the start → {record['final_loss']:.4f} at the end ({over})"


def stage_table(stages: list[dict[str, Any]]) -> list[str]:
    """The stages as a table of short columns, then each stage's work and output in a list under
    it, the outputs relative to the folder that holds them all (the store root): Prefect's V1 UI
    does not wrap a table's cells, so a long one ran off the page there."""
    root = layout.common_folder([s["output"] for s in stages])
    return (["| stage | status | amount | time |", "| --- | --- | --- | --- |"]
            + [f"| {s['stage']} | {s['status']} | {s['amount']} | {s['seconds']} |" for s in stages]
            + ["", f"Outputs, under `{root}`, and the work each took:", ""]
            + [f"- {s['stage']}: `{s['output'].removeprefix(root)}`" + (f"; {s['work']}" if s["work"] else "")
               for s in stages])


def _assign(name: str, path: str, width: int = 80) -> str:
    """`name = 'path'` in Python, a long path split after its slashes into strings on lines of at
    most `width` characters (where its parts allow), which Python joins: a longer line is clipped
    in Prefect's V1 UI."""
    indent = len(name) + 4  # name = (
    lines = [""]
    for part in re.split(r"(?<=/)", path):
        if lines[-1] and indent + len(repr(lines[-1] + part)) + 1 > width:
            lines.append("")
        lines[-1] += part
    if len(lines) == 1:
        return f"{name} = {path!r}"
    return f"{name} = (" + ("\n" + " " * indent).join(map(repr, lines)) + ")"


def _mixed(source: dict[str, Any]) -> str:
    """A dataset source as the run drew from it: its samples, settings and share of the draws."""
    settings = [f"×{source['repeats']} repeats" if source["repeats"] != 1 else "",
                f"weight {source['weight']:g}" if source["weight"] is not None else "",
                f"loss weight {source['loss_weight']:g}" if source["loss_weight"] != 1 else "",
                f"caption dropout {source['caption_dropout']:g}" if source["caption_dropout"] is not None else "",
                f"regularisation ({source['regularisation']})" if source["regularisation"] != "off" else ""]
    share = f"{source['share']:.1%} of draws"
    return f"`{source['path']}` {source['samples']} samples, " + ", ".join(filter(None, [*settings, share]))


def _data_uri(data: bytes, width: int | None = None) -> str:
    """An image as a data URI; wider than `width`, scaled down and sent as JPEG."""
    if width is not None:
        image = Image.open(io.BytesIO(data))
        if image.width > width:
            image = image.convert("RGB").resize((width, round(image.height * width / image.width)))
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=88)
            return f"data:image/jpeg;base64,{base64.b64encode(buffer.getvalue()).decode()}"
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"
