"""Label selectors (equality and set-based) and field selectors, parsed once and matched per object.

Parse errors raise `SelectorError` with a message in the real server's words; the HTTP layer
turns it into a 400 BadRequest Status.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

Matcher = Callable[[dict[str, Any]], bool]


class SelectorError(ValueError):
    pass


_TOKEN = re.compile(r"\s*(!=|==|=|!|,|\(|\)|<|>|[^\s!=,()<>]+)", re.ASCII)


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or not m.group(1):
            raise SelectorError(f"unable to parse requirement: {text!r}")
        out.append(m.group(1))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


def parse_label_selector(text: str | None) -> Matcher | None:
    """`app=x,tier!=y,env in (a,b),!legacy,gpu` -> a predicate over metadata.labels."""
    if not text or not text.strip():
        return None
    toks = _tokens(text)
    reqs: list[Callable[[dict[str, str]], bool]] = []
    i = 0

    def take() -> str:
        nonlocal i
        if i >= len(toks):
            raise SelectorError(f"unable to parse requirement: unexpected end of selector {text!r}")
        i += 1
        return toks[i - 1]

    while i < len(toks):
        tok = take()
        if tok == "!":
            key = take()
            reqs.append(functools.partial(_lacks, key))
        else:
            key = tok
            _check_key(key)
            op = toks[i] if i < len(toks) else ","
            if op == ",":
                reqs.append(functools.partial(_has, key))
            elif op in ("=", "==", "!="):
                i += 1
                value = toks[i] if i < len(toks) and toks[i] != "," else ""
                if value:
                    i += 1
                if op == "!=":
                    reqs.append(functools.partial(_differs, key, value))
                else:
                    reqs.append(functools.partial(_equals, key, value))
            elif op in ("in", "notin"):
                i += 1
                if take() != "(":
                    raise SelectorError(f"found '{toks[i - 1]}', expected: '(' in selector {text!r}")
                values: set[str] = set()
                while True:
                    t = take()
                    if t == ")":
                        break
                    if t != ",":
                        values.add(t)
                if op == "in":
                    reqs.append(functools.partial(_among, key, frozenset(values)))
                else:
                    reqs.append(functools.partial(_not_among, key, frozenset(values)))
            elif op in ("<", ">"):
                i += 1
                bound = take()
                try:
                    limit = int(bound)
                except ValueError as exc:
                    raise SelectorError(f"for 'Gt', 'Lt' operators, the value must be an integer: {bound}") from exc
                reqs.append(functools.partial(_compares, key, limit, op == ">"))
            else:
                raise SelectorError(f"found '{op}', expected: '=', '!=', '==', 'in', notin' in selector {text!r}")
        if i < len(toks):
            if toks[i] != ",":
                raise SelectorError(f"found '{toks[i]}', expected: ',' or 'end of string' in selector {text!r}")
            i += 1

    def match(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(r(labels) for r in reqs)

    return match


def _cmp(value: str | None, limit: int, gt: bool) -> bool:
    try:
        n = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return n > limit if gt else n < limit


def _has(key: str, labels: dict[str, str]) -> bool:
    return key in labels


def _lacks(key: str, labels: dict[str, str]) -> bool:
    return key not in labels


def _equals(key: str, value: str, labels: dict[str, str]) -> bool:
    return key in labels and labels[key] == value


def _differs(key: str, value: str, labels: dict[str, str]) -> bool:
    return labels.get(key) != value


def _among(key: str, values: frozenset[str], labels: dict[str, str]) -> bool:
    return labels.get(key) in values


def _not_among(key: str, values: frozenset[str], labels: dict[str, str]) -> bool:
    return labels.get(key) not in values


def _compares(key: str, limit: int, greater: bool, labels: dict[str, str]) -> bool:
    return _cmp(labels.get(key), limit, greater)


_KEY = re.compile(r"^([a-z0-9A-Z.-]{1,253}/)?[a-zA-Z0-9]([-a-zA-Z0-9_.]{0,61}[a-zA-Z0-9])?\Z")


def _check_key(key: str) -> None:
    if not _KEY.match(key):
        raise SelectorError(f"unable to parse requirement: invalid label key {key!r}")


def field_value(obj: dict[str, Any], path: str) -> str:
    """The string a field selector compares: nested lookup by dots, booleans as true/false."""
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            cur = None
            break
        cur = cur.get(part)
    if cur is None:
        if path == "spec.unschedulable":
            return "false"
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    if path == "source" and isinstance(cur, dict):
        return str(cur.get("component", ""))
    return str(cur)


def parse_field_selector(text: str | None, allowed: tuple[str, ...], kind: str) -> Matcher | None:
    """`metadata.name=x,spec.nodeName!=y` -> a predicate; unknown fields are a 400 like upstream."""
    if not text or not text.strip():
        return None
    reqs: list[tuple[str, str, bool]] = []
    for part in _split_unescaped(text):
        part = part.strip()
        if not part:
            continue
        if "!=" in part:
            field, value = part.split("!=", 1)
            negate = True
        elif "==" in part:
            field, value = part.split("==", 1)
            negate = False
        elif "=" in part:
            field, value = part.split("=", 1)
            negate = False
        else:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{part}'")
        field = field.strip()
        if field not in allowed:
            raise SelectorError(f"field label not supported: {field}")
        reqs.append((field, _unescape(value.strip()), negate))

    def match(obj: dict[str, Any]) -> bool:
        for field, value, negate in reqs:
            if (field_value(obj, field) == value) == negate:
                return False
        return True

    return match


def _split_unescaped(text: str) -> list[str]:
    parts, cur, esc = [], [], False
    for ch in text:
        if esc:
            cur.append("\\" + ch)
            esc = False
        elif ch == "\\":
            esc = True
        elif ch == ",":
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)
