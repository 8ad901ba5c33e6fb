"""`recforge gc`: what it keeps, what it frees, and that it never touches what a running
flow uses or anything outside the root.

Roots are built by hand with the store and registry APIs (no training). `memory://` stands
for an object store where the remote code path matters; the moto S3 test runs the real
flow body with a lease (`scaleout`).
"""

import json
import logging
import os
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest

import artifacts.gc as gc_module
import flows.pipeline as pipeline_module
from artifacts.durable import write_json
from artifacts.errors import ConfigError, InputNotFoundError
from artifacts.gc import CATEGORIES, collect_garbage, parse_duration
from artifacts.lease import RunLease, lease_location
from artifacts.locations import filesystem, join, read_text_or_none, safe_join
from artifacts.registry import CHAMPION
from artifacts.signing import loads_verified, place, sign
from artifacts.store import MANIFEST, STAGES, ArtifactStore
from flows.cli import main
from tasks.plan import StagePlan
from tests.flows.test_object_store import s3_root  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
DAY = 86400.0
WEEK = 7 * DAY


def fp(char: str) -> str:
    """A fingerprint: 64 hex digits."""
    return char * 64


def publish(
    store: ArtifactStore,
    stage: str,
    fingerprint: str,
    payload: bytes = b"rows\n",
    extra: dict[str, bytes] | None = None,
) -> str:
    """Publish an output holding `part-0.bin` (and `extra`), its manifest bound to its place."""
    staging = store.new_staging(stage, fingerprint)
    (staging / "part-0.bin").write_bytes(payload)
    for rel, data in (extra or {}).items():
        (staging / rel).write_bytes(data)
    store.publish(stage, fingerprint, staging, {})
    bind(
        store,
        f"stages/{stage}/{fingerprint}/{MANIFEST}",
        "stage-output",
        stage=stage,
        fingerprint=fingerprint,
    )
    return store.output_url(stage, fingerprint)


def bind(store: ArtifactStore, rel: str, kind: str, **coordinates: str) -> None:
    """Sign the record at `rel` again, bound to `place(kind, **coordinates)` (what the
    writers do; idempotent once they do)."""
    location = store.location(*rel.split("/"))
    record = json.loads(read_text_or_none(location))
    write_json(location, sign(record, place=place(kind, **coordinates)))


def register(store: ArtifactStore, model: str, export_fp: str) -> str:
    """Publish the export output `export_fp` as version `export_fp[:12]` of `model`, its
    package manifest bound to its place; returns the version."""
    version = export_fp[:12]
    store.publish_model(model, version, store.output_url("export", export_fp))
    bind(store, f"registry/{model}/{version}/{MANIFEST}", "package", model=model, version=version)
    return version


def write_champion(store: ArtifactStore, model: str, version: str) -> None:
    record = {"version": version, "previous": None, "reason": "test"}
    location = store.location("registry", model, CHAMPION)
    write_json(location, sign(record, place=place("champion", model=model)))


def write_latest(store: ArtifactStore, pipeline: str, name: str, record: dict) -> None:
    location = store.location("latest", pipeline, name)
    write_json(location, sign(record, place=place("latest", pipeline=pipeline, name=name)))


def write_lease(store: ArtifactStore, run_id: str, record: dict) -> None:
    location = lease_location(store.url, run_id)
    write_json(location, sign(record, place=place("lease", run_id=run_id)))


def put(store: ArtifactStore, rel: str, data: bytes = b"x" * 10) -> None:
    """Write one file (object) at `rel` under the root."""
    location = store.location(*rel.split("/"))
    if store.remote:
        fs, path = filesystem(location)
        fs.pipe_file(path, data)
    else:
        Path(location).parent.mkdir(parents=True, exist_ok=True)
        Path(location).write_bytes(data)


def write_record(store: ArtifactStore, run_id: str, stages: dict[str, str]) -> None:
    record = {
        "run_id": run_id,
        "status": "completed",
        "stages": {s: {"status": "ran", "fingerprint": f} for s, f in stages.items()},
    }
    location = safe_join(store.url, f"runs/{run_id}/summary.json", "a run id")
    write_json(location, sign(record, place=place("run-record", run_id=run_id)))


def files(store: ArtifactStore) -> dict[str, int]:
    """Every file under the root: rel -> bytes."""
    if store.remote:
        fs, path = filesystem(store.url)
        fs.invalidate_cache(path)
        found = fs.find(path, detail=True)
        return {name.removeprefix(path + "/"): info["size"] for name, info in found.items()}
    found = {}
    for directory, _, names in os.walk(store.url):
        for name in names:
            path = Path(directory, name)
            try:  # a lease being rewritten beside this walk
                found[path.relative_to(store.url).as_posix()] = path.lstat().st_size
            except FileNotFoundError:
                continue
    return found


def backdate(store: ArtifactStore, rel: str, seconds: float) -> None:
    """Make everything under `rel` look last written `seconds` ago (nothing there: no-op)."""
    when = time.time() - seconds
    location = store.location(*rel.split("/"))
    if store.remote:  # memory://: the listing's "created"
        fs, path = filesystem(location)
        for name in [path] if fs.isfile(path) else fs.find(path):
            fs.store[name].created = datetime.fromtimestamp(when, UTC)
        return
    base = Path(location)
    if not base.exists():
        return
    for path in [base, *(base.rglob("*") if base.is_dir() else [])]:
        os.utime(path, (when, when), follow_symlinks=False)


def under(rel: str, location: str) -> bool:
    return rel == location or rel.startswith(location + "/")


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "local":
        return ArtifactStore(tmp_path / "root")
    return ArtifactStore(f"memory://gc-{tmp_path.name[-24:].lower()}/root")


def test_gc_keeps_what_runs_models_and_pointers_name_frees_the_rest_and_a_dry_run_nothing(
    store: ArtifactStore,
) -> None:
    a, b, c, d, young = fp("a"), fp("b"), fp("c"), fp("d"), fp("9")
    v1, v2, p = "e1e1e1e1e1e1" + "0" * 52, "e2e2e2e2e2e2" + "0" * 52, fp("f")
    for stage, fingerprint in [
        ("ingest", a), ("shard", b), ("train", c), ("ingest", d), ("ingest", young),
        ("export", v1), ("export", v2), ("preprocess", p),
    ]:  # fmt: skip
        publish(store, stage, fingerprint)
    write_record(store, "20260301T000000-new00000", {"ingest": a})  # the newest: kept
    write_record(store, "20260201T000000-old00000", {"shard": b})  # beyond --keep-runs 1
    write_record(store, "20250101T000000-yng00000", {"train": c})  # an old id, written now
    for version in (v1, v2):  # registered packages; v1 the champion
        register(store, "ctr", version)
    write_champion(store, "ctr", v1[:12])
    write_latest(store, "tiny", "preprocess.json", {"output": store.output_url("preprocess", p)})
    old_key, young_key = "1" * 64, "2" * 64
    old_checkpoint = f"checkpoints/train/{old_key}"
    leftovers = [  # (a file, the unit it makes that is old, or "" when it is young)
        (f"stages/ingest/.staging-{d[:16]}-0badc0de/part-0.bin", "."),
        (f"stages/shard/.staging-{b[:16]}-00c0ffee/part-0.bin", ""),
        ("registry/ctr/.staging-e1e1e1e1e1e1-deadbeef/model.bin", "."),
        (f"failed/ingest/{d[:16]}-20250101T000000/part-0.bin", "."),
        (f"checkpoints/train/{old_key}/step-00000010/_manifest.json", old_checkpoint),
        (f"checkpoints/train/{young_key}/step-00000020/_manifest.json", ""),
        (f"checkpoints/train/{young_key}/exchange/{'a' * 32}/STOP", "."),
        (f"checkpoints/train/{young_key}/exchange/{'b' * 32}/STOP", ""),
        (f"checkpoints/train/{young_key}/.staging/step-00000030/state.bin", "."),
    ]  # fmt: skip
    for rel, _ in leftovers:
        put(store, rel)
    dead = {"run_id": "dead", "started": 0.0, "heartbeat": 0.0, "fingerprints": None}
    write_lease(store, "dead", dead)  # a killed run's lease
    if store.remote:  # a killed upload's data prefix beside a kept output's live one
        put(store, f"stages/ingest/{a}/data-0rphan000000/part-0.bin")

    old = [  # everything but the young output, record and leftovers
        *(f"stages/{s}/{x}" for s, x in [("ingest", a), ("shard", b), ("train", c),
                                         ("ingest", d), ("export", v1), ("export", v2),
                                         ("preprocess", p)]),
        "runs/20260301T000000-new00000", "runs/20260201T000000-old00000", "leases/dead.json",
        *(rel.rsplit("/", 1)[0] if unit == "." else unit for rel, unit in leftovers if unit),
    ]  # fmt: skip
    for rel in old:
        backdate(store, rel, 30 * DAY)
    expected = {
        ("run records", "runs/20260201T000000-old00000"),
        ("stage outputs", f"stages/shard/{b}"),
        ("stage outputs", f"stages/ingest/{d}"),
        ("checkpoints", f"checkpoints/train/{old_key}"),
        ("exchanges", f"checkpoints/train/{young_key}/exchange/{'a' * 32}"),
        ("staging", f"stages/ingest/.staging-{d[:16]}-0badc0de"),
        ("staging", "registry/ctr/.staging-e1e1e1e1e1e1-deadbeef"),
        ("staging", f"checkpoints/train/{young_key}/.staging/step-00000030"),
        ("failed outputs", f"failed/ingest/{d[:16]}-20250101T000000"),
        ("leases", "leases/dead.json"),
    }
    if store.remote:
        expected.add(("data prefixes", f"stages/ingest/{a}/data-0rphan000000"))
    before = files(store)

    dry = collect_garbage(store.url, keep_runs=1, older_than_s=WEEK, dry_run=True)

    assert files(store) == before  # a dry run deletes nothing
    assert {(item.category, item.location) for item in dry.freed} == expected
    for item in dry.freed:
        assert item.bytes == sum(n for rel, n in before.items() if under(rel, item.location))
        assert item.bytes > 0
    assert dry.total_bytes == sum(item.bytes for item in dry.freed)
    text = "\n".join(dry.lines())
    assert "dry run, nothing deleted" in text and f"{dry.total_bytes:,} bytes" in text
    for category in CATEGORIES:
        assert category in text

    real = collect_garbage(store.url, keep_runs=1, older_than_s=WEEK)

    assert real.freed == dry.freed and real.totals() == dry.totals()
    assert files(store) == {
        rel: n
        for rel, n in before.items()
        if not any(under(rel, item.location) for item in real.freed)
    }
    again = collect_garbage(store.url, keep_runs=1, older_than_s=WEEK)
    assert again.freed == []


def test_the_cli_prints_each_category_and_the_total(tmp_path: Path, capsys) -> None:
    store = ArtifactStore(tmp_path / "root")
    publish(store, "ingest", fp("a"), b"12345")
    write_record(store, "20260101T000000-aaaaaaaa", {"ingest": fp("a")})
    backdate(store, "stages", 30 * DAY)
    backdate(store, "runs", 30 * DAY)
    root = str(store.url)

    assert main(["gc", root, "--keep-runs", "0", "--older-than", "1d", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would free stages/ingest/{fp('a')}" in out and "would free runs/" in out
    total = next(line for line in out.splitlines() if line.startswith("total"))
    freed = sum(files(store).values())
    assert total.split() == ["total", "2", "items", f"{freed:,}", "bytes"]

    assert main(["gc", root, "--keep-runs", "0", "--older-than", "1d"]) == 0
    assert f"freed stages/ingest/{fp('a')}" in capsys.readouterr().out
    assert files(store) == {}


@pytest.mark.parametrize(
    "text, seconds",
    [("30s", 30), ("30m", 1800), ("12h", 43200), ("7d", WEEK), ("2w", 2 * WEEK),
     ("1.5h", 5400), ("0", 0), (" 7D ", WEEK)],
)  # fmt: skip
def test_durations_parse(text: str, seconds: float) -> None:
    assert parse_duration(text, "--older-than") == seconds


@pytest.mark.parametrize("text", ["7x", "", "7", "d", "-1d", "7 days", "1e3s"])
def test_a_bad_duration_is_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match=f"--older-than {text!r} is not a duration; write"):
        parse_duration(text, "--older-than")


@pytest.mark.parametrize(
    "flags, named",
    [(["--older-than", "7x"], "--older-than '7x'"),
     (["--lease-stale-after", "soon"], "--lease-stale-after 'soon'"),
     (["--keep-runs", "-1"], "--keep-runs -1")],
)  # fmt: skip
def test_the_cli_names_the_flag_of_a_bad_value(flags, named, tmp_path: Path, capsys) -> None:
    assert main(["gc", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err


def test_a_root_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InputNotFoundError, match="no artifact root at"):
        collect_garbage(tmp_path / "typo", keep_runs=1, older_than_s=WEEK)


def test_a_lease_beats_until_released_and_a_dead_runs_lease_stops_protecting(
    tmp_path: Path,
) -> None:
    store = ArtifactStore(tmp_path / "root")
    publish(store, "ingest", fp("a"))
    backdate(store, "stages", DAY)
    lease = RunLease(store.url, "20260101T000000-live0000", interval_s=0.05)
    location = Path(lease_location(store.url, lease.run_id))
    lease.start()
    bound = place("lease", run_id=lease.run_id)
    first = loads_verified(location.read_text(), str(location), place=bound)
    assert first["fingerprints"] is None and first["run_id"] == lease.run_id
    deadline = time.monotonic() + 10
    while loads_verified(location.read_text(), "", place=bound)["heartbeat"] == first["heartbeat"]:
        assert time.monotonic() < deadline, "the lease was not refreshed"
        time.sleep(0.02)
    lease.name([fp("b")])
    assert loads_verified(location.read_text(), "", place=bound)["fingerprints"] == [fp("b")]
    # Live and naming other fingerprints: the old output it does not name may go.
    report = collect_garbage(store.url, keep_runs=0, older_than_s=0, dry_run=True)
    assert [item.location for item in report.freed] == [f"stages/ingest/{fp('a')}"]
    lease.release()
    time.sleep(0.15)  # no late heartbeat brings it back
    assert not location.exists()
    lease.release()  # twice is fine

    # A run killed with SIGKILL leaves its lease, naming nothing yet: while it is fresh,
    # gc keeps every output; once stale, nothing, and the lease itself goes.
    now = time.time()
    dead = {"run_id": "dead", "started": now, "heartbeat": now, "fingerprints": None}
    write_lease(store, "dead", dead)
    kept = collect_garbage(store.url, keep_runs=0, older_than_s=0, stale_after_s=60)
    assert kept.freed == [] and kept.kept["live leases of running flows"] == 1
    time.sleep(0.3)
    gone = collect_garbage(store.url, keep_runs=0, older_than_s=0, stale_after_s=0.2)
    assert {item.category for item in gone.freed} == {"stage outputs", "leases"}


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.scaleout)])
def test_gc_during_a_running_flow_deletes_nothing_the_run_uses(
    where: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real flow body (`run_pipeline`) holds the lease; its plan and stages are stand-ins
    that run gc where a stage would run."""
    root = str(tmp_path / "root") if where == "local" else request.getfixturevalue("s3_root")
    store = ArtifactStore(root)
    planned = {stage: fp("0123456789"[i]) for i, stage in enumerate(STAGES)}
    publish(store, "ingest", planned["ingest"])  # cached outputs the run reuses
    publish(store, "shard", planned["shard"])
    unplanned = fp("d")
    publish(store, "ingest", unplanned)  # another config's: free to go
    resume = f"checkpoints/train/{fp('e')}/step-00000010/_manifest.json"
    put(store, resume)  # resume state a train stage may pull
    if where == "local":
        stale = 30.0
        backdate(store, "stages", DAY)
        backdate(store, "checkpoints", DAY)
    else:  # S3 keeps whole seconds and cannot be backdated: let the objects age instead
        stale = 2.0
        time.sleep(stale + 1.1)
    gc = partial(collect_garbage, root, keep_runs=0, older_than_s=0, stale_after_s=stale)
    seen: dict[str, object] = {}

    def plan(config, modes, store, parent=None) -> list[StagePlan]:
        # The lease is written, the plan not yet known: gc keeps every stage output.
        seen["before plan"] = gc(dry_run=True)
        return [StagePlan(s, modes[s], "cached", planned[s], "test") for s in STAGES]

    def stages(config, plans, store, outputs, parent=None) -> None:
        (lease,) = [r for r in files(store) if r.startswith("leases/") and r.endswith(".json")]
        bound = place("lease", run_id=lease.split("/")[1].removesuffix(".json"))
        record = loads_verified(_read(store, lease), lease, place=bound)  # the run key's
        assert record["fingerprints"] == sorted(planned.values())
        deadline = time.monotonic() + 10
        while (
            loads_verified(_read(store, lease), lease, place=bound)["heartbeat"]
            == record["heartbeat"]
        ):
            assert time.monotonic() < deadline, "the lease was not refreshed"
            time.sleep(0.02)
        seen["during"] = gc()
        raise RuntimeError("the stages end here")

    monkeypatch.setattr(pipeline_module, "plan_task", plan)
    monkeypatch.setattr(pipeline_module, "run_stages", stages)
    monkeypatch.setattr(pipeline_module, "record_bases", lambda *args: None)
    monkeypatch.setattr(pipeline_module, "publish_run_artifacts", lambda *args: None)
    monkeypatch.setattr(pipeline_module, "RunLease", partial(RunLease, interval_s=0.05))

    with pytest.raises(RuntimeError, match="the stages end here"):
        pipeline_module.run_pipeline(pipeline_module.RunParams(config=TINY, root=root))

    assert [item.category for item in seen["before plan"].freed] == []
    during = seen["during"]
    assert [item.location for item in during.freed] == [f"stages/ingest/{unplanned}"]
    assert during.kept["stage outputs a live lease keeps"] == 2
    assert during.kept["checkpoints a live lease keeps"] == 1
    left = files(store)
    assert resume in left
    assert not [rel for rel in left if rel.startswith("leases/")]  # released at the end
    # The run is over (its record names no output: it ran no stage): now they go.
    after = gc()
    assert {item.location for item in after.freed} >= {
        f"stages/ingest/{planned['ingest']}",
        f"stages/shard/{planned['shard']}",
        f"checkpoints/train/{fp('e')}",
    }


def _read(store: ArtifactStore, rel: str) -> str:
    location = store.location(*rel.split("/"))
    if store.remote:
        fs, path = filesystem(location)
        fs.invalidate_cache(path)
        return fs.cat_file(path).decode()
    return Path(location).read_text()


def test_a_forged_lease_only_makes_gc_keep_more_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = ArtifactStore(tmp_path / "root")
    publish(store, "ingest", fp("a"))
    put(store, f"checkpoints/train/{fp('e')}/step-00000010/_manifest.json")
    backdate(store, "stages", DAY)
    backdate(store, "checkpoints", DAY)
    forged = Path(lease_location(store.url, "20260101T000000-forged00"))
    forged.parent.mkdir(parents=True)
    # Unsigned, naming nothing it protects, and claiming to have beaten far in the future.
    forged.write_text(json.dumps({"run_id": forged.stem, "heartbeat": 9e12, "started": 0}))

    with caplog.at_level(logging.WARNING, logger="artifacts.gc"):
        first = collect_garbage(store.url, keep_runs=0, older_than_s=0)
        second = collect_garbage(store.url, keep_runs=0, older_than_s=0)
    assert first.freed == second.freed == []  # fresh: it keeps everything a flow writes
    assert first.kept["leases that do not verify (kept; while fresh they keep more)"] == 1
    warnings = [r.getMessage() for r in caplog.records if forged.name in r.getMessage()]
    assert len(warnings) == 1 and "does not verify" in warnings[0]

    backdate(store, "leases", DAY)  # its signed-looking heartbeat does not keep it live
    freed = collect_garbage(store.url, keep_runs=0, older_than_s=0)
    assert {item.location for item in freed.freed} == {
        f"stages/ingest/{fp('a')}",
        f"checkpoints/train/{fp('e')}",
        f"leases/{forged.name}",
    }


def test_a_replayed_or_forged_run_record_cannot_push_kept_runs_out(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    older, newer, junk = fp("a"), fp("b"), fp("c")
    for fingerprint in (older, newer, junk):
        publish(store, "ingest", fingerprint)
    write_record(store, "20260101T000000-older000", {"ingest": older})
    write_record(store, "20260201T000000-newer000", {"ingest": newer})
    # The older record, signed by the run key, copied under a run id that sorts newest.
    text = (Path(store.url) / "runs/20260101T000000-older000/summary.json").read_text()
    replay = Path(store.url) / "runs/99991231T235959-replay00/summary.json"
    replay.parent.mkdir()
    replay.write_text(text)
    forged = Path(store.url) / "runs/99991231T235959-forged00/summary.json"
    forged.parent.mkdir()
    forged.write_text(json.dumps({"run_id": "99991231T235959-forged00", "stages": {}}))
    backdate(store, "stages", 30 * DAY)
    backdate(store, "runs", 30 * DAY)

    report = collect_garbage(store.url, keep_runs=1, older_than_s=WEEK)

    # The older record itself goes: the replay and the forgery do not count among the
    # newest. Neither verifies, so both stay, and each keeps every stage output (what they
    # named cannot be known): the junk output stays too.
    assert {item.location for item in report.freed} == {"runs/20260101T000000-older000"}
    assert replay.exists() and forged.exists()
    assert report.kept["run records that do not verify (kept; they keep every stage output)"] == 2
    assert report.kept["stage outputs the kept run records name"] == 1  # the newer one's
    assert report.kept["stage outputs kept because a record does not verify"] == 2
    (note,) = [n for n in report.notes if "99991231T235959-replay00" in n]
    assert "relocated copy" in note and "run_id=20260101T000000-" in note


def plant(base: Path) -> tuple[ArtifactStore, Path]:
    """A root whose `failed/` a writer replaced with a symlink to a directory outside it,
    a forged run record and a forged lease naming `..` and outside paths, and an old
    output. Returns the store and the victim's file."""
    victim = base / "victim"
    precious = victim / "ingest" / "0123456789abcdef-20250101T000000" / "precious.txt"
    precious.parent.mkdir(parents=True)
    precious.write_text("not recforge's\n")
    store = ArtifactStore(base / "root")
    publish(store, "ingest", fp("a"))
    root = Path(store.url)
    (root / "failed").symlink_to(victim, target_is_directory=True)
    record = root / "runs" / "evil" / "summary.json"
    record.parent.mkdir(parents=True)
    record.write_text(
        json.dumps(
            {
                "run_id": "../../victim",
                "stages": {"ingest": {"fingerprint": "../../../victim", "output": str(victim)}},
                "model": str(victim),
            }
        )
    )
    lease = root / "leases" / "evil.json"
    lease.parent.mkdir()
    lease.write_text(
        json.dumps(
            {"run_id": "../victim", "started": 0, "heartbeat": 9e12, "fingerprints": ["../.."]}
        )
    )
    for path in [*victim.rglob("*"), *root.rglob("*")]:
        os.utime(path, (time.time() - 30 * DAY,) * 2, follow_symlinks=False)
    return store, precious


@pytest.mark.security
def test_forged_names_and_a_symlink_cannot_make_gc_delete_outside_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The payloads are live: joined naively, each name lands on the victim.
    store, precious = plant(tmp_path / "unguarded")
    victim = precious.parents[2]
    assert (Path(store.url) / "runs" / "../../victim").resolve() == victim.resolve()
    assert (Path(store.url) / "failed" / "ingest").resolve() == (victim / "ingest").resolve()
    # Without the one safe join, gc follows the planted symlink out of the root.
    monkeypatch.setattr(gc_module, "safe_join", lambda root, name, what: join(root, name))
    collect_garbage(store.url, keep_runs=0, older_than_s=WEEK)
    assert not precious.exists()
    monkeypatch.undo()

    store, precious = plant(tmp_path / "guarded")
    report = collect_garbage(store.url, keep_runs=0, older_than_s=WEEK)

    assert precious.read_text() == "not recforge's\n"
    assert any("refused failed/ingest/" in note for note in report.notes)
    root = Path(store.url)
    # The forged record stays and keeps every stage output (keeping more); the forged
    # lease is stale (its claimed heartbeat is not signed) and goes.
    assert {item.location for item in report.freed} == {"leases/evil.json"}
    assert (root / "runs" / "evil" / "summary.json").exists()
    assert (root / "stages" / "ingest" / fp("a")).is_dir()


def test_a_run_that_starts_while_gc_deletes_is_seen_before_the_next_deletion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(tmp_path / "root")
    outputs = [fp(c) for c in "abcdef"]
    for fingerprint in outputs:
        publish(store, "ingest", fingerprint)
    backdate(store, "stages", DAY)
    lease = RunLease(store.url, "20260101T000000-late0000", interval_s=0.05)
    real = gc_module._remove_local

    def remove_then_start_a_run(path: Path) -> None:
        real(path)
        if not Path(lease.location).exists():
            lease.start()  # its plan not named yet: every stage output is kept

    monkeypatch.setattr(gc_module, "_remove_local", remove_then_start_a_run)
    try:
        report = collect_garbage(store.url, keep_runs=0, older_than_s=0)
    finally:
        lease.release()
    assert len(report.freed) == 1
    assert report.kept["stage outputs a flow started using meanwhile"] == 5


def test_a_lease_copied_under_another_runs_name_does_not_verify_and_keeps_more(
    tmp_path: Path,
) -> None:
    store = ArtifactStore(tmp_path / "root")
    named, other = fp("a"), fp("b")
    publish(store, "ingest", named)
    publish(store, "ingest", other)
    backdate(store, "stages", DAY)
    now = time.time()
    lease = {"run_id": "20260101T000000-real0000", "started": now, "heartbeat": now}
    write_lease(store, lease["run_id"], {**lease, "fingerprints": [named]})
    genuine = Path(lease_location(store.url, lease["run_id"]))
    copy = Path(lease_location(store.url, "20260101T000000-copy0000"))
    copy.write_bytes(genuine.read_bytes())

    report = collect_garbage(store.url, keep_runs=0, older_than_s=0, dry_run=True)

    assert report.freed == []  # the copy is fresh: it keeps every stage output
    assert report.kept["leases that do not verify (kept; while fresh they keep more)"] == 1
    (note,) = [n for n in report.notes if copy.name in n]
    assert "relocated copy" in note and "run_id=20260101T000000-" in note
    genuine.unlink()
    assert collect_garbage(store.url, keep_runs=0, older_than_s=0, dry_run=True).freed == []


def test_the_report_names_a_bounded_number_of_records_that_do_not_verify(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    for number in range(gc_module._MAX_NOTES + 20):
        put(store, f"runs/20260101T000000-junk{number:04d}/summary.json", b"{}")

    report = collect_garbage(store.url, keep_runs=0, older_than_s=0, dry_run=True)

    assert len(report.notes) == gc_module._MAX_NOTES + 1
    assert report.notes[-1].startswith("... and 20 more records that do not verify")
    assert report.kept["run records that do not verify (kept; they keep every stage output)"] == (
        gc_module._MAX_NOTES + 20
    )
