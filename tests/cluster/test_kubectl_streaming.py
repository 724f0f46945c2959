"""The real kubectl's streaming verbs against `gpu-dra up`: exec (pipes and a terminal), RBAC on pods/exec, attach,
cp, debug, and port-forward (SPDY tunneled over a WebSocket into the pod's sandbox, RBAC on pods/portforward)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.helpers import Up, pod_manifest

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (containers run)"),
]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    cluster = Up(tmp_path_factory.mktemp("streaming") / "cluster", nodes=1)
    try:
        cluster.wait_ready()
        cluster.kubectl("apply", "-f", "-", stdin=pod_manifest("p"))
        cluster.kubectl("wait", "--for=condition=Ready", "pod/p", "--timeout=60s")
        yield cluster
    finally:
        cluster.kill()


def kubectl(up: Up, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "--kubeconfig", str(up.kubeconfig), *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def allocated_uuid(up: Up, pod: str) -> str:
    claim = up.json("get", "pod", pod)["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    (result,) = up.json("get", "resourceclaim", claim)["status"]["allocation"]["devices"]["results"]
    for piece in up.json("get", "resourceslices")["items"]:
        for device in piece["spec"].get("devices") or []:
            if piece["spec"]["pool"]["name"] == result["pool"] and device["name"] == result["device"]:
                return str(device["attributes"]["uuid"]["string"])
    raise AssertionError(f"device {result} is in no slice")


def test_exec_runs_in_the_container_and_sees_its_gpu(up: Up) -> None:
    done = kubectl(up, "exec", "p", "--", "nvidia-smi", "-L")
    assert done.returncode == 0, done.stderr
    assert f"(UUID: {allocated_uuid(up, 'p')})" in done.stdout, done.stdout
    # the container's own sandbox: its hostname, its work dir, its files
    done = kubectl(up, "exec", "p", "--", "sh", "-c", "hostname; pwd; echo kept > /tmp/mark")
    assert done.stdout.split() == ["pod", "/run/pod"], done.stdout + done.stderr
    assert kubectl(up, "exec", "p", "--", "cat", "/tmp/mark").stdout == "kept\n"


def test_exec_passes_stdin_stderr_and_the_exit_code(up: Up) -> None:
    done = kubectl(up, "exec", "-i", "p", "--", "sh", "-c", "cat; echo oops >&2; exit 3", stdin="one\ntwo\n")
    assert done.returncode == 3, done.stderr
    assert done.stdout == "one\ntwo\n"
    assert "oops" in done.stderr and "command terminated with exit code 3" in done.stderr


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a local terminal")
def test_exec_with_a_terminal_runs_an_interactive_shell(up: Up, tmp_path: Path) -> None:
    typed = "stty size; echo in-$((40+2)); exit 5\n"
    done = subprocess.run(
        [
            "script",
            "-qec",
            f"stty cols 120 rows 40; kubectl --kubeconfig {up.kubeconfig} exec -it p -- sh",
            "/dev/null",
        ],
        input=typed,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 5, done.stdout
    assert "in-42" in done.stdout and "command terminated with exit code 5" in done.stdout, done.stdout


def test_exec_needs_create_on_pods_exec(up: Up) -> None:
    user = "system:serviceaccount:default:viewer"
    up.kubectl("create", "role", "pod-reader", "--verb=get", "--resource=pods")
    up.kubectl("create", "rolebinding", "pod-reader", "--role=pod-reader", "--serviceaccount=default:viewer")
    denied = kubectl(up, "--as", user, "exec", "p", "--", "true")
    assert denied.returncode == 1
    assert (
        f'User "{user}" cannot create resource "pods/exec" in API group "" in the namespace "default"' in denied.stderr
    ), denied.stderr
    up.kubectl("create", "role", "pod-exec", "--verb=create", "--resource=pods/exec")
    up.kubectl("create", "rolebinding", "pod-exec", "--role=pod-exec", "--serviceaccount=default:viewer")
    allowed = kubectl(up, "--as", user, "exec", "p", "--", "echo", "ok")
    assert allowed.returncode == 0 and allowed.stdout == "ok\n", allowed.stderr


CRASHING = """\
apiVersion: v1
kind: Pod
metadata: {name: crash, namespace: default}
spec:
  containers: [{name: c, image: busybox:1.36, imagePullPolicy: Always, command: [sh, -c, "exit 1"]}]
"""
JOBS = """\
apiVersion: batch/v1
kind: Job
metadata: {name: once, namespace: default}
spec:
  template:
    spec:
      restartPolicy: Never
      containers: [{name: c, image: busybox, command: [echo, "I am once"]}]
---
apiVersion: batch/v1
kind: Job
metadata: {name: once-more, namespace: default}
spec:
  template:
    spec:
      restartPolicy: Never
      containers: [{name: c, image: busybox, command: [echo, "I am once-more"]}]
"""


def watch_events(up: Up, pod: str, wanted: set[str], timeout: float = 60) -> dict[str, dict]:
    """reason -> the first Event about `pod` with it, read from a watch until every `wanted` reason came."""
    import json
    import threading

    proc = subprocess.Popen(
        [
            "kubectl",
            "--kubeconfig",
            str(up.kubeconfig),
            "get",
            "events",
            "--watch",
            "--field-selector",
            f"involvedObject.name={pod}",
            "-o",
            "json",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    seen: dict[str, dict] = {}
    decoder, buffer = json.JSONDecoder(), ""
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            buffer += line
            try:
                event, _ = decoder.raw_decode(buffer.strip())
            except ValueError:
                continue
            buffer = ""
            seen.setdefault(event["reason"], event)
            if wanted <= set(seen):
                return seen
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()
    raise AssertionError(f"events about {pod}: {sorted(seen)}, wanted {sorted(wanted)}")


def test_the_kubelet_records_container_events_with_upstream_reasons(up: Up) -> None:
    seen = watch_events(up, "p", {"Scheduled", "Pulled", "Created", "Started"})
    assert seen["Pulled"]["message"] == 'Container image "ubuntu:22.04" already present on machine'
    assert seen["Created"]["message"] == "Created container: ctr"
    assert seen["Started"]["message"] == "Started container ctr"
    assert seen["Started"]["involvedObject"]["fieldPath"] == "spec.containers{ctr}"
    assert seen["Started"]["source"] == {"component": "kubelet", "host": "gpu-node-0"}
    up.kubectl("apply", "-f", "-", stdin=CRASHING)
    seen = watch_events(up, "crash", {"Pulling", "Pulled", "Started", "BackOff"})
    assert seen["Pulling"]["message"] == 'Pulling image "busybox:1.36"'
    assert seen["BackOff"]["type"] == "Warning"
    assert seen["BackOff"]["message"].startswith("Back-off restarting failed container c in pod crash_default(")
    up.kubectl(
        "apply", "-f", "-", stdin=CRASHING.replace("name: crash", "name: sleeper").replace('"exit 1"', '"sleep 600"')
    )
    up.kubectl("wait", "--for=condition=Ready", "pod/sleeper", "--timeout=60s")
    up.kubectl("delete", "pod", "sleeper", "--wait=false")
    assert watch_events(up, "sleeper", {"Killing"})["Killing"]["message"] == "Stopping container c"


def test_kubectl_logs_of_a_job_reads_that_jobs_pod(up: Up) -> None:
    up.kubectl("apply", "-f", "-", stdin=JOBS)
    up.kubectl("wait", "--for=condition=complete", "job/once", "job/once-more", "--timeout=60s")
    assert up.kubectl("logs", "job/once") == "I am once\n"
    assert up.kubectl("logs", "job/once-more") == "I am once-more\n"


def test_kubectl_cp_both_ways_through_tar_in_the_container(up: Up, tmp_path: Path) -> None:
    source = tmp_path / "tree"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "data.bin").write_bytes(bytes(range(256)) * 512)
    (source / "top.txt").write_text("top\n")
    up.kubectl("cp", str(source), "p:/run/pod/tree")
    listed = up.kubectl("exec", "p", "--", "find", "/run/pod/tree", "-type", "f")
    assert sorted(listed.split()) == ["/run/pod/tree/sub/data.bin", "/run/pod/tree/top.txt"]
    back = tmp_path / "back"
    up.kubectl("cp", "p:/run/pod/tree", str(back))
    assert (back / "sub" / "data.bin").read_bytes() == (source / "sub" / "data.bin").read_bytes()
    assert (back / "top.txt").read_text() == "top\n"


def test_kubectl_debug_runs_an_ephemeral_container(up: Up) -> None:
    up.kubectl(
        "debug",
        "p",
        "--image=busybox",
        "--container=dbg",
        "--profile=general",
        "--",
        "sh",
        "-c",
        "echo debugging from $(hostname)",
    )
    up.kubectl(
        "wait",
        "pod/p",
        "--for=jsonpath={.status.ephemeralContainerStatuses[0].state.terminated.reason}=Completed",
        "--timeout=60s",
    )
    assert up.kubectl("logs", "p", "-c", "dbg") == "debugging from pod\n"
    status = up.json("get", "pod", "p")["status"]
    assert status["phase"] == "Running" and [c["name"] for c in status["ephemeralContainerStatuses"]] == ["dbg"]


TALKER = """\
apiVersion: v1
kind: Pod
metadata: {name: talker, namespace: default}
spec:
  restartPolicy: Never
  containers:
  - {name: c, image: busybox, stdin: true, stdinOnce: true,
     command: [sh, -c, 'while read l; do echo "got $l"; done; echo bye']}
"""


def test_kubectl_attach_talks_to_the_containers_own_streams(up: Up) -> None:
    up.kubectl("apply", "-f", "-", stdin=TALKER)
    up.kubectl("wait", "--for=condition=Ready", "pod/talker", "--timeout=60s")
    done = kubectl(up, "attach", "-i", "talker", stdin="a\nb\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "got a\ngot b\nbye\n"  # stdinOnce: the end of kubectl's input ends the container's
    up.kubectl("wait", "pod/talker", "--for=jsonpath={.status.phase}=Succeeded", "--timeout=60s")
    assert up.kubectl("logs", "talker") == "got a\ngot b\nbye\n"


def test_kubectl_debug_interactive_attaches_to_its_container(up: Up) -> None:
    done = kubectl(
        up,
        "debug",
        "-i",
        "p",
        "--image=busybox",
        "--container=shell",
        "--profile=general",
        "--",
        "sh",
        stdin="echo hi from $(hostname)\nexit 0\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hi from pod\n"


WEB = """\
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: default}
spec:
  containers:
  - name: c
    image: python:3
    command: [sh, -c, 'echo served-from-pod > index.html; yes 0123456789abcdef | head -c 4194304 > big;
      exec python3 -m http.server 8080']
"""
BIG = b"0123456789abcdef\n" * (4194304 // 17) + b"0123456789abcdef\n"[: 4194304 % 17]  # 4 MiB: many SPDY frames


class PortForward:
    """`kubectl port-forward` running, its output read as it comes."""

    def __init__(self, up: Up, *args: str) -> None:
        self.proc = subprocess.Popen(
            ["kubectl", "--kubeconfig", str(up.kubeconfig), "port-forward", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # EOF
            self._changed.notify_all()

    def wait_line(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        """The first output line that matches `pattern`, as soon as kubectl prints it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if found := re.search(pattern, line):
                        return found
                left = deadline - time.monotonic()
                assert left > 0 and self.lines[-1:] != [""], f"no {pattern!r} in:\n{''.join(self.lines)}"
                self._changed.wait(left)

    def local_port(self, remote: int) -> int:
        return int(self.wait_line(rf"^Forwarding from 127\.0\.0\.1:(\d+) -> {remote}$").group(1))

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=30)
        with self._changed:
            while self.lines[-1:] != [""]:
                self._changed.wait(30)
            return "".join(self.lines)


def http_get(port: int, conn: socket.socket | None = None, path: str = "/") -> bytes:
    """GET `path` through the forward (on `conn` if given); the whole response, up to the server's close."""
    conn = conn or socket.create_connection(("127.0.0.1", port), timeout=30)
    with conn:
        conn.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        return b"".join(iter(lambda: conn.recv(65536), b""))


@pytest.fixture(scope="module")
def web(up: Up) -> str:
    up.kubectl("apply", "-f", "-", stdin=WEB)
    up.kubectl("wait", "--for=condition=Ready", "pod/web", "--timeout=60s")
    return "web"


def test_port_forward_reaches_a_server_in_the_pods_sandbox(up: Up, web: str) -> None:
    forward = PortForward(up, f"pod/{web}", ":8080")
    try:
        port = forward.local_port(8080)
        first = socket.create_connection(("127.0.0.1", port), timeout=30)
        second = socket.create_connection(("127.0.0.1", port), timeout=30)
        # both connections are open at once, each its own pair of SPDY streams: the second is served first
        assert http_get(port, second).endswith(b"\r\n\r\nserved-from-pod\n")
        assert http_get(port, first).startswith(b"HTTP/1.0 200 OK\r\n")
        assert http_get(port, path="/big").endswith(b"\r\n\r\n" + BIG)
        forward.wait_line(r"^Handling connection for \d+$")
        assert forward.proc.poll() is None
    finally:
        output = forward.stop()
    assert "error" not in output.lower(), output


def test_port_forward_to_a_port_nobody_listens_on_reports_the_kubelets_error(up: Up, web: str) -> None:
    forward = PortForward(up, f"pod/{web}", ":8080", ":9999")
    try:
        good, bad = forward.local_port(8080), forward.local_port(9999)
        assert http_get(good).endswith(b"served-from-pod\n")
        assert http_get(bad) == b""  # kubectl closes the local connection
        error = forward.wait_line(r"an error occurred forwarding \d+ -> 9999: (.*)").group(1)
        assert error.startswith(f"error forwarding port 9999 to pod {web}_default, uid "), error
        assert "IPv4: dial tcp4 127.0.0.1:9999: connect: connection refused" in error, error
        # client-go drops the whole connection after an error on any forward (kubectl 1.32 here)
        assert forward.proc.wait(timeout=30) == 1
    finally:
        output = forward.stop()
    assert "error: lost connection to pod" in output, output
    again = PortForward(up, f"pod/{web}", ":8080")  # the pod's server is untouched
    try:
        assert http_get(again.local_port(8080)).endswith(b"served-from-pod\n")
    finally:
        again.stop()


def test_port_forward_needs_create_on_pods_portforward(up: Up, web: str) -> None:
    user = "system:serviceaccount:default:forwarder"
    up.kubectl("create", "role", "pf-pod-reader", "--verb=get", "--resource=pods")
    up.kubectl("create", "rolebinding", "pf-pod-reader", "--role=pf-pod-reader", "--serviceaccount=default:forwarder")
    denied = kubectl(up, "--as", user, "port-forward", f"pod/{web}", ":8080")
    assert denied.returncode == 1
    assert (
        f'User "{user}" cannot create resource "pods/portforward" in API group "" in the namespace "default"'
        in denied.stderr
    ), denied.stderr
    up.kubectl("create", "role", "pf", "--verb=create", "--resource=pods/portforward")
    up.kubectl("create", "rolebinding", "pf", "--role=pf", "--serviceaccount=default:forwarder")
    forward = PortForward(up, "--as", user, f"pod/{web}", ":8080")
    try:
        assert http_get(forward.local_port(8080)).endswith(b"served-from-pod\n")
    finally:
        forward.stop()


FINISHED = """\
apiVersion: v1
kind: Pod
metadata: {name: done, namespace: default}
spec:
  restartPolicy: Never
  containers: [{name: c, image: busybox, command: ["true"]}]
"""


def test_port_forward_to_a_finished_pod_is_refused(up: Up) -> None:
    up.kubectl("apply", "-f", "-", stdin=FINISHED)
    up.kubectl("wait", "pod/done", "--for=jsonpath={.status.phase}=Succeeded", "--timeout=60s")
    done = kubectl(up, "port-forward", "pod/done", ":8080")
    assert done.returncode == 1
    assert "unable to forward port because pod is not running. Current status=Succeeded" in done.stderr, done.stderr


def test_port_forward_over_plain_spdy_is_refused_saying_why(up: Up, web: str) -> None:
    done = subprocess.run(
        ["kubectl", "--kubeconfig", str(up.kubeconfig), "port-forward", f"pod/{web}", ":8080"],
        env={**os.environ, "KUBECTL_PORT_FORWARD_WEBSOCKETS": "false"},  # kubectl's SPDY upgrade, as before 1.31
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "error upgrading connection: this server tunnels port-forward over WebSockets" in done.stderr, done.stderr
