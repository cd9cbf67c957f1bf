"""Edit pairs as users lay them out: a target picture, its caption (the edit) and the reference
pictures it was made from, in every source format. Each reference is stored once however many
targets name it, a target's sample id covers its references' bytes, a pair whose reference is
missing or refused is quarantined with that reason, and a nightly run after one reference changed
reads that pair alone."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from pydantic import ValidationError

from configs.schema import DatasetConfig, PipelineConfig, StorageConfig
from storage import layout
from storage.shards import read_image_shard
from storage.store import Store
from tasks.demo.data import write_edit_data
from tasks.ingest.examine import REFERENCE, REFERENCES
from tasks.ingest.report import report_markdown
from tasks.ingest.stage import ingest

FORMATS = ["folder", "folder on S3", "jsonl", "jsonl-column", "csv", "parquet", "webdataset"]
PAIRS = 6  # pairs 0-1, 2-3 and 4-5 share their reference picture (two edits of it)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def target_id(target: bytes, references: list[bytes]) -> str:
    """A target's sample id as the product defines it: its bytes and its references' ids, in order."""
    return _sha(target + REFERENCES + ",".join(_sha(r + REFERENCE) for r in references).encode())


def _pairs(folder: Path) -> tuple[dict[str, bytes], dict[str, str], dict[str, list[bytes]]]:
    """The demo's edit pairs (targets, captions, references by name), and two that cannot be pairs:
    99998's reference is no picture, 99999 has none."""
    write_edit_data(folder, count=PAIRS)
    (folder / "references" / "99998.png").write_bytes(b"not a picture")
    for name in ("99998", "99999"):
        (folder / "targets" / f"{name}.png").write_bytes((folder / "targets" / "00000.png").read_bytes() + name.encode())
        (folder / "targets" / f"{name}.txt").write_text("make the background red")
    names = sorted(path.stem for path in (folder / "targets").glob("*.png"))
    targets = {name: (folder / "targets" / f"{name}.png").read_bytes() for name in names}
    captions = {name: (folder / "targets" / f"{name}.txt").read_text().strip() for name in names}
    references = {name: [(folder / "references" / f"{name}.png").read_bytes()]
                  for name in names if (folder / "references" / f"{name}.png").exists()}
    return targets, captions, references


def _source(folder: Path, fmt: str, targets: dict[str, bytes], captions: dict[str, str],
            references: dict[str, list[bytes]]) -> tuple[str, dict]:
    """The pairs as a source of `fmt` (in the column formats pair 00005 names two references, the
    second 00004's picture): its path and settings."""
    files = {"references": "files", "reference_path": str(folder / "references")}
    if fmt in ("folder", "folder on S3"):
        return str(folder / "targets"), files
    if fmt == "jsonl":  # the metadata's names relative to its folder, the references' to reference_path
        rows = [{"file_name": f"{name}.png", "text": captions[name]} for name in targets]
        (folder / "targets" / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(folder / "targets" / "metadata.jsonl"), files
    references["00005"] = references["00005"] + references["00004"]
    named = {name: [f"references/{name}.png"] + ["references/00004.png"] * (name == "00005")
             for name in targets if name != "99999"}
    if fmt == "jsonl-column":
        rows = [{"file_name": f"targets/{name}.png", "text": captions[name],
                 **({"reference": named[name] if len(named[name]) > 1 else named[name][0]} if name in named else {})}
                for name in targets]
        (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(folder / "metadata.jsonl"), {"references": "column"}
    if fmt == "csv":  # a further reference in its own column, as musubi-tuner's control_path_N
        lines = ["file_name,text,reference,reference_2"] + [
            f"targets/{name}.png,{captions[name]},{','.join((named.get(name, []) + ['', ''])[:2])}" for name in targets]
        (folder / "metadata.csv").write_text("\n".join(lines) + "\n")
        return str(folder / "metadata.csv"), {"references": "column"}
    if fmt == "parquet":  # bytes, or HF datasets' {bytes, path} structs, in a list a row
        cells = [[{"bytes": (folder / path).read_bytes(), "path": path} for path in named[name]] if name in named
                 else None for name in targets]
        pq.write_table(pa.table({"image": list(targets.values()), "text": [captions[n] for n in targets],
                                 "reference": cells}), folder / "pairs.parquet", row_group_size=3)
        return str(folder / "pairs.parquet"), {"references": "column"}
    with tarfile.open(folder / "pairs.tar", "w") as archive:  # x.png, x.txt, x.reference.png, x.reference_2.png
        for name in targets:
            members = {f"{name}.png": targets[name], f"{name}.txt": captions[name].encode()}
            for number, path in enumerate(named.get(name, []), start=1):
                members[f"{name}.reference{'' if number == 1 else f'_{number}'}.png"] = (folder / path).read_bytes()
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return str(folder / "pairs.tar"), {"references": "column"}


def _config(folder: Path, source: str, settings: dict, storage: dict | None = None) -> tuple[StorageConfig, DatasetConfig]:
    config = PipelineConfig.model_validate({
        "storage": storage or {"root": str(folder / "store")}, "model": {"path": str(folder / "model")},
        "dataset": {"sources": [{"path": source, **settings}], "shard_size": 4}})
    return config.storage, config.dataset


@pytest.mark.parametrize("fmt", FORMATS)
def test_pairs_are_read_from_every_format_each_reference_stored_once(tmp_path, fmt, request):
    targets, captions, references = _pairs(tmp_path)
    source, settings = _source(tmp_path, fmt, targets, captions, references)
    storage, upload = None, lambda: None
    if fmt == "folder on S3":  # the targets and references uploaded, read through the store's options
        import s3fs

        endpoint = request.getfixturevalue("s3_endpoint")
        s3 = s3fs.S3FileSystem(endpoint_url=endpoint)
        s3.mkdir("precast-pairs")
        storage = {"root": "s3://precast-pairs/store", "options": {"endpoint_url": endpoint}}

        def upload():
            for name in ("targets", "references"):
                for path in (tmp_path / name).glob("*.*"):
                    s3.put_file(str(path), f"precast-pairs/{name}/{path.name}")

        upload()
        source, settings = "s3://precast-pairs/targets", {**settings, "reference_path": "s3://precast-pairs/references"}
    config = _config(tmp_path, source, settings, storage)
    done = ingest(*config)
    store = Store(config[0])
    report = store.read_json(layout.dataset_report(done["id"]))

    def named(where: str) -> str:  # a quarantined pair's target: a file, a tar member or a parquet row
        return list(targets)[int(where.rsplit("#", 1)[1])] if fmt == "parquet" else \
            Path(where.split("::")[-1]).name.split(".")[0]

    assert sorted((named(q["source"]), q["reason"]) for q in report["quarantine"]) == \
        [("99998", "bad_reference"), ("99999", "missing_reference")], report["quarantine"]
    bad = next(q["message"] for q in report["quarantine"] if q["reason"] == "bad_reference")
    assert bad.startswith("reference 1, ") and "not_image" in bad, bad

    rows = [row for shard in done["shards"] for row in read_image_shard(
        store.read_bytes(layout.image_shard(shard["id"])), ["sample_id", "role", "references", "captions"]).to_pylist()]
    samples = {row["sample_id"]: row for row in rows if row["role"] is None}
    stored = {row["sample_id"] for row in rows if row["role"] == "reference"}
    expected = {target_id(targets[name], references[name]): name for name in targets if name < "99998"}
    assert set(samples) == set(expected) and done["samples"] == PAIRS
    # three reference pictures, each stored once however many targets or files name it
    assert stored == {_sha(r + REFERENCE) for name in expected.values() for r in references[name]}
    assert len(stored) == 3 and done["references"] == 3
    for sample_id, row in samples.items():
        name = expected[sample_id]
        assert row["references"] == [_sha(r + REFERENCE) for r in references[name]]
        assert row["captions"] == [captions[name]]
    assert (report["pairs"], report["references"], report["references_shared"]) == (PAIRS, 3, 3)
    assert "**6** of the samples are pairs made from references" in report_markdown(report)

    # a nightly run after one reference was redrawn: that pair alone is read and stored again
    if fmt not in ("folder", "folder on S3"):
        return
    changed = targets["00000"]  # another picture as 00002's reference
    (tmp_path / "references" / "00002.png").write_bytes(changed)
    upload()
    again = ingest(*config)
    assert again["work"]["units_read"] == 1 and again["new_samples"] == 2  # the pair's target and its new reference
    assert again["samples"] == PAIRS and again["references"] == 4  # 00003 still names the old picture
    assert target_id(targets["00002"], [changed]) in {
        row["sample_id"] for shard in again["shards"]
        for row in read_image_shard(store.read_bytes(layout.image_shard(shard["id"])), ["sample_id"]).to_pylist()}
    assert ingest(*config)["work"]["units_read"] == 0


def test_reference_settings_that_cannot_be_read_are_refused_naming_the_source(tmp_path):
    with pytest.raises(ValidationError, match="references: files reads its references from reference_path"):
        _config(tmp_path, str(tmp_path), {"references": "files"})
    with pytest.raises(ValidationError, match="reference_path is read with references: files only"):
        _config(tmp_path, str(tmp_path), {"reference_path": str(tmp_path)})
    with pytest.raises(ValidationError, match="reference_column is read with references: column only"):
        _config(tmp_path, str(tmp_path), {"reference_column": "control"})
    targets, captions, references = _pairs(tmp_path)
    with pytest.raises(RuntimeError, match="references: column reads references for jsonl, csv, parquet, webdataset "
                                           "sources, not folder"):
        ingest(*_config(tmp_path, str(tmp_path / "targets"), {"references": "column"}))
    with pytest.raises(RuntimeError, match=r"reference_path '.*elsewhere' cannot be read"):
        ingest(*_config(tmp_path, str(tmp_path / "targets"), {"references": "files",
                                                                "reference_path": str(tmp_path / "elsewhere")}))


def test_a_target_with_two_reference_folders_takes_one_from_each_in_order(tmp_path):
    """reference_path as a list (ai-toolkit's control_path list): the first folder's picture is
    Picture 1, the second's Picture 2; a target missing from the second is quarantined naming it."""
    targets, captions, references = _pairs(tmp_path)
    second = tmp_path / "second"
    second.mkdir()
    for name in ("00000", "00001"):  # 00001's second reference is 00000's first
        (second / f"{name}.jpg").write_bytes((tmp_path / "references" / "00000.png").read_bytes())
    config = _config(tmp_path, str(tmp_path / "targets"),
                     {"references": "files", "reference_path": [str(tmp_path / "references"), str(second)]})
    done = ingest(*config)
    store = Store(config[0])
    report = store.read_json(layout.dataset_report(done["id"]))
    missing = [q for q in report["quarantine"] if q["reason"] == "missing_reference"]
    assert len(missing) == 6 and all(str(second) in q["message"] for q in missing[:-1])
    rows = [row for shard in done["shards"] for row in read_image_shard(
        store.read_bytes(layout.image_shard(shard["id"])), ["sample_id", "role", "references"]).to_pylist()]
    first = (tmp_path / "references" / "00000.png").read_bytes()
    assert {row["sample_id"] for row in rows if row["role"] is None} == {
        target_id(targets[name], [references[name][0], first]) for name in ("00000", "00001")}


def test_a_reference_is_stored_beside_the_first_target_that_names_it(tmp_path):
    """An encoder that sees references reads them from its target's shard: each reference goes in
    the shard of the first new target naming it, unless a shard's end falls between them (so at
    most one reference a shard is parted from its target); a dataset without pairs is cut by sample
    id as before."""
    folder = write_edit_data(tmp_path / "pairs", count=16)
    config = _config(tmp_path, str(folder / "targets"),
                     {"references": "files", "reference_path": str(folder / "references")})
    done = ingest(*config)
    store = Store(config[0])
    shard_of, first = {}, {}
    for shard in done["shards"]:
        rows = read_image_shard(store.read_bytes(layout.image_shard(shard["id"])), ["sample_id", "references"])
        ids = [row["sample_id"] for row in rows.to_pylist()]
        for row in rows.to_pylist():
            shard_of[row["sample_id"]] = shard["id"]
            for reference in row["references"] or []:
                first[reference] = min(first.get(reference, row["sample_id"]), row["sample_id"])
        assert len(ids) == 4
    parted = sum(shard_of[reference] != shard_of[target] for reference, target in first.items())
    assert len(first) == 8 and parted <= len(done["shards"]) - 1


def test_a_family_that_takes_no_references_refuses_pairs_before_any_stage(tmp_path, tiny_models):
    """Pairs given to a model that takes no reference images (PixArt-Σ) are refused before ingest,
    naming the source and the family; ingest alone reads them (the pairs wait for an edit model)."""
    from tasks.runner import run_direct

    _pairs(tmp_path)
    config = PipelineConfig.model_validate({
        "storage": {"root": str(tmp_path / "store")}, "model": {"path": tiny_models},
        "dataset": {"sources": [{"path": str(tmp_path / "targets"), "references": "files",
                                 "reference_path": str(tmp_path / "references")}]}})
    with pytest.raises(ValueError, match=r"targets'.*references: files pairs each picture .* PixArt-Σ takes none"):
        run_direct(config)
    assert not (tmp_path / "store").exists()
    assert run_direct(config, until="ingest")["ingest"]["samples"] == PAIRS


def test_the_edit_demo_judges_an_edit_made_and_a_reference_kept():
    """The edit world's scorer (tasks.demo.world.edit_judged), on the held-out edits made by hand:
    each edit's target at the sample size is made and kept; the reference itself neither (its shapes
    do not stand on the new colour); the new colour alone is made but not kept."""
    from PIL import Image

    from tasks.demo.data import COLORS, edited, held_out_edits
    from tasks.demo.world import edit_judged

    for edit in held_out_edits():
        target = edited(edit["reference"], edit["background"], edit["colour"]).resize((128, 128))
        assert edit_judged(target, edit) == (True, True)
        assert edit_judged(edit["reference"].resize((128, 128)), edit) == (False, False)
        assert edit_judged(Image.new("RGB", (128, 128), COLORS[edit["colour"]]), edit) == (True, False)


def test_the_edit_demo_reads_its_pairs_and_draws_from_held_out_references(tmp_path, monkeypatch):
    """`precast demo --family flux-kontext`'s config: its pairs read as references: files, its sample
    grid one held-out edit a prompt, drawn from that edit's reference; what it does not find is
    written (the pairs, the references), the references the held-out edits' own pictures."""
    from configs.schema import QUICKSTART, load_config
    from tasks.demo import demo_settings, write_demo_inputs
    from tasks.demo.data import held_out_edits

    monkeypatch.chdir(tmp_path)
    config = load_config(QUICKSTART, [*demo_settings("flux-kontext"), "model.path=models"])
    (source,) = config.dataset.sources
    assert source.references == "files" and source.reference_folders() == ["precast-demo/edit-pairs/references"]
    edits = held_out_edits()
    assert config.training.samples.prompts == [edit["prompt"] for edit in edits]
    monkeypatch.setattr("tasks.demo.write_demo_models", lambda *args, **kwargs: None)
    write_demo_inputs(config, "flux-kontext", count=4)
    assert len(list((tmp_path / source.path).glob("*.png"))) == 4
    for path, edit in zip(config.training.samples.references, edits):
        assert Image.open(tmp_path / path).tobytes() == edit["reference"].tobytes()
