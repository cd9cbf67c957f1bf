"""`parquet`: a parquet file, or a folder of them, with media bytes (or a `{bytes, path}` struct, as
HF datasets exports) and captions in columns."""

from __future__ import annotations

from collections.abc import Iterator

import fsspec
import pyarrow.parquet as pq

from configs.schema import SourceConfig
from storage.store import PYTHON_BYTES
from tasks.ingest.formats.base import CHUNK, Candidate, Limit, SourceFormat, Unit, count_files, top_level, unit_of
from tasks.ingest.listing import Listing
from tasks.ingest.untrusted import Rejected, caption_variants

PARQUET_BATCH_BYTES = 16 << 20  # media bytes a parquet batch holds as Python objects at most


def parquet_units(listing: Listing, source: SourceConfig) -> Iterator[Unit]:
    for listed in listing.files(".parquet"):
        yield Unit(*unit_of(listed), ["parquet", listed.path])


def read_parquet(fs: fsspec.AbstractFileSystem, fmt: str, source: SourceConfig, args: list,
                 limit: Limit) -> Iterator[Candidate]:
    """Parquet exports: image or video bytes (or a struct with `bytes`, as HF datasets writes) and
    caption(s). Arrow holds a row group's media column while its rows are read (about twice its
    bytes with pages streamed), so a batch is as many rows as fit in `PARQUET_BATCH_BYTES` (one
    video each), and ingest checks each cell's size."""
    (file,) = args
    # pages streamed CHUNK at a time, not a column chunk read whole first
    with fs.open(file, "rb") as handle, pq.ParquetFile(handle, buffer_size=CHUNK, pre_buffer=False) as parquet:
        columns = [source.image_column, source.caption_column, *[source.mask_column] * (source.masks == "column")]
        missing = set(columns) - set(parquet.schema_arrow.names)
        if missing:
            raise RuntimeError(f"dataset source {fs.unstrip_protocol(file)}: no column {sorted(missing)}")
        row = 0
        media = {source.image_column, *columns[2:]}  # a mask column's bytes are held as the pictures' are
        for batch in parquet.iter_batches(batch_size=parquet_batch_rows(parquet, media), columns=columns,
                                          **PYTHON_BYTES):
            for image, caption, *mask in zip(*(batch.column(i).to_pylist() for i in range(len(columns)))):
                candidate = Candidate(f"{fs.unstrip_protocol(file)}#{row}", fmt)
                row += 1
                try:
                    candidate.captions = caption_variants(caption)
                    candidate.image = cell_bytes(image)
                    if candidate.image is None:
                        raise Rejected("missing_image", "no image bytes in the row")
                    if mask:
                        candidate.mask = cell_bytes(mask[0])
                        if candidate.mask is None:
                            raise Rejected("missing_mask", f"no mask bytes in the row's {source.mask_column!r}")
                        if not isinstance(candidate.mask, bytes):
                            raise Rejected("bad_mask", f"the row's {source.mask_column!r} holds "
                                                       f"{type(candidate.mask).__name__}, not a mask's bytes")
                except Rejected as problem:
                    candidate.problem = problem
                yield candidate


def cell_bytes(cell) -> bytes | None:
    """A media cell's bytes: the bytes, or a struct's `bytes` (as HF datasets writes them)."""
    return cell.get("bytes") if isinstance(cell, dict) else cell


def parquet_batch_rows(parquet: pq.ParquetFile, media: set[str]) -> int:
    """Rows a batch: 64 small pictures, one video (the largest row group's bytes a row in the
    `media` columns decide)."""
    metadata = parquet.metadata
    row_bytes = 0
    for group in range(metadata.num_row_groups):
        chunks = metadata.row_group(group)
        held = sum(chunks.column(i).total_uncompressed_size for i in range(chunks.num_columns)
                   if chunks.column(i).path_in_schema.split(".")[0] in media)
        row_bytes = max(row_bytes, held // max(chunks.num_rows, 1))
    return max(1, min(64, PARQUET_BATCH_BYTES // max(row_bytes, 1)))


PARQUET = SourceFormat("parquet", parquet_units, count_files(".parquet"), {"parquet": read_parquet},
                       extensions=("parquet",), holds=lambda listing: top_level(listing, ".parquet"))
