"""Signed manifests: an HMAC-SHA256 over a record's canonical JSON, with the run key.

The trust model (docs/security.md): whoever holds the run key, and the ranks of one job,
are trusted; the bucket's contents and anyone else who can write to it are not. So every
manifest or pointer recforge writes to the root and reads back (stage outputs,
checkpoints, registry packages, CHAMPION, the `latest/` pointers, exchange indexes)
carries ``"signature": {"key_id", "hmac"}``, and a reader checks it before it trusts a
single name or sha256 in the record. A file's sha256 proves nothing on its own: whoever
can replace the file can rewrite the manifest beside it, but not sign it.

The key never lives in the bucket. It comes from, in order:

- ``$RECFORGE_SIGNING_KEY``: the secret itself (at least 32 characters);
- ``$RECFORGE_SIGNING_KEY_FILE``: a file holding it (the first line; any further lines
  are retired keys, still accepted by readers: rotation);
- a Prefect Secret block named by ``$RECFORGE_SIGNING_KEY_BLOCK``, which the flow
  resolves into ``$RECFORGE_SIGNING_KEY`` for itself and the ranks it starts
  (``artifacts`` imports no Prefect).

``$RECFORGE_SIGNING_KEYS_RETIRED`` (comma-separated) adds retired keys too. The key id
in a signature is the first 16 hex digits of the key's sha256, so a reader picks the
right key after a rotation without trying each one.

Without any key a local root works as before, unsigned, with a one-line notice; a remote
root refuses to start (`require_key`). With a key, an unsigned or wrongly signed record
is refused wherever it is read: nothing it names is opened.

A signature proves that a key holder wrote the bytes, not that they are the bytes meant
for the place they were found: a signed manifest copied to another fingerprint would
verify there too. So every signed record also says what it is and where it belongs, in
its ``"place"`` field (`place`): a record type and the coordinates of its place (stage
and fingerprint, model and version, run id, attempt and node). The field is covered by
the signature, and every reader passes the place it read the record from: a relocated
copy is refused naming both places (`MisplacedRecord`), and a record written before
records were bound is refused by name with the command that rebuilds it.

Reading is bounded: a record is read up to a size cap (`read_text_or_none`), and a
record that does not parse for any reason (bad JSON, a 5,000-digit integer, deep
nesting, bytes that are not UTF-8) is unverifiable (`SignatureError`), never a crash.

Why by hand: hmac and hashlib are the standard library's; what is ours is only the
canonical form (sorted keys, no whitespace, the signature field left out), which every
writer and reader must agree on byte for byte.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# SignatureError lives in artifacts.errors (the bounded reader raises it too); readers
# import it from here.
from artifacts.errors import ConfigError, SignatureError  # noqa: F401

KEY_ENV = "RECFORGE_SIGNING_KEY"
KEY_FILE_ENV = "RECFORGE_SIGNING_KEY_FILE"
KEY_BLOCK_ENV = "RECFORGE_SIGNING_KEY_BLOCK"
RETIRED_ENV = "RECFORGE_SIGNING_KEYS_RETIRED"
SIGNATURE = "signature"
PLACE = "place"
# Shorter secrets are refused: an HMAC key should carry at least 128 bits of entropy,
# and a typed password of a few characters does not.
MIN_KEY_CHARS = 32

_logger = logging.getLogger(__name__)
_noticed: set[str] = set()

HOW_TO_SET = (
    f"set {KEY_ENV} (a random secret of >= {MIN_KEY_CHARS} characters, e.g. "
    "`python -c 'import secrets; print(secrets.token_hex(32))'`), or "
    f"{KEY_FILE_ENV} to a file holding it, or {KEY_BLOCK_ENV} to the name of a Prefect "
    "Secret block; keep it out of the bucket"
)


class MisplacedRecord(SignatureError):
    """A signed record found somewhere other than the place it was signed for, or one
    that names no place (written before records were bound)."""


# The record types and the coordinates of their places; `place` refuses any other.
PLACES: dict[str, tuple[str, ...]] = {
    "stage-output": ("stage", "fingerprint"),
    "latest": ("pipeline", "name"),
    "run-record": ("run_id",),
    "lease": ("run_id",),
    "package": ("model", "version"),
    "champion": ("model",),
    "history": ("model",),
    "decision": ("model", "version"),
    "champion-score": ("model", "version"),
    "checkpoint": ("fingerprint", "step"),
    "exchange-spec": ("attempt",),
    "exchange-stop": ("attempt",),
    "exchange-index": ("attempt", "node"),
    "exchange-outcome": ("attempt", "node"),
    "heartbeat": ("attempt", "node"),
}

# What rebuilds a record of each type, for the message that refuses an unbound one.
REBUILD: dict[str, str] = {
    "stage-output": "rerun the stage with `recforge run CONFIG --force STAGE`",
    "latest": "the next `recforge run` of the pipeline writes it again",
    "run-record": "it is a record of a past run; rerun the config to get a new one",
    "lease": "the run that holds it writes it again while it is alive",
    "package": "export the model again: `recforge run CONFIG --force export`",
    "champion": "promote a version again: `recforge models --model NAME promote VERSION`",
    "history": "promote a version again: `recforge models --model NAME promote VERSION`",
    "decision": "run the gate again: `recforge run CONFIG --force evaluate`",
    "champion-score": "it is scored again on the next run",
    "checkpoint": "the training run writes a new checkpoint (or rerun with --force train)",
    "exchange-spec": "rerun the train stage (--force train)",
    "exchange-stop": "rerun the train stage (--force train)",
    "exchange-index": "rerun the train stage (--force train)",
    "exchange-outcome": "rerun the train stage (--force train)",
    "heartbeat": "the node writes a new one while it is alive",
}


def place(kind: str, **where: Any) -> dict[str, str]:
    """The place a record of type `kind` belongs to, e.g.
    ``place("stage-output", stage="train", fingerprint=fp)``.

    Every coordinate is kept as text, so a reader compares what it computed with what
    was signed without caring whether a step or node was an int.

    Raises:
        ValueError: An unknown type, or not exactly that type's coordinates (a bug).
    """
    fields = PLACES.get(kind)
    if fields is None or set(where) != set(fields):
        raise ValueError(f"place({kind!r}, {sorted(where)}): expected the fields {fields}")
    return {"type": kind, **{name: str(where[name]) for name in fields}}


def describe_place(record_place: Any) -> str:
    """A place as one short phrase for messages: ``stage-output stage=train fingerprint=ab12..``."""
    if not isinstance(record_place, dict):
        return "no place"
    parts = [str(record_place.get("type", "?"))[:40]]
    for name, value in record_place.items():
        if name != "type":
            text = str(value)
            if len(text) > 18 and "/" in text:  # a URL or path: its end tells it apart
                text = f"..{text[-40:]}" if len(text) > 42 else text
            elif len(text) > 18:  # a fingerprint: its start, as the CLI shows them
                text = f"{text[:16]}.."
            parts.append(f"{str(name)[:40]}={text}")
    return " ".join(parts)


def check_place(record: dict[str, Any], where: str, expected: dict[str, str]) -> None:
    """Refuse `record` unless it names `expected` as its place.

    Raises:
        MisplacedRecord: It names another place (a relocated copy: both are named), or
            none at all (written before records were bound: the message says what
            rebuilds it).
    """
    found = record.get(PLACE)
    if found == expected:
        return
    if found is None:
        raise MisplacedRecord(
            f"{where} names no place, so it may have been copied from anywhere (recforge "
            f"before records were bound to their place wrote it, or it was forged): refusing "
            f"it. To rebuild it, {REBUILD.get(expected['type'], 'rerun the stage that writes it')}"
        )
    raise MisplacedRecord(
        f"{where} is a relocated copy: it was signed for {describe_place(found)}, but was "
        f"found at {describe_place(expected)}; refusing it (someone with write access to "
        "the bucket copied it there)"
    )


@dataclass(frozen=True)
class Keyring:
    """The run key (signs) and the keys readers accept (it and the retired ones)."""

    current: bytes
    accepted: dict[str, bytes]

    @property
    def key_id(self) -> str:
        return key_id(self.current)


def key_id(secret: bytes) -> str:
    """The public name of a key: the first 16 hex digits of its sha256."""
    return hashlib.sha256(secret).hexdigest()[:16]


def _checked(secret: str, where: str) -> bytes:
    secret = secret.strip()
    if len(secret) < MIN_KEY_CHARS:
        raise ConfigError(
            f"{where}: the signing key has {len(secret)} characters; use a random secret of "
            f">= {MIN_KEY_CHARS} (e.g. `python -c 'import secrets; "
            "print(secrets.token_hex(32))'`)"
        )
    return secret.encode()


def keyring() -> Keyring | None:
    """The configured keys (see the module docstring), or None when none is set.

    Raises:
        ConfigError: The key file is missing or a key is too short.
    """
    keys: list[bytes] = []
    if os.environ.get(KEY_ENV):
        keys.append(_checked(os.environ[KEY_ENV], KEY_ENV))
    if os.environ.get(KEY_FILE_ENV):
        path = Path(os.environ[KEY_FILE_ENV])
        try:
            lines = [line for line in path.read_text().splitlines() if line.strip()]
        except OSError as err:
            raise ConfigError(
                f"{KEY_FILE_ENV}={path}: cannot read the signing key ({err.strerror}); "
                "point it at a readable file whose first line is the key"
            ) from err
        if not lines:
            raise ConfigError(f"{KEY_FILE_ENV}={path} is empty; write the key on its first line")
        keys.extend(_checked(line, f"{KEY_FILE_ENV}={path}") for line in lines)
    retired = [s for s in os.environ.get(RETIRED_ENV, "").split(",") if s.strip()]
    if not keys:
        return None
    keys.extend(_checked(secret, RETIRED_ENV) for secret in retired)
    return Keyring(current=keys[0], accepted={key_id(k): k for k in keys})


def require_key(root: str, remote: bool) -> Keyring | None:
    """The keyring a run on `root` signs with; a remote root must have one.

    Raises:
        ConfigError: `root` is an object-store URL and no key is configured.
    """
    keys = keyring()
    if keys is None and remote:
        raise ConfigError(
            f"the artifact root {root} is shared storage, and recforge trusts nothing it "
            f"reads back from there unless it is signed: {HOW_TO_SET}"
        )
    if keys is None and root not in _noticed:
        _noticed.add(root)
        _logger.warning(
            "no signing key (%s): the manifests under %s are not signed; set one before "
            "anyone else can write there",
            KEY_ENV,
            root,
        )
    return keys


def canonical(record: dict[str, Any]) -> bytes:
    """The bytes a signature covers: `record` without its signature, as canonical JSON."""
    body = {k: v for k, v in record.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def digest(secret: bytes, record: dict[str, Any]) -> str:
    return hmac.new(secret, canonical(record), hashlib.sha256).hexdigest()


def sign(
    record: dict[str, Any], keys: Keyring | None = None, *, place: dict[str, str] | None = None
) -> dict[str, Any]:
    """`record` with its place and signature (a copy); unsigned when no key is configured.

    Args:
        record: The record to sign (any signature it has is replaced).
        keys: The keyring; default: the configured one.
        place: Where the record belongs (`place`); written into it as ``"place"`` and
            covered by the signature.
    """
    keys = keys if keys is not None else keyring()
    body = {k: v for k, v in record.items() if k != SIGNATURE}
    if place is not None:
        body[PLACE] = place
    if keys is None:
        return body
    return {**body, SIGNATURE: {"key_id": keys.key_id, "hmac": digest(keys.current, body)}}


def verify(
    record: Any,
    where: str,
    keys: Keyring | None = None,
    *,
    place: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`record` once its signature and place check out (without a key: once it is a JSON
    object, and names `place` if it names any).

    Args:
        record: A parsed manifest or pointer read back from storage.
        where: Its location, for the message.
        keys: The keyring; default: the configured one.
        place: The place it was read from (`place`); None only where the caller checks
            the place itself.

    Raises:
        SignatureError: Not an object; or, with a key configured, no signature, an
            unknown key id, or an HMAC that does not match (a forgery or a change).
        MisplacedRecord: It is bound to another place than `place`, or (with a key) to
            none.
    """
    if not isinstance(record, dict):
        raise SignatureError(f"{where} is not a JSON object; it was not written by recforge")
    keys = keys if keys is not None else keyring()
    if keys is None:
        if place is not None and PLACE in record:
            check_place(record, where, place)
        return record
    signature = record.get(SIGNATURE)
    if not isinstance(signature, dict):
        raise SignatureError(
            f"{where} is not signed, and a signing key is configured: refusing to trust it "
            "(it may be forged, or written before the key was set). Rerun the stage that "
            "writes it (--force STAGE) to replace it"
        )
    secret = keys.accepted.get(str(signature.get("key_id")))
    if secret is None:
        raise SignatureError(
            f"{where} is signed with key id {str(signature.get('key_id'))[:16]!r}, which is "
            f"not among the configured keys ({', '.join(keys.accepted)}); add the old key "
            f"to {RETIRED_ENV} after a rotation, or rerun the stage that writes it"
        )
    try:
        expected_hmac = digest(secret, record)
    except (ValueError, RecursionError, TypeError) as err:
        raise SignatureError(
            f"{where} cannot be put in canonical form ({type(err).__name__})"
        ) from err
    if not hmac.compare_digest(str(signature.get("hmac")), expected_hmac):
        raise SignatureError(
            f"{where}: its signature does not match its contents; it was changed or forged "
            "by someone without the key. Nothing it names was opened; rerun the stage that "
            "writes it (--force STAGE)"
        )
    if place is not None:
        check_place(record, where, place)
    return record


def read_hint(
    location: str | Path,
    what: str,
    *,
    place: dict[str, str] | None = None,
    limit: int | None = None,
) -> dict[str, Any] | None:
    """A signed record that is a hint, not a source of truth (a pointer, a cached score,
    a decision): without its signature, or None when it is missing or does not verify
    (logged under `what`: a forged or relocated hint is ignored, never trusted).

    Args:
        location: Where it is.
        what: What reads it, for the log line.
        place: The place it must be bound to (`place`).
        limit: Its size cap in bytes (default: `locations.MAX_RECORD_BYTES`).
    """
    try:
        record = read_verified(location, place=place, limit=limit)
    except SignatureError as err:
        _logger.warning("%s: ignoring %s: %s", what, location, err)
        return None
    if record is None:
        return None
    return {k: v for k, v in record.items() if k != SIGNATURE}


def read_verified(
    location: str | Path,
    *,
    place: dict[str, str] | None = None,
    limit: int | None = None,
    keys: Keyring | None = None,
) -> dict[str, Any] | None:
    """Read (up to its size cap), parse and `verify` the record at `location`.

    Returns:
        The record, or None when there is no object there.

    Raises:
        SignatureError: It is too large, not UTF-8, does not parse, or `verify`
            refuses it (`MisplacedRecord` when it belongs elsewhere).
    """
    from artifacts.locations import MAX_RECORD_BYTES, read_text_or_none

    text = read_text_or_none(location, MAX_RECORD_BYTES if limit is None else limit)
    if text is None:
        return None
    return loads_verified(text, str(location), keys, place=place)


def loads_verified(
    text: str | bytes,
    where: str,
    keys: Keyring | None = None,
    *,
    place: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Parse and `verify` a record's JSON text.

    Any parse failure (bad JSON, an integer of thousands of digits, nesting deeper than
    the parser's stack, bytes that are not UTF-8) makes the record unverifiable, never
    a crash: whoever can write the bucket can write such an object.

    Raises:
        SignatureError: It does not parse, or `verify` refuses it.
    """
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise SignatureError(f"{where} is not valid JSON ({err.msg}, line {err.lineno})") from err
    except (ValueError, RecursionError, UnicodeDecodeError, TypeError) as err:
        raise SignatureError(
            f"{where} does not parse as a record ({type(err).__name__}); recforge never wrote it"
        ) from err
    return verify(record, where, keys, place=place)
