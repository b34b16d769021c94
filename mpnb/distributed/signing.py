"""Messages signed with a launch's secret: what another process did not sign is never read.

A :class:`Signer` puts an HMAC-SHA256 tag (32 bytes) in front of a payload and takes it off
again only if the tag matches. The secret itself never travels: a launch makes a fresh one and
hands it to the workers it forks or spawns (a pipe between parent and child, not a socket);
several machines share one the user gives to each node's launch, as Jupyter's token is given.

Example:
    >>> signer = Signer(b"k" * 32)
    >>> message = signer.sign(b"hello")
    >>> signer.open(message)
    b'hello'
    >>> signer.open(b"x" * 32 + b"hello") is None
    True
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from mpnb.errors import MpnbError

__all__: list[str] = []

#: The environment variable each node's launch reads its shared secret from (several machines).
SECRET_ENV = "MPNB_LAUNCH_SECRET"
#: The fewest bytes a shared secret may have (a hex string of 32 characters).
MIN_SECRET_BYTES = 16
#: The bytes a signature puts in front of a payload.
TAG_BYTES = hashlib.sha256().digest_size


def new_secret() -> bytes:
    """A fresh random secret for one launch on one machine."""
    return secrets.token_bytes(32)


def shared_secret(given: str | bytes | None) -> bytes | None:
    """The secret every node of a launch shares: ``given``, else :data:`SECRET_ENV`, else None.

    Raises:
        MpnbError: it is shorter than :data:`MIN_SECRET_BYTES` bytes, or not text or bytes.

    >>> shared_secret("0123456789abcdef0123456789abcdef")
    b'0123456789abcdef0123456789abcdef'
    """
    value = given if given is not None else os.environ.get(SECRET_ENV) or None
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, bytes):
        raise MpnbError(f"secret must be text or bytes, got {type(value).__name__}")
    if len(value) < MIN_SECRET_BYTES:
        raise MpnbError(
            f"the launch secret has {len(value)} bytes, fewer than {MIN_SECRET_BYTES}: make one with "
            "python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return value


class Signer:
    """Signs payloads with one secret and opens only what that secret signed."""

    def __init__(self, secret: bytes) -> None:
        self._key = secret

    def tag(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()

    def sign(self, payload: bytes) -> bytes:
        """``payload`` with its tag in front."""
        return self.tag(payload) + payload

    def open(self, message: bytes) -> bytes | None:
        """The payload of a message this secret signed; None for anything else (compared in constant time)."""
        if not isinstance(message, bytes) or len(message) < TAG_BYTES:
            return None
        tag, payload = message[:TAG_BYTES], message[TAG_BYTES:]
        return payload if hmac.compare_digest(tag, self.tag(payload)) else None
