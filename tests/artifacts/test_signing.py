"""The place a signed record is bound to (`artifacts.signing.place`)."""

import json

import pytest

from artifacts.signing import (
    KEY_ENV,
    MisplacedRecord,
    SignatureError,
    loads_verified,
    place,
    sign,
    verify,
)

KEY = "k" * 64
TRAIN_A = place("stage-output", stage="train", fingerprint="a" * 64)
TRAIN_B = place("stage-output", stage="train", fingerprint="b" * 64)


@pytest.fixture
def run_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


def test_a_record_verifies_at_its_own_place(run_key: None) -> None:
    record = sign({"files": {}}, place=TRAIN_A)

    assert loads_verified(json.dumps(record), "here", place=TRAIN_A)["place"] == TRAIN_A


def test_a_relocated_record_is_refused_naming_both_places(run_key: None) -> None:
    record = sign({"files": {}}, place=TRAIN_A)

    with pytest.raises(MisplacedRecord) as refused:
        verify(record, "stages/train/bbbb/_manifest.json", place=TRAIN_B)
    assert "aaaaaaaa" in str(refused.value) and "bbbbbbbb" in str(refused.value)


def test_the_place_is_covered_by_the_signature(run_key: None) -> None:
    record = sign({"files": {}}, place=TRAIN_A)
    record["place"] = TRAIN_B  # moved by someone without the key

    with pytest.raises(SignatureError, match="does not match"):
        verify(record, "here", place=TRAIN_B)


def test_an_unbound_record_is_refused_with_what_rebuilds_it(run_key: None) -> None:
    with pytest.raises(MisplacedRecord, match="--force STAGE"):
        verify(sign({"files": {}}), "here", place=TRAIN_A)


def test_without_a_key_an_unbound_record_reads_but_a_misplaced_one_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)

    assert verify({"files": {}}, "here", place=TRAIN_A) == {"files": {}}
    with pytest.raises(MisplacedRecord):
        verify(sign({"files": {}}, place=TRAIN_A), "here", place=TRAIN_B)


def test_place_keeps_coordinates_as_text_and_refuses_others() -> None:
    assert place("checkpoint", fingerprint="f" * 64, step=40)["step"] == "40"
    with pytest.raises(ValueError):
        place("checkpoint", fingerprint="f" * 64)
    with pytest.raises(ValueError):
        place("no-such-type", run_id="x")
