"""Data prep on a Dask cluster that shares no disk with the flow: only an S3 root.

The cluster's worker processes run in a directory of their own, with a cache directory
of their own, and a worker plugin refuses (PermissionError) and records every access
they make to the flow's temporary directory: the flow's cache, the flow's copy of the
raw logs and the local artifact root of the thread run all live there. ingest,
preprocess and shard of configs/tiny.yaml then run on the cluster against a moto S3
root, and the shards must be byte-identical to the default thread runner's on a local
root (the in-process shuffle), with the shuffle's three passes recorded on the workers.
"""

import json
import os
import tempfile
import uuid
from collections import Counter
from pathlib import Path

import pytest

from artifacts.errors import StoreUnreachable
from artifacts.locations import CACHE_DIR_ENV, filesystem, read_text_or_none
from artifacts.store import MANIFEST, materialize, remote_manifest
from data_prep.synthetic import generate_logs
from flows.config import load_config
from tasks.ingest import check_workers

distributed = pytest.importorskip("distributed")
pytest.importorskip("prefect_dask")
s3fs = pytest.importorskip("s3fs", reason="pip install -e '.[s3]'")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
DATA_STAGES = ["ingest", "preprocess", "shard"]
# Functions whose calls the guard records on the workers (module, name).
RECORDED = [
    ("data_prep.ingest", "ingest_file"),
    ("tasks.ingest", "ingest_file"),
    ("data_prep.preprocess", "_count_file"),
    ("data_prep.preprocess", "_transform_file"),
    ("data_prep.shard", "scatter_unit"),
    ("data_prep.shard", "deal_bucket"),
    ("data_prep.shard", "write_part"),
    ("tasks.common", "_describe_nth"),
]


class SharedNothingGuard(distributed.WorkerPlugin):
    """Moves a worker into a directory of its own and forbids it the flow's directory.

    Python-level file access (open, listdir, scandir, mkdir, rename, remove: the audit
    events) and pyarrow's path-based Parquet/Arrow readers and writers under
    ``forbidden`` raise PermissionError and are recorded in ``violations``.
    """

    name = "shared-nothing-guard"

    def __init__(self, forbidden: str, workdir: str) -> None:
        self.forbidden = forbidden
        self.workdir = workdir
        self.violations: list[str] = []
        self.calls: list[str] = []

    def setup(self, worker) -> None:
        import functools
        import importlib
        import sys

        import pyarrow as pa
        import pyarrow.parquet as pq

        home = Path(self.workdir) / f"worker-{os.getpid()}"
        home.mkdir(parents=True, exist_ok=True)
        os.chdir(home)

        def forbidden(path) -> bool:
            if isinstance(path, int) or path is None:
                return False
            try:
                text = os.fsdecode(os.fspath(path))
            except TypeError:
                return False
            if "://" in text:
                return False
            absolute = os.path.abspath(text)
            return absolute == self.forbidden or absolute.startswith(self.forbidden + os.sep)

        def refuse(what: str, path) -> None:
            self.violations.append(f"{what}: {path}")
            raise PermissionError(f"shared-nothing worker touched the flow's disk: {path}")

        events = {"open", "os.listdir", "os.scandir", "os.mkdir", "os.rename", "os.remove"}

        def audit(event: str, args: tuple) -> None:
            if event in events and args and forbidden(args[0]):
                refuse(event, args[0])

        sys.addaudithook(audit)

        def guarded(fn, label):
            @functools.wraps(fn)
            def check(*args, **kwargs):
                for value in [*args[:2], *kwargs.values()]:
                    if isinstance(value, str | os.PathLike) and forbidden(value):
                        refuse(label, value)
                return fn(*args, **kwargs)

            return check

        pq.ParquetFile.__init__ = guarded(pq.ParquetFile.__init__, "ParquetFile")
        pq.ParquetWriter.__init__ = guarded(pq.ParquetWriter.__init__, "ParquetWriter")
        for name in ("read_table", "write_table", "read_schema", "read_metadata"):
            setattr(pq, name, guarded(getattr(pq, name), f"pq.{name}"))
        for name in ("new_stream", "open_stream", "new_file", "open_file"):
            setattr(pa.ipc, name, guarded(getattr(pa.ipc, name), f"ipc.{name}"))

        def recorded(fn, label):
            @functools.wraps(fn)
            def call(*args, **kwargs):
                self.calls.append(label)
                return fn(*args, **kwargs)

            return call

        for module_name, name in RECORDED:
            module = importlib.import_module(module_name)
            setattr(module, name, recorded(getattr(module, name), name))


def _report(dask_worker) -> dict:
    guard = dask_worker.plugins[SharedNothingGuard.name]
    return {
        "pid": os.getpid(),
        "cwd": os.getcwd(),
        "violations": guard.violations,
        "calls": guard.calls,
    }


def _open(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _parquet_rows(path: str) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


@pytest.fixture
def s3_root(moto_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """`s3://<a fresh bucket>/x`, with this process's environment pointing at moto."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"recforge-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}/x"


def shard_files(root: str, record: dict) -> tuple[dict[str, bytes], dict]:
    """The shard output's files (bytes) and its manifest, from a local or an S3 root."""
    output = record["stages"]["shard"]["output"]
    if "://" not in root:
        manifest = json.loads((Path(output) / MANIFEST).read_text())
        return {rel: (Path(output) / rel).read_bytes() for rel in manifest["files"]}, manifest
    manifest = remote_manifest(output)
    fs, path = filesystem(output)
    data = f"{path}/{manifest['data']}"
    return {rel: fs.cat_file(f"{data}/{rel}") for rel in manifest["files"]}, manifest


def test_dask_workers_without_the_flows_disk_write_the_thread_runners_shards(
    prefect_server: None, s3_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.cli import task_runner
    from flows.pipeline import pipeline

    # The raw logs, generated on the flow's disk, then put into the bucket.
    raw = tmp_path / "raw"
    generate_logs(load_config(TINY, [f"generate.out={raw}"]).generate)
    bucket = s3_root.removeprefix("s3://").split("/")[0]
    s3fs.S3FileSystem().put(f"{raw}/", f"{bucket}/raw/", recursive=True)
    overrides = [
        f"ingest.path=s3://{bucket}/raw/",
        # 5 buckets for ~4,800 train rows: the shuffle spills, and pass 2 has 5 tasks.
        "shard.shuffle_buffer_rows=1000",
    ]

    # The default: threads, a local root, the in-process shuffle.
    local_root = str(tmp_path / "artifacts")
    path = pipeline.with_options(task_runner=ThreadPoolTaskRunner(max_workers=2))(
        config=TINY, root=local_root, only=DATA_STAGES, overrides=overrides
    )
    local_record = json.loads(Path(path).read_text())

    workdir = tempfile.mkdtemp(prefix="recforge-dask-workers-")
    assert not workdir.startswith(str(tmp_path))
    worker_env = {
        name: os.environ[name]
        for name in (
            "AWS_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
        )
    }
    worker_env[CACHE_DIR_ENV] = str(Path(workdir) / "cache")
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            local_directory=workdir,
            env=worker_env,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.register_plugin(SharedNothingGuard(str(tmp_path), workdir))
        # The guard bites: a worker cannot read the flow's files, neither through Python
        # nor through pyarrow.
        some_raw_file = str(next(raw.iterdir()))
        with pytest.raises(PermissionError):
            client.submit(_open, some_raw_file, pure=False).result()
        parquet = next((tmp_path / "artifacts").rglob("*.parquet"))
        with pytest.raises(PermissionError):
            client.submit(_parquet_rows, str(parquet), pure=False).result()
        client.run(
            lambda dask_worker: dask_worker.plugins[SharedNothingGuard.name].violations.clear()
        )

        # What the ingest task checks first: each worker reaches the root with its own
        # environment and runs this checkout's code.
        check_workers(client, s3_root)
        missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x"
        with pytest.raises(StoreUnreachable, match=r"the Dask worker tcp://127\.0\.0\.1:\d+ "):
            check_workers(client, missing)

        runner = task_runner(None, cluster.scheduler_address)
        # A local input path is refused at once: the workers could not read it.
        state = pipeline.with_options(task_runner=runner)(
            config=TINY,
            root=s3_root,
            only=DATA_STAGES,
            overrides=[f"ingest.path={raw}"],
            return_state=True,
        )
        assert state.is_failed()
        with pytest.raises(Exception, match=rf"ingest.path '{raw}' is a path on this machine"):
            state.result()

        url = pipeline.with_options(task_runner=task_runner(None, cluster.scheduler_address))(
            config=TINY, root=s3_root, only=DATA_STAGES, overrides=overrides
        )
        reports = client.run(_report)

    dask_record = json.loads(read_text_or_none(url))
    assert [dask_record["stages"][s]["status"] for s in DATA_STAGES] == ["ran"] * 3
    local_files, local_manifest = shard_files(local_root, local_record)
    dask_files, dask_manifest = shard_files(s3_root, dask_record)
    assert sorted(dask_files) == sorted(local_files)
    assert len([n for n in local_files if n.startswith("train-")]) == 4
    for name, data in local_files.items():
        assert dask_files[name] == data, name
    strip = {"etag"}
    assert {
        r: {k: v for k, v in e.items() if k not in strip} for r, e in dask_manifest["files"].items()
    } == local_manifest["files"]

    # What the workers published verifies for any runner; the shuffle as tasks on
    # threads (an S3 root, no cluster) writes the same shards again.
    again = pipeline.with_options(task_runner=ThreadPoolTaskRunner(max_workers=2))(
        config=TINY, root=s3_root, only=["shard"], overrides=overrides
    )
    again_record = json.loads(read_text_or_none(again))
    assert [again_record["stages"][s]["status"] for s in DATA_STAGES] == ["cached"] * 2 + ["ran"]
    assert shard_files(s3_root, again_record)[0] == local_files
    # The train stage's way in: a sha256-checked local copy of the published shards.
    copy = materialize(again_record["stages"]["shard"]["output"])
    assert {name: (copy / name).read_bytes() for name in local_files} == local_files

    # Nothing on the workers touched the flow's disk, and they did the work.
    assert {r["cwd"] for r in reports.values()}.isdisjoint({str(REPO), os.getcwd()})
    assert [v for r in reports.values() for v in r["violations"]] == []
    calls = Counter(c for r in reports.values() for c in r["calls"])
    train_rows = dask_record["stages"]["shard"] and dask_manifest["meta"]["rows"]["train"]
    assert calls["ingest_file"] == 2  # one per raw file
    assert calls["_count_file"] == 2 and calls["_transform_file"] == 2
    # The shuffle ran on the workers: pass 1 per train row group (one per preprocessed
    # file here), pass 2 per bucket, pass 3 per train shard plus one per eval split.
    assert calls["scatter_unit"] == 2
    assert calls["deal_bucket"] == -(-train_rows // 1000) == 5
    assert calls["write_part"] == 4 + 2
    assert calls["_describe_nth"] >= len(dask_files)
    # Both workers took part.
    assert all(r["calls"] for r in reports.values())
