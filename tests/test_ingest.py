"""Ingest: every source format, every quarantine reason, normalisation, append-only re-runs."""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flows.summary import ingest_work_text
from storage.shards import read_image_shard
from storage.store import Store
from tasks.ingest.stage import ingest
from tests.corpus import ACCEPTED, MAX_PIXELS, REASONS, WRITERS, items


def _config(make_config, source, **dataset):
    return make_config(source=str(source), dataset={"max_pixels": MAX_PIXELS, **dataset})


def _rows(store: Store, dataset: dict) -> dict[tuple[str, ...], dict]:
    rows = {}
    for shard in dataset["shards"]:
        for row in read_image_shard(store.read_bytes(f"shards/images/{shard['id']}.parquet")).to_pylist():
            rows[tuple(sorted(row["captions"]))] = row
    return rows


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    base = tmp_path_factory.mktemp("corpora")
    return {fmt: write(base / fmt) for fmt, write in WRITERS.items()}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_each_format_accepts_and_quarantines_exactly(fmt, corpora, make_config):
    config = _config(make_config, corpora[fmt])
    result = ingest(config.storage, config.dataset)
    store = Store(config.storage)
    report = store.read_json(store.key(result["report"]))
    assert result["samples"] == ACCEPTED
    expected = dict(REASONS, **({"unsafe_member": 3} if fmt == "webdataset" else {}))
    assert report["by_reason"] == expected, report["quarantine"]
    assert report["by_format"] == {fmt: {"accepted": ACCEPTED, "quarantined": sum(expected.values())}}
    assert report["duplicates"] == 1 and report["caption_variants"] == ACCEPTED + 2
    assert {q["reason"] for q in report["quarantine"]} == set(expected)

    rows = _rows(store, result)
    source_bytes = {item["name"]: item["image"] for item in items()}
    merged = rows[("a rotated red photo", "the same red photo again")]  # duplicate kept once, captions merged
    assert (merged["width"], merged["height"]) == (100, 200)  # EXIF orientation applied
    assert Image.open(io.BytesIO(merged["image"])).getpixel((50, 100))[0] > 200
    assert rows[("the first variant", "the second variant",)]  # multi-line caption → two variants
    assert ("a caption that starts with a byte order mark",) in rows
    cmyk = Image.open(io.BytesIO(rows[("a cmyk jpeg",)]["image"]))
    assert cmyk.mode == "RGB" and cmyk.getpixel((5, 5))[0] > 200 and cmyk.getpixel((5, 5))[1] < 50
    deep = Image.open(io.BytesIO(rows[("a sixteen bit png",)]["image"]))
    assert deep.mode == "RGB" and deep.getpixel((0, 0)) == (156, 156, 156)  # 40000/65535 of full scale
    gif = Image.open(io.BytesIO(rows[("an animated palette gif",)]["image"]))
    assert gif.format == "PNG" and gif.getpixel((0, 0)) == (10, 200, 30)  # first frame, palette resolved
    alpha = Image.open(io.BytesIO(rows[("a transparent png",)]["image"]))
    assert alpha.getpixel((0, 0)) == (255, 255, 255)  # transparent pixels composited on white
    assert rows[("a webp photo",)]["image"] == source_bytes["photo.webp"]  # no conversion: original bytes
    assert rows[("a plain blue picture",)]["image"] == source_bytes["plain.png"]


def test_every_format_yields_the_same_dataset(corpora, make_config, tmp_path):
    ids = {fmt: ingest(*_split(_config(make_config, path))).get("id") for fmt, path in corpora.items()}
    assert len(set(ids.values())) == 1, ids


def _split(config):
    return config.storage, config.dataset


def test_reingest_writes_nothing_and_new_data_goes_to_new_shards(tmp_path, make_config, demo_data):
    source = tmp_path / "src"
    shutil.copytree(demo_data, source)
    config = make_config(source=str(source))
    store = Store(config.storage)
    first = ingest(config.storage, config.dataset)
    assert first["samples"] == 24 and first["new_shards"] == 3
    before = {p: store.fs.info(p)["mtime"] for p in store.fs.find(store.root_path)}

    again = ingest(config.storage, config.dataset)
    assert again["id"] == first["id"] and again["new_shards"] == 0
    assert {p: store.fs.info(p)["mtime"] for p in store.fs.find(store.root_path)} == before  # wrote nothing

    shards = set(store.list("shards/images", ".parquet"))
    Image.new("RGB", (120, 100), (10, 200, 10)).save(source / "extra.png")
    (source / "extra.txt").write_text("a green square")
    grown = ingest(config.storage, config.dataset)
    assert grown["id"] != first["id"] and grown["new_shards"] == 1 and grown["samples"] == 25
    (new_shard,) = set(store.list("shards/images", ".parquet")) - shards
    assert [r["captions"] for r in read_image_shard(store.read_bytes(new_shard)).to_pylist()] == [["a green square"]]

    # an edited caption supersedes the old record without rewriting its shard
    (source / "00000.txt").write_text("a new caption for the first image\n")
    edited = ingest(config.storage, config.dataset)
    assert edited["samples"] == 25 and edited["new_samples"] == 1
    partial = [s for s in edited["shards"] if s["samples"] is not None]
    assert len(partial) == 1 and len(partial[0]["samples"]) == 9

    # a changed file is a new sample; the old one leaves the dataset
    png = source / "00001.png"
    pixels = np.asarray(Image.open(png)).copy()
    pixels[0, 0] = 255 - pixels[0, 0]
    Image.fromarray(pixels).save(png)
    changed = ingest(config.storage, config.dataset)
    assert changed["samples"] == 25 and changed["new_samples"] == 1 and changed["id"] != edited["id"]


def test_a_deleted_shard_is_rebuilt_from_the_sources(tmp_path, make_config, demo_data, caplog):
    """The last ingest's record points at shards; one deleted by hand (data and commit) makes the
    next ingest read its samples' files again and write the same shard back, not fail."""
    config = make_config(source=str(demo_data))
    store = Store(config.storage)
    first = ingest(config.storage, config.dataset)
    gone = f"shards/images/{first['shards'][1]['id']}.parquet"
    before, size = store.read_bytes(gone), store.require(gone)["samples"]
    store.remove(gone + ".done")
    store.remove(gone)
    again = ingest(config.storage, config.dataset)
    assert again["id"] == first["id"] and store.read_bytes(gone) == before
    assert again["work"]["units_read"] == size and again["work"]["units_reused"] == 24 - size
    assert f"1 image shard(s) of the last ingest are gone ({first['shards'][1]['id']})" in caplog.text
    assert ingest(config.storage, config.dataset)["work"]["units_read"] == 0


def test_same_corpus_from_s3_gives_the_same_dataset_id(corpora, make_config, s3_endpoint, tmp_path):
    import s3fs

    s3 = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    s3.mkdir("precast-corpus")
    s3.put(str(corpora["webdataset"]), "precast-corpus/wds", recursive=True)
    local = ingest(*_split(_config(make_config, corpora["webdataset"], )))
    remote_config = _config(make_config, "s3://precast-corpus/wds")
    remote_config = remote_config.model_copy(update={"storage": remote_config.storage.model_copy(
        update={"root": str(tmp_path / "other-store"), "options": {"endpoint_url": s3_endpoint}})})
    remote = ingest(remote_config.storage, remote_config.dataset)
    assert remote["id"] == local["id"] and remote["quarantined"] == local["quarantined"]


def _shards(store: Store) -> dict[str, bytes]:
    return {key: store.read_bytes(key) for key in store.list("shards/images", ".parquet")}


def test_shards_written_in_parallel_are_those_one_writer_writes_and_a_writer_dying_loses_nothing(
        demo_data, make_config, tmp_path, monkeypatch):
    """Ingest packs and commits its new shards on several writer threads: the shards and the
    dataset are byte for byte those of one writer. A writer that fails (the store refuses its third
    shard) fails the ingest with its error, leaves only whole shards and no dataset, and the
    re-run writes the missing shards only, to the same bytes."""
    from tasks.ingest import shards as ingest_shards

    configs = {name: make_config(root=str(tmp_path / name), dataset={"shard_size": 3}) for name in ("one", "many")}
    monkeypatch.setattr(ingest_shards, "WRITERS", 1)
    one = ingest(*_split(configs["one"]))
    monkeypatch.setattr(ingest_shards, "WRITERS", 4)
    store, commit, commits = Store(configs["many"].storage), Store.commit, []

    def failing(self, key, data, **record):
        if key.startswith("shards/images/"):
            commits.append(key)
            if len(commits) == 3:
                raise OSError(28, "No space left on device", key)
        return commit(self, key, data, **record)

    monkeypatch.setattr(Store, "commit", failing)
    with pytest.raises(OSError, match="No space left"):
        ingest(*_split(configs["many"]))
    written = [key for key in store.list("shards/images", ".parquet") if store.committed(key)]
    assert 0 < len(written) < len(one["shards"]) and not store.find("datasets")
    assert all(store.read_bytes(key) == Store(configs["one"].storage).read_bytes(key) for key in written)
    commits.clear()
    monkeypatch.setattr(Store, "commit", commit)
    many = ingest(*_split(configs["many"]))
    assert many["id"] == one["id"] and many["new_shards"] == len(one["shards"]) - len(written)
    assert _shards(store) == _shards(Store(configs["one"].storage))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_nightly_ingest_reads_only_new_or_rewritten_files(where, demo_data, make_config, tmp_path, request):
    """Each ingest also runs, on a second store, as a full sequential read (no record of the last
    ingest, one read at a time): datasets and shards are byte for byte the same. An unchanged night
    reads nothing; one new image reads only it; a file rewritten in place is read again. On S3 the
    object GETs are counted at the HTTP level, behind an endpoint that adds 20 ms a request."""
    from storage.slow_endpoint import SlowEndpoint

    local = tmp_path / "src"
    shutil.copytree(demo_data, local)
    proxy = None
    if where == "s3":
        import s3fs

        proxy = SlowEndpoint(request.getfixturevalue("s3_endpoint")).__enter__()
        request.addfinalizer(lambda: proxy.__exit__(None, None, None))
        s3 = s3fs.S3FileSystem(endpoint_url=proxy.url)
        s3.mkdir("precast-nightly")

    def sync(*names: str) -> None:  # the source as the user changes it
        if proxy is not None:
            for name in names or [p.name for p in local.iterdir()]:
                s3.put_file(str(local / name), f"precast-nightly/data/{name}")

    sync()
    source = "s3://precast-nightly/data" if proxy else str(local)
    options = {"options": {"endpoint_url": proxy.url}} if proxy else {}
    nightly = make_config(root=str(tmp_path / "nightly"), source=source, storage=options)
    full = make_config(root=str(tmp_path / "full"), source=source, storage=options, dataset={"read_concurrency": 1})
    stores = Store(nightly.storage), Store(full.storage)

    def night() -> dict:
        if proxy:
            proxy.reset()
        done = ingest(nightly.storage, nightly.dataset)
        reads = sorted(r.path.rsplit("/", 1)[-1] for r in proxy.gets("/precast-nightly/")) if proxy else None
        for key in stores[1].find("refs"):  # the reference forgets what it read: a full read
            if key.endswith(".sources.parquet"):
                stores[1].remove(key)
        reference = ingest(full.storage, full.dataset)
        assert reference["id"] == done["id"] and reference["quarantined"] == done["quarantined"]
        assert _shards(stores[0]) == _shards(stores[1])
        return {**done["work"], "gets": reads}

    sizes = lambda *names: sum((local / name).stat().st_size for name in names)  # noqa: E731
    first = night()
    everything = sorted(p.name for p in local.iterdir())
    assert first["units_read"] == 24 and first["bytes_read"] == sizes(*everything)
    assert first["gets"] in (None, everything)

    assert night() == {"bytes_read": 0, "units_read": 0, "units_reused": 24, "io_retries": 0,
                       "gets": [] if proxy else None}

    Image.new("RGB", (120, 100), (10, 200, 10)).save(local / "extra.png")
    (local / "extra.txt").write_text("a green square")
    sync("extra.png", "extra.txt")
    added = night()
    assert (added["units_read"], added["bytes_read"]) == (1, sizes("extra.png", "extra.txt"))
    assert added["gets"] in (None, ["extra.png", "extra.txt"])
    # what the run's summary says of it: the bytes, not "0.0 MB"
    assert ingest_work_text(added).startswith(f"{sizes('extra.png', 'extra.txt'):,} B read: 1 unit read, 24 taken")

    (local / "00003.txt").write_text("the same picture, described again\n")  # rewritten in place
    png = local / "00001.png"
    pixels = np.asarray(Image.open(png)).copy()
    pixels[0, 0] = 255 - pixels[0, 0]
    Image.fromarray(pixels).save(png)
    sync("00003.txt", "00001.png")
    rewritten = night()
    assert rewritten["units_read"] == 2 and rewritten["units_reused"] == 23
    assert rewritten["gets"] in (None, sorted(["00001.png", "00001.txt", "00003.png", "00003.txt"]))
    assert night()["units_read"] == 0


def test_an_s3_listing_of_several_pages_is_streamed_whole(s3_endpoint, demo_data, make_config):
    """S3 lists 1,000 objects a request: the listing streamed page by page holds exactly what
    s3fs's own `find` returns, and images listed on the last page, beside their captions, become
    the same samples as from a local copy."""
    import s3fs

    from tasks.ingest.listing import walk_s3

    s3 = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    s3.mkdir("precast-pages")
    s3.pipe({f"precast-pages/data/0-notes/{n:05d}.json": b"{}" for n in range(1100)})  # listed before the images
    s3.put(f"{demo_data}/", "precast-pages/data/", recursive=True)
    listed = sorted(walk_s3(s3, "precast-pages/data"))
    reference = s3.find("precast-pages/data", detail=True)
    assert [path for path, _, _ in listed] == sorted(reference) and len(listed) == 1100 + 48
    assert all(size == reference[path]["size"] and stamp == reference[path]["ETag"] for path, size, stamp in listed)

    remote = make_config(source="s3://precast-pages/data", storage={"options": {"endpoint_url": s3_endpoint}})
    local = make_config(root=str(Path(remote.storage.root).parent / "local-store"), source=demo_data)
    assert ingest(remote.storage, remote.dataset)["id"] == ingest(local.storage, local.dataset)["id"]


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_an_unchanged_source_of_any_format_is_not_read_again(fmt, corpora, make_config, tmp_path):
    """A tar or parquet file is one listed object; metadata files are read again (they list the
    images), their images are not. A file written again, even with the same bytes, is read again."""
    source = tmp_path / fmt
    shutil.copytree(corpora[fmt], source)
    config = _config(make_config, source)
    first = ingest(*_split(config))
    again = ingest(*_split(config))
    metadata = sum(p.stat().st_size for p in source.glob("metadata.*"))
    assert again["id"] == first["id"] and again["quarantined"] == first["quarantined"]
    assert again["work"]["bytes_read"] == metadata and again["work"]["units_read"] == (1 if metadata else 0)
    assert again["work"]["units_reused"] == first["work"]["units_read"] - (1 if metadata else 0)

    touched = sorted(p for p in source.rglob("*") if p.is_file() and not p.name.startswith("metadata."))[0]
    touched.write_bytes(touched.read_bytes())  # a new modification time
    third = ingest(*_split(config))
    assert third["id"] == first["id"] and third["work"]["units_read"] == 1 + (1 if metadata else 0)


def test_unreachable_source_fails_naming_it(tmp_path, make_config):
    config = make_config(source=str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="missing"):
        ingest(config.storage, config.dataset)


def test_inspect_prints_the_report(corpora, make_config, capsys):
    import json

    from flows.cli import main

    config = _config(make_config, corpora["jsonl"])
    result = ingest(config.storage, config.dataset)
    assert main(["inspect", result["url"], "--json"]) == 0
    shown = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert shown["dataset"]["id"] == result["id"] and shown["report"]["by_reason"] == REASONS
    assert main(["inspect", result["url"]]) == 0
    text = capsys.readouterr().out
    assert "| caption_encoding | 1 |" in text and "| jsonl | 9 | 9 |" in text
    # the stored report's bins come back as a dict sorted as strings; the reader sees numeric order
    lengths = text.split("## Caption length (words)")[1].split("##")[0]
    bins = [line.split("|")[1].strip() for line in lengths.splitlines() if line.startswith("| <") or line.startswith("| >")]
    assert bins == ["<=5", "<=10", "<=20", "<=50", "<=100", "<=200", ">200"]
    ratios = text.split("## By aspect-ratio bucket (height/width)")[1].split("##")[0]
    values = [float(line.split("|")[1]) for line in ratios.splitlines()[4:] if line.startswith("| ")]
    assert values == sorted(values) and values
    # the quarantined inputs as a list under their common folder (V1's table cells do not wrap), each
    # name and message escaped so that markdown shows them as they are
    quarantined = text.split("## Quarantined inputs, under `")[1].split("`", 1)
    folder, items = quarantined[0], [line for line in quarantined[1].splitlines() if line.startswith("- ")]
    assert folder.startswith(corpora["jsonl"].as_uri() + "/") and len(items) == sum(REASONS.values())
    reasons = sorted(reason.replace("_", "\\_") for reason, count in REASONS.items() for _ in range(count))
    assert sorted(line.split(": ")[1] for line in items) == reasons
    assert [line for line in items if re.search(r"(?<!\\)[<>|`*_]", line[2:])] == []


def test_a_clean_ingest_reports_no_quarantine_as_none_not_an_empty_table(make_config, demo_data, capsys):
    from flows.cli import main

    config = make_config()
    result = ingest(config.storage, config.dataset)
    assert main(["inspect", result["url"]]) == 0
    text = capsys.readouterr().out
    assert "## Quarantined by reason\n\nnone\n" in text and "| reason | count |" not in text


def test_demo_captions_name_what_the_image_shows(demo_data):
    """The demo's captions are learnable: the background colour is the image's commonest colour,
    and the first shape sits in the part of the image its caption names (judged by the box of its
    colour's pixels, which another shape of that colour can stretch: most, not all, must match;
    chance would match about one in nine)."""
    import re
    from pathlib import Path

    from PIL import Image

    from tasks.demo.data import COLORS

    pattern = re.compile(r"^a (\w+) (\w+) at the ([a-z ]+) on a (\w+) background")
    placed = []
    for caption_file in sorted(Path(demo_data).glob("*.txt")):
        image_file = caption_file.with_suffix(".png")
        if not image_file.exists():  # JPEG colours are not exact
            continue
        color, _, position, background = pattern.match(caption_file.read_text()).groups()
        pixels = np.asarray(Image.open(image_file).convert("RGB"))
        colours, counts = np.unique(pixels.reshape(-1, 3), axis=0, return_counts=True)
        assert tuple(colours[counts.argmax()]) == COLORS[background], caption_file.name
        ys, xs = np.nonzero((pixels == COLORS[color]).all(-1))
        if not ys.size:  # covered by a later shape
            continue
        y = (ys.min() + ys.max()) / 2 / pixels.shape[0]
        x = (xs.min() + xs.max()) / 2 / pixels.shape[1]
        seen = " ".join(w for w in ("top" if y < 1 / 3 else "bottom" if y > 2 / 3 else "",
                                    "left" if x < 1 / 3 else "right" if x > 2 / 3 else "") if w) or "center"
        placed.append(seen == position)
    assert len(placed) >= 10 and sum(placed) >= 0.8 * len(placed), placed


def test_partitions_on_s3_give_the_same_dataset_and_survive_the_coordinator_dying(demo_data, make_config,
                                                                                  s3_endpoint, tmp_path):
    """Ingest in partitions (`examine_partition`, as a worker runs it) with source and store on S3:
    the same dataset as one process reading everything. When the ingest dies after a partition was
    staged but before it was merged, the next ingest takes that partition from the store, reading
    only the other units' objects, and leaves no staged partition behind."""
    import s3fs

    from storage.slow_endpoint import SlowEndpoint
    from tasks.ingest.staging import Partitions, examine_partition

    s3 = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    s3.mkdir("precast-partitions")
    s3.put(f"{demo_data}/", "precast-partitions/data/", recursive=True)
    reference = ingest(*_split(make_config(root=str(tmp_path / "reference"), source=demo_data)))
    with SlowEndpoint(s3_endpoint, 0) as proxy:
        config = make_config(root="s3://precast-partitions/store", source="s3://precast-partitions/data",
                             storage={"options": {"endpoint_url": proxy.url}}, dataset={"partition_size": 4})
        store, sent = Store(config.storage), []

        def dying(*args):
            sent.append(examine_partition(config.storage, config.dataset, *args))
            if len(sent) == 3:
                raise RuntimeError("the coordinator dies")
            return sent[-1]

        with pytest.raises(RuntimeError, match="the coordinator dies"):
            ingest(config.storage, config.dataset, partitions=Partitions(dying, slots=2, size=4))
        staged = [key for key in store.find("staging") if key.endswith(".parquet")]
        assert sent[2] in staged and all(store.committed(key) for key in staged)
        proxy.reset()
        alive = Partitions(lambda *args: examine_partition(config.storage, config.dataset, *args), slots=2, size=4)
        done = ingest(config.storage, config.dataset, partitions=alive)
        assert done["id"] == reference["id"] and done["quarantined"] == reference["quarantined"]
        assert len(proxy.gets("/precast-partitions/data/")) == 48 - 8 * len(staged)  # an image and its caption a unit
        assert store.find("staging") == []
    # a worker that does not see the source fails the partition naming it, rather than
    # quarantining every image as missing
    unseen = make_config(source=str(tmp_path / "only-on-the-coordinator"))
    with pytest.raises(RuntimeError, match="only-on-the-coordinator.* cannot be read on worker"):
        examine_partition(unseen.storage, unseen.dataset, 0, "folder", [["key", ["file", "a.png", "a.txt"]]])


@pytest.mark.parametrize("pattern", ["every other unit new", "one new unit in a hundred", "all new"])
def test_reads_in_flight_stay_bounded_and_in_order(pattern):
    """However new units are spread among known ones (a nightly run), outcomes come back in the
    listing's order, partitions are sent before the listing runs far ahead of what was taken, and
    new units scattered sparsely still fill several partitions at once."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.ingest.formats import Unit
    from tasks.ingest.scheduler import in_order

    new = {"every other unit new": lambda n: n % 2 == 0, "one new unit in a hundred": lambda n: n % 100 == 0,
           "all new": lambda n: True}[pattern]
    pulled, batches = [0], []

    def units():
        for n in range(2000):
            pulled[0] += 1
            yield Unit(str(n), 1, ["none"])

    window, span = 3, 10
    with ThreadPoolExecutor(window) as pool:
        def read(batch):
            batches.append(len(batch))
            return pool.submit(lambda: [f"read {unit.key}" for unit in batch])

        taken = []
        for unit, outcome, was_read in in_order(read, units(), lambda u: None if new(int(u.key)) else f"known {u.key}",
                                                 window, lambda batch: len(batch) >= 4, span):
            assert pulled[0] - len(taken) <= window * span  # the listing is never far ahead
            taken.append((outcome, was_read))
    assert taken == [(f"read {n}" if new(n) else f"known {n}", new(n)) for n in range(2000)]
    assert sum(batches) == sum(map(new, range(2000))) and max(batches) <= 4
    if pattern == "one new unit in a hundred":
        assert len(batches) == 20  # one a batch: sent when its span ends, never waiting for three more


def test_a_staged_partition_another_ingest_merged_first_is_examined_again(demo_data, make_config, tmp_path):
    """Two ingests of the same sources name the same staged partitions: when the other one has
    merged and deleted a partition before this one fetches it, it is examined again, not lost."""
    from tasks.ingest.staging import Partitions, examine_partition

    reference = ingest(*_split(make_config(root=str(tmp_path / "reference"), source=demo_data)))
    config = make_config(source=demo_data, dataset={"partition_size": 5})
    store, taken = Store(config.storage), []

    def raced(*args):
        key = examine_partition(config.storage, config.dataset, *args)
        if key not in taken:  # the other ingest gets there first
            taken.append(key)
            store.remove(key + ".done")
            store.remove(key)
        return key

    done = ingest(config.storage, config.dataset, partitions=Partitions(raced, slots=2, size=5))
    assert done["id"] == reference["id"] and len(taken) == 5 and store.find("staging") == []


def test_a_source_file_that_holds_no_sample_is_not_read_again(corpora, make_config, tmp_path):
    import tarfile

    source = tmp_path / "webdataset"
    shutil.copytree(corpora["webdataset"], source)
    tarfile.open(source / "zz-empty.tar", "w").close()
    config = _config(make_config, source)
    first = ingest(*_split(config))
    again = ingest(*_split(config))
    assert again["id"] == first["id"] and again["work"]["units_read"] == 0
    assert again["work"]["units_reused"] == first["work"]["units_read"]


def test_a_format_added_by_a_module_of_its_own_needs_no_stage_changed(corpora, make_config, tmp_path, monkeypatch):
    """A dataset format is one `SourceFormat`, registered in one place: here a layout of
    pictures in `images/` and their captions in `captions/` (matched by name) joins by `register`
    alone. `auto` finds it, ingest counts, reads and quarantines it as it does every format, and
    its dataset is every other format's."""
    import posixpath

    from tasks.ingest import formats
    from tasks.ingest.formats.base import SourceFormat, Unit, is_image_name, unit_of
    from tasks.ingest.formats.folder import read_captioned_file
    from tests.corpus import _caption_text

    def pictures(listing):
        return [entry for entry in listing.files() if entry.path.startswith(f"{listing.root}/images/")
                and is_image_name(entry.path)]

    def units(listing, source):
        for picture in pictures(listing):
            stem = posixpath.basename(picture.path).rpartition(".")[0]
            caption = listing.entry(f"{listing.root}/captions/{stem}.txt")
            yield Unit(*unit_of(picture, caption) if caption else unit_of(picture),
                       ["pair", picture.path, caption and caption.path])

    monkeypatch.setattr(formats, "FORMATS", dict(formats.FORMATS))
    formats.register(SourceFormat("pairs", units, lambda listing: len(pictures(listing)),
                                  {"pair": read_captioned_file},
                                  holds=lambda listing: any(entry.path.startswith(f"{listing.root}/captions/")
                                                            for entry in listing.files())))
    root = tmp_path / "pairs"
    for folder in ("images", "captions"):
        (root / folder).mkdir(parents=True)
    for item in items():
        (root / "images" / item["name"]).write_bytes(item["image"])
        if item["caption"] is not None:
            (root / "captions" / f"{item['name'].rpartition('.')[0]}.txt").write_bytes(_caption_text(item["caption"]))

    config = _config(make_config, root)
    result = ingest(config.storage, config.dataset)
    store = Store(config.storage)
    report = store.read_json(store.key(result["report"]))
    assert report["by_format"] == {"pairs": {"accepted": ACCEPTED, "quarantined": sum(REASONS.values())}}
    assert report["by_reason"] == REASONS, report["quarantine"]
    folder = make_config(root=str(tmp_path / "folder-store"), source=str(corpora["folder"]),
                         dataset={"max_pixels": MAX_PIXELS})
    assert result["id"] == ingest(folder.storage, folder.dataset)["id"]


def test_the_formats_a_config_can_name_are_the_registered_ones():
    from typing import get_args

    from configs.schema import SourceConfig
    from tasks.ingest.formats import FORMATS

    assert set(get_args(SourceConfig.model_fields["format"].annotation)) == {"auto", *FORMATS}
