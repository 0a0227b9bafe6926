"""Checks every field that arrives from the network before it touches state."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping

from rollcall.membership import fingerprint
from rollcall.membership.config import Config
from rollcall.membership.errors import InvalidRequest

#: Member ids, name prefixes and job names: letters, digits, ``.``, ``_``, ``-``;
#: first character alphanumeric.
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")
_PORT = re.compile(r"[0-9]{1,5}")  # ASCII only: str.isdigit() admits "²" and "٢"
_DIGEST = re.compile(r"[A-Za-z0-9:+/=_-]*")
#: Largest epoch or step accepted (fits a signed 64-bit integer).
MAX_COUNTER = 2**63 - 1


def check_id(value: str, what: str, config: Config) -> str:
    if not value:
        raise InvalidRequest(f"{what} is empty")
    if len(value) > config.max_id_length:
        raise InvalidRequest(f"{what} is longer than {config.max_id_length} characters")
    if not ID_PATTERN.fullmatch(value):
        raise InvalidRequest(
            f"{what} {value[:40]!r} has characters outside [A-Za-z0-9._-] "
            "or does not start with a letter or digit"
        )
    return value


def check_address(value: str, config: Config, listen: bool = False) -> str:
    """``host:port`` with a hostname, IPv4 address or bracketed IPv6 address
    (for a ``listen`` address, port 0 picks a free port)."""
    if not value:
        raise InvalidRequest("address is empty")
    if len(value) > config.max_address_length:
        raise InvalidRequest(f"address is longer than {config.max_address_length} characters")
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise InvalidRequest(f"address {value[:60]!r} is not host:port")
    lowest = 0 if listen else 1
    if not _PORT.fullmatch(port) or not lowest <= int(port) < 65536:
        raise InvalidRequest(f"address {value[:60]!r} has no valid port ({lowest}-65535)")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise InvalidRequest(f"address {value[:60]!r} has an invalid IPv6 host") from None
    elif not _HOSTNAME.fullmatch(host):
        raise InvalidRequest(f"address {value[:60]!r} has an invalid host")
    return value


def check_digest(value: str, config: Config) -> str:
    if len(value) > config.max_digest_length:
        raise InvalidRequest(f"digest is longer than {config.max_digest_length} characters")
    if not _DIGEST.fullmatch(value):
        raise InvalidRequest("digest has characters outside [A-Za-z0-9:+/=_-]")
    return value


def check_counter(value: int, what: str) -> int:
    if value > MAX_COUNTER:
        raise InvalidRequest(f"{what} {value} is out of range")
    return value


def check_time(value: float, what: str, below: float | None = None) -> float:
    """A time or duration in seconds: finite (JSON has no infinity), >= 0
    and, if ``below`` is given, less than that."""
    if not (math.isfinite(value) and value >= 0):
        raise InvalidRequest(f"{what} must be a finite, non-negative number")
    if below is not None and value >= below:
        raise InvalidRequest(f"{what} must be less than {below:g} seconds")
    return value


def check_text(value: str, what: str, limit: int) -> str:
    if len(value) > limit:
        raise InvalidRequest(f"{what} is longer than {limit} characters")
    return value


def check_fingerprint(values: Mapping[str, str]) -> fingerprint.JobFingerprint | None:
    """A joiner's fingerprint (``rollcall.membership.fingerprint.check_fingerprint``);
    None when it sent none, which is not checked."""
    return fingerprint.check_fingerprint(values) if values else None
