"""Shard formats: image shards (parquet), text and latent caches (safetensors).

Text cache (one per text encoder): each caption's sequence, ragged — `embeddings` [total_tokens,
dim] plus `offsets` [rows + 1], the real tokens only for a masked encoder (the attention mask is
implied by the length) or every padded position for an unmasked one; an encoder's further outputs
(a pooled vector: one row of one token) as `<output>.embeddings` and `<output>.offsets`; leading positions
several captions share (`heads.embeddings`, `heads.offsets`, and each row's `head_of`) stored once.
Latent cache: the VAE
posterior of each sample (mean with std or log-variance, or the mean alone, as
`latent_encoding.posterior` says; flipped twins when `flip` is on), one tensor per aspect-ratio
bucket. Both are read
memory-mapped through safetensors, a row at a time.
"""

from __future__ import annotations

import functools
import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import save

from storage.store import PYTHON_BYTES, Store

IMAGE_SHARD_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("image", pa.binary()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("captions", pa.list_(pa.string())),
        ("source", pa.string()),
        # the shard that held this image before its captions or its source's resolution changed (null
        # for an image new to the store): its latents are copied from there where that shard's crop is
        # the same, not encoded again (shards of older stores lack it)
        ("pixels_from", pa.string()),
        # its source's own resolution (null: latent_encoding's; shards of older stores lack it)
        ("resolution", pa.int32()),
        # "reference": a paired sample's reference image (no captions, no sample of its own); null: a sample
        ("role", pa.string()),
        # a paired sample's references' ids (rows of role "reference"), in order; null: none
        ("references", pa.list_(pa.string())),
    ]
)


def shard_id_of(url: str) -> str:
    """The id of an image shard from its URL (`…/shards/images/<id>.parquet`)."""
    return url.rsplit("/", 1)[-1].removesuffix(".parquet")


# images are JPEG, PNG or WebP bytes, compressed already: zstd gained nothing on 250 KB JPEGs and
# cost 1.3 ms an image, most of what writing a shard costs (docs/benchmarks.md)
IMAGE_SHARD_COMPRESSION = {"sample_id": "zstd", "image": "none", "width": "zstd", "height": "zstd",
                           "captions.list.element": "zstd", "source": "zstd", "pixels_from": "zstd",
                           "resolution": "zstd", "role": "zstd",
                           "references.list.element": "zstd"}  # by leaf column path


def pack_image_shard(rows: list[dict[str, Any]]) -> bytes:
    table = pa.Table.from_pylist(rows, schema=IMAGE_SHARD_SCHEMA)
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression=IMAGE_SHARD_COMPRESSION)
    return buffer.getvalue()


def save_deterministic(tensors: dict[str, torch.Tensor], rows: dict[str, Any], meta: dict[str, Any]) -> bytes:
    """A cache shard's safetensors bytes, which depend on the content only: `rows` and `meta` go
    into the header as JSON with sorted keys, however their dicts were built, and the header is
    rewritten with sorted keys too, since the library writes `__metadata__` in hash-map order,
    which differs from call to call (tensor offsets are relative to the data, so only the header's
    length prefix changes)."""
    metadata = {"rows": json.dumps(rows, sort_keys=True), "meta": json.dumps(meta, sort_keys=True)}
    data = save(tensors, metadata=metadata)
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned
    return len(text).to_bytes(8, "little") + text + data[8 + length :]


def read_image_shard(data: bytes, columns: list[str] | None = None) -> pa.Table:
    return read_parquet_bytes(data, columns)


def read_parquet_bytes(data: bytes, columns: list[str] | None = None) -> pa.Table:
    """A parquet file's table (or those of `columns` it has: shards of older stores lack the
    columns added since) from its bytes, decoded in this thread (`PYTHON_BYTES`)."""
    with pq.ParquetFile(pa.BufferReader(data)) as parquet:
        return parquet.read(columns=columns, **PYTHON_BYTES)


# a text shard's heads: the leading positions several of its sequences share (an edit pair's
# pictures, read before its caption and its empty caption), stored once
HEADS, HEAD_OF = "heads", "head_of"


def ragged_name(output: str | None, tensor: str) -> str:
    return tensor if output is None else f"{output}.{tensor}"


def pack_ragged(
    rows: dict[str, int], sequences: list[torch.Tensor], metadata: dict[str, Any],
    more: dict[str, list[torch.Tensor]] | None = None,
    heads: tuple[list[torch.Tensor], list[int]] | None = None,
) -> bytes:
    """Text cache shard: `sequences[i]` is [len_i, dim]; `rows` maps a key to its sequence index;
    `more` holds further outputs by name, indexed alike; `heads`, the shared heads [len_j, dim] and
    each sequence's (-1: none), which it follows: a sequence read back is its head then itself. An
    image shard of references alone has no captions: its text shard holds no rows."""
    tensors = {}
    for output, outputs in [(None, sequences), *(more or {}).items(), *([(HEADS, heads[0])] if heads else [])]:
        lengths = torch.tensor([len(s) for s in outputs], dtype=torch.int64)
        offsets = torch.zeros(len(outputs) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        tensors[ragged_name(output, "embeddings")] = torch.cat(outputs).contiguous() if outputs else torch.zeros(0, 0)
        tensors[ragged_name(output, "offsets")] = offsets
    if heads:
        tensors[HEAD_OF] = torch.tensor(heads[1], dtype=torch.int64)
    return save_deterministic(tensors, rows, metadata)


class RaggedShard:
    """Reader of a text cache shard; `shard[key]` is the [length, dim] embedding of one caption,
    `shard.get(key, output)` that of one of its further outputs."""

    def __init__(self, path: str):
        self._file = safe_open(path, framework="pt")
        header = self._file.metadata()
        self.rows: dict[str, int] = json.loads(header["rows"])
        self.meta: dict[str, Any] = json.loads(header["meta"])
        self._outputs: dict[str | None, tuple[torch.Tensor, Any]] = {}  # offsets and slice, by output

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.get(key)

    def get(self, key: str, output: str | None = None) -> torch.Tensor:
        row = self.rows[key]
        own = self._sequence(output, row)
        if output is None and self._head_of is not None and (head := int(self._head_of[row])) >= 0:
            return torch.cat([self._sequence(HEADS, head), own])
        return own

    def _sequence(self, output: str | None, index: int) -> torch.Tensor:
        if output not in self._outputs:
            self._outputs[output] = (self._file.get_tensor(ragged_name(output, "offsets")),
                                     self._file.get_slice(ragged_name(output, "embeddings")))
        offsets, embeddings = self._outputs[output]
        return embeddings[int(offsets[index]) : int(offsets[index + 1])]

    @functools.cached_property
    def _head_of(self) -> torch.Tensor | None:
        """Each sequence's shared head (-1: none); None in a shard without heads."""
        return self._file.get_tensor(HEAD_OF) if HEAD_OF in self._file.keys() else None


def bucket_name(*sides: int) -> str:
    """A bucket by its latents' sides: "<height>x<width>", or "<frames>x<height>x<width>"."""
    return "x".join(str(side) for side in sides)


def bucket_sides(name: str) -> tuple[int, ...]:
    """`bucket_name`'s inverse: (height, width), or (frames, height, width)."""
    return tuple(int(side) for side in name.split("x"))


def pack_latents(
    buckets: dict[str, dict[str, torch.Tensor]], rows: dict[str, tuple[str, int]], metadata: dict[str, Any]
) -> bytes:
    """Latent cache shard: `buckets[name]` holds `mean` and, per the posterior layout, `std` or
    `logvar` (and `flip_*` twins) [n, C, h, w] or [n, C, F, h, w]; `rows` maps a sample id to (bucket name, index)."""
    tensors = {f"{part}/{name}": t.contiguous() for name, parts in buckets.items() for part, t in parts.items()}
    return save_deterministic(tensors, rows, metadata)


# safetensors' dtype names
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def read_latent_rows(store: Store, key: str, size: int, boxes: dict[str, list[int]]
                     ) -> tuple[dict[str, tuple[str, dict[str, torch.Tensor]]], dict[str, Any]]:
    """The rows of the samples of `boxes` a committed latent shard of `size` bytes holds cropped by
    the same box (the same pixels), each its bucket and every part of it (`mean`, `std` or `logvar`,
    and their `flip_` twins) [1, C, (F,) h, w] in the storage dtype, by ranged reads of its header and
    those rows alone (not the object, nor its hash: a shard encoded from these rows is checked whole
    by whoever reads it), and the shard's meta."""
    header, start = store.read_safetensors_header(key, size)
    rows, meta = (json.loads(header["__metadata__"][name]) for name in ("rows", "meta"))
    wanted, ranges = [], []
    for sample_id in (s for s, box in boxes.items() if s in rows and meta["crop_boxes"].get(s) == box):
        bucket, index = rows[sample_id]
        for name, entry in header.items():
            part, _, held = name.partition("/")
            if held == bucket:  # `pack_latents`' "<part>/<bucket>": row `index` of it
                first, last = entry["data_offsets"]
                width = (last - first) // entry["shape"][0]
                wanted.append((sample_id, bucket, part, entry))
                ranges.append((start + first + width * index, start + first + width * (index + 1)))
    found: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
    for (sample_id, bucket, part, entry), raw in zip(wanted, store.read_ranges(key, ranges)):
        tensor = torch.frombuffer(bytearray(raw), dtype=SAFETENSORS_DTYPES[entry["dtype"]])
        found.setdefault(sample_id, (bucket, {}))[1][part] = tensor.reshape(1, *entry["shape"][1:])
    return found, meta


class LatentShard:
    """Reader of a latent cache shard; `shard.get(sample_id, flipped)` is (mean, std or None),
    each [C, h, w] (or [C, F, h, w]), whatever posterior layout the shard stores."""

    def __init__(self, path: str):
        self._file = safe_open(path, framework="pt")
        header = self._file.metadata()
        self.rows: dict[str, list] = json.loads(header["rows"])
        self.meta: dict[str, Any] = json.loads(header["meta"])

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.rows

    def get(self, sample_id: str, flipped: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        bucket, index = self.rows[sample_id]
        prefix = "flip_" if flipped else ""
        mean = self._file.get_slice(f"{prefix}mean/{bucket}")[index]
        posterior = self.meta["posterior"]
        if posterior == "mean_std":
            return mean, self._file.get_slice(f"{prefix}std/{bucket}")[index]
        if posterior == "mean_logvar":
            return mean, torch.exp(0.5 * self._file.get_slice(f"{prefix}logvar/{bucket}")[index].float())
        return mean, None

    def mask(self, sample_id: str, flipped: bool = False) -> torch.Tensor | None:
        """The sample's loss mask on its latents' grid [1, (F,) h, w], or None when its shard holds
        no masked picture."""
        bucket, index = self.rows[sample_id]
        name = f"{'flip_' if flipped else ''}mask/{bucket}"
        return self._file.get_slice(name)[index] if name in self._names else None

    @functools.cached_property
    def _names(self) -> set[str]:
        return set(self._file.keys())

def collate(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-caption text features → a batch's: sequences [len_i, D] right-padded to the longest
    ([B, L, D] float32, and their mask [B, L] as `<name>_mask`), vectors [D] stacked [B, D]."""
    batch = {}
    for name in features[0]:
        values = [feature[name] for feature in features]
        if values[0].ndim == 1:
            batch[name] = torch.stack([value.float() for value in values])
        else:
            batch[name], batch[f"{name}_mask"] = pad_sequences(values)
    return batch


def pad_sequences(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [len_i, D] tensors to the longest: ([B, L, D] float32, [B, L] mask)."""
    longest = max(len(s) for s in sequences)
    out = torch.zeros(len(sequences), longest, sequences[0].shape[-1])
    mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for i, sequence in enumerate(sequences):
        out[i, : len(sequence)] = sequence.float()
        mask[i, : len(sequence)] = 1
    return out, mask
