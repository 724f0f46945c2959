"""CEL selectors for DRA devices: compile once, evaluate against a cached per-device environment.

Owns the `device` variable as Kubernetes builds it (`driver`, `attributes` and `capacity` keyed by
domain, unqualified names under the driver's domain, versions as semvers, capacities as
quantities, `allowMultipleAllocations`), the program cache (one compile per expression text),
and turning compile/runtime failures into `CelError`s whose message says what was wrong.
Evaluation uses the compiled `common-expression-language` package (`import cel`).

Where a selector runs (`Selector.inline`): one whose worst-case cost (`celcost.estimate`) is at most
INLINE_COST and that calls no regex function may run here, on the caller's thread (typically
microseconds, ~20 ms at the very worst); any other runs in the CEL worker process (`celworker`),
bounded per evaluation by the worker's CPU-time limit, because the `cel` package evaluates in Rust
while holding the GIL (no cost hook, nothing another thread can interrupt) and `find`/`findAll` use
Python's backtracking `re`. The scheduler loop has those evaluated in the background first
(`celsandbox`, which also moves inline ones there when a pod's selectors times the devices would
cost too much); a caller that reaches one without a result (tools, tests) waits for a one-off
worker. A selector that ran past the limit fails on every device with upstream's "actual cost limit
exceeded" (`failure`).

Most selectors read a few literal fields (`device.driver`, `device.attributes['dom'].name`,
`device.capacity['dom'].name`). For those the result depends on nothing else, so it is cached by
(expression, the raw values of those fields) across devices: a fleet of identical GPUs costs one
evaluation, not one per device. A device's CEL variable is built only when a projection misses.
"""

from __future__ import annotations

import re
from typing import Any

import cel as _cel
import msgspec

from embedded.scheduler.celcost import REGEX_FUNCTIONS, UNKNOWN, estimate
from embedded.scheduler.celext import FUNCTIONS, quantity_value, semver_value
from embedded.scheduler.celparse import CelSyntaxError
from embedded.scheduler.values import QuantityError, SemverError, parse_quantity, parse_semver

MAX_EXPRESSION_LENGTH = 10 * 1024
INLINE_COST = 10_000  # estimated cost units a selector may have and still run on the caller's thread
COST_LIMIT_MESSAGE = "cel evaluation error: operation cancelled: actual cost limit exceeded"
# `device.attributes['dom']` / `device.capacity["dom"]`: an unknown domain is an empty map, not an error.
_DOMAIN_LOOKUP = re.compile(r"device\s*\.\s*(attributes|capacity)\s*\[\s*(['\"])([^'\"]+)\2\s*\]", re.ASCII)
_QUOTED_MESSAGE = re.compile(r"Python function call failed: \w+: (.*?)\. Check function arguments")
# Every mention of `device` must be one of these for a selector's result to be cached by projection.
_DEVICE_WORD = re.compile(r"\bdevice\b")
_FIELD_REF = re.compile(
    r"device\s*\.\s*(?:"
    r"(?P<plain>driver|allowMultipleAllocations)\b(?!\s*\()"
    r"|(?P<map>attributes|capacity)\s*\[\s*(?P<q>['\"])(?P<dom>[^'\"\\]+)(?P=q)\s*\]\s*"
    r"(?:\.\s*(?P<ident>[A-Za-z_][A-Za-z0-9_]*)\b(?!\s*\()"
    r"|\[\s*(?P<q2>['\"])(?P<ident2>[^'\"\\]+)(?P=q2)\s*\])"
    r")"
)
Ref = tuple[str, str, str]  # ("driver" | "allowMultipleAllocations" | "attributes" | "capacity", domain, name)


class CelError(ValueError):
    """A selector that does not compile or fails on a device; `expression` is its text."""

    def __init__(self, expression: str, message: str):
        super().__init__(message)
        self.expression = expression
        self.message = message


class Selector:
    """One compiled expression and the domains it looks up literally."""

    __slots__ = ("cost", "domains", "expression", "failure", "inline", "program", "refs")

    def __init__(self, expression: str):
        self.expression = expression
        if not expression.strip():
            raise CelError(expression, "empty CEL expression: a selector must be a boolean expression over `device`")
        if len(expression) > MAX_EXPRESSION_LENGTH:
            raise CelError(
                expression, f"CEL expression is {len(expression)} characters; the limit is {MAX_EXPRESSION_LENGTH}"
            )
        try:
            self.program = _cel.compile(expression)
        except (ValueError, RuntimeError) as exc:
            raise CelError(expression, f"CEL syntax error: {_first_lines(str(exc))}") from None
        self.domains = frozenset(m.group(3) for m in _DOMAIN_LOOKUP.finditer(expression))
        self.refs = field_refs(expression)
        try:
            found = estimate(expression)
            self.cost, calls = found.cost, found.calls
        except CelSyntaxError:  # the estimator's parser is stricter than the `cel` package's: assume the worst
            self.cost, calls = UNKNOWN, frozenset()
        self.inline = self.cost <= INLINE_COST and not calls & REGEX_FUNCTIONS
        self.failure: CelError | None = None  # set once an evaluation ran past the worker's limit


def field_refs(expression: str) -> tuple[Ref, ...] | None:
    """The device fields `expression` reads, when each mention of `device` is a literal field lookup;
    None when the result may depend on more (a whole map, a computed key, `device` alone)."""
    refs: list[Ref] = []
    for word in _DEVICE_WORD.finditer(expression):
        m = _FIELD_REF.match(expression, word.start())
        if m is None:
            return None
        if m.group("plain"):
            ref: Ref = (m.group("plain"), "", "")
        else:
            ref = (m.group("map"), m.group("dom"), m.group("ident") or m.group("ident2"))
        if ref not in refs:
            refs.append(ref)
    return tuple(refs)


_compiled: dict[str, Selector | CelError] = {}


def compile_selector(expression: str) -> Selector:
    """The cached compiled program for `expression`; CelError (also cached) if it does not compile."""
    found = _compiled.get(expression)
    if found is None:
        try:
            found = Selector(expression)
        except CelError as exc:
            found = exc
        if len(_compiled) > 10_000:
            _compiled.clear()
        _compiled[expression] = found
    if isinstance(found, CelError):
        raise found
    return found


def _first_lines(text: str, limit: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[:limit] if line.strip())


def split_name(name: str, driver: str) -> tuple[str, str]:
    """`type` -> (driver, type); `resource.kubernetes.io/pciBusID` -> (resource.kubernetes.io, pciBusID)."""
    domain, sep, ident = name.rpartition("/")
    return (domain, ident) if sep else (driver, name)


def attribute_value(attr: dict[str, Any]) -> Any:
    """A v1 DeviceAttribute -> its CEL value (version -> semver map)."""
    if "string" in attr:
        return attr["string"]
    if "int" in attr:
        return int(attr["int"])
    if "bool" in attr:
        return bool(attr["bool"])
    if "version" in attr:
        return semver_value(parse_semver(attr["version"]))
    for key in ("strings", "ints", "bools"):
        if key in attr:
            return list(attr[key])
    if "versions" in attr:
        return [semver_value(parse_semver(v)) for v in attr["versions"]]
    raise ValueError(f"attribute has no value field (string, int, bool, version): {attr}")


_MISSING = b""  # no JSON text is empty
_projected: dict[tuple[str, tuple[Any, ...]], bool | CelError] = {}
MAX_PROJECTIONS = 100_000


_json = msgspec.json.Encoder()


def _frozen(value: Any) -> Any:
    """A raw JSON value as a hashable key that tells apart what CEL would tell apart (1 vs True vs "1"):
    its JSON text, or for values JSON cannot hold, a tagged tuple."""
    try:
        return _json.encode(value)
    except (TypeError, ValueError):
        pass
    kind = value.__class__
    if kind is dict:
        return (dict, tuple((k, _frozen(v)) for k, v in value.items()))
    if kind is list or kind is tuple:
        return (list, tuple(_frozen(v) for v in value))
    return (kind.__name__, value)


def _field(fields: dict[str, Any], name: str) -> Any:
    return _frozen(fields[name]) if name in fields else _MISSING


def device_problem(driver: str, device: dict[str, Any]) -> str:
    """Why the device's attributes or capacity cannot become a CEL value ("" when they can)."""
    try:
        for attr in (device.get("attributes") or {}).values():
            if attr.__class__ is dict:
                if "string" in attr:
                    continue  # as attribute_value: taken as it is
                version = attr.get("version")
                if version is not None and "int" not in attr and "bool" not in attr:
                    parse_semver(version)  # cached; the CEL value is built only if a selector needs it
                    continue
            attribute_value(attr)
        for cap in (device.get("capacity") or {}).values():
            parse_quantity(str(cap["value"]))
    except (SemverError, QuantityError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"device {device.get('name')} has a malformed attribute or capacity: {exc}"
    return ""


class DeviceEnv:
    """The CEL `device` variable of one device (built on first need), its Context, and its selector results."""

    __slots__ = ("_context", "_domains", "_error", "_variables", "device", "driver", "results")

    def __init__(self, driver: str, device: dict[str, Any]):
        self.driver = driver
        self.device = device
        self.results: dict[str, bool | CelError] = {}
        self._error: str | None = None
        self._variables: dict[str, Any] | None = None
        self._domains: set[str] = set()
        self._context: Any = None

    @property
    def error(self) -> str:
        """Why this device cannot be evaluated at all ("" when it can)."""
        if self._error is None:
            self._error = device_problem(self.driver, self.device)
        return self._error

    def _build(self) -> dict[str, Any]:
        device, driver = self.device, self.driver
        attributes: dict[str, dict[str, Any]] = {driver: {}}
        capacity: dict[str, dict[str, Any]] = {driver: {}}
        for name, attr in (device.get("attributes") or {}).items():
            domain, ident = split_name(name, driver)
            attributes.setdefault(domain, {})[ident] = attribute_value(attr)
        for name, cap in (device.get("capacity") or {}).items():
            domain, ident = split_name(name, driver)
            capacity.setdefault(domain, {})[ident] = quantity_value(parse_quantity(str(cap["value"])))
        self._domains = set(attributes) & set(capacity)
        return {
            "driver": driver,
            "attributes": attributes,
            "capacity": capacity,
            "allowMultipleAllocations": bool(device.get("allowMultipleAllocations", False)),
        }

    def variables_for(self, selector: Selector) -> dict[str, Any]:
        """The `device` variable, with an empty map for each domain the selector names that the device lacks."""
        if self._variables is None:
            self._variables = self._build()
        missing = selector.domains - self._domains
        if missing:
            for domain in missing:
                self._variables["attributes"].setdefault(domain, {})
                self._variables["capacity"].setdefault(domain, {})
            self._domains |= missing
            self._context = None
        return self._variables

    def _context_for(self, selector: Selector) -> Any:
        variables = self.variables_for(selector)
        if self._context is None:
            self._context = context_of(variables)
        return self._context

    def projection(self, refs: tuple[Ref, ...]) -> tuple[Any, ...]:
        """The raw values of the fields `refs` names: equal projections give equal selector results."""
        device, driver = self.device, self.driver
        out: list[Any] = []
        for kind, domain, ident in refs:
            if kind == "driver":
                out.append(driver)
            elif kind == "allowMultipleAllocations":
                out.append(bool(device.get("allowMultipleAllocations", False)))
            else:
                fields = device.get(kind) or {}
                qualified = f"{domain}/{ident}"
                if domain != driver:
                    out.append(_field(fields, qualified))
                    continue
                # Both spellings land on the same CEL key; the later one in the map wins.
                both = ident in fields and qualified in fields
                later = list(fields).index(qualified) > list(fields).index(ident) if both else None
                out.append((_field(fields, ident), _field(fields, qualified), later))
        return tuple(out)

    def shared_key(self, selector: Selector) -> Any:
        """The key under which devices share the selector's result (None: this device's own result)."""
        if self.error or selector.refs is None:
            return None
        return (selector.expression, self.projection(selector.refs))

    def known(self, selector: Selector, key: Any) -> bool | CelError | None:
        """The selector's result here if already known (from this device or one agreeing on its fields)."""
        found = self.results.get(selector.expression)
        if found is None and key is not None:
            found = _projected.get(key)
            if found is not None:
                self.results[selector.expression] = found
        return found

    def remember(self, selector: Selector, key: Any, value: bool | CelError) -> None:
        self.results[selector.expression] = value
        if key is not None:
            if len(_projected) >= MAX_PROJECTIONS:
                _projected.clear()
            _projected[key] = value

    def matches(self, selector: Selector) -> bool:
        """Whether the selector accepts this device; CelError for a failure (cached either way)."""
        cached = self.results.get(selector.expression)
        if cached is None:
            key = self.shared_key(selector)
            cached = self.known(selector, key)
            if cached is None:
                cached = self._evaluate(selector)
                self.remember(selector, key, cached)
        if isinstance(cached, CelError):
            raise cached
        return cached

    def _evaluate(self, selector: Selector) -> bool | CelError:
        if self.error:
            return CelError(selector.expression, self.error)
        if selector.failure is not None:
            return selector.failure
        if not selector.inline:
            from embedded.scheduler.celworker import evaluate_once  # it runs this module's `run`

            return evaluate_once(selector, self.variables_for(selector))
        return run(selector.expression, selector.program, self._context_for(selector))


def context_of(variables: dict[str, Any]) -> Any:
    """The evaluation context of a device variable, with the Kubernetes extension functions."""
    return _cel.Context(variables={"device": variables}, functions=FUNCTIONS)


def run(expression: str, program: Any, context: Any) -> bool | CelError:
    """One evaluation: its bool, or a CelError saying what went wrong."""
    try:
        value = program.execute(context)
    except KeyError as exc:
        return CelError(expression, f"no such key: {exc.args[0] if exc.args else exc}")
    except Exception as exc:  # the cel package raises several types for runtime errors
        return CelError(expression, runtime_message(exc))
    if not isinstance(value, bool):
        return CelError(expression, f"selector returned {type(value).__name__} {value!r}, but it must return a bool")
    return value


def runtime_message(exc: BaseException) -> str:
    text = str(exc)
    m = _QUOTED_MESSAGE.search(text)
    if m:
        return m.group(1)
    return _first_lines(text) or type(exc).__name__


def evaluate(expression: str, driver: str, device: dict[str, Any]) -> bool:
    """One-off evaluation (tools, tests); the allocator keeps DeviceEnvs instead."""
    return DeviceEnv(driver, device).matches(compile_selector(expression))
