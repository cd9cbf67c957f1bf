"""`parquet`: a parquet file, or a folder of them, with media bytes (or a `{bytes, path}` struct, as
HF datasets exports) and captions in columns."""

from __future__ import annotations

from collections.abc import Iterator

import fsspec
import pyarrow.parquet as pq

from configs.schema import MAX_REFERENCES, SourceConfig
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
        masks, references = source.masks == "column", source.references == "column"
        columns = [source.image_column, source.caption_column, source.mask_column if masks else None,
                   source.reference_column if references else None]
        missing = set(filter(None, columns)) - set(parquet.schema_arrow.names)
        if missing:
            raise RuntimeError(f"dataset source {fs.unstrip_protocol(file)}: no column {sorted(missing)}")
        row = 0
        read = [column for column in columns if column]
        media = {source.image_column, *read[2:]}  # mask and reference bytes are held as the pictures' are
        for batch in parquet.iter_batches(batch_size=parquet_batch_rows(parquet, media), columns=read,
                                          **PYTHON_BYTES):
            cells = {name: batch.column(name).to_pylist() for name in read}
            for at in range(batch.num_rows):
                candidate = Candidate(f"{fs.unstrip_protocol(file)}#{row}", fmt)
                row += 1
                try:
                    candidate.captions = caption_variants(cells[source.caption_column][at])
                    candidate.image = cell_bytes(cells[source.image_column][at])
                    if candidate.image is None:
                        raise Rejected("missing_image", "no image bytes in the row")
                    if masks:
                        candidate.mask = picture_bytes(cells[source.mask_column][at], source.mask_column, "mask")
                    if references:
                        found = cells[source.reference_column][at]
                        found = found if isinstance(found, list) else [] if found is None else [found]
                        if not found:
                            raise Rejected("missing_reference",
                                           f"no reference bytes in the row's {source.reference_column!r}")
                        if len(found) > MAX_REFERENCES:
                            raise Rejected("bad_reference", f"the row's {source.reference_column!r} holds "
                                                            f"{len(found)} references, more than {MAX_REFERENCES}")
                        candidate.references = [
                            (f"{candidate.source}:{source.reference_column}[{number}]",
                             picture_bytes(cell, source.reference_column, "reference"))
                            for number, cell in enumerate(found)]
                except Rejected as problem:
                    candidate.problem = problem
                yield candidate


def picture_bytes(cell, column: str, kind: str) -> bytes:
    """A mask's or reference's bytes from its cell: `missing_<kind>` when there are none, `bad_<kind>`
    when the cell holds anything else."""
    found = cell_bytes(cell)
    if found is None:
        raise Rejected(f"missing_{kind}", f"no {kind} bytes in the row's {column!r}")
    if not isinstance(found, bytes):
        raise Rejected(f"bad_{kind}", f"the row's {column!r} holds {type(found).__name__}, not a {kind}'s bytes")
    return found


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
