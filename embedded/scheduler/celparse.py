"""A CEL parser for cost estimation: expression text -> a small syntax tree (no evaluation).

Owns the CEL grammar as the spec gives it (literals with their escapes, `?:`, `||`, `&&`,
relations with `in`, arithmetic, `!`/`-`, member selection, indexing, calls, list/map/message
literals, `has()` and the comprehension macros) and nothing else: `celcost` walks the tree.
The `cel` package compiles and evaluates but exposes no syntax tree, hence this module.

Chains (`a || b || c`, `a.b.c()[d]`, `c1 ? x : c2 ? y : z`) are kept flat, so a 10 KiB expression
never nests deeper than its brackets; brackets deeper than MAX_DEPTH are refused (cel-go refuses
past 250 levels of recursion, the `cel` package earlier still).
"""

from __future__ import annotations

import re
from typing import Any

MAX_DEPTH = 100
MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})


class CelSyntaxError(ValueError):
    """The text is not a CEL expression this parser knows."""


class Node:
    __slots__ = ()


class Lit(Node):
    """A literal: kind is int, uint, double, string, bytes, bool or null."""

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: Any):
        self.kind, self.value = kind, value


class Ident(Node):
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class Sel:
    """`.name` in a member chain; `test` for the operand of has()."""

    __slots__ = ("name", "test")

    def __init__(self, name: str, test: bool = False):
        self.name, self.test = name, test


class Index:
    __slots__ = ("key",)

    def __init__(self, key: Node):
        self.key = key


class Method:
    """`.name(args)` in a member chain (comprehension macros included: `celcost` tells them apart)."""

    __slots__ = ("args", "name")

    def __init__(self, name: str, args: list[Node]):
        self.name, self.args = name, args


class Member(Node):
    """`base` followed by selections, indexes and method calls, left to right."""

    __slots__ = ("base", "ops")

    def __init__(self, base: Node, ops: list[Sel | Index | Method]):
        self.base, self.ops = base, ops


class Call(Node):
    """A global call `name(args)` (`has`, `size`, `quantity`, ...)."""

    __slots__ = ("args", "name")

    def __init__(self, name: str, args: list[Node]):
        self.name, self.args = name, args


class ListLit(Node):
    __slots__ = ("items",)

    def __init__(self, items: list[Node]):
        self.items = items


class MapLit(Node):
    __slots__ = ("entries",)

    def __init__(self, entries: list[tuple[Node, Node]]):
        self.entries = entries


class MessageLit(Node):
    __slots__ = ("fields", "type_name")

    def __init__(self, type_name: str, fields: list[tuple[str, Node]]):
        self.type_name, self.fields = type_name, fields


class Unary(Node):
    """`!x`, `-x`, `!!x`...: the operators outermost first."""

    __slots__ = ("operand", "ops")

    def __init__(self, ops: list[str], operand: Node):
        self.ops, self.operand = ops, operand


class Chain(Node):
    """`operands[0] ops[0] operands[1] ops[1] ...`, left-associative, all of one precedence."""

    __slots__ = ("operands", "ops")

    def __init__(self, operands: list[Node], ops: list[str]):
        self.operands, self.ops = operands, ops


class Cond(Node):
    """`c1 ? v1 : c2 ? v2 : ... : otherwise`, right-associative, kept flat."""

    __slots__ = ("branches", "otherwise")

    def __init__(self, branches: list[tuple[Node, Node]], otherwise: Node):
        self.branches, self.otherwise = branches, otherwise


_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|//[^\n]*)
  | (?P<float>(?:\d+\.\d+(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+|\.\d+(?:[eE][+-]?\d+)?))
  | (?P<hex>0[xX][0-9a-fA-F]+[uU]?)
  | (?P<int>\d+[uU]?)
  | (?P<string>(?:[rR][bB]?|[bB][rR]?)?(?:\"\"\"|'''|"|'))
  | (?P<ident>[_a-zA-Z][_a-zA-Z0-9]*)
  | (?P<punct>==|!=|<=|>=|&&|\|\||[-<>!+*/%?:.,()\[\]{}])
""",
    re.VERBOSE,
)
_ESCAPE = re.compile(
    r"""\\(?:([abfnrtv\\'"`?])|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|([0-3][0-7]{2}))"""
)
_SIMPLE_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
    "'": "'",
    '"': '"',
    "`": "`",
    "?": "?",
}
_RESERVED = frozenset(
    {
        "as",
        "break",
        "const",
        "continue",
        "else",
        "for",
        "function",
        "if",
        "import",
        "let",
        "loop",
        "package",
        "namespace",
        "return",
        "var",
        "void",
        "while",
        "in",
    }
)
# Binary operators by precedence, lowest first.
_LEVELS = (("||",), ("&&",), ("<", "<=", ">=", ">", "==", "!=", "in"), ("+", "-"), ("*", "/", "%"))
_PRECEDENCE = {op: i for i, ops in enumerate(_LEVELS) for op in ops}


def _unescape(body: str, raw: bool, where: int) -> str:
    if raw:
        return body

    def one(m: re.Match[str]) -> str:
        simple, hx, u4, u8, octal = m.groups()
        if simple:
            return _SIMPLE_ESCAPES[simple]
        code = int(hx or u4 or u8, 16) if not octal else int(octal, 8)
        try:
            return chr(code)
        except (ValueError, OverflowError):
            raise CelSyntaxError(f"invalid escape at {where}") from None

    text = _ESCAPE.sub(one, body)
    if "\\" in _ESCAPE.sub("", body):
        raise CelSyntaxError(f"invalid escape sequence in the string at {where}")
    return text


def tokenize(text: str) -> list[tuple[str, Any, int]]:
    """(kind, value, position) for each token; kinds: int, uint, double, string, bytes, ident, op, end."""
    out: list[tuple[str, Any, int]] = []
    pos, n = 0, len(text)
    while pos < n:
        m = _TOKEN.match(text, pos)
        if m is None:
            raise CelSyntaxError(f"unexpected character {text[pos]!r} at {pos}")
        kind = m.lastgroup
        if kind == "ws":
            pos = m.end()
            continue
        lexeme = m.group()
        if kind == "string":
            quote = lexeme.lstrip("rRbB")
            prefix = lexeme[: len(lexeme) - len(quote)].lower()
            start = m.end()
            end = text.find(quote, start)
            if len(quote) == 1:  # a single-quoted string ends at its first unescaped quote, on this line
                end = start
                while end < n and text[end] != quote:
                    if text[end] == "\n":
                        raise CelSyntaxError(f"newline in the string at {pos}")
                    end += 2 if text[end] == "\\" and "r" not in prefix else 1
                if end >= n:
                    end = -1
            if end < 0:
                raise CelSyntaxError(f"unterminated string at {pos}")
            value = _unescape(text[start:end], "r" in prefix, pos)
            out.append(("bytes" if "b" in prefix else "string", value, pos))
            pos = end + len(quote)
            continue
        if kind == "float":
            out.append(("double", float(lexeme), pos))
        elif kind in ("hex", "int"):
            unsigned = lexeme[-1] in "uU"
            digits = lexeme.rstrip("uU")
            out.append(("uint" if unsigned else "int", int(digits, 16 if kind == "hex" else 10), pos))
        elif kind == "ident":
            out.append(("op" if lexeme == "in" else "ident", lexeme, pos))
        else:
            out.append(("op", lexeme, pos))
        pos = m.end()
    out.append(("end", None, n))
    return out


class _Parser:
    def __init__(self, text: str):
        self.tokens = tokenize(text)
        self.i = 0
        self.depth = 0

    # ---- token helpers ----------------------------------------------------------------------------

    def peek(self, value: str) -> bool:
        kind, v, _ = self.tokens[self.i]
        return kind == "op" and v == value

    def take(self, value: str) -> bool:
        if self.peek(value):
            self.i += 1
            return True
        return False

    def expect(self, value: str) -> None:
        if not self.take(value):
            kind, v, pos = self.tokens[self.i]
            found = "the end" if kind == "end" else repr(v)
            raise CelSyntaxError(f"expected {value!r} at {pos}, found {found}")

    def ident(self) -> str:
        kind, v, pos = self.tokens[self.i]
        if kind != "ident" or v in _RESERVED:
            raise CelSyntaxError(f"expected an identifier at {pos}")
        self.i += 1
        return str(v)

    def nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CelSyntaxError(f"expression nested deeper than {MAX_DEPTH} levels")

    # ---- grammar ----------------------------------------------------------------------------------

    def expr(self) -> Node:
        branches: list[tuple[Node, Node]] = []
        first = self.binary()
        while self.take("?"):
            value = self.binary()
            self.expect(":")
            branches.append((first, value))
            first = self.binary()
        return Cond(branches, first) if branches else first

    def binary(self) -> Node:
        operands = [self.unary()]
        ops: list[str] = []
        while True:
            kind, v, _ = self.tokens[self.i]
            if kind != "op" or v not in _PRECEDENCE:
                break
            self.i += 1
            ops.append(v)
            operands.append(self.unary())
        return _group(operands, ops, 0) if ops else operands[0]

    def unary(self) -> Node:
        ops: list[str] = []
        while self.peek("!") or self.peek("-"):
            ops.append(self.tokens[self.i][1])
            self.i += 1
        operand = self.member()
        if ops and ops[-1] == "-" and isinstance(operand, Lit) and operand.kind in ("int", "double"):
            operand = Lit(operand.kind, -operand.value)  # `-1` is a literal, as the parsers fold it
            ops.pop()
        return Unary(ops, operand) if ops else operand

    def member(self) -> Node:
        base = self.primary()
        ops: list[Sel | Index | Method] = []
        while True:
            if self.take("."):
                name = self.ident()
                if self.take("("):
                    ops.append(Method(name, self.args(")")))
                else:
                    ops.append(Sel(name))
            elif self.take("["):
                self.nest()
                ops.append(Index(self.expr()))
                self.expect("]")
                self.depth -= 1
            elif self.peek("{") and _qualified(base, ops) is not None:
                self.i += 1
                base, ops = MessageLit(str(_qualified(base, ops)), self.fields()), []
            else:
                break
        return Member(base, ops) if ops else base

    def primary(self) -> Node:
        kind, v, pos = self.tokens[self.i]
        if kind in ("int", "uint", "double", "string", "bytes"):
            self.i += 1
            return Lit(kind, v)
        if kind == "ident":
            if v in ("true", "false"):
                self.i += 1
                return Lit("bool", v == "true")
            if v == "null":
                self.i += 1
                return Lit("null", None)
            name = self.ident()
            if self.take("("):
                return Call(name, self.args(")"))
            return Ident(name)
        if self.take("."):  # a name from the root scope: `.device`
            name = self.ident()
            if self.take("("):
                return Call(name, self.args(")"))
            return Ident(name)
        if self.take("("):
            self.nest()
            inner = self.expr()
            self.expect(")")
            self.depth -= 1
            return inner
        if self.take("["):
            return ListLit(self.args("]"))
        if self.take("{"):
            return MapLit(self.entries())
        found = "the end" if kind == "end" else repr(v)
        raise CelSyntaxError(f"unexpected {found} at {pos}")

    def args(self, close: str) -> list[Node]:
        self.nest()
        out: list[Node] = []
        while not self.take(close):
            out.append(self.expr())
            if not self.take(","):
                self.expect(close)
                break
        self.depth -= 1
        return out

    def entries(self) -> list[tuple[Node, Node]]:
        self.nest()
        out: list[tuple[Node, Node]] = []
        while not self.take("}"):
            key = self.expr()
            self.expect(":")
            out.append((key, self.expr()))
            if not self.take(","):
                self.expect("}")
                break
        self.depth -= 1
        return out

    def fields(self) -> list[tuple[str, Node]]:
        self.nest()
        out: list[tuple[str, Node]] = []
        while not self.take("}"):
            name = self.ident()
            self.expect(":")
            out.append((name, self.expr()))
            if not self.take(","):
                self.expect("}")
                break
        self.depth -= 1
        return out


def _qualified(base: Node, ops: list[Sel | Index | Method]) -> str | None:
    """`a.b.c` when base and ops spell a qualified name (a message type may follow)."""
    if not isinstance(base, Ident) or not all(isinstance(op, Sel) for op in ops):
        return None
    return ".".join([base.name, *(op.name for op in ops if isinstance(op, Sel))])


def _group(operands: list[Node], ops: list[str], level: int) -> Node:
    """A flat `a op b op c ...` -> Chains by precedence (lowest level outermost)."""
    if level == len(_LEVELS):
        return operands[0]
    groups: list[Node] = []
    joins: list[str] = []
    start = 0
    for k, op in enumerate(ops):
        if _PRECEDENCE[op] == level:
            groups.append(_group(operands[start : k + 1], ops[start:k], level + 1))
            joins.append(op)
            start = k + 1
    if not joins:
        return _group(operands, ops, level + 1)
    groups.append(_group(operands[start:], ops[start:], level + 1))
    return Chain(groups, joins)


def parse(text: str) -> Node:
    """The syntax tree of `text`; CelSyntaxError when it is not CEL."""
    parser = _Parser(text)
    tree = parser.expr()
    kind, v, pos = parser.tokens[parser.i]
    if kind != "end":
        raise CelSyntaxError(f"unexpected {v!r} at {pos}")
    return tree
