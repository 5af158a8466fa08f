"""Storage on a busy S3 (tests/faulty_s3.py in front of the tests' server): transient faults
are retried, never reported as the user's; past the budget they stay transient; a damaged
object is still damaged; a half-written object never appears under its name."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core import storage
from pipeline.core.entry import user_error
from pipeline.core.errors import ArtifactError, ConfigError, InputError, StorageError, TransientStorageError
from tests.faulty_s3 import FaultPlan, FaultyS3


@pytest.fixture
def busy_s3(s3_endpoint, s3_bucket, monkeypatch):
    """The tests' S3 behind the fault-injecting proxy, for this process's storage calls."""
    proxy = FaultyS3(s3_endpoint, FaultPlan(error_rate=0.25, reset_rate=0.05, seed=7)).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("RAYDENSE_S3_RETRY_SECONDS", "60")
    yield proxy, f"s3://{s3_bucket}"
    proxy.stop()


# What pyarrow and botocore raise, as they word it.
FAULTS = [
    (
        "When reading information for key 'a' in bucket 'b': AWS Error UNKNOWN (HTTP status 503) during HeadObject operation: No response body.",
        True,
    ),
    ("When reading 'a': AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate.", True),
    ("AWS Error INTERNAL_FAILURE during PutObject operation: We encountered an internal error.", True),
    ("AWS Error UNKNOWN (HTTP status 502) during ListObjectsV2 operation", True),
    (
        "AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56, Failure when receiving data from the peer",
        True,
    ),
    ("curlCode: 28, Timeout was reached", True),
    ("AWS Error ACCESS_DENIED during HeadObject operation: Access Denied (HTTP status 403)", False),
    ("AWS Error NO_SUCH_BUCKET during ListObjectsV2 operation: The specified bucket does not exist", False),
    ("AWS Error UNKNOWN (HTTP status 404) during HeadObject operation", False),
    ("Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file.", False),
]


@pytest.mark.parametrize("text,transient", FAULTS)
def test_transient_faults_are_told_from_permanent_ones(text, transient):
    assert storage.is_transient(OSError(text)) is transient


def test_botocore_and_socket_faults_are_classified_by_code_and_status():
    from botocore.exceptions import ClientError, EndpointConnectionError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")

    assert storage.is_transient(client_error("SlowDown", 503))
    assert storage.is_transient(client_error("503", 503))  # a HEAD's: no body, the status for its code
    assert not storage.is_transient(client_error("NoSuchKey", 404))
    assert not storage.is_transient(client_error("AccessDenied", 403))
    assert storage.is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert storage.is_transient(ConnectionResetError("reset by peer"))
    assert not storage.is_transient(FileNotFoundError("gone"))
    assert not storage.is_transient(InputError("a user's"))


def test_one_s3_filesystem_serves_every_call_of_a_process(s3_endpoint):
    """Mutation: building a filesystem in every ``resolve`` (as before) fails this."""
    assert storage.resolve("s3://a/b").fs is storage.resolve("s3://c/d").fs


def _operations(root: str, scratch) -> dict:
    """Every kind of storage call once, what each returned."""
    storage.write_bytes(f"{root}/a/one.bin", b"1" * 100_000)
    storage.write_json(f"{root}/a/two.json", {"x": 1})
    with storage.open_output(f"{root}/a/three.txt.gz") as out:
        out.write(b"line\n" * 1000)
    pq.write_table(pa.table({"v": np.arange(5000)}), scratch / "t.parquet")
    (scratch / "dir").mkdir(exist_ok=True)
    (scratch / "dir" / "f.txt").write_text("up")
    storage.upload_dir(scratch / "dir", f"{root}/up")
    storage.write_bytes(f"{root}/a/t.parquet", (scratch / "t.parquet").read_bytes())
    with storage.open_input(f"{root}/a/one.bin") as f:
        streamed = f.read(10) + f.read()
    with storage.open_input(f"{root}/a/one.bin", random_access=True) as f:
        ranged = f.read_at(7, 99_990)
    storage.copy_dir(f"{root}/up", f"{root}/copied")
    result = {
        "bytes": storage.read_bytes(f"{root}/a/one.bin"),
        "streamed": streamed,
        "ranged": ranged,
        "json": storage.read_json(f"{root}/a/two.json"),
        "lines": sum(1 for _ in storage.iter_lines(f"{root}/a/one.bin")),
        "parquet": storage.read_parquet(f"{root}/a/t.parquet")["v"].to_pylist()[-3:],
        "footer": storage.read_parquet_metadata(f"{root}/a/t.parquet").num_rows,
        "files": [f.rsplit("/", 2)[-2:] for f in storage.list_files(root)],
        "sizes": storage.file_sizes(f"{root}/a"),
        "exists": storage.exists(f"{root}/a/two.json"),
        "download": open(os.path.join(storage.download_dir(f"{root}/copied", scratch / "down"), "f.txt")).read(),
    }
    storage.delete_file(f"{root}/a/two.json")
    storage.delete_dir(f"{root}/up")
    result["after_delete"] = [f.rsplit("/", 1)[-1] for f in storage.list_files(root)]
    return result


def test_every_storage_call_gives_on_a_busy_s3_what_it_gives_on_a_quiet_one(busy_s3, tmp_path):
    """Mutation: pyarrow's own 3 attempts and no retry of ours (``retrying`` calling once)
    fails this on the 25% of faults (a call meets three in a row in about 2% of cases)."""
    proxy, root = busy_s3
    proxy.faults = False
    (tmp_path / "quiet").mkdir()
    quiet = _operations(f"{root}/quiet", tmp_path / "quiet")
    proxy.faults = True
    before = proxy.counts.injected
    (tmp_path / "busy").mkdir()
    busy = _operations(f"{root}/busy", tmp_path / "busy")
    assert busy == quiet
    assert proxy.counts.injected - before > 20  # the faults were met, and outlived
    assert proxy.counts.resets > 0 and proxy.counts.slowdown > 0 and proxy.counts.internal > 0


def test_a_throttling_storm_is_waited_out_with_backoff(busy_s3):
    """Mutation: ``retrying`` without its loop (one call) fails this with the storm's 503."""
    proxy, root = busy_s3
    proxy.faults = False
    storage.write_bytes(f"{root}/stormy", b"x")
    proxy.faults = True
    proxy.plan.error_rate = proxy.plan.reset_rate = 0.0
    retried, slept = storage.RETRIES.transient, storage.RETRIES.backoff_s
    proxy.storm(3.0)
    started = time.monotonic()
    assert storage.read_bytes(f"{root}/stormy") == b"x"
    assert time.monotonic() - started >= 2.5
    assert storage.RETRIES.transient > retried and storage.RETRIES.backoff_s > slept


def test_storage_that_stays_throttled_past_the_budget_is_a_transient_failure_not_the_users(busy_s3, monkeypatch):
    """Past ``RAYDENSE_S3_RETRY_SECONDS`` the error is transient (exit 1, retryable), never a
    StorageError (exit 2, the user's). Mutation: raising StorageError there fails this."""
    proxy, root = busy_s3
    monkeypatch.setenv("RAYDENSE_S3_RETRY_SECONDS", "1")
    proxy.storm(30.0)
    with pytest.raises(TransientStorageError, match=r"cannot stat s3://.*kept failing transiently for 1 s") as caught:
        storage.exists(f"{root}/anything")
    assert not isinstance(caught.value, StorageError)
    error = user_error(caught.value)
    assert error is caught.value and error.exit_code == 1 and error.retryable
    proxy.storm(0)


def test_an_upload_that_failed_is_reported_and_leaves_no_object(busy_s3, monkeypatch):
    """pyarrow's ``copy_files`` let an upload whose part S3 refused be closed by its destructor,
    which ignored the error: the copy returned, the object was never written (a staged text
    shard went missing so). Mutation: ``copy_files`` back in ``_upload_file``."""
    proxy, root = busy_s3
    monkeypatch.setenv("RAYDENSE_S3_RETRY_SECONDS", "1")
    proxy.plan.error_rate = proxy.plan.reset_rate = 0.0
    proxy.storm(30.0, matching="partNumber=")  # the upload starts; its parts are refused
    with pytest.raises(TransientStorageError):
        with storage.open_output(f"{root}/upload.bin") as out:
            out.write(b"u" * 1000)
    proxy.storm(0)
    assert not storage.exists(f"{root}/upload.bin")


def test_a_missing_object_is_not_retried(busy_s3):
    proxy, root = busy_s3
    proxy.faults = False
    asked = proxy.counts.requests
    with pytest.raises(StorageError, match="no such file"):
        storage.read_bytes(f"{root}/never-written")
    assert proxy.counts.requests - asked <= 2  # a GET (and the SDK's HEAD), no retries


def _prepared_shard(path) -> bytes:
    ids = pa.array([np.arange(i, i + 8, dtype=np.int32) for i in range(200)], pa.list_(pa.int32()))
    pq.write_table(pa.table({"row": np.arange(200), "input_ids": ids}), path)
    return open(path, "rb").read()


def test_a_damaged_shard_is_damaged_and_a_throttled_one_is_not(busy_s3, tmp_path, monkeypatch):
    """A shard whose bytes changed (same size) is reported damaged, however busy S3 is; a
    shard that only could not be read within the budget is a transient failure, never
    "damaged" with advice to prepare the corpus again."""
    from pipeline.data.shards import read_shard_tokens

    proxy, root = busy_s3
    data = bytearray(_prepared_shard(tmp_path / "s.parquet"))
    storage.write_bytes(f"{root}/good.parquet", bytes(data))
    assert len(read_shard_tokens(f"{root}/good.parquet")["row"]) == 200
    data[len(data) // 3 : len(data) // 3 + 64] = b"\xff" * 64  # inside the data pages
    data[-8:-4] = (len(data) * 2).to_bytes(4, "little")  # and the footer's length
    storage.write_bytes(f"{root}/bad.parquet", bytes(data))
    with pytest.raises(ArtifactError, match=r"bad.parquet is damaged"):
        read_shard_tokens(f"{root}/bad.parquet")
    monkeypatch.setenv("RAYDENSE_S3_RETRY_SECONDS", "1")
    proxy.storm(30.0)
    with pytest.raises(TransientStorageError):
        read_shard_tokens(f"{root}/good.parquet")
    proxy.storm(0)


def test_a_text_shard_is_stored_whole_or_not_at_all(busy_s3, tmp_path):
    """Staging that fails on a bad record half-way through a shard leaves no object under the
    shard's name. Mutation: the ParquetWriter straight onto S3 (as before): its destructor
    closed it, and a valid shard of the first 4,096 rows appeared."""
    from pipeline.data.corpus import Piece
    from pipeline.data.text_shards import write_text_shards

    proxy, root = busy_s3
    proxy.faults = False
    lines = [json.dumps({"_id": f"d{i}", "text": f"passage {i}"}) for i in range(5000)]
    lines[4500] = "{not json"
    storage.write_bytes(f"{root}/raw/corpus.jsonl", ("\n".join(lines) + "\n").encode())
    with pytest.raises(InputError, match="line 4501"):
        write_text_shards([Piece(f"{root}/raw/corpus.jsonl")], f"{root}/text", "part", docs_per_shard=10_000)
    import gc

    gc.collect()  # what a destructor would store, it stores now
    assert storage.list_files(f"{root}/text") == []


def test_a_stage_is_run_again_after_a_transient_failure_and_not_after_the_users(tmp_path):
    """``run_units``' retries take storage that kept failing; a user's error ends at once."""
    from pipeline.workflows.manifest import RunManifest
    from pipeline.workflows.units import Unit, run_units

    calls = {"flaky": 0, "mistake": 0}

    def flaky():
        calls["flaky"] += 1
        if calls["flaky"] == 1:
            raise TransientStorageError("cannot read s3://b/x: object storage kept failing transiently")
        return {}

    def mistake():
        calls["mistake"] += 1
        raise ConfigError("--k 0: must be at least 1")

    manifest = RunManifest(str(tmp_path / "run"), "run.json")
    run_units(manifest, [Unit("flaky", flaky)], "[test]", retries=2)
    assert calls["flaky"] == 2
    with pytest.raises(ConfigError):
        run_units(manifest, [Unit("mistake", mistake)], "[test]", retries=2)
    assert calls["mistake"] == 1


def _throttled_shard(batch):
    raise TransientStorageError("cannot read s3://b/corpus/part-00000.parquet: object storage kept failing transiently")


def test_a_transient_failure_in_a_data_task_is_ray_trains_to_restart_not_the_users(shared_ray):
    """What a training worker meets when its Ray Data read task gave up on a throttled S3: not
    a deterministic error (no user_error.json, no exit 2): Ray Train's max_failures restarts
    the run. Mutation: TransientStorageError among failures.DETERMINISTIC fails this."""
    import sys

    import ray
    from ray import cloudpickle

    from pipeline.training.failures import fed_user_error, round_trips

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the map function reaches the tasks by value

    @ray.remote
    def consume(dataset):  # as a training worker reads its stream
        try:
            for _ in dataset.iter_batches():
                pass
        except Exception as exc:  # noqa: BLE001 - whatever the iterator raises
            return fed_user_error(exc), round_trips(exc), str(exc)

    fed, travels, text = ray.get(consume.remote(ray.data.range(4).map_batches(_throttled_shard)))
    assert fed is None and travels
    assert "kept failing transiently" in text


def test_bytes_written_to_a_gz_name_on_s3_are_stored_as_given(s3_endpoint, s3_bucket):
    """A gzipped file uploaded whole stays one gzip: pyarrow's default compressed the bytes of
    a ``*.gz`` name again (locally they were stored as given), and the corpus read back as
    invalid UTF-8. Mutation: ``open_output_stream`` with its default compression."""
    import gzip

    import boto3

    packed = gzip.compress(b'{"_id": "q1", "text": "a query"}\n')
    storage.write_bytes(f"s3://{s3_bucket}/queries.jsonl.gz", packed)
    stored = boto3.client("s3").get_object(Bucket=s3_bucket, Key="queries.jsonl.gz")["Body"].read()
    assert stored == packed
