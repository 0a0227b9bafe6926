"""Field checks applied to every request before it touches state."""

import pytest

from rollcall.membership.config import Config
from rollcall.membership.errors import InvalidRequest
from rollcall.protocol import validation as check

CONFIG = Config()


@pytest.mark.parametrize("value", ["w-1", "a", "Job_2.x", "x" * 64])
def test_valid_ids_pass(value):
    assert check.check_id(value, "id", CONFIG) == value


@pytest.mark.parametrize("value", ["", "-lead", ".x", "a b", "a/b", "é", "x" * 65, "a\n"])
def test_invalid_ids_are_rejected(value):
    with pytest.raises(InvalidRequest):
        check.check_id(value, "id", CONFIG)


@pytest.mark.parametrize("value", ["127.0.0.1:29500", "host-1.example:1", "[::1]:8080", "h:65535"])
def test_valid_addresses_pass(value):
    assert check.check_address(value, CONFIG) == value


@pytest.mark.parametrize(
    "value",
    ["", "host", ":80", "host:0", "host:65536", "host:x", "[zz]:80", "ho st:80", "a" * 300 + ":1"],
)
def test_invalid_addresses_are_rejected(value):
    with pytest.raises(InvalidRequest):
        check.check_address(value, CONFIG)


def test_digest_length_and_charset_are_checked():
    assert check.check_digest("sha256:abcDEF012+/=", CONFIG)
    with pytest.raises(InvalidRequest):
        check.check_digest("x" * (CONFIG.max_digest_length + 1), CONFIG)
    with pytest.raises(InvalidRequest):
        check.check_digest("bad digest", CONFIG)


def test_counters_beyond_int64_are_rejected():
    assert check.check_counter(2**63 - 1, "step") == 2**63 - 1
    with pytest.raises(InvalidRequest):
        check.check_counter(2**63, "step")
