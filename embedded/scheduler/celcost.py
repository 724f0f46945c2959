"""The worst-case cost of a DRA device selector, estimated before it runs, as kube-apiserver does.

Owns the static estimate behind `resource.k8s.io`'s refusal of selectors "too complex, exceeds cost
limit" (`CELSelectorExpressionMaxCost`, 1,000,000 units) and the scheduler's choice of where a
selector runs (`embedded.scheduler.cel`). It follows cel-go's `checker.Cost` with Kubernetes' cost
library and the DRA `device` declaration (`dynamic-resource-allocation/cel/compile.go`):

- a field, identifier or index costs 1, a literal 0, a list literal 10, a map 30, a message 40;
  a call 1 plus its arguments; `&&`/`||` the sum of their sides; `?:` the condition plus the
  dearer branch;
- a comprehension (`all`, `exists`, `exists_one`, `map`, `filter`) costs its range, its
  accumulator, and for every element of the range the loop condition and step as cel-go expands
  the macro: `all` 3 + predicate, `exists` 4 + predicate, `exists_one` 2 + predicate, `map` 12 +
  transform, `filter` 13 + predicate (the iteration variable's size comes from the range);
  `cel.bind` 10 plus its value and body;
- sizes: a literal's own (a 500-element list is 500); `device.driver` 63 characters, a domain
  63, an attribute or capacity name 32, an attribute value 64, each attributes/capacity map 32
  entries (upstream's maxima); results of string functions as Kubernetes sizes them; anything
  else unknown, which makes a loop over it or a comparison of two unknowns cost the maximum;
- strings cost by length (factor 0.1): `==`, `<` and friends the shorter side, `+` the result,
  `contains` the product, `startsWith` the prefix, `lowerAscii`/`trim`/`substring` the receiver,
  `split`/`replace` twice the receiver; `matches`/`find`/`findAll` (receiver + 1) x 0.1 times the
  pattern x 0.25; list functions (`sum`, `max`, `indexOf`...) the list's length; `in` a list
  the list's length.

Without cel-go's type checker the types come from the declaration, literals and function results;
what is unknown is dynamic. Costs are integers rounded up at each factor, as cel-go rounds.
"""

from __future__ import annotations

import math
from functools import lru_cache

from embedded.scheduler.celparse import (
    MACROS,
    Call,
    Chain,
    Cond,
    Ident,
    Index,
    ListLit,
    Lit,
    MapLit,
    Member,
    MessageLit,
    Method,
    Node,
    Sel,
    Unary,
    parse,
)
from shared.heap import collection_paused

MAX_COST = 1_000_000  # resourceapi.CELSelectorExpressionMaxCost, per evaluation
MAX_LENGTH = 10 * 1024  # resourceapi.CELSelectorExpressionMaxLength
UNKNOWN = (1 << 64) - 1  # cel-go's unknown size / saturated cost
STRING_TRAVERSAL = 0.1  # common.StringTraversalCostFactor
REGEX_LENGTH = 0.25  # common.RegexStringLengthCostFactor
LIST_CREATE, MAP_CREATE, MESSAGE_CREATE = 10, 30, 40
REGEX_FUNCTIONS = frozenset({"matches", "find", "findAll"})


class T:
    """What the estimate knows of a value: its kind, its size (None: unknown) and its parts."""

    __slots__ = ("elem", "fields", "key", "kind", "min", "size")

    def __init__(
        self,
        kind: str,
        size: int | None = 1,
        *,
        elem: T | None = None,
        key: T | None = None,
        fields: dict[str, T] | None = None,
        min_size: int = 0,
    ):
        self.kind, self.size, self.elem, self.key, self.fields, self.min = kind, size, elem, key, fields, min_size


def _string(size: int | None) -> T:
    return T("string", size)


DYN = T("dyn", None)
BOOL, INT, DOUBLE = T("bool"), T("int"), T("double")
QUANTITY, SEMVER = T("quantity"), T("semver")
_ATTRIBUTE = T("dyn", 64)  # DeviceAttributeMaxValueLength
_ID, _DOMAIN = _string(32), _string(63)  # DeviceMaxIDLength, DeviceMaxDomainLength
_PER_DEVICE = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
DEVICE = T(
    "object",
    None,
    fields={
        "driver": _string(63),  # DriverNameMaxLength
        "attributes": T("map", _PER_DEVICE, key=_DOMAIN, elem=T("map", _PER_DEVICE, key=_ID, elem=_ATTRIBUTE)),
        "capacity": T("map", _PER_DEVICE, key=_DOMAIN, elem=T("map", _PER_DEVICE, key=_ID, elem=QUANTITY)),
        "allowMultipleAllocations": BOOL,
    },
)
_SCALARS = {"int": INT, "uint": T("uint"), "double": DOUBLE, "bool": BOOL, "null": T("null")}
_RESULTS = {  # function -> result when fixed (sizes of string results are worked out in _method)
    "size": INT,
    "int": INT,
    "uint": T("uint"),
    "double": DOUBLE,
    "bool": BOOL,
    "string": _string(None),
    "contains": BOOL,
    "startsWith": BOOL,
    "endsWith": BOOL,
    "matches": BOOL,
    "isSorted": BOOL,
    "quantity": QUANTITY,
    "isQuantity": BOOL,
    "semver": SEMVER,
    "isSemver": BOOL,
    "add": QUANTITY,
    "sub": QUANTITY,
    "compareTo": INT,
    "isGreaterThan": BOOL,
    "isLessThan": BOOL,
    "sign": INT,
    "asInteger": INT,
    "isInteger": BOOL,
    "asApproximateFloat": DOUBLE,
    "major": INT,
    "minor": INT,
    "patch": INT,
    "indexOf": INT,
    "lastIndexOf": INT,
    "charAt": _string(1),
}


class Estimate:
    """The worst-case cost of one expression and the functions it calls."""

    __slots__ = ("calls", "cost")

    def __init__(self, cost: int, calls: frozenset[str]):
        self.cost, self.calls = cost, calls

    @property
    def exceeds(self) -> bool:
        return self.cost > MAX_COST


def _sat(n: int) -> int:
    return n if n < UNKNOWN else UNKNOWN


def _size(t: T) -> int:
    return UNKNOWN if t.size is None else t.size


def _factor(size: int, factor: float) -> int:
    """cel-go's multiplyByCostFactor: the product rounded up, saturated."""
    if size >= UNKNOWN:
        return UNKNOWN
    return _sat(math.ceil(size * factor))


def _union(a: T, b: T) -> T:
    size = None if a.size is None or b.size is None else max(a.size, b.size)
    if a.kind != b.kind:
        return T("dyn", size)
    elem = _union(a.elem, b.elem) if a.elem is not None and b.elem is not None else (a.elem or b.elem)
    key = _union(a.key, b.key) if a.key is not None and b.key is not None else (a.key or b.key)
    return T(
        a.kind, size, elem=elem, key=key, fields=a.fields if a.fields is b.fields else None, min_size=min(a.min, b.min)
    )


def _stringy(t: T) -> bool:
    return t.kind in ("string", "bytes", "dyn")


class _Coster:
    def __init__(self) -> None:
        self.scopes: list[dict[str, T]] = []
        self.calls: set[str] = set()

    def lookup(self, name: str) -> T:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return DEVICE if name == "device" else DYN

    def cost(self, node: Node) -> tuple[int, T]:
        if isinstance(node, Lit):
            if node.kind in ("string", "bytes"):
                return 0, T(node.kind, len(node.value), min_size=len(node.value))
            return 0, _SCALARS[node.kind]
        if isinstance(node, Ident):
            return 1, self.lookup(node.name)
        if isinstance(node, Member):
            return self.member(node)
        if isinstance(node, Call):
            return self.call(node)
        if isinstance(node, Chain):
            return self.chain(node)
        if isinstance(node, Unary):
            cost, t = self.cost(node.operand)
            return _sat(cost + len(node.ops)), BOOL if node.ops[0] == "!" else t
        if isinstance(node, Cond):
            return self.cond(node)
        if isinstance(node, ListLit):
            total, elem = LIST_CREATE, None
            for item in node.items:
                c, t = self.cost(item)
                total, elem = _sat(total + c), t if elem is None else _union(elem, t)
            n = len(node.items)
            return total, T("list", n, elem=elem or T("dyn", 0), min_size=n)
        if isinstance(node, MapLit):
            total, key, elem = MAP_CREATE, None, None
            for k, v in node.entries:
                ck, tk = self.cost(k)
                cv, tv = self.cost(v)
                total = _sat(total + ck + cv)
                key, elem = tk if key is None else _union(key, tk), tv if elem is None else _union(elem, tv)
            n = len(node.entries)
            return total, T("map", n, key=key or T("dyn", 0), elem=elem or T("dyn", 0), min_size=n)
        if isinstance(node, MessageLit):
            total = MESSAGE_CREATE
            for _, v in node.fields:
                total = _sat(total + self.cost(v)[0])
            return total, T("object", None)
        raise TypeError(f"unknown node {type(node).__name__}")

    # ---- operators --------------------------------------------------------------------------------

    def chain(self, node: Chain) -> tuple[int, T]:
        cost, left = self.cost(node.operands[0])
        for op, operand in zip(node.ops, node.operands[1:], strict=True):
            c, right = self.cost(operand)
            args = _sat(cost + c)
            if op in ("&&", "||"):
                cost, left = args, BOOL
            elif op in ("==", "!=", "<", "<=", ">", ">="):
                if op in ("==", "!=") or (_stringy(left) or _stringy(right)):
                    cost = _sat(_factor(min(_size(left), _size(right)), STRING_TRAVERSAL) + args)
                else:
                    cost = _sat(1 + args)
                left = BOOL
            elif op == "in":
                cost = _sat(args + (1 if right.kind in ("map", "object") else _size(right)))
                left = BOOL
            elif op == "+" and "list" in (left.kind, right.kind) and {left.kind, right.kind} <= {"list", "dyn"}:
                cost = _sat(1 + args)
                size = None if left.size is None or right.size is None else left.size + right.size
                left = T("list", size, elem=_union(left.elem or DYN, right.elem or DYN))
            elif op == "+" and (
                left.kind in ("string", "bytes")
                or right.kind in ("string", "bytes")
                or left.kind == right.kind == "dyn"
            ):
                size = None if left.size is None or right.size is None else left.size + right.size
                cost = _sat(_factor(UNKNOWN if size is None else size, STRING_TRAVERSAL) + args)
                left = T(left.kind if left.kind == right.kind else "dyn", size)
            else:
                cost, left = _sat(1 + args), left if left.kind in ("int", "uint", "double") else T("dyn", 1)
        return cost, left

    def cond(self, node: Cond) -> tuple[int, T]:
        cost, t = self.cost(node.otherwise)
        for test, value in reversed(node.branches):
            ct, _ = self.cost(test)
            cv, tv = self.cost(value)
            cost, t = _sat(ct + max(cv, cost)), _union(tv, t)
        return cost, t

    # ---- members and calls ------------------------------------------------------------------------

    def member(self, node: Member) -> tuple[int, T]:
        ops = node.ops
        if (
            isinstance(node.base, Ident)
            and node.base.name == "cel"
            and len(ops) == 1
            and isinstance(ops[0], Method)
            and ops[0].name == "bind"
        ):
            return self.bind(ops[0].args)
        cost, t = self.cost(node.base)
        for op in ops:
            if isinstance(op, Sel):
                if t.kind in ("map", "object", "dyn"):
                    cost = _sat(cost + 1)
                t = (t.fields or {}).get(op.name, DYN) if t.kind == "object" else (t.elem or DYN)
            elif isinstance(op, Index):
                c, _ = self.cost(op.key)
                cost, t = _sat(cost + c + 1), t.elem if t.kind in ("map", "list") and t.elem else DYN
            elif op.name in MACROS and _macro_vars(op) is not None:
                cost, t = self.comprehension(op, cost, t)
            else:
                cost, t = self.method(op.name, cost, t, op.args)
        return cost, t

    def bind(self, args: list[Node]) -> tuple[int, T]:
        if len(args) != 3 or not isinstance(args[0], Ident):
            return _sat(1 + sum(self.cost(a)[0] for a in args)), DYN
        c_init, t_init = self.cost(args[1])
        self.scopes.append({args[0].name: t_init})
        try:
            c_body, t_body = self.cost(args[2])
        finally:
            self.scopes.pop()
        return _sat(LIST_CREATE + c_init + c_body), t_body

    def comprehension(self, op: Method, range_cost: int, rng: T) -> tuple[int, T]:
        names = _macro_vars(op)
        assert names is not None
        n = _size(rng)
        if rng.kind == "map":
            kinds = [rng.key or DYN, rng.elem or DYN]
        elif rng.kind == "list":
            kinds = [INT, rng.elem or DYN] if len(names) == 2 else [rng.elem or DYN]
        else:
            kinds = [DYN, DYN]
        scope = dict(zip(names, kinds, strict=False))
        body = op.args[len(names) :]
        self.scopes.append(scope)
        try:
            parts = [self.cost(b) for b in body]
        finally:
            self.scopes.pop()
        step = sum(c for c, _ in parts)
        if op.name == "all":
            fixed, per, result = 1, 3, BOOL
        elif op.name == "exists":
            fixed, per, result = 1, 4, BOOL
        elif op.name == "exists_one":
            fixed, per, result = 2, 2, BOOL
        elif op.name == "map":
            fixed, per, result = LIST_CREATE + 1, 12, T("list", rng.size, elem=parts[-1][1])
        else:  # filter
            fixed, per, result = LIST_CREATE + 1, 13, T("list", rng.size, elem=kinds[-1])
        loop = UNKNOWN if n >= UNKNOWN and per + step > 0 else _sat(n * (per + step))
        return _sat(range_cost + fixed + loop), result

    def call(self, node: Call) -> tuple[int, T]:
        name, args = node.name, node.args
        if name == "has" and len(args) == 1:
            cost, _ = self.cost(_without_last_select(args[0]))
            return _sat(cost + 1), BOOL
        if name == "dyn" and len(args) == 1:
            cost, t = self.cost(args[0])
            return _sat(cost + 1), t
        if name in REGEX_FUNCTIONS and len(args) == 2:  # matches(s, re): the receiver as first argument
            c, t = self.cost(args[0])
            return self.method(name, c, t, args[1:])
        self.calls.add(name)
        total = 1
        for a in args:
            total = _sat(total + self.cost(a)[0])
        return total, _RESULTS.get(name, DYN)

    def method(self, name: str, target_cost: int, target: T, arg_nodes: list[Node]) -> tuple[int, T]:
        """cel-go's and Kubernetes' call estimates for a receiver-style call."""
        self.calls.add(name)
        costed = [self.cost(a) for a in arg_nodes]
        args = _sat(target_cost + sum(c for c, _ in costed))
        types = [t for _, t in costed]
        size = _size(target)
        if name in REGEX_FUNCTIONS and types:
            string = _factor(_sat(size + 1), STRING_TRAVERSAL)
            regex = _factor(_size(types[0]), REGEX_LENGTH)
            own = _sat(string * regex)
            if name == "matches":
                return _sat(own + args), BOOL
            if name == "find":
                return _sat(own + args), _string(target.size)
            return _sat(own + args), T("list", target.size, elem=_string(target.size))
        if name == "contains" and types and target.kind != "list":
            return _sat(_factor(size, STRING_TRAVERSAL) * _factor(_size(types[0]), STRING_TRAVERSAL) + args), BOOL
        if name in ("startsWith", "endsWith") and types:
            return _sat(_factor(_size(types[0]), STRING_TRAVERSAL) + args), BOOL
        if name in ("isSorted", "sum", "max", "min", "indexOf", "lastIndexOf"):
            result = _RESULTS.get(name) or (target.elem or DYN)
            if target.kind == "list":
                elem = target.elem or DYN
                per = 1 + (_factor(_size(elem), STRING_TRAVERSAL) if elem.kind in ("string", "bytes") else 0)
                return _sat(_sat(size * per) + args), result
            return _sat(_factor(size, STRING_TRAVERSAL) + args), result
        if name in ("lowerAscii", "upperAscii", "substring", "trim"):
            return _sat(_factor(size, STRING_TRAVERSAL) + args), _string(target.size)
        if name == "reverse":
            return _sat(1 + args), _string(target.size)
        if name == "replace" and len(types) >= 2:
            return _sat(_factor(size, 2 * STRING_TRAVERSAL) + args), _string(_replaced(target, types[0], types[1]))
        if name == "split":
            return _sat(_factor(size, 2 * STRING_TRAVERSAL) + args), T("list", target.size, elem=_string(target.size))
        if name == "join" and target.kind == "list":
            elem = target.elem or DYN
            joined = _sat(size * _size(elem))
            if types:
                joined = _sat(joined + _sat(_size(types[0]) * max(size - 1, 0)))
            joined_size = None if joined >= UNKNOWN else joined
            return _sat(_factor(joined, STRING_TRAVERSAL) + args), _string(joined_size)
        if name == "size":
            return _sat(1 + args), INT
        return _sat(1 + args), _RESULTS.get(name, DYN)


def _replaced(target: T, old: T, new: T) -> int | None:
    """The longest result of `target.replace(old, new)`, as Kubernetes' estimator sizes it."""
    if target.size is None or new.size is None:
        return None
    if old.min == 0:
        return (target.size + 1) * new.size + target.size
    if new.size <= old.min:
        return target.size
    return math.ceil(target.size / old.min) * new.size


def _macro_vars(op: Method) -> list[str] | None:
    """The iteration variables of a comprehension macro (`x` or `k, v`), None for a plain method call:
    `all(x, p)`, `all(k, v, p)` (likewise exists, exists_one, filter), `map(x, f)`, `map(x, p, f)`."""
    args = op.args
    if len(args) not in (2, 3) or not isinstance(args[0], Ident):
        return None
    if len(args) == 2 or op.name == "map":
        return [args[0].name]
    return [args[0].name, args[1].name] if isinstance(args[1], Ident) else None


def _without_last_select(node: Node) -> Node:
    """has(a.b): the presence test costs 1 plus its operand `a`."""
    if isinstance(node, Member) and node.ops and isinstance(node.ops[-1], Sel):
        return Member(node.base, node.ops[:-1]) if len(node.ops) > 1 else node.base
    return node


@lru_cache(maxsize=1024)
def estimate(expression: str) -> Estimate:
    """The worst-case cost of evaluating `expression` against one device (CelSyntaxError if it does not parse).
    Thousands of short-lived, acyclic nodes for a long literal list: no collector pass in the middle."""
    coster = _Coster()
    with collection_paused():
        cost, _ = coster.cost(parse(expression))
    return Estimate(cost, frozenset(coster.calls))
