"""A small Chrome DevTools Protocol client for the browser tests and the bench (one job: drive a headless Chromium).

Starts Debian's `chromium` headless with its own profile and `--remote-debugging-port=0`, takes the
DevTools address from the line Chromium prints when it listens, and talks CDP over one websocket (aiohttp)
with a flattened session on one page. Waiting is done in the page: a promise that settles on a DOM
mutation or an animation frame, never a sleep here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-port=0",
]


KEYS = {"Enter": 13, "Escape": 27, "Tab": 9, "ArrowLeft": 37, "ArrowUp": 38, "ArrowRight": 39, "ArrowDown": 40}


def chromium_path() -> str | None:
    """The browser binary: $CHROMIUM, else `chromium` (Debian) or `chromium-browser` on PATH."""
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


class CDPError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page; `await Browser.start(profile_dir)`, then `await close()`."""

    def __init__(self, proc: asyncio.subprocess.Process, profile: Path) -> None:
        self.proc = proc
        self.profile = profile
        self.stderr_tail: list[str] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._waiters: dict[str, list[asyncio.Future[dict[str, Any]]]] = {}
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._session = ""
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def start(cls, profile: Path, width: int = 1440, height: int = 900, timeout: float = 60.0) -> Browser:
        exe = chromium_path()
        if exe is None:
            raise CDPError(
                "chromium not found: install Debian's chromium (apt-get install -y chromium) or set CHROMIUM"
            )
        profile.mkdir(parents=True, exist_ok=True)
        proc = await asyncio.create_subprocess_exec(
            exe,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self = cls(proc, profile)
        try:
            ws_url = await asyncio.wait_for(self._listening(), timeout)
            self._tasks.append(asyncio.create_task(self._drain_stderr()))
            self._http = aiohttp.ClientSession()
            self._ws = await self._http.ws_connect(ws_url, max_msg_size=0)
            self._tasks.append(asyncio.create_task(self._read()))
            target = await self.send("Target.createTarget", {"url": "about:blank"}, page=False)
            attached = await self.send(
                "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, page=False
            )
            self._session = attached["sessionId"]
            await self.send("Page.enable")
            await self.send("Runtime.enable")
            await self.resize(width, height)
        except BaseException:
            await self.close()
            raise
        return self

    async def _listening(self) -> str:
        """The browser's websocket URL from Chromium's "DevTools listening on ws://..." line (the port is the
        one it also writes to <profile>/DevToolsActivePort, which may appear a moment later)."""
        assert self.proc.stderr is not None
        while True:
            line = await self.proc.stderr.readline()
            if not line:
                raise CDPError(
                    f"chromium exited ({await self.proc.wait()}) before DevTools listened: "
                    + " | ".join(self.stderr_tail[-5:])
                )
            text = line.decode(errors="replace").rstrip()
            self.stderr_tail = [*self.stderr_tail[-20:], text]
            if text.startswith("DevTools listening on "):
                return text.removeprefix("DevTools listening on ").strip()

    async def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.stderr_tail = [*self.stderr_tail[-20:], line.decode(errors="replace").rstrip()]

    async def _read(self) -> None:
        assert self._ws is not None
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            elif "method" in data:
                for fut in self._waiters.pop(data["method"], []):
                    if not fut.done():
                        fut.set_result(data.get("params") or {})
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(CDPError("the DevTools connection closed"))

    async def send(
        self, method: str, params: dict[str, Any] | None = None, page: bool = True, timeout: float = 30.0
    ) -> dict[str, Any]:
        if self._ws is None or self._ws.closed:
            raise CDPError(f"{method}: not connected to chromium")
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if page:
            msg["sessionId"] = self._session
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        await self._ws.send_str(json.dumps(msg))
        reply = await asyncio.wait_for(fut, timeout)
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error'].get('message')} {reply['error'].get('data', '')}")
        return dict(reply.get("result") or {})

    def event(self, method: str) -> asyncio.Future[dict[str, Any]]:
        """A future for the next `method` event; take it before the command that causes the event."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(method, []).append(fut)
        return fut

    async def navigate(self, url: str, timeout: float = 30.0) -> None:
        loaded = self.event("Page.loadEventFired")
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise CDPError(f"navigate {url}: {result['errorText']}")
        await asyncio.wait_for(loaded, timeout)

    async def reload(self, timeout: float = 30.0) -> None:
        """Reload the page and wait for its load event (a reload from inside an evaluate races the
        evaluate's own answer: "Inspected target navigated or closed")."""
        loaded = self.event("Page.loadEventFired")
        await self.send("Page.reload")
        await asyncio.wait_for(loaded, timeout)

    async def evaluate(self, expression: str, timeout: float = 30.0) -> Any:
        """The value of a JS expression (a promise is awaited), returned by value."""
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True},
            timeout=timeout + 5,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = (details.get("exception") or {}).get("description") or details.get("text")
            raise CDPError(f"{text}\n  in: {expression[:300]}")
        return (result.get("result") or {}).get("value")

    async def wait_for(self, condition: str, timeout: float = 10.0) -> Any:
        """The first truthy value of the JS expression `condition`, checked on every DOM mutation and
        animation frame in the page; raises with the expression when `timeout` passes first."""
        script = f"""new Promise((resolve, reject) => {{
  const check = () => {{ try {{ return ({condition}); }} catch (e) {{ return undefined; }} }};
  const first = check();
  if (first) {{ resolve(first); return; }}
  let over = false;
  const finish = (fn, v) => {{ if (over) return; over = true; mo.disconnect(); clearTimeout(timer); fn(v); }};
  const test = () => {{ const v = check(); if (v) finish(resolve, v); }};
  const mo = new MutationObserver(test);
  mo.observe(document, {{subtree: true, childList: true, attributes: true, characterData: true}});
  const frame = () => {{ test(); if (!over) requestAnimationFrame(frame); }};
  requestAnimationFrame(frame);
  const timer = setTimeout(() => finish(reject, new Error({json.dumps("timed out waiting for: " + condition)})),
                           {int(timeout * 1000)});
}})"""
        return await self.evaluate(script, timeout=timeout)

    async def resize(self, width: int, height: int) -> None:
        """Set the page's viewport to `width` x `height` CSS pixels (the page sees a resize event)."""
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    async def press(self, key: str) -> None:
        """A real key press (keyDown + keyUp) on the focused element: Enter, Escape, Tab, arrows."""
        code = KEYS[key]
        base = {"key": key, "code": key, "windowsVirtualKeyCode": code, "nativeVirtualKeyCode": code}
        down = {**base, "type": "keyDown", **({"text": "\r"} if key == "Enter" else {})}
        await self.send("Input.dispatchKeyEvent", down)
        await self.send("Input.dispatchKeyEvent", {**base, "type": "keyUp"})

    async def screenshot(self, path: Path, scale: float = 1.0, height: int | None = None) -> Path:
        """A PNG of the viewport, its top `height` CSS pixels when given, scaled by `scale` (small copies)."""
        params: dict[str, Any] = {"format": "png"}
        if scale != 1.0 or height is not None:
            metrics = await self.send("Page.getLayoutMetrics")
            view = metrics.get("cssVisualViewport") or metrics["layoutViewport"]
            params["clip"] = {
                "x": 0,
                "y": 0,
                "width": view["clientWidth"],
                "height": min(height or view["clientHeight"], view["clientHeight"]),
                "scale": scale,
            }
        shot = await self.send("Page.captureScreenshot", params)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    async def close(self) -> None:
        if self._ws is not None and not self._ws.closed:
            with contextlib.suppress(Exception):
                await self.send("Browser.close", page=False, timeout=5)
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        # the Debian wrapper script execs chromium; its helpers share the process group we started
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
