"""Typed service configuration from flags and `GPU_DRA_*` environment variables.

A service declares one msgspec Struct (subclassing `CommonConfig`); `load_config` builds the
command line from its fields, reads the matching environment variables, and converts both
strictly. Precedence: flag > environment > default. An unknown `GPU_DRA_*` variable or a value
of the wrong type stops the service at start with a message naming the setting.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from shared import featuregates
from shared.telemetry import DEFAULT_PERIODIC_RATIO

ENV_PREFIX = "GPU_DRA_"

# Variables read by tooling rather than by a service config; not "unknown".
LAUNCHER_ENV = frozenset({"GPU_DRA_TRACE_FILE"})

C = TypeVar("C", bound="CommonConfig")


class ConfigError(ValueError):
    """A setting was unknown or malformed; the message says which and what is accepted."""


def _help(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class CommonConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings every service has."""

    nats_url: Annotated[str, _help("NATS server URL(s), comma-separated; empty starts an embedded nats-server")] = ""
    nats_user: Annotated[str, _help("NATS user name (multi-tenant deployments)")] = ""
    nats_password: Annotated[str, _help("NATS password")] = ""
    nats_creds: Annotated[
        str, _help("NATS .creds file (user JWT + NKEY seed from `gpu-dra nats credentials`), instead of a password")
    ] = ""
    nats_token_file: Annotated[
        str,
        _help(
            "projected ServiceAccount token (audience nats) sent to the NATS auth callout, with GPU_DRA_NATS_CREDS "
            "naming the sentinel's creds and GPU_DRA_NATS_USER the identity asked for; read at every connect"
        ),
    ] = ""
    nats_tls_ca: Annotated[str, _help("CA bundle that signed the NATS server certificate (tls:// URLs)")] = ""
    nats_tls_cert: Annotated[str, _help("client certificate for NATS servers that verify clients")] = ""
    nats_tls_key: Annotated[str, _help("private key of GPU_DRA_NATS_TLS_CERT")] = ""
    nats_replicas: Annotated[
        int, msgspec.Meta(ge=1, le=5, description="copies of each JetStream stream/KV bucket this service creates")
    ] = 1
    log_level: Annotated[Literal["debug", "info", "warning", "error"], _help("log level")] = "info"
    log_format: Annotated[Literal["text", "json"], _help("log line format")] = "text"
    otel_exporter: Annotated[
        str, _help("trace exporter when OTEL_EXPORTER_OTLP_ENDPOINT is unset: none, console, memory, file:<path>")
    ] = "none"
    otel_periodic_ratio: Annotated[
        float,
        msgspec.Meta(
            ge=0,
            le=1,
            description=(
                "share of periodic no-op work (scans, resyncs) traced as root spans; what such work changes is "
                "always traced"
            ),
        ),
    ] = DEFAULT_PERIODIC_RATIO
    metrics_port: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=65535,
            description=("HTTP port of /metrics (Prometheus), /healthz (liveness) and /readyz (readiness); 0 is off"),
        ),
    ] = 0
    health_stall_seconds: Annotated[
        float,
        msgspec.Meta(
            gt=1,
            le=3600,
            description=("/healthz fails once the event loop has not ticked (every second) for this long"),
        ),
    ] = 10.0
    feature_gates: Annotated[
        str,
        _help(
            "feature gates to change from their defaults, Name=true|false comma-separated (`gpu-dra features` "
            "lists them with stage and default)"
        ),
    ] = ""

    @property
    def gates(self) -> featuregates.FeatureGates:
        """The feature gates in force: the registry's defaults with `feature_gates` applied."""
        return featuregates.parsed(self.feature_gates)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def settings_env(config: CommonConfig, names: Iterable[str]) -> dict[str, str]:
    """The `GPU_DRA_*` environment that gives another process these settings of `config`, as they are."""
    out = {}
    for name in names:
        value = getattr(config, name)
        out[_env(name)] = ",".join(map(str, value)) if isinstance(value, list | tuple | set | frozenset) else str(value)
    return out


def without_settings(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less its `GPU_DRA_*` settings (launchers' own variables kept): what a process passes on to a child
    whose settings it gives itself, as a child refuses the settings it does not know."""
    return {k: v for k, v in env.items() if not k.startswith(ENV_PREFIX) or k in LAUNCHER_ENV}


def _strip(tp: Any) -> tuple[Any, str]:
    """The bare type and its description from Annotated metadata."""
    description = ""
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        for item in meta:
            if isinstance(item, msgspec.Meta) and item.description:
                description = item.description
        return base, description
    return tp, description


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) in (list, tuple, set, frozenset)


def _is_bool(tp: Any) -> bool:
    return tp is bool


def _choices(tp: Any) -> list[str] | None:
    if typing.get_origin(tp) is Literal:
        return [str(a) for a in typing.get_args(tp)]
    return None


def _type_name(tp: Any) -> str:
    choices = _choices(tp)
    if choices:
        return "one of " + ", ".join(choices)
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def build_parser(cls: type[CommonConfig], prog: str, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser with one option per config field (defaults left to the loader)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_config_arguments(parser, cls)
    return parser


def add_config_arguments(parser: argparse.ArgumentParser, cls: type[CommonConfig]) -> None:
    for f in msgspec.structs.fields(cls):
        tp, description = _strip(f.type)
        default = f.default if f.default is not msgspec.NODEFAULT else None
        # argparse expands `%` in help (`%(default)s`): a literal one (`SM %`) is doubled
        help_text = f"{description} (env {_env(f.name)}; default {default!r})".replace("%", "%%")
        if _is_bool(tp):
            parser.add_argument(
                _flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(_flag(f.name), dest=f.name, default=None, metavar=f.name.upper(), help=help_text)


def _raw_value(tp: Any, text: str) -> Any:
    if _is_list(tp):
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


def config_from(
    cls: type[C], args: argparse.Namespace | Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> C:
    """Merge defaults, environment and parsed flags into a validated config."""
    env = os.environ if env is None else env
    names = {f.name: f for f in msgspec.structs.fields(cls)}
    known_env = {_env(n) for n in names} | LAUNCHER_ENV
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known_env)
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)}; "
            f"this service accepts: {', '.join(sorted(known_env - LAUNCHER_ENV))}"
        )
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, f in names.items():
        tp, _ = _strip(f.type)
        if _env(name) in env:
            raw[name] = _raw_value(tp, env[_env(name)])
            sources[name] = _env(name)
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    for name, value in values.items():
        if name not in names or value is None:
            continue
        tp, _ = _strip(names[name].type)
        raw[name] = _raw_value(tp, value) if isinstance(value, str) else value
        sources[name] = _flag(name)
    try:
        config = msgspec.convert(raw, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, names, sources)) from None
    try:
        featuregates.parsed(config.feature_gates)
    except featuregates.FeatureGateError as exc:
        raise ConfigError(f"invalid setting {sources.get('feature_gates', '--feature-gates')}: {exc}") from None
    return config


def _explain(exc: msgspec.ValidationError, names: Mapping[str, Any], sources: Mapping[str, str]) -> str:
    text = str(exc)
    marker = " - at `$."
    if marker in text:
        problem, _, where = text.partition(marker)
        field_name = where.rstrip("`").split(".")[0].split("[")[0]
        if field_name in names:
            tp, _ = _strip(names[field_name].type)
            source = sources.get(field_name, _flag(field_name))
            return f"invalid setting {source}: {problem} (expected {_type_name(tp)})"
    return f"invalid configuration: {text}"


def load_config(
    cls: type[C],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str = "",
    env: Mapping[str, str] | None = None,
) -> C:
    """Parse argv and the environment into `cls`; ConfigError on anything unknown or malformed."""
    parser = build_parser(cls, prog, description)
    args = parser.parse_args(list(argv) if argv is not None else None)
    return config_from(cls, args, env)


def load_config_or_report(cls: type[C], argv: Sequence[str] | None, *, prog: str, description: str = "") -> C | None:
    """`load_config` for a command's `main`: None after printing `prog: <what is wrong>` to stderr (exit 2)."""
    try:
        return load_config(cls, argv, prog=prog, description=description)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
