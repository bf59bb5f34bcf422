"""Stable fingerprints of protobuf messages."""
from __future__ import annotations

import hashlib

from google.protobuf.message import Message


def fingerprint(message: Message) -> str:
    """Returns a hex SHA-256 of the message's deterministic serialization.

    Args:
        message: Any protobuf message.

    Returns:
        32 hex characters (the first 128 bits of the digest).
    """
    data = message.SerializeToString(deterministic=True)
    return hashlib.sha256(data).hexdigest()[:32]
