"""Sealed folders: a folder that says which files make it whole.

The last step of writing a folder (a training checkpoint) is its seal, ``seal_<writer>.json``:
every file's size and SHA-256, signed (HMAC-SHA256) with the run's :class:`SealKey`.
Several writers may fill one folder (each rank of a checkpoint seals the files it wrote). A
folder is taken for whole only when it is sealed and every sealed file is there:
:func:`damage` decides that from a listing (sizes: cheap, also on S3), :func:`verify` from
the files themselves (hashes: what a loader does once it holds them). A folder found corrupt
is marked (``damaged.json``), so the next reader passes it over without reading it again.

The signature is what keeps a planted checkpoint from being loaded: anyone who can write the
bucket can write a folder and a seal beside it, but not sign the seal without the key, which
never goes to storage (:func:`seal_key`). :func:`verify` raises on a seal that is unsigned
or signed with another key, before any file of the folder is hashed or loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from dataclasses import dataclass, field

from pipeline.core import storage
from pipeline.core.errors import ArtifactError

SEAL = re.compile(r"^seal_[\w.-]+\.json$")
DAMAGED = "damaged.json"
KEY_ENV = "RAYDENSE_CHECKPOINT_KEY"


@dataclass(frozen=True)
class SealKey:
    """The secret seals are signed with, and where it came from (for messages). Its repr
    leaves the secret out: configs holding it are logged."""

    secret: bytes = field(repr=False)
    source: str

    def sign(self, files: dict[str, list]) -> str:
        message = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()


def seal_key(run_dir: str) -> SealKey:
    """``$RAYDENSE_CHECKPOINT_KEY`` (on a cluster, a Secret every pod reads); without it, a
    key generated for this run on first use and kept on this machine, outside the run's
    storage (mode 0600, under the node-local cache): a rerun elsewhere cannot resume."""
    value = os.environ.get(KEY_ENV, "")
    if value:
        return SealKey(value.encode(), f"${KEY_ENV}")
    folder = os.path.join(storage.cache_root(), "checkpoint_keys")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, hashlib.sha256(run_dir.encode()).hexdigest()[:32] + ".key")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        with open(path, "rb") as f:
            return SealKey(f.read().strip(), path)
    secret = secrets.token_hex(32).encode()
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return SealKey(secret, path)


def seal(local_dir: str, writer: str, key: SealKey) -> None:
    """Seal the files under ``local_dir`` as ``writer``'s (write it last)."""
    files = {}
    for rel, path in _local_files(local_dir).items():
        if not SEAL.match(rel) and rel != DAMAGED:
            files[rel] = [os.path.getsize(path), _sha256(path)]
    with open(os.path.join(local_dir, f"seal_{writer}.json"), "w") as f:
        json.dump({"files": files, "hmac": key.sign(files)}, f, indent=1, sort_keys=True)


def damage(uri: str, listing: dict[str, int] | None = None) -> str | None:
    """What makes the stored folder not whole, judged by its listing (``listing``: its
    :func:`storage.file_sizes`, when the caller has it), or None."""
    listing = storage.file_sizes(uri) if listing is None else listing
    if DAMAGED in listing:
        return storage.read_json(storage.join(uri, DAMAGED)).get("problem", "marked damaged")
    sealed = _sealed_files({rel: storage.read_json(storage.join(uri, rel)) for rel in listing if SEAL.match(rel)})
    return _missing_or_cut(sealed, listing)


def verify(local_dir: str, key: SealKey, name: str = "") -> str | None:
    """What makes the local folder not whole, every sealed file hashed, or None. Raises
    :class:`ArtifactError` first if a seal is not signed with ``key`` (``name``: the
    folder, for the message)."""
    paths = _local_files(local_dir)
    seals = {}
    for rel, path in paths.items():
        if SEAL.match(rel):
            with open(path) as f:
                seals[rel] = json.load(f)
    for rel, content in sorted(seals.items()):
        if not hmac.compare_digest(str(content.get("hmac", "")), key.sign(content.get("files", {}))):
            how = "is not signed" if "hmac" not in content else f"is not signed with this run's key ({key.source})"
            raise ArtifactError(
                f"checkpoint {name or local_dir}: {rel} {how}: planted, or written with another key; "
                f"not resuming from it (set {KEY_ENV} to the key it was written with, or remove the "
                "folder to resume from an earlier checkpoint)"
            )
    sealed = _sealed_files(seals)
    problem = _missing_or_cut(sealed, {rel: os.path.getsize(path) for rel, path in paths.items()})
    if problem is None and sealed is not None:
        for rel, (_, digest) in sorted(sealed.items()):
            if _sha256(paths[rel]) != digest:
                return f"{rel} does not hold what was written (SHA-256 differs)"
    return problem


def mark_damaged(uri: str, problem: str) -> None:
    storage.write_json(storage.join(uri, DAMAGED), {"problem": problem})


def _sealed_files(seals: dict[str, dict]) -> dict[str, list] | None:
    if not seals:
        return None
    files: dict[str, list] = {}
    for content in seals.values():
        files.update(content["files"])
    return files


def _missing_or_cut(sealed: dict[str, list] | None, sizes: dict[str, int]) -> str | None:
    if sealed is None:
        return "not sealed (unfinished, or written before raydense sealed checkpoints)"
    for rel, (size, _) in sorted(sealed.items()):
        if rel not in sizes:
            return f"{rel} is missing"
        if sizes[rel] != size:
            return f"{rel} holds {sizes[rel]} bytes, {size} were written"
    return None


def _local_files(local_dir: str) -> dict[str, str]:
    out = {}
    for root, _, names in os.walk(local_dir):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, local_dir).replace(os.sep, "/")] = path
    return out


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
