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

from artifacts.errors import ConfigError, DataError

KEY_ENV = "RECFORGE_SIGNING_KEY"
KEY_FILE_ENV = "RECFORGE_SIGNING_KEY_FILE"
KEY_BLOCK_ENV = "RECFORGE_SIGNING_KEY_BLOCK"
RETIRED_ENV = "RECFORGE_SIGNING_KEYS_RETIRED"
SIGNATURE = "signature"
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


class SignatureError(DataError):
    """A record read back from storage is unsigned, signed with an unknown key, or forged."""


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


def sign(record: dict[str, Any], keys: Keyring | None = None) -> dict[str, Any]:
    """`record` with its signature (a copy); unchanged when no key is configured."""
    keys = keys if keys is not None else keyring()
    body = {k: v for k, v in record.items() if k != SIGNATURE}
    if keys is None:
        return body
    return {**body, SIGNATURE: {"key_id": keys.key_id, "hmac": digest(keys.current, body)}}


def verify(record: Any, where: str, keys: Keyring | None = None) -> dict[str, Any]:
    """`record` once its signature checks out (without a key: once it is a JSON object).

    Args:
        record: A parsed manifest or pointer read back from storage.
        where: Its location, for the message.
        keys: The keyring; default: the configured one.

    Raises:
        SignatureError: Not an object; or, with a key configured, no signature, an
            unknown key id, or an HMAC that does not match (a forgery or a change).
    """
    if not isinstance(record, dict):
        raise SignatureError(f"{where} is not a JSON object; it was not written by recforge")
    keys = keys if keys is not None else keyring()
    if keys is None:
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
    if not hmac.compare_digest(str(signature.get("hmac")), digest(secret, record)):
        raise SignatureError(
            f"{where}: its signature does not match its contents; it was changed or forged "
            "by someone without the key. Nothing it names was opened; rerun the stage that "
            "writes it (--force STAGE)"
        )
    return record


def read_hint(location: str | Path, what: str) -> dict[str, Any] | None:
    """A signed record that is a hint, not a source of truth (a pointer, a cached score,
    a decision): without its signature, or None when it is missing or does not verify
    (logged under `what`: a forged hint is ignored, never trusted).
    """
    from artifacts.locations import read_text_or_none

    text = read_text_or_none(location)
    if text is None:
        return None
    try:
        record = loads_verified(text, str(location))
    except SignatureError as err:
        _logger.warning("%s: ignoring %s: %s", what, location, err)
        return None
    return {k: v for k, v in record.items() if k != SIGNATURE}


def loads_verified(text: str, where: str, keys: Keyring | None = None) -> dict[str, Any]:
    """Parse and `verify` a record's JSON text.

    Raises:
        SignatureError: It does not parse, or `verify` refuses it.
    """
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise SignatureError(f"{where} is not valid JSON ({err.msg}, line {err.lineno})") from err
    return verify(record, where, keys)
