"""The artifact store, registry and train checkpoints on S3: a moto server on 127.0.0.1.

Every test gets its own bucket and its own local cache directory (the "machine"), with
AWS_ENDPOINT_URL pointing at the session's moto server and fake credentials.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from artifacts.checkpoint_mirror import CheckpointMirror
from artifacts.checkpoints import CheckpointStore
from artifacts.errors import CorruptOutput, StoreUnreachable
from artifacts.locations import CACHE_DIR_ENV, filesystem, read_text_or_none
from artifacts.registry import CHAMPION, ChampionMoved, Registry
from artifacts.store import CHAOS_PUBLISH_FAULT, MANIFEST, ArtifactStore, materialize
from data_prep.synthetic import generate_logs
from flows.config import load_config

s3fs = pytest.importorskip("s3fs", reason="pip install -e '.[s3]'")

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
FP = "0" * 64


def s3_environment(endpoint: str, cache: Path) -> dict[str, str]:
    """The variables that point boto at the moto server, with fake credentials."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        CACHE_DIR_ENV: str(cache),
    }


@pytest.fixture
def s3_root(moto_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """`s3://<a fresh bucket>/x`, with this test's environment pointing at moto."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_environment(moto_endpoint, tmp_path / "cache").items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # no client made with other settings
    bucket = f"recforge-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}/x"


def publish(store: ArtifactStore, stage: str, fp: str, files: dict[str, bytes], meta: dict):
    staging = store.new_staging(stage, fp)
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    return store.publish(stage, fp, staging, meta)


def objects(url: str) -> list[str]:
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    return sorted(name.removeprefix(path + "/") for name in fs.find(path))


def test_publish_uploads_files_then_the_manifest_and_a_reader_trusts_only_that(
    s3_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(s3_root)
    assert store.verify("ingest", FP) == (None, f"no output at {s3_root}/stages/ingest/{FP}")
    manifest = publish(store, "ingest", FP, {"a.txt": b"hello", "d/b.bin": b"\0" * 9}, {"k": 1})
    url = store.output_url("ingest", FP)
    data = manifest["data"]
    assert objects(url) == [MANIFEST, f"{data}/a.txt", f"{data}/d/b.bin"]
    assert json.loads(read_text_or_none(f"{url}/{MANIFEST}")) == manifest
    assert store.verify("ingest", FP)[0]["meta"] == {"k": 1}  # a cache hit, no download

    # Another machine (an empty cache) materializes the output, sha256-checked.
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "elsewhere"))
    local = materialize(url)
    assert local.is_relative_to(tmp_path / "elsewhere")
    assert (local / "a.txt").read_bytes() == b"hello" and (local / "d/b.bin").stat().st_size == 9

    # Republishing writes a new data prefix and commits it with one manifest write; the
    # replaced objects go once nothing names them.
    second = publish(store, "ingest", FP, {"a.txt": b"world"}, {"k": 2})
    assert objects(url) == [MANIFEST, f"{second['data']}/a.txt"]
    assert (materialize(url) / "a.txt").read_bytes() == b"world"

    # Killed after the files, before the manifest: the old output stays the only one.
    script = (
        "import sys; from pathlib import Path; from artifacts.store import ArtifactStore\n"
        "store = ArtifactStore(sys.argv[1]); staging = store.new_staging('ingest', '0' * 64)\n"
        "(staging / 'a.txt').write_text('torn'); store.publish('ingest', '0' * 64, staging, {})\n"
    )
    env = {**os.environ, CHAOS_PUBLISH_FAULT: "ingest:before-manifest"}
    killed = subprocess.run(
        [sys.executable, "-c", script, s3_root],
        cwd=REPO,
        env=env,
        start_new_session=True,
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert len(objects(url)) == 3  # the killed upload's object, named by no manifest
    assert store.verify("ingest", FP)[0]["meta"] == {"k": 2}


def test_a_corrupted_object_is_refused_by_its_manifest(
    s3_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(s3_root)
    manifest = publish(store, "shard", FP, {"part-0.bin": b"abcdef"}, {})
    url = store.output_url("shard", FP)
    fs, path = filesystem(url)
    key = f"{path}/{manifest['data']}/part-0.bin"

    fs.pipe_file(key, b"abcdeF")  # same size, one byte flipped
    with pytest.raises(CorruptOutput, match=r"part-0\.bin was written again.*--force shard"):
        store.verify("shard", FP)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "fresh"))  # nothing materialized yet
    with pytest.raises(CorruptOutput, match=rf"{manifest['data']}/part-0\.bin does not match"):
        materialize(url)
    assert not list((tmp_path / "fresh").rglob("part-0.bin"))  # nothing half-trusted

    fs.pipe_file(key, b"abc")
    with pytest.raises(CorruptOutput, match="has 3 bytes, the manifest 6"):
        store.verify("shard", FP)
    fs.rm(key)
    with pytest.raises(CorruptOutput, match="listed in the manifest is missing"):
        store.verify("shard", FP)


def register(root: str, version: str) -> None:
    """A verified package (no ONNX: no infra report needed) as `version` of model `m`."""
    store = ArtifactStore(root)
    publish(store, "export", version * 32, {"model.safetensors": version.encode()}, {})
    store.publish_model("m", version, store.output_url("export", version * 32))


@pytest.mark.parametrize("where", ["s3", "local"])
def test_of_two_concurrent_promotions_exactly_one_wins(
    s3_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    root = s3_root if where == "s3" else str(tmp_path / "artifacts")
    for version in ("v1", "v2", "v3", "v4"):
        register(root, version)

    def race(first: str, second: str) -> dict[str, BaseException | None]:
        # Both promoters read CHAMPION, then both verify (the barrier), then both write.
        barrier = threading.Barrier(2)
        verify = Registry.verify

        def slow_verify(self: Registry, version: str) -> Path:
            barrier.wait(timeout=30)
            return verify(self, version)

        outcome: dict[str, BaseException | None] = {}

        def promote(version: str) -> None:
            try:
                Registry(root, "m").promote(version, "race")
                outcome[version] = None
            except ChampionMoved as err:
                outcome[version] = err

        with monkeypatch.context() as patch:
            patch.setattr(Registry, "verify", slow_verify)
            threads = [threading.Thread(target=promote, args=(v,)) for v in (first, second)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
        return outcome

    registry = Registry(root, "m")
    for first, second, previous in (("v1", "v2", None), ("v3", "v4", "v1|v2")):
        outcome = race(first, second)
        winners = [v for v, err in outcome.items() if err is None]
        assert len(winners) == 1, outcome  # never both, never neither
        loser = next(v for v, err in outcome.items() if err is not None)
        assert "nothing was changed" in str(outcome[loser]) and f"{registry.url}/" in str(
            outcome[loser]
        )
        assert registry.champion() == winners[0]
        record = registry.champion_record()
        assert (record["previous"] or "None") in (previous or "None").split("|")
    assert [h["version"] for h in registry.history()] == [
        v for v in ("v1", "v2", "v3", "v4") if v in {h["version"] for h in registry.history()}
    ]
    assert len(registry.history()) == 2  # the losers left no trace
    assert registry.rollback()["version"] == registry.history()[0]["version"]
    if where == "s3":
        assert read_text_or_none(f"{registry.url}/{CHAMPION}") is not None
        assert sorted(v.name for v in registry.versions()) == ["v1", "v2", "v3", "v4"]


def test_an_unreachable_bucket_or_missing_credentials_fail_once_naming_the_url(
    s3_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x"
    with pytest.raises(StoreUnreachable, match=rf"{missing}.*bucket exists.*AWS_ENDPOINT_URL"):
        ArtifactStore(missing).check_reachable()
    ArtifactStore(s3_root).check_reachable()  # the fixture's bucket answers

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(StoreUnreachable, match=rf"{s3_root}.*AWS_ACCESS_KEY_ID"):
            ArtifactStore(s3_root).check_reachable()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def commit(store: CheckpointStore, step: int, payload: bytes) -> None:
    staging = store.prepare(step)
    (staging / "weights.bin").write_bytes(payload)
    store.commit(step, meta={"step": step})


def test_checkpoints_mirror_to_s3_and_the_newest_that_verifies_comes_back(
    s3_root: str, tmp_path: Path
) -> None:
    url = f"{s3_root}/checkpoints/train/{FP}"
    lines: list[str] = []
    local = CheckpointStore(tmp_path / "one", keep=2, fingerprint=FP)
    mirror = CheckpointMirror(local.root, url, keep=2, log=lines.append)
    with mirror.pushing():
        for step in (10, 20, 30):
            commit(local, step, bytes([step]) * 100)
    assert objects(url) == [
        f"step-000000{s}/{name}" for s in (20, 30) for name in (MANIFEST, "weights.bin")
    ]

    # Another machine, nothing local: the newest remote checkpoint is downloaded, verified.
    fresh = CheckpointMirror(tmp_path / "two", url, keep=2, log=lines.append)
    assert fresh.pull() == 30
    resumed = CheckpointStore(tmp_path / "two", fingerprint=FP).latest_valid(strict=True)
    assert resumed.step == 30 and (resumed.path / "weights.bin").read_bytes() == b"\x1e" * 100

    # A corrupted newest object is refused by its manifest: the one before is the resume.
    fs, path = filesystem(url)
    fs.pipe_file(f"{path}/step-00000030/weights.bin", b"\0" * 100)
    third = CheckpointMirror(tmp_path / "three", url, keep=2, log=lines.append)
    assert third.pull() == 20
    assert any("step-00000030 does not verify" in line for line in lines)
    mirror.remove()
    assert objects(url) == []


def test_the_pinned_best_checkpoint_survives_remote_retention_and_comes_back_with_the_newest(
    s3_root: str, tmp_path: Path
) -> None:
    url = f"{s3_root}/checkpoints/train/{FP}"
    lines: list[str] = []
    local = CheckpointStore(tmp_path / "one", keep=1, fingerprint=FP)
    mirror = CheckpointMirror(local.root, url, keep=1, log=lines.append)
    for step in (10, 20, 30):
        # Step 10 was the best validation: the later checkpoints pin it, as the ranks do.
        local.pin([10])
        staging = local.prepare(step)
        (staging / "weights.bin").write_bytes(bytes([step]) * 10)
        local.commit(step, meta={"step": step, "pinned": [10] if step > 10 else []})
        mirror.push()
    assert sorted({name.split("/")[0] for name in objects(url)}) == [
        "step-00000010",
        "step-00000030",
    ]
    # Another machine resumes from 30 and gets the best weights (10) with it.
    fresh = CheckpointMirror(tmp_path / "two", url, keep=1, log=lines.append)
    assert fresh.pull() == 30
    second = CheckpointStore(tmp_path / "two", fingerprint=FP)
    best = second.verify(tmp_path / "two" / "step-00000010")
    assert best is None and any("pinned checkpoint of step 10 downloaded" in x for x in lines)


# Killed at its first checkpoint in S3; the ranks it orphans are stopped by the test.
# ZeRO 2 as tiny.yaml had it: test_scaleout's 2-node runs (no shared disk) fail their
# final checkpoint's exchange at ZeRO 0, which auto picks (TrainConfig.zero_stages).
RESUMABLE = [
    "train.max_steps=40",
    "train.checkpoint_every=10",
    "train.log_every=10",
    "train.zero_stage=2",
]


def recforge_run(
    root: str,
    raw: Path,
    env: dict[str, str],
    extra: tuple[str, ...] = (),
    flags: tuple[str, ...] = (),
) -> subprocess.Popen:
    """`recforge run configs/tiny.yaml --root <root>` in a session of its own (`extra`:
    more `--set` overrides; `flags`: more arguments, e.g. `--force train`). It starts its
    own temporary Prefect API unless `env` names one (PREFECT_API_URL)."""
    items = [f"ingest.path={raw}", *RESUMABLE, *extra]
    overrides = [arg for item in items for arg in ("--set", item)]
    full_env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **env}
    if "PREFECT_API_URL" not in env:
        full_env.pop("PREFECT_API_URL", None)
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", TINY, "--root", root, *overrides, *flags],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def committed_in_s3(root: str) -> dict[str, set[int]]:
    """{train fingerprint: steps whose checkpoint manifest is in S3} under `root`."""
    found: dict[str, set[int]] = {}
    for name in objects(f"{root}/checkpoints/train"):
        fp, step, rest = (name.split("/", 2) + ["", ""])[:3]
        if rest == MANIFEST and step.startswith("step-"):
            found.setdefault(fp, set()).add(int(step.removeprefix("step-")))
    return found


def stop_ranks_of(cache: Path) -> None:
    """SIGKILL the ranks a killed run orphaned (their command lines name its cache)."""
    found = subprocess.run(["pgrep", "-f", str(cache)], capture_output=True, text=True)
    for pid in found.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            continue


@pytest.mark.slow
@pytest.mark.chaos
def test_tiny_pipeline_on_s3_killed_in_train_resumes_from_s3_then_is_all_cached(
    s3_root: str, moto_endpoint: str, tmp_path: Path
) -> None:
    raw = tmp_path / "raw"
    generate_logs(load_config(TINY, [f"generate.out={raw}"]).generate)
    first_cache = tmp_path / "machine-one"
    victim = recforge_run(s3_root, raw, s3_environment(moto_endpoint, first_cache))
    deadline = time.monotonic() + 400
    # SIGKILL the flow's process group once a checkpoint is committed in S3.
    while not committed_in_s3(s3_root):
        assert victim.poll() is None, "".join(victim.communicate())[-3000:]
        assert time.monotonic() < deadline, "no checkpoint reached S3"
        time.sleep(0.3)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=60)
    stop_ranks_of(first_cache)
    ((fp, steps),) = committed_in_s3(s3_root).items()
    in_s3 = max(steps)  # the newest committed checkpoint the killed run uploaded

    # Another machine: nothing local, another cache directory. Upstream outputs and the
    # checkpoint come from S3 (a resume knows the shards by their sha256s, not their path).
    shutil.rmtree(first_cache)
    second = recforge_run(s3_root, raw, s3_environment(moto_endpoint, tmp_path / "machine-two"))
    out, err = second.communicate(timeout=600)
    assert second.returncode == 0, (out + err)[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"{s3_root}/runs/") and last.endswith("/summary.json")
    record = json.loads(read_text_or_none(last))
    stages = record["stages"]
    assert [stages[s]["status"] for s in ("ingest", "preprocess", "shard")] == ["cached"] * 3
    assert stages["train"]["status"] == "ran" and stages["train"]["resumed_from_step"] == in_s3
    assert record["model"].startswith(f"{s3_root}/registry/tiny-ctr/")
    # The gate promoted the first model by a conditional write of CHAMPION in S3.
    assert record["promotion"]["status"] == "promoted", record["promotion"]
    assert Registry(s3_root, "tiny-ctr").champion() == record["model"].rsplit("/", 1)[-1]
    assert objects(f"{s3_root}/checkpoints/train/{fp}") == []  # spent: removed
    for stage, info in stages.items():
        assert info["output"] == f"{s3_root}/stages/{stage}/{info['fingerprint']}"
        assert ArtifactStore(s3_root).verify(stage, info["fingerprint"])[0] is not None

    third = recforge_run(s3_root, raw, s3_environment(moto_endpoint, tmp_path / "machine-three"))
    out, err = third.communicate(timeout=600)
    assert third.returncode == 0, (out + err)[-3000:]
    again = json.loads(read_text_or_none(out.strip().splitlines()[-1]))
    assert [info["status"] for info in again["stages"].values()] == ["cached"] * 6
    assert again["metrics"] == record["metrics"] and again["model"] == record["model"]


def test_a_run_on_a_missing_bucket_fails_at_the_plan_once_naming_the_url(
    prefect_server: None, s3_root: str, tmp_path: Path
) -> None:
    from flows.pipeline import pipeline

    root = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x"
    state = pipeline(
        config=TINY, root=root, overrides=[f"ingest.path={tmp_path}"], return_state=True
    )
    assert state.is_failed()
    with pytest.raises(StoreUnreachable, match=rf"cannot reach the artifact store {root}"):
        state.result()
    # The plan failed once (no retry), before any stage task started.
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[state.state_details.flow_run_id])
            )
        )
    assert [(r.name, r.state.name, r.run_count) for r in runs] == [("plan", "Failed", 1)]
    assert not (tmp_path / "cache").exists()  # nothing staged locally either
