"""Numbers written as text are read as Go reads them: ASCII digits only. Python's int(), str.isdigit() and
the `\\d` of a `re` pattern also take other scripts' digits ("١٠" is 10), and isdigit() passes superscripts
("²") that int() then refuses; each case below was accepted, or raised ValueError, before."""

from __future__ import annotations

import pytest

from embedded.scheduler.values import SemverError, parse_semver
from shared.claimconfigs import ClaimConfigError, MpsConfig, pinned_limits
from shared.numbers import decimal_int
from shared.quantity import QuantityError, parse_quantity

OTHER_DIGITS = ["١٢", "²", "１２", "1_2", " 12", "12\n", "", "+12", "1.0"]


@pytest.mark.parametrize("text", OTHER_DIGITS)
def test_decimal_int_takes_ascii_digits_only(text: str) -> None:
    assert decimal_int(text) is None


def test_decimal_int_reads_a_plain_or_signed_integer() -> None:
    assert decimal_int("012") == 12 and decimal_int("-5") is None
    assert decimal_int("-5", signed=True) == -5 and decimal_int("+5", signed=True) == 5
    assert decimal_int("+", signed=True) is None


@pytest.mark.parametrize("text", ["١٠Gi", "1٠", "10Gi\n", "1e١"])
def test_a_quantity_with_other_digits_is_not_one(text: str) -> None:
    with pytest.raises(QuantityError, match="is not a quantity"):
        parse_quantity(text)
    assert parse_quantity("10Gi") == 10 << 30


@pytest.mark.parametrize("key", ["١", "²"])
def test_a_per_device_limit_keyed_by_other_digits_is_a_config_error(key: str) -> None:
    uuids = ["GPU-a", "GPU-b"]
    with pytest.raises(ClaimConfigError, match="neither a UUID"):
        pinned_limits(MpsConfig(defaultPerDevicePinnedMemoryLimit={key: "1Gi"}), uuids)
    assert pinned_limits(MpsConfig(defaultPerDevicePinnedMemoryLimit={"1": "1Gi"}), uuids) == {"GPU-b": 1 << 30}


def test_a_version_with_other_digits_is_not_semver() -> None:
    with pytest.raises(SemverError):
        parse_semver("1١.0.0")
    assert parse_semver("11.0.0") == (11, 0, 0, ())
