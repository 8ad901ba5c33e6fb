"""Issue 38 finding 8: parsing what the bucket holds is bounded.

The attacker writes objects that a recforge reader parses before it can check their
signature: a 5,000-digit integer, nesting deeper than the parser's stack, bytes that are
not UTF-8, an object of hundreds of megabytes. Each must make the record unverifiable
(a `SignatureError`, a hint ignored), never a crash, and never be read whole.
"""

import json
import tracemalloc
import uuid
from pathlib import Path

import fsspec
import pytest

from artifacts.signing import KEY_ENV, SignatureError, loads_verified, read_hint, sign

pytestmark = pytest.mark.security

KEY = "k" * 64
POISON = {
    "5,000-digit integer": '{"output": ' + "9" * 5000 + "}",
    "deep nesting": "[" * 200_000 + "]" * 200_000,
    "not UTF-8": b'{"output": "\xff\xfe\xfd"}',
}


@pytest.fixture(autouse=True)
def run_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.mark.parametrize("kind", list(POISON))
def test_a_poisoned_record_is_unverifiable_not_a_crash(kind: str) -> None:
    with pytest.raises(SignatureError):
        loads_verified(POISON[kind], "latest/demo/plan.json")


@pytest.mark.parametrize("kind", list(POISON))
def test_a_poisoned_pointer_in_the_bucket_is_an_ignored_hint(kind: str) -> None:
    poison = POISON[kind]
    url = f"memory://bucket-{uuid.uuid4().hex[:8]}/root/latest/demo/plan.json"
    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe_file(path, poison.encode() if isinstance(poison, str) else poison)

    assert read_hint(url, "the plan") is None


def test_an_oversized_object_is_refused_without_being_read_whole(tmp_path: Path) -> None:
    # A record a key holder once signed, padded with 200 MB of JSON whitespace: its
    # signature still verifies, so only the size cap stops a reader holding it all.
    planted = tmp_path / "plan.json"
    signed = json.dumps(sign({"output": "elsewhere"}))
    with open(planted, "wb") as handle:
        handle.write(b" " * (200 << 20))
        handle.write(signed.encode())

    tracemalloc.start()
    try:
        assert read_hint(planted, "the plan") is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100 << 20, f"reading the planted object held {peak >> 20} MiB"
