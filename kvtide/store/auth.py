"""Record authentication: the store secret, the keys derived from it, and the record MAC.

With a secret (``RestoreConfig.secret``, else the environment's ``KVTIDE_STORE_SECRET``) every record a store writes
carries HMAC-SHA256 (truncated to the header's 16-byte digest field) over its header fields, metadata and body, and a
store with a secret accepts no other record: unkeyed ones (versions 1-3, or 4 without the flag) and ones keyed with
another secret are rejected as forged. HMAC-SHA256 over keyed BLAKE2b because on CPUs with SHA extensions (most
x86 servers) it verifies about twice as fast; both release the GIL on large inputs. The secret never goes into a
record or a key: three keys are derived from it, one for the MAC, one for keyed token-id hashes
(``store_token_ids=False``) and one salt for the chunk-key root, so that entry names cannot be computed (or a
prompt's presence probed) without it.
"""
from __future__ import annotations

import hashlib
import hmac
import os

SECRET_ENV = "KVTIDE_STORE_SECRET"
MAC_BYTES = 16
TOKEN_HASH_BYTES = 32


def resolve_secret(secret: str | bytes | None) -> bytes | None:
    """The secret to use: ``secret`` when given, else ``$KVTIDE_STORE_SECRET`` (unset or empty: None)."""
    if secret is None:
        env = os.environ.get(SECRET_ENV)
        return env.encode() if env else None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise TypeError(f"store secret must be str or bytes, got {type(secret).__name__}")
    if not secret:
        raise ValueError("store secret must not be empty (use None for no secret)")
    return secret


class RecordAuth:
    """Keys derived from one secret; ``mac`` signs a record, ``token_hash`` hides a chunk's token ids."""

    __slots__ = ("_mac_key", "_tok_key", "key_salt")

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("RecordAuth needs a non-empty secret")
        derive = lambda purpose: hmac.digest(secret, b"kvtide/" + purpose, "sha256")  # noqa: E731
        self._mac_key = derive(b"record-mac/v1")
        self._tok_key = derive(b"token-hash/v1")
        self.key_salt = derive(b"key-root/v1")

    def mac(self, header: bytes | memoryview, body: bytes | memoryview) -> bytes:
        """HMAC-SHA256/128 of the header's fixed fields then the record from its metadata on."""
        h = hmac.new(self._mac_key, header, "sha256")
        h.update(body)
        return h.digest()[:MAC_BYTES]

    def token_hash(self, token_bytes: bytes) -> bytes:
        return hmac.digest(self._tok_key, token_bytes, "sha256")

    def __repr__(self) -> str:
        return "RecordAuth(<secret>)"


def token_hash(token_bytes: bytes, auth: RecordAuth | None) -> bytes:
    """What a record holds instead of its token ids: keyed with the secret when there is one, else plain BLAKE2b
    (which only hides the ids from a reader who cannot guess the prompt)."""
    if auth is not None:
        return auth.token_hash(token_bytes)
    return hashlib.blake2b(token_bytes, digest_size=TOKEN_HASH_BYTES, person=b"kvtide-tok-v1").digest()
