"""A hub id is fingerprinted from the hub's metadata, never by downloading weights; the workers'
`from_pretrained` downloads them. Tested against a local endpoint that speaks the hub's API."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import torch

from configs.schema import LatentEncodingConfig, ModelConfig, TextEncodingConfig
from storage.fingerprint import component_fingerprint
from tasks.encode.models import build_text_encoder, build_vae
from tasks.families import family_of
from tasks.identity import text_fingerprints, vae_fingerprint

REPO = "precast/tiny-pixart-sigma"
WEIGHTS = (".safetensors", ".bin")
LFS_SUFFIXES = (*WEIGHTS, ".model")  # what the hub's default .gitattributes keeps in LFS


class FakeHub:
    """The hub's API for model repos: revision info, tree listings with LFS sha256, and
    `resolve` downloads with the headers huggingface_hub reads. Records every request."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []

    def publish(self, repo: str, files: dict[str, bytes]) -> str:
        """A new commit of `files` on `repo`'s main branch; returns its hash."""
        sha = hashlib.sha1(repr(sorted(files.items())).encode() + repo.encode()).hexdigest()
        entry = self.repos.setdefault(repo, {"commits": {}})
        entry["commits"][sha], entry["main"] = dict(files), sha
        return sha

    def files(self, repo: str, revision: str) -> tuple[str, dict[str, bytes]]:
        commits = self.repos[repo]["commits"]
        sha = self.repos[repo]["main"] if revision == "main" else revision
        return sha, commits[sha]

    def downloaded(self, suffixes: tuple[str, ...]) -> list[str]:
        return [path for _, path in self.requests if "/resolve/" in path and path.endswith(suffixes)]


def blob_entry(path: str, data: bytes) -> dict:
    git_oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    entry = {"type": "file", "path": path, "size": len(data), "oid": git_oid}
    if path.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def handler_for(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.answer(body=False)

        def do_GET(self):
            self.answer(body=True)

        def log_message(self, *args):
            pass

        def answer(self, body: bool):
            url = urlsplit(self.path)
            hub.requests.append((self.command, url.path))
            parts = [unquote(part) for part in url.path.strip("/").split("/")]
            api = parts[:2] == ["api", "models"]
            repo = "/".join(parts[2:4] if api else parts[:2])
            if repo not in hub.repos:
                return self.send(404, b"", {"X-Error-Code": "RepoNotFound"})
            rest = parts[4:] if api else parts[2:]
            if not api and rest[:1] == ["resolve"]:
                return self.resolve(repo, rest[1], "/".join(rest[2:]), body)
            revision = rest[1] if rest[:1] in (["revision"], ["tree"]) else "main"
            if revision not in hub.repos[repo]["commits"] and revision != "main":
                return self.send(404, b"", {"X-Error-Code": "RevisionNotFound"})
            sha, files = hub.files(repo, revision)
            if rest[:1] == ["tree"]:
                recursive = parse_qs(url.query).get("recursive") in (["true"], ["True"])
                return self.tree(files, "/".join(rest[2:]), recursive)
            info = {"id": repo, "sha": sha, "siblings": [{"rfilename": path} for path in sorted(files)]}
            self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

        def tree(self, files: dict[str, bytes], folder: str, recursive: bool):
            prefix = f"{folder}/" if folder else ""
            below = [path for path in sorted(files) if path.startswith(prefix)]
            if folder and not below:
                return self.send(404, b"", {"X-Error-Code": "EntryNotFound"})
            entries, folders = [], set()
            for path in below:
                names = path[len(prefix):].split("/")
                for depth in range(1, len(names) if recursive else min(len(names), 2)):
                    folders.add(prefix + "/".join(names[:depth]))
                if recursive or len(names) == 1:
                    entries.append(blob_entry(path, files[path]))
            entries += [{"type": "directory", "path": name, "size": 0, "oid": "0" * 40} for name in sorted(folders)]
            self.send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"})

        def resolve(self, repo: str, revision: str, path: str, body: bool):
            sha, files = hub.files(repo, revision)
            if path not in files:
                return self.send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha})
            data, entry = files[path], blob_entry(path, files[path])
            headers = {"X-Repo-Commit": sha, "ETag": f'"{entry["oid"]}"', "Content-Type": "application/octet-stream"}
            if "lfs" in entry:  # the hub names an LFS file by its sha256
                headers.update({"X-Linked-Etag": f'"{entry["lfs"]["oid"]}"', "X-Linked-Size": str(len(data))})
            self.send(200, data if body else b"", headers, length=len(data))

        def send(self, status: int, data: bytes, headers: dict[str, str], length: int | None = None):
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(data) if length is None else length)}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

    return Handler


def folder_files(folder: str | Path) -> dict[str, bytes]:
    folder = Path(folder)
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_models):
    """The tiny model served as REPO on a loopback endpoint; the hub cache and HF_HOME in tmp_path.
    huggingface_hub reads its settings at import, so its constants are patched (and restored)."""
    from huggingface_hub import constants

    fake = FakeHub()
    fake.publish(REPO, folder_files(tiny_models))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(fake))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    home, cache = tmp_path / "hf-home", tmp_path / "hf-home" / "hub"
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    settings = {"ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": False,
                "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
                "HF_TOKEN_PATH": str(home / "token"), "HF_STORED_TOKENS_PATH": str(home / "stored_tokens")}
    for name, value in settings.items():
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setattr("transformers.utils.hub._hf_api", None)  # its client keeps the endpoint it was made with
    yield fake
    server.shutdown()
    server.server_close()


def set_offline(monkeypatch, offline: bool):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


def fingerprints(path: str) -> tuple[str, str]:
    return (text_fingerprints(ModelConfig(path=path), TextEncodingConfig())["t5"],
            vae_fingerprint(ModelConfig(path=path), LatentEncodingConfig()))


def load_workers_models(path: str):
    """What an encoding worker loads: T5 and the VAE, by precast's own from_pretrained loaders."""
    model = ModelConfig(path=path)
    return build_text_encoder(model, family := family_of(model), family.text.encoders[0], "fp32", "cpu", "none"), \
        build_vae(model, family, "fp32", "cpu")


def test_a_hub_id_is_fingerprinted_without_downloading_weights_and_as_its_local_copy(hub, tiny_models):
    subfolders = ["text_encoder", "tokenizer", "vae", "transformer", "scheduler"]
    assert component_fingerprint(REPO, subfolders) == component_fingerprint(tiny_models, subfolders)
    assert fingerprints(REPO) == fingerprints(tiny_models)
    assert hub.downloaded(WEIGHTS) == []
    # the small files are downloaded (and cached for the workers), the weights only listed
    assert any(path.endswith("/resolve/" + hub.repos[REPO]["main"] + "/text_encoder/config.json")
               for _, path in hub.requests)


def test_workers_download_through_the_endpoint_and_load_what_the_local_copy_holds(hub, tiny_models):
    (text, vae), (local_text, local_vae) = load_workers_models(REPO), load_workers_models(tiny_models)
    assert {"text_encoder/model.safetensors", "vae/diffusion_pytorch_model.safetensors"} <= {
        path.split("/resolve/")[1].split("/", 1)[1] for path in hub.downloaded(WEIGHTS)}
    prompt = ["a red circle on a blue background"]
    tokens = text.tokenizer(prompt, return_tensors="pt")
    assert torch.equal(tokens.input_ids, local_text.tokenizer(prompt, return_tensors="pt").input_ids)
    with torch.no_grad():
        assert torch.equal(text.model(**tokens).last_hidden_state, local_text.model(**tokens).last_hidden_state)
        image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
        assert torch.equal(vae.encode(image).latent_dist.mean, local_vae.encode(image).latent_dist.mean)


def test_offline_the_cached_snapshot_fingerprints_the_same_without_the_hub_or_rereading_weights(
    hub, tiny_models, monkeypatch
):
    import storage.fingerprint as fingerprint

    online = fingerprints(REPO)
    load_workers_models(REPO)
    set_offline(monkeypatch, True)
    hub.requests.clear()
    hashed = []
    read = fingerprint._file_digest.__wrapped__
    monkeypatch.setattr(fingerprint, "_file_digest", lambda path, *key: hashed.append(path) or read(path, *key))
    assert fingerprints(REPO) == online == fingerprints(tiny_models)
    assert hub.requests == []
    assert not [path for path in hashed if "hf-home" in path and path.endswith(WEIGHTS)]


def test_offline_without_the_weights_cached_is_refused_by_name(hub, monkeypatch):
    set_offline(monkeypatch, True)
    with pytest.raises(FileNotFoundError, match=rf"{REPO}'.*text_encoder/ could not be fingerprinted.*offline mode"):
        fingerprints(REPO)
    set_offline(monkeypatch, False)
    fingerprints(REPO)  # caches the small files and the commit's listing, not the weights
    set_offline(monkeypatch, True)
    with pytest.raises(FileNotFoundError, match=r"text_encoder/ could not be fingerprinted(.|\n)*incomplete"):
        fingerprints(REPO)


def test_a_changed_weight_on_the_hub_changes_only_its_components_fingerprint(hub, tiny_models):
    text_fp, vae_fp = fingerprints(REPO)
    files = folder_files(tiny_models)
    hub.publish(REPO, {**files, "README.md": b"a model card edit"})
    assert fingerprints(REPO) == (text_fp, vae_fp)
    weights = bytearray(files["text_encoder/model.safetensors"])
    weights[-1] ^= 1
    hub.publish(REPO, {**files, "text_encoder/model.safetensors": bytes(weights)})
    new_text_fp, new_vae_fp = fingerprints(REPO)
    assert new_text_fp != text_fp and new_vae_fp == vae_fp
    assert hub.downloaded(WEIGHTS) == []


def test_an_unknown_repo_is_refused_by_name(hub):
    with pytest.raises(FileNotFoundError, match=r"'precast/no-such-model'.*vae/ could not be fingerprinted"
                                                r"(.|\n)*RepositoryNotFoundError"):
        component_fingerprint("precast/no-such-model", ["vae"])


def test_a_hub_cache_this_user_cannot_write_is_refused_naming_what_moves_it(hub, tmp_path, monkeypatch):
    """A home this user cannot write in (a container's HOME=/ for a numeric user) holds no hub
    cache: fingerprinting a hub id, and a worker's load of it (its family read from the hub, or
    already known), say which settings move the cache."""
    from huggingface_hub import constants

    from storage.store import UnusableFolder
    from tasks.families import model_json

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a path through a file: no user, root included, can make a folder there
    refused = rf"{re.escape(str(blocked / 'hub'))} cannot be written \(Not a directory: .*\): set HF_HOME \(or " \
              r"HF_HUB_CACHE\) to a folder this user can write in"
    model_json.cache_clear()
    family_of(ModelConfig(path=REPO))  # the family known (from a cache this user could write)
    with monkeypatch.context() as patch:
        patch.setattr(constants, "HF_HUB_CACHE", str(blocked / "hub"))
        with pytest.raises(UnusableFolder, match=refused):
            fingerprints(REPO)
        with pytest.raises(UnusableFolder, match=refused):
            load_workers_models(REPO)
        model_json.cache_clear()
        with pytest.raises(UnusableFolder, match=refused):
            load_workers_models(REPO)
