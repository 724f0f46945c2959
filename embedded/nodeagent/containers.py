"""The kubelet emulator's container runtime: runs a pod's containers as sandboxed processes, as the kubelet does.

Owns, for each pod: its init containers in order, then its containers side by side, each a bubblewrap process
(`sandbox.py`) with the pod's env, the CDI edits' env/mounts and the `nvidia-smi` shim at /usr/bin (`nvidiasmi.py`); the
container states (waiting/running/terminated with exit code and reason), restarts per restartPolicy with the
kubelet's doubling back-off (`CrashLoopBackOff` meanwhile), the pod phase (Running, Succeeded, Failed) and
termination (SIGTERM to the container's processes, SIGKILL once the grace period is over). Output goes, a line
at a time with its timestamp, to `<log-dir>/<namespace>_<pod>_<uid>/<container>/<restart>.log`, where the API
server's pod log subresource reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from embedded.nodeagent import nvidiasmi
from embedded.nodeagent.attach import Attachment
from embedded.nodeagent.kubeletevents import pull_events
from embedded.nodeagent.sandbox import CONTAINER_PATH, NOBODY, SIM_STATE, WORK_DIR, bwrap_argv
from shared.backoff import Backoff
from shared.kube.events import EventType
from shared.logs import get_logger

log = get_logger(__name__)
BACKOFF_MAX = 300.0
ContainerEvent = Callable[[str, EventType, str, str], None]  # (container, type, reason, message): kubeletevents
IDLE = "trap 'exit 0' TERM; sleep infinity & wait"  # what a container without a command runs


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def stamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def pod_log_dir(root: Path, pod: dict[str, Any]) -> Path:
    meta = pod["metadata"]
    return root / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"


@dataclass
class ContainerState:
    name: str
    image: str
    init: bool = False
    restarts: int = 0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last: dict[str, Any] = field(default_factory=dict)
    done: bool = False  # will not run again

    def status(self) -> dict[str, Any]:
        running = "running" in self.state
        out = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "restartCount": self.restarts,
            "ready": running and not self.init,
            "started": running,
            "state": {k: self.state.get(k) for k in ("waiting", "running", "terminated")},
            "lastState": self.last,
        }
        if running:
            out["containerID"] = f"bwrap://{self.name}-{self.restarts}"
        return out


def _flag(value: bool) -> str:
    return "True" if value else "False"


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(k) for k in f.read().split()]
    return out


def _commands(sandbox: int) -> list[int]:
    """The container's own process: the child of the sandbox's PID-1 (bwrap's init in its PID namespace, itself
    the child of the bwrap we started). A runtime signals the container's process, as here, not its children:
    the command decides what its children get, and they go with the namespace once it ends."""
    return [pid for init in _children(sandbox) for pid in _children(init)]


def _holders(pipes: set[str]) -> list[int]:
    """The processes whose stdout is one of `pipes` (containers' output pipes, as /proc names them), in one
    scan: their sandboxes', those that outlived the sandbox's bwrap included (a bwrap killed before its child
    armed `--die-with-parent` leaves the child, reparented, holding the pipe open; it is no descendant any more)."""
    out: list[int] = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/fd/1") in pipes:
                    out.append(int(entry.name))
    return out


async def _terminate_commands(procs: list[asyncio.subprocess.Process], deadline: float) -> None:
    """SIGTERM each sandbox's command. A sandbox still setting up (a pod deleted as it starts) has no command yet:
    it is looked for again every COMMAND_POLL_S until it runs or `deadline` (the grace period's end) passes;
    nothing says when bwrap has exec'd it."""
    loop = asyncio.get_running_loop()
    waiting = list(procs)
    while waiting:
        for proc in list(waiting):
            commands = _commands(proc.pid)
            for pid in commands:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            if commands or proc.returncode is not None:
                waiting.remove(proc)
        if not waiting or loop.time() + COMMAND_POLL_S > deadline:
            return
        await asyncio.sleep(COMMAND_POLL_S)


COMMAND_POLL_S = 0.005
ESCAPED_AFTER_S = 0.5  # a killed sandbox whose output pipe is still open this long after: kill who holds it


class PodWorker:
    """One pod's containers, from start to a final phase or until stopped."""

    def __init__(
        self,
        pod: dict[str, Any],
        edits: dict[str, dict[str, Any]],
        *,
        bwrap: str,
        work_root: Path,
        log_root: Path,
        shim_dir: Path,
        sim_state: str,
        on_change: Callable[[PodWorker], None],
        backoff_base: float = 10.0,
        on_event: ContainerEvent | None = None,
    ) -> None:
        self.pod = pod
        self.on_event = on_event or (lambda container, type, reason, message: None)
        self.edits = edits
        self.bwrap = bwrap
        self.work = work_root / pod["metadata"]["uid"]
        self.logs = pod_log_dir(log_root, pod)
        self.shim_dir = shim_dir
        self.sim_state = sim_state
        self.on_change = on_change
        self.backoff_base = backoff_base
        spec = pod.get("spec") or {}
        self.policy = spec.get("restartPolicy") or "Always"
        self.inits = [
            ContainerState(c["name"], c.get("image", ""), init=True) for c in spec.get("initContainers") or []
        ]
        self.mains = [ContainerState(c["name"], c.get("image", "")) for c in spec.get("containers") or []]
        self.specs = {c["name"]: c for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]}
        self.ephemerals: list[ContainerState] = []  # `kubectl debug`'s containers, run once each, as they come
        self._ephemeral_tasks: set[asyncio.Task[int]] = set()
        status = pod.get("status") or {}
        # a pod already Running (the emulator restarted) stays Running while its containers start again
        self.phase = "Running" if status.get("phase") == "Running" else "Pending"
        self.initialized = not self.inits
        self.started_at = status.get("startTime") or now()
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._pipes: dict[str, str] = {}  # container -> its output pipe, as /proc/<pid>/fd/1 names it
        self._attached: dict[str, set[asyncio.Queue[bytes]]] = {}  # container -> attached sessions' output
        self.envs: dict[str, dict[str, str]] = {}  # container -> the environment it runs with (exec gets it too)
        self.dirty = False  # a status change not written yet (the PodRunner's writer clears it)
        self.started = asyncio.Event()  # every main container has started once (or the pod has ended)
        self._stopping = False
        self._stop_event = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        t = now()
        ready = self.phase == "Running" and all("running" in c.state for c in self.mains)
        why: dict[str, str | None] = {"reason": None, "message": None}
        if self.phase in ("Succeeded", "Failed"):
            why = {"reason": "PodCompleted", "message": None}
        elif not ready:
            bad = " ".join(c.name for c in self.mains if "running" not in c.state)
            why = {"reason": "ContainersNotReady", "message": f"containers with unready status: [{bad}]"}
        return {
            "phase": self.phase,
            "hostIP": "127.0.0.1",
            "podIP": "127.0.0.1",
            "startTime": self.started_at,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": self.started_at},
                {"type": "Initialized", "status": _flag(self.initialized), "lastTransitionTime": t},
                {"type": "ContainersReady", "status": _flag(ready), "lastTransitionTime": t, **why},
                {"type": "Ready", "status": _flag(ready), "lastTransitionTime": t, **why},
            ],
            "initContainerStatuses": [c.status() for c in self.inits] or None,
            "containerStatuses": [c.status() for c in self.mains],
            "ephemeralContainerStatuses": [{**c.status(), "ready": False} for c in self.ephemerals] or None,
        }

    def _changed(self) -> None:
        if self.phase in ("Succeeded", "Failed") or all("waiting" not in c.state or c.restarts for c in self.mains):
            self.started.set()
        self.on_change(self)

    # ------------------------------------------------------------------ one run of one container
    def _env(self, name: str) -> tuple[dict[str, str], list[tuple[str, str]], int]:
        spec = self.specs[name]
        env = {
            "PATH": CONTAINER_PATH,
            "HOME": WORK_DIR,
            "HOSTNAME": self.pod["metadata"]["name"],  # noqa: S108
            "KUBERNETES_POD_NAME": self.pod["metadata"]["name"],
            nvidiasmi.STATE_ENV: SIM_STATE,
        }
        edits = self.edits.get(name) or {}
        for entry in edits.get("env") or []:
            key, _, value = entry.partition("=")
            env[key] = value
        nodes = list(edits.get("deviceNodes") or [])
        env[nvidiasmi.NODES_ENV] = ":".join(nodes)
        uuids = self._uuids(nodes)
        if uuids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(uuids)
        for item in spec.get("env") or []:
            if "value" in item:
                env[item["name"]] = str(item["value"])
        binds = [tuple(m.split(":", 1)) for m in edits.get("mounts") or [] if ":" in m]
        ctx = {**((self.pod.get("spec") or {}).get("securityContext") or {}), **(spec.get("securityContext") or {})}
        uid = 0 if ctx.get("runAsUser") == 0 or (ctx.get("privileged") is True) else NOBODY
        return env, [(a, b) for a, b in binds], uid

    def _set_up(
        self, name: str, tmp: Path, work: Path, log_path: Path
    ) -> tuple[dict[str, str], list[tuple[str, str]], int, str, BinaryIO]:
        """A container's env, binds and user, its directories made, the simulated NVML state to bind ("" when
        there is none) and its log file opened: one trip to a worker thread."""
        env, binds, uid = self._env(name)
        for d in (tmp, work, log_path.parent):
            d.mkdir(parents=True, exist_ok=True)
        if uid == NOBODY:
            for d in (tmp, work):
                os.chmod(d, 0o777)  # noqa: S103 - the private dirs of an unprivileged user
        sim = self.sim_state if self.sim_state and os.path.isfile(self.sim_state) else ""
        return env, binds, uid, sim, open(log_path, "ab", buffering=0)  # noqa: SIM115 - the caller closes it

    def _uuids(self, nodes: list[str]) -> list[str]:
        try:
            state = json.loads(Path(self.sim_state).read_text())
        except (OSError, ValueError):
            return []
        return nvidiasmi.visible_uuids(nvidiasmi.visible_devices(state, nodes))

    async def _run_once(self, c: ContainerState) -> int:
        spec = self.specs[c.name]
        argv = [*(spec.get("command") or []), *(spec.get("args") or [])]
        if not argv:  # the image's entrypoint is unknown here: the container idles until stopped
            argv = ["sh", "-c", IDLE]
        tmp = self.work / c.name / "tmp"
        work = self.work / c.name / "work"
        log_path = self.logs / c.name / f"{c.restarts}.log"
        env, binds, uid, sim, f = await asyncio.to_thread(self._set_up, c.name, tmp, work, log_path)
        self.envs[c.name] = env
        cmd = bwrap_argv(
            self.bwrap, argv, work=work, tmp=tmp, shim_dir=self.shim_dir, uid=uid, env=env, binds=binds, sim_state=sim
        )
        for event in pull_events(c.image, spec.get("imagePullPolicy") or "IfNotPresent"):
            self.on_event(c.name, *event)
        started = now()
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.PIPE if spec.get("stdin") else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except BaseException:
            f.close()
            raise
        self._procs[c.name] = proc
        with contextlib.suppress(OSError):
            self._pipes[c.name] = os.readlink(f"/proc/{proc.pid}/fd/1")
        self.on_event(c.name, "Normal", "Created", f"Created container: {c.name}")
        self.on_event(c.name, "Normal", "Started", f"Started container {c.name}")
        c.state = {"running": {"startedAt": started}}
        self._changed()
        log.info(
            "container started",
            pod=self.pod["metadata"]["name"],
            container=c.name,
            pid=proc.pid,
            image=c.image,
            restarts=c.restarts,
        )
        assert proc.stdout is not None
        with f:
            while True:
                line = await proc.stdout.readline()
                if not line:
                    break
                await asyncio.to_thread(f.write, stamp().encode() + b" " + line.rstrip(b"\n") + b"\n")
                for session in self._attached.get(c.name, ()):
                    session.put_nowait(line)
        for session in self._attached.pop(c.name, set()):
            session.put_nowait(b"")  # the attached sessions end with the container
        code = await proc.wait()
        self._procs.pop(c.name, None)
        self._pipes.pop(c.name, None)
        if code < 0:
            code = 128 - code  # killed by a signal: as a runtime reports it
        c.state = {
            "terminated": {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": started,
                "finishedAt": now(),
            }
        }
        log.info("container exited", pod=self.pod["metadata"]["name"], container=c.name, exit_code=code)
        return code

    async def _loop(self, c: ContainerState, restart: Callable[[int], bool]) -> int:
        backoff = Backoff(initial_s=self.backoff_base, cap_s=max(BACKOFF_MAX, self.backoff_base))
        while True:
            code = await self._run_once(c)
            if self._stopping or not restart(code):
                c.done = True
                self._changed()
                return code
            c.last = dict(c.state)
            c.restarts += 1
            delay = backoff.next()
            c.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay:g}s restarting failed container={c.name} "
                    f"pod={self.pod['metadata']['name']}",
                }
            }
            self._changed()
            meta = self.pod["metadata"]
            self.on_event(
                c.name,
                "Warning",
                "BackOff",
                f"Back-off restarting failed container {c.name} in pod "
                f"{meta['name']}_{meta['namespace']}({meta['uid']})",
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_event.wait(), delay)
            if self._stopping:
                c.done = True
                return code

    async def run(self) -> None:
        try:
            for c in self.inits:  # in order; a failed one is retried unless the policy is Never
                code = await self._loop(c, lambda rc: rc != 0 and self.policy != "Never")
                if code != 0 or self._stopping:
                    self.phase = "Failed" if not self._stopping or code != 0 else self.phase
                    self._changed()
                    return
            self.initialized = True
            self.phase = "Running"
            self._changed()
            policy = self.policy
            codes = await asyncio.gather(
                *(
                    self._loop(c, lambda rc: policy == "Always" or (policy == "OnFailure" and rc != 0))
                    for c in self.mains
                )
            )
            if not self._stopping:
                self.phase = "Succeeded" if all(rc == 0 for rc in codes) else "Failed"
                self._changed()
        except OSError as exc:
            log.error("container could not start", pod=self.pod["metadata"]["name"], error=str(exc))
            self.phase = "Failed"
            self._changed()

    def add_ephemeral(self, pod: dict[str, Any]) -> None:
        """Start the ephemeral containers `pod` has that are not started yet (they never restart, and do not
        count for the pod's phase or readiness)."""
        if self._stopping or self.phase not in ("Pending", "Running"):
            return
        for spec in (pod.get("spec") or {}).get("ephemeralContainers") or []:
            if spec.get("name") in self.specs:
                continue
            self.pod = pod
            self.specs[spec["name"]] = spec
            c = ContainerState(spec["name"], spec.get("image", ""))
            self.ephemerals.append(c)
            task = asyncio.create_task(self._loop(c, lambda rc: False))
            self._ephemeral_tasks.add(task)
            task.add_done_callback(self._ephemeral_tasks.discard)

    def attach(self, name: str) -> Attachment | None:
        """A session on container `name`'s streams while it runs (None otherwise)."""
        proc = self._procs.get(name)
        if proc is None or proc.returncode is not None:
            return None
        sessions = self._attached.setdefault(name, set())
        session = Attachment(proc, self.specs[name], sessions.discard)
        sessions.add(session.lines)
        return session

    def running_pid(self, name: str) -> int | None:
        """The host PID of the sandbox process of container `name` while it runs (None otherwise)."""
        proc = self._procs.get(name)
        return proc.pid if proc is not None and proc.returncode is None else None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run())

    async def stop(self, grace: float) -> None:
        """SIGTERM each container's process, SIGKILL its sandbox after `grace` seconds (and whatever of it
        escaped the sandbox's end: `_holders`)."""
        self._stopping = True
        self._stop_event.set()
        procs = list(self._procs.values())
        for name in self._procs:
            self.on_event(name, "Normal", "Killing", f"Stopping container {name}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await _terminate_commands(procs, deadline)
        if procs:
            pipes = set(self._pipes.values())
            waits = [asyncio.ensure_future(p.wait()) for p in procs]
            _, pending = await asyncio.wait(waits, timeout=max(0.0, deadline - loop.time()))
            for proc in procs:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()  # bwrap; --die-with-parent takes the sandbox with it
            if pending:  # a wait ends once the output pipe closes, which an escaped sandbox process holds open
                _, pending = await asyncio.wait(pending, timeout=ESCAPED_AFTER_S)
                for pid in _holders(pipes) if pending else ():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            for fut in pending:
                with contextlib.suppress(Exception):
                    await fut
        for task in [*self._ephemeral_tasks, *([self.task] if self.task is not None else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
