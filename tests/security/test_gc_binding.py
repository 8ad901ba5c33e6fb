"""Issue 38 finding 4 (and 8 for gc): whatever is written to the bucket can only make
`recforge gc` keep more, never less.

The attacker can write any object under the root and can start deployment runs with any
parameters, but does not hold the run key. Each test plays one attack on what gc reads
back (stage manifests, run records, `latest/` pointers and JSON, registry packages and
their `lineage.json`, CHAMPION, leases) and checks that nothing a valid record keeps is
deleted, that gc says why it kept more, and that it never crashes. `memory://` stands for
the bucket where the object-store code path matters.
"""

import json
import time
import uuid
from pathlib import Path

import pytest

from artifacts.gc import collect_garbage
from artifacts.locations import filesystem, read_text_or_none
from artifacts.signing import keyring
from artifacts.store import MANIFEST, ArtifactStore
from tests.flows.test_gc import (
    DAY,
    WEEK,
    backdate,
    files,
    fp,
    publish,
    put,
    register,
    write_champion,
    write_latest,
    write_lease,
    write_record,
)

pytestmark = pytest.mark.security

POISON: dict[str, bytes] = {
    "5,000-digit integer": b'{"output": ' + b"9" * 5000 + b"}",
    "deep nesting": b"[" * 200_000 + b"]" * 200_000,
    "not UTF-8": b'{"output": "\xff\xfe\xfd"}',
}


@pytest.fixture(autouse=True)
def _a_run_key_is_configured() -> None:
    # The attacks are on a root whose records are signed (tests/conftest.py sets the key).
    assert keyring() is not None


def memory_store() -> ArtifactStore:
    return ArtifactStore(f"memory://gc-attack-{uuid.uuid4().hex[:12]}/root")


def held(store: ArtifactStore, location: str) -> list[str]:
    """The files under `location` (relative to the root) that are still there."""
    return [rel for rel in files(store) if rel.startswith(location + "/")]


def noted(report, rel: str) -> list[str]:
    """The report's notes that name `rel`."""
    return [note for note in report.notes if rel in note]


def test_a_signed_manifest_copied_over_a_kept_output_cannot_make_gc_delete_its_data() -> None:
    store = memory_store()
    kept, other = fp("a"), fp("b")
    publish(store, "ingest", kept)
    publish(store, "ingest", other)
    write_record(store, "20260301T000000-kept0000", {"ingest": kept})
    manifest = f"stages/ingest/{kept}/{MANIFEST}"
    real = json.loads(read_text_or_none(store.location(*manifest.split("/"))))["data"]
    # The attacker copies the other output's manifest, signed by the run key, over the
    # kept one's: it names the other output's data prefix, not the kept output's own.
    fs, _ = filesystem(store.url)
    source = filesystem(store.location("stages", "ingest", other, MANIFEST))[1]
    fs.pipe_file(filesystem(store.location(*manifest.split("/")))[1], fs.cat_file(source))
    backdate(store, "stages", 30 * DAY)
    backdate(store, "runs", 30 * DAY)

    report = collect_garbage(store.url, keep_runs=1, older_than_s=WEEK)

    assert held(store, f"stages/ingest/{kept}/{real}"), "gc deleted the kept output's data"
    (note,) = noted(report, manifest)
    assert "relocated copy" in note and other[:16] in note and kept[:16] in note


def test_a_run_record_overwritten_with_an_empty_object_makes_gc_keep_more_and_say_so(
    tmp_path: Path,
) -> None:
    store = ArtifactStore(tmp_path / "root")
    named, newer = fp("a"), fp("b")
    publish(store, "ingest", named)
    publish(store, "ingest", newer)
    write_record(store, "20260201T000000-named000", {"ingest": named})
    write_record(store, "20260301T000000-newer000", {"ingest": newer})
    record = "runs/20260201T000000-named000/summary.json"
    put(store, record, b"{}")
    backdate(store, "stages", 30 * DAY)
    backdate(store, "runs", 30 * DAY)

    report = collect_garbage(store.url, keep_runs=2, older_than_s=WEEK)

    assert held(store, f"stages/ingest/{named}"), "gc dropped what the overwritten record named"
    assert report.freed == []
    (note,) = noted(report, record)
    assert "does not verify" in note and "keeps every stage output" in note
    assert report.kept["stage outputs kept because a record does not verify"] == 1


def test_a_latest_pointer_overwritten_with_an_empty_object_makes_gc_keep_more_and_say_so(
    tmp_path: Path,
) -> None:
    store = ArtifactStore(tmp_path / "root")
    baseline = fp("a")
    url = publish(store, "ingest", baseline)
    write_latest(store, "tiny", "ingest.json", {"output": url})
    put(store, "latest/tiny/ingest.json", b"{}")
    backdate(store, "stages", 30 * DAY)

    report = collect_garbage(store.url, keep_runs=0, older_than_s=WEEK)

    assert held(store, f"stages/ingest/{baseline}"), "gc dropped the drift baseline"
    (note,) = noted(report, "latest/tiny/ingest.json")
    assert "does not verify" in note and "every ingest output" in note


@pytest.mark.parametrize("where", ["local", "memory"])
def test_ten_junk_runs_cannot_push_the_champions_train_output_out(
    where: str, tmp_path: Path
) -> None:
    store = ArtifactStore(tmp_path / "root") if where == "local" else memory_store()
    train, export = fp("c"), "e1e1e1e1e1e1" + "0" * 52
    publish(store, "train", train)
    lineage = {"parent": None, "partitions": ["dt=2026-03-01"], "train": train}
    publish(store, "export", export, extra={"lineage.json": json.dumps(lineage).encode()})
    version = register(store, "ctr", export)
    write_champion(store, "ctr", version)
    write_record(store, "20260301T000000-champion", {"train": train, "export": export})
    # A UI user starts ten runs (signed by the flow like any other): the champion's run
    # record is now beyond --keep-runs 10, and so is the train output it named.
    for day, char in enumerate("0123456789", start=2):
        publish(store, "ingest", fp(char))
        write_record(store, f"202603{day:02d}T000000-junk{char * 4}", {"ingest": fp(char)})
    for top in ("stages", "runs", "registry", "latest"):
        backdate(store, top, 30 * DAY)

    report = collect_garbage(store.url, keep_runs=10, older_than_s=WEEK)

    assert held(store, f"stages/train/{train}"), "the next warm start would find no parent"
    assert report.kept["stage outputs the lineage of registry versions names"] == 1
    assert "runs/20260301T000000-champion" in {item.location for item in report.freed}


def test_a_rewritten_lineage_cannot_move_what_gc_keeps(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root")
    train, junk, export = fp("c"), fp("d"), "e1e1e1e1e1e1" + "0" * 52
    publish(store, "train", train)
    publish(store, "train", junk)
    lineage = {"parent": None, "partitions": ["dt=2026-03-01"], "train": train}
    publish(store, "export", export, extra={"lineage.json": json.dumps(lineage).encode()})
    version = register(store, "ctr", export)
    # The attacker points the champion's lineage at another train output: kept by a
    # lineage read without its sha256, it would leave the real parent to be deleted.
    rel = f"registry/ctr/{version}/lineage.json"
    put(store, rel, json.dumps({**lineage, "train": junk}).encode())
    for top in ("stages", "registry"):
        backdate(store, top, 30 * DAY)

    report = collect_garbage(store.url, keep_runs=0, older_than_s=WEEK)

    assert held(store, f"stages/train/{train}"), "gc deleted the champion's parent"
    (note,) = noted(report, rel)
    assert "sha256" in note and "keeps every stage output" in note


@pytest.mark.parametrize("rel", ["latest/tiny/ingest.json", "leases/20260301T000000-padded00.json"])
def test_a_signed_record_padded_past_its_cap_is_refused_and_keeps_more(
    rel: str, tmp_path: Path
) -> None:
    store = ArtifactStore(tmp_path / "root")
    other = fp("b")
    url = publish(store, "ingest", fp("a"))
    publish(store, "ingest", other)
    if rel.startswith("latest/"):
        write_latest(store, "tiny", "ingest.json", {"output": url})
    else:
        run_id = rel.split("/")[1].removesuffix(".json")
        now = time.time()  # a genuine lease of a live run, naming one output
        write_lease(store, run_id, {"run_id": run_id, "started": now, "heartbeat": now,
                                    "fingerprints": [fp("a")]})  # fmt: skip
    location = Path(store.location(*rel.split("/")))
    # Whitespace before a record a key holder signed: it still verifies, unless capped.
    location.write_bytes(b" " * (1 << 20) + location.read_bytes())
    backdate(store, "stages", 30 * DAY)
    backdate(store, "latest", 30 * DAY)

    report = collect_garbage(store.url, keep_runs=0, older_than_s=WEEK)

    assert held(store, f"stages/ingest/{other}")
    (note,) = noted(report, rel)
    assert "larger than" in note


# Where a poisoned object is planted, and the output gc must then keep.
POISONED = {
    "plan.json": ("latest/tiny/plan.json", "ingest"),
    "latest pointer": ("latest/tiny/ingest.json", "ingest"),
    "run record": ("runs/20260301T000000-poison00/summary.json", "ingest"),
    "CHAMPION": ("registry/ctr/CHAMPION", "export"),
    "package manifest": (f"registry/ctr/e2e2e2e2e2e2/{MANIFEST}", "train"),
    "lease": ("leases/20260301T000000-poison00.json", "ingest"),
    "stage manifest": (f"stages/ingest/{fp('a')}/{MANIFEST}", "ingest"),
}


@pytest.mark.parametrize("kind", list(POISON))
@pytest.mark.parametrize("where", list(POISONED))
def test_a_poisoned_record_makes_gc_keep_more_never_crash(
    where: str, kind: str, tmp_path: Path
) -> None:
    rel, stage = POISONED[where]
    store = memory_store() if where == "stage manifest" else ArtifactStore(tmp_path / "root")
    victim = fp("a")
    publish(store, stage, victim)
    if where == "stage manifest":  # a kept output, and a data prefix beside its own
        write_record(store, "20260301T000000-kept0000", {"ingest": victim})
        put(store, f"stages/ingest/{victim}/data-0rphan000000/part-0.bin")
    put(store, rel, POISON[kind])
    for top in ("stages", "runs", "registry", "latest"):  # the lease stays fresh
        backdate(store, top, 30 * DAY)

    report = collect_garbage(store.url, keep_runs=1, older_than_s=WEEK)

    assert report.freed == []
    assert held(store, f"stages/{stage}/{victim}")
    assert noted(report, rel), report.notes
