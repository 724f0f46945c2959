"""Name and value formats the API server checks (apimachinery validation): DNS-1123 labels and
subdomains, qualified names (label keys), label values, C identifiers, DRA qualified names, semver.
Each checker returns a list of detail strings, empty when the value is fine."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?\Z",
    re.ASCII,
)

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
LABEL_VALUE_MAX = 63
C_IDENTIFIER_MAX = 32

_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
    "start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
    "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
    "must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_QUALIFIED_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
    "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex "
    "used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
_C_IDENTIFIER_MSG = (
    "a valid C identifier must start with alphabetic character or '_', followed by a string of "
    "alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for "
    "validation is '[A-Za-z_][A-Za-z0-9_]*')"
)


def _memo(check: Callable[[str], list[str]]) -> Callable[[str], list[str]]:
    """Caches a checker: the same names (attribute keys, driver names) recur on every device."""
    cached = functools.lru_cache(maxsize=4096)(lambda value: tuple(check(value)))

    @functools.wraps(check)
    def checker(value: str) -> list[str]:
        return list(cached(value))

    return checker


def _max_len(value: str, limit: int) -> list[str]:
    return [f"must be no more than {limit} characters"] if len(value) > limit else []


@_memo
def dns1123_label(value: str) -> list[str]:
    errs = _max_len(value, DNS1123_LABEL_MAX)
    if not _DNS1123_LABEL.match(value):
        errs.append(_LABEL_MSG)
    return errs


@_memo
def dns1123_subdomain(value: str) -> list[str]:
    errs = _max_len(value, DNS1123_SUBDOMAIN_MAX)
    if not _DNS1123_SUBDOMAIN.match(value):
        errs.append(_SUBDOMAIN_MSG)
    return errs


@_memo
def qualified_name(value: str) -> list[str]:
    """A label or annotation key: `[prefix/]name`, prefix a DNS subdomain, name ≤63 chars."""
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
        errs: list[str] = []
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errs = ["prefix part must be non-empty"]
        else:
            errs = [f"prefix part {e}" for e in dns1123_subdomain(prefix)]
    else:
        return [
            "a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start "
            "and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex "
            "used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional DNS "
            "subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    if not name:
        errs.append("name part must be non-empty")
    else:
        if len(name) > 63:
            errs.append("name part must be no more than 63 characters")
        if not _QUALIFIED_NAME.match(name):
            errs.append(_QUALIFIED_MSG)
    return errs


@_memo
def label_value(value: str) -> list[str]:
    errs = _max_len(value, LABEL_VALUE_MAX)
    if not _LABEL_VALUE.match(value):
        errs.append(_LABEL_VALUE_MSG)
    return errs


def c_identifier(value: str) -> list[str]:
    return [] if _C_IDENTIFIER.match(value) else [_C_IDENTIFIER_MSG]


@_memo
def driver_name(value: str) -> list[str]:
    """DRA driver names (and attribute domains): a DNS subdomain of at most 63 characters, lower case."""
    if not value:
        return ["driver name must not be empty"]
    errs = _max_len(value, 63)
    if not _DNS1123_SUBDOMAIN.match(value.lower()):
        errs.append(_SUBDOMAIN_MSG)
    return errs


@_memo
def dra_qualified_name(value: str) -> list[str]:
    """Attribute/capacity keys: `<C identifier>` or `<domain>/<C identifier>` (identifier ≤32)."""
    if not value:
        return ["name must not be empty"]
    domain, slash, ident = value.rpartition("/")
    errs: list[str] = []
    if slash:
        if not domain:
            errs.append("the domain must not be empty")
        else:
            errs.extend(driver_name(domain))
    if not ident:
        errs.append("the name must not be empty")
    else:
        errs.extend(c_identifier(ident))
        if len(ident) > C_IDENTIFIER_MAX:
            errs.append(f"must be no more than {C_IDENTIFIER_MAX} characters")
    return errs


def dra_fully_qualified_name(value: str) -> list[str]:
    """matchAttribute/distinctAttribute: like a qualified name, but the domain is mandatory."""
    errs = dra_qualified_name(value)
    if "/" not in value:
        errs.append("a fully qualified name must be a domain and a name separated by a slash")
    return errs


@_memo
def semver(value: str) -> list[str]:
    return [] if _SEMVER.match(value) else ["must be a string compatible with semver.org spec 2.0.0"]


def path_segment_name(value: str) -> list[str]:
    """Names of every object: may not be `.`/`..` or contain `/` or `%`."""
    if value in (".", ".."):
        return [f"may not be '{value}'"]
    return [f"may not contain '{c}'" for c in "/%" if c in value]
