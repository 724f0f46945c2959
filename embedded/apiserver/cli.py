"""`gpu-dra apiserver`: flags and GPU_DRA_* variables -> a running API server; nothing else."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated

import msgspec

from embedded.apiserver.authn import TokenFileError
from shared.config import CommonConfig, load_config_or_report
from shared.logs import get_logger, setup_logging

log = get_logger(__name__)


class ApiServerConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    port: Annotated[int, msgspec.Meta(ge=0, le=65535, description="port on 127.0.0.1; 0 picks a free one")] = 6443
    kubeconfig: Annotated[str, msgspec.Meta(description="where to write a kubeconfig for kubectl and clients")] = ""
    data_dir: Annotated[str, msgspec.Meta(description="persist objects here (SQLite); empty keeps them in memory")] = ""
    token: Annotated[
        str,
        msgspec.Meta(
            description=(
                "the admin's bearer token (system:masters); empty makes a random one, written only to --kubeconfig. "
                "A flag shows in `ps`: prefer leaving it empty"
            )
        ),
    ] = ""
    token_auth_file: Annotated[
        str,
        msgspec.Meta(
            description=(
                'static tokens, one identity a line: token,user,uid,"group1,group2" (as kube-apiserver\'s '
                "--token-auth-file); ServiceAccount tokens come from the TokenRequest API"
            )
        ),
    ] = ""
    insecure_http: Annotated[
        bool,
        msgspec.Meta(
            description="serve plain HTTP instead of TLS (kubectl then sends no token, so the token is not checked)"
        ),
    ] = False
    pod_log_dir: Annotated[
        str,
        msgspec.Meta(description="where the kubelets write container logs (served as pods/{name}/log); empty: none"),
    ] = ""
    bookmark_interval: Annotated[float, msgspec.Meta(gt=0, description="seconds between watch bookmarks")] = 60.0


async def serve(config: ApiServerConfig) -> None:
    from embedded.apiserver.server import ApiServer
    from shared.runtime import stop_event

    server = ApiServer(
        data_dir=Path(config.data_dir) if config.data_dir else None,
        token=config.token or (None if not config.insecure_http else ""),
        port=config.port,
        bookmark_interval=config.bookmark_interval,
        tls=not config.insecure_http,
        token_file=Path(config.token_auth_file) if config.token_auth_file else None,
    )
    server.pod_log_dir = Path(config.pod_log_dir) if config.pod_log_dir else None
    stopping = stop_event()
    await server.start()
    if config.kubeconfig:
        server.write_kubeconfig(Path(config.kubeconfig))
    log.info(
        "apiserver listening",
        url=server.url,
        kubeconfig=config.kubeconfig or "-",
        data_dir=config.data_dir or "(memory)",
    )
    print(f"apiserver listening on {server.url}", flush=True)
    try:
        await stopping.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    config = load_config_or_report(
        ApiServerConfig, argv, prog="gpu-dra apiserver", description="the embedded Kubernetes API server"
    )
    if config is None:
        return 2
    setup_logging("apiserver", config.log_level, config.log_format)
    try:
        asyncio.run(serve(config))
    except TokenFileError as exc:
        print(f"gpu-dra apiserver: --token-auth-file: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # TlsUnavailable: no way to make a serving certificate
        print(f"gpu-dra apiserver: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"gpu-dra apiserver: cannot serve on 127.0.0.1:{config.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
