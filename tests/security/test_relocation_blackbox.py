"""Issue 38, black box: outputs relocated by a writer to the bucket are not cache hits.

`recforge run` of config A on a moto S3 root; the attacker (no key, write access to the
bucket) copies A's train, evaluate and export outputs, manifests and data objects alike,
to the fingerprints of config B, which differs from A in its train section only. The
fingerprints are readable in the bucket (plans, run records); the test computes B's
with the plan's own function. `recforge run` of config B on the same root must then
train, evaluate and export B itself, and name the refused relocation in its log.
"""

import json
from pathlib import Path

import pytest

from artifacts.locations import filesystem, read_text_or_none
from artifacts.store import ArtifactStore
from data_prep.synthetic import generate_logs
from flows.config import load_config
from flows.pipeline import RunParams, plan_modes
from tasks.plan import plan_run
from tests.flows.test_object_store import (  # noqa: F401 - s3_root is a fixture
    RESUMABLE,
    TINY,
    recforge_run,
    s3_environment,
    s3_root,
)

pytestmark = [pytest.mark.security, pytest.mark.slow]

KEY = "k" * 64
# Config B: config A with another learning rate (a train-only change).
B_ONLY = ("train.lr=0.004",)
RELOCATED = ("train", "evaluate", "export")


def finished(process, what: str) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, f"{what}: {(out + err)[-3000:]}"
    record = json.loads(read_text_or_none(out.strip().splitlines()[-1]))
    return {"record": record, "log": out + err}


def copy_output(root: str, stage: str, source_fp: str, target_fp: str) -> None:
    """What the attacker does: every object of one output, copied under another fp."""
    fs, base = filesystem(f"{root}/stages/{stage}")
    fs.invalidate_cache(base)
    for name in fs.find(f"{base}/{source_fp}"):
        fs.copy(name, name.replace(f"/{source_fp}/", f"/{target_fp}/", 1))


def test_outputs_copied_to_another_configs_fingerprints_are_refused_and_rebuilt(
    s3_root: str,  # noqa: F811 - the fixture imported above
    moto_endpoint: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RECFORGE_SIGNING_KEY", KEY)
    raw = tmp_path / "raw"
    generate_logs(load_config(TINY, [f"generate.out={raw}"]).generate)
    env = {**s3_environment(moto_endpoint, tmp_path / "machine"), "RECFORGE_SIGNING_KEY": KEY}
    a = finished(recforge_run(s3_root, raw, env), "config A")["record"]

    config_b = load_config(TINY, [f"ingest.path={raw}", *RESUMABLE, *B_ONLY])
    params = RunParams(config=TINY, root=s3_root)
    plans = {p.stage: p for p in plan_run(config_b, plan_modes(params), ArtifactStore(s3_root))}
    for stage in RELOCATED:
        a_fp, b_fp = a["stages"][stage]["fingerprint"], plans[stage].fingerprint
        assert a_fp != b_fp
        copy_output(s3_root, stage, a_fp, b_fp)

    b = finished(recforge_run(s3_root, raw, env, extra=B_ONLY), "config B")
    stages = b["record"]["stages"]
    assert [stages[s]["status"] for s in ("ingest", "preprocess", "shard")] == ["cached"] * 3
    assert [stages[s]["status"] for s in RELOCATED] == ["ran"] * 3, stages
    for stage in RELOCATED:
        assert stages[stage]["fingerprint"] == plans[stage].fingerprint
        a_fp = a["stages"][stage]["fingerprint"]
        assert f"{stage}: not a cache hit" in b["log"]
        assert f"signed for stage-output stage={stage} fingerprint={a_fp[:16]}" in b["log"]
        # B's own output replaced the copy: its manifest is bound to B's place.
        manifest, _ = ArtifactStore(s3_root).verify(stage, plans[stage].fingerprint)
        assert manifest["place"]["fingerprint"] == plans[stage].fingerprint
    assert b["record"]["model"] != a["model"]
