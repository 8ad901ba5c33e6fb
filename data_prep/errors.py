"""The error only the data libraries raise; the shared kinds are in `artifacts.errors`.

Messages name the file, line or row and column of a bad input, never the input itself:
at most a short `preview`, and none of a line that looks like a credential (a message
reaches logs and the UI; the quarantine keeps every bad row whole).
"""

import re

from artifacts.errors import DeterministicError

# Characters of an input line a message may show.
PREVIEW_CHARS = 40

# Words and shapes that mark a line as a credential: an assignment of a key, secret,
# token or password (an ini, .env or JSON line), an access key id, a private key.
# Cautious on purpose: a withheld preview costs a look into the quarantine.
_CREDENTIAL_LIKE = re.compile(
    r"key|secret|token|passw|credential|auth|bearer|"
    r"\b(?:AKIA|ASIA)[0-9A-Z]{12,}|\bgh[pousr]_\w{20,}|\bxox[abpr]-|-----BEGIN",
    re.IGNORECASE,
)
# A bare token (base64, hex, a random id) as long as a key: a secret on a line of its own.
_BARE_TOKEN = re.compile(r"\s*(?=[^\s]*[A-Za-z])(?=[^\s]*\d)[A-Za-z0-9+/=_.~-]{20,}\s*")


class SchemaError(DeterministicError):
    """Data does not match the declared schema (too many bad rows, missing columns)."""


def preview(text: str, limit: int = PREVIEW_CHARS) -> str:
    """A short, quoted preview of an input line for a message, or why none is shown.

    Args:
        text: The line (or the values of a row) as read.
        limit: Characters shown at most; longer text is cut and marked with "...".

    Returns:
        `repr` of the first `limit` characters, or "(not shown: N characters that look
        like a credential)".
    """
    if _CREDENTIAL_LIKE.search(text) or _BARE_TOKEN.fullmatch(text):
        return f"(not shown: {len(text)} characters that look like a credential)"
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
