"""`folder`: pictures and videos in nested folders, each with a caption file beside it
(`x.txt` or `x.caption`: a caption variant a line)."""

from __future__ import annotations

import posixpath
from collections.abc import Iterator

import fsspec

from configs.schema import SourceConfig
from tasks.ingest.formats.base import (MEDIA_EXTENSIONS, Candidate, Limit, SourceFormat, Unit, is_image_name,
                                       companion_unit, media_kind, read_media, refused)
from tasks.ingest.listing import Listing
from tasks.ingest.untrusted import MAX_CAPTION_BYTES, Rejected, caption_variants, read_file

CAPTION_EXTENSIONS = ("txt", "caption")  # in order of preference


def folder_units(listing: Listing, source: SourceConfig) -> Iterator[Unit]:
    """Each picture or video with its caption file, then each caption file with neither beside it
    (a unit that reads nothing: its picture or video never arrived, or was removed)."""
    for image, captions in listing.files_beside(*CAPTION_EXTENSIONS):
        if is_image_name(image.path):
            caption = next(filter(None, captions), None)  # in order of preference
            yield companion_unit(listing, source, image.path, listing.fs.unstrip_protocol(image.path),
                              ["file", image.path, caption and caption.path], *(image, caption) if caption else (image,))
    for caption in listing.alone(CAPTION_EXTENSIONS, MEDIA_EXTENSIONS):
        name = posixpath.basename(caption.path)
        yield refused(listing.fs.unstrip_protocol(caption.path), Rejected(
            "orphan_caption", f"no picture or video named {name.rpartition('.')[0]}.* beside {name}"))


def count_folder(listing: Listing) -> int:
    return (sum(1 for file in listing.files() if is_image_name(file.path))
            + sum(1 for _ in listing.alone(CAPTION_EXTENSIONS, MEDIA_EXTENSIONS)))


def read_captioned_file(fs: fsspec.AbstractFileSystem, fmt: str, source: SourceConfig, args: list,
                        limit: Limit) -> Iterator[Candidate]:
    """An image file of a folder and the caption file beside it (and its companions: its mask and
    references)."""
    file, caption_file, *companions = args
    candidate = Candidate(fs.unstrip_protocol(file), fmt)
    try:
        if caption_file is None:
            stem = posixpath.basename(file).rpartition(".")[0]
            raise Rejected("missing_caption", f"no {stem}.txt or .caption beside the {media_kind(file)}")
        candidate.captions = caption_variants(read_file(fs, caption_file, MAX_CAPTION_BYTES, "missing_caption"))
        read_media(fs, file, limit, candidate, *companions)
    except Rejected as problem:
        candidate.problem = problem
    yield candidate


FOLDER = SourceFormat("folder", folder_units, count_folder, {"file": read_captioned_file})
