"""Deployment, ReplicaSet and Job controllers against the embedded API server, over HTTP.

Every wait watches: a test-side informer per resource re-evaluates a probe on each event, bounded
by asyncio.wait_for. Pods are never bound here (no scheduler), so deletions are immediate; where a
test needs pods Ready or finished it writes their status through /status, as a kubelet would.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from embedded.apiserver.testing import RunningApiServer, running_apiserver
from embedded.controllers.replicasets import is_active, now_iso
from embedded.controllers.runner import Controllers
from shared.kube.informer import Informer, uid_of
from shared.kube.resources import DEPLOYMENTS, JOBS, PODS, REPLICASETS, Kube, Resource
from shared.kube.rest import ApiError

ROOT = Path(__file__).resolve().parents[2]
NS = "default"
CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap")
Obj = dict[str, Any]


class Watcher:
    """Test-side informers; `until(probe)` returns probe()'s first truthy value, re-checked on every event."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._subscribers: list[asyncio.Event] = []
        self.informers = {
            res.plural: Informer(kube, res, self._changed) for res in (PODS, REPLICASETS, DEPLOYMENTS, JOBS)
        }

    def _changed(self, event: str, obj: Obj, old: Obj | None) -> None:
        for ev in self._subscribers:
            ev.set()

    def subscribe(self) -> asyncio.Event:
        ev = asyncio.Event()
        self._subscribers.append(ev)
        return ev

    def items(self, res: Any) -> list[Obj]:
        return self.informers[res.plural].values(NS)

    def get(self, res: Any, name: str) -> Obj | None:
        return self.informers[res.plural].get(NS, name)

    def owned(self, res: Any, owner: Obj | None) -> list[Obj]:
        return [] if owner is None else self.informers[res.plural].owned_by(uid_of(owner))

    async def until(self, probe: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
        changed = self.subscribe()

        async def loop() -> Any:
            while True:
                changed.clear()
                value = probe()
                if value:
                    return value
                await changed.wait()

        try:
            return await asyncio.wait_for(loop(), timeout)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None
        finally:
            self._subscribers.remove(changed)


class Env:
    def __init__(self, api: RunningApiServer, kube: Kube, controllers: Controllers, watch: Watcher) -> None:
        self.api, self.kube, self.controllers, self.watch = api, kube, controllers, watch

    async def set_pod_status(self, pod: Obj, phase: str, ready: bool = False) -> None:
        """Write a pod's status as a kubelet would (re-reading on a conflict)."""
        for _ in range(5):
            status = {
                "phase": phase,
                "conditions": [
                    {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now_iso()}
                ],
            }
            try:
                await self.kube.replace(PODS, {**pod, "status": status}, subresource="status")
                return
            except ApiError as exc:
                if not exc.conflict:
                    raise
                pod = await self.kube.get(PODS, NS, pod["metadata"]["name"])
        raise AssertionError("pod status kept conflicting")

    def active_pods(self, owner: Obj | None) -> list[Obj]:
        return [p for p in self.watch.owned(PODS, owner) if is_active(p)]

    def replicasets_of(self, name: str) -> list[Obj]:
        return self.watch.owned(REPLICASETS, self.watch.get(DEPLOYMENTS, name))

    @contextlib.asynccontextmanager
    async def kubelet(self) -> AsyncIterator[None]:
        """Every pending pod becomes Running and Ready, as soon as it shows up."""
        changed, seen = self.watch.subscribe(), set()

        async def loop() -> None:
            while True:
                changed.clear()
                for pod in self.watch.items(PODS):
                    if uid_of(pod) not in seen and is_active(pod):
                        seen.add(uid_of(pod))
                        await self.set_pod_status(pod, "Running", ready=True)
                await changed.wait()

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with running_apiserver(tmp_path) as api, api.client() as client:
        kube = Kube(client)
        watch = Watcher(kube)
        controllers = Controllers(client, resync_seconds=30.0)
        stopping = asyncio.Event()
        tasks = [asyncio.create_task(i.run(stopping)) for i in watch.informers.values()]
        tasks.append(asyncio.create_task(controllers.run(stopping)))
        try:
            await asyncio.wait_for(controllers.ready.wait(), 10)
            for inf in watch.informers.values():
                await asyncio.wait_for(inf.synced.wait(), 10)
            yield Env(api, kube, controllers, watch)
        finally:
            stopping.set()
            for task in tasks[:-1]:
                task.cancel()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)


def deployment(name: str, replicas: int = 2, image: str = "busybox:1", **spec: Any) -> Obj:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            **spec,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [{"name": "ctr", "image": image, "resources": {"claims": [{"name": "gpu"}]}}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "single-gpu"}],
                },
            },
        },
    }


def job(name: str, completions: int = 1, parallelism: int = 1, backoff: int = 6) -> Obj:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "completions": completions,
            "parallelism": parallelism,
            "backoffLimit": backoff,
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"restartPolicy": "Never", "containers": [{"name": "ctr", "image": "busybox:1"}]},
            },
        },
    }


def controller_ref(obj: Obj) -> Obj:
    [ref] = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")]
    return dict(ref)


def condition(obj: Obj | None, kind: str) -> Obj:
    """The status condition of `kind`; {} (falsy) when `obj` has none."""
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


async def test_deployment_makes_a_replicaset_and_pods_and_scales(env: Env) -> None:
    created = await env.kube.create(DEPLOYMENTS, NS, deployment("web", replicas=2))
    [rs] = await env.watch.until(
        lambda: len(env.active_pods(rs := next(iter(env.replicasets_of("web")), None))) == 2 and [rs],
        "an RS with 2 pods",
    )
    h = rs["metadata"]["labels"]["pod-template-hash"]
    assert rs["metadata"]["name"] == f"web-{h}"
    assert rs["spec"]["selector"]["matchLabels"] == {"app": "web", "pod-template-hash": h}
    ref = controller_ref(rs)
    assert (ref["kind"], ref["name"], ref["uid"], ref["blockOwnerDeletion"]) == (
        "Deployment",
        "web",
        created["metadata"]["uid"],
        True,
    )
    for pod in env.active_pods(rs):
        assert re.fullmatch(rf"web-{h}-[a-z0-9]{{5}}", pod["metadata"]["name"]), pod["metadata"]["name"]
        assert pod["metadata"]["labels"] == {"app": "web", "pod-template-hash": h}
        ref = controller_ref(pod)
        assert (ref["kind"], ref["name"], ref["uid"], ref["blockOwnerDeletion"]) == (
            "ReplicaSet",
            rs["metadata"]["name"],
            rs["metadata"]["uid"],
            True,
        )
        assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "single-gpu"}]

    def status(replicas: int) -> Any:
        d = env.watch.get(DEPLOYMENTS, "web") or {}
        s = d.get("status") or {}
        return (
            s.get("replicas") == replicas
            and s.get("updatedReplicas") == replicas
            and s.get("observedGeneration") == d["metadata"]["generation"]
        ) and d

    d = await env.watch.until(lambda: status(2), "deployment status replicas=2")
    assert condition(d, "Available")["status"] == "False"  # nothing runs the pods here
    assert condition(d, "Progressing")["reason"] == "ReplicaSetUpdated"
    for n in (3, 1):
        await env.kube.patch(DEPLOYMENTS, NS, "web", {"spec": {"replicas": n}})
        await env.watch.until(lambda: len(env.active_pods(rs)) == n and status(n), f"{n} pods")  # noqa: B023 - awaited here
        assert (env.watch.get(REPLICASETS, rs["metadata"]["name"]) or {})["spec"]["replicas"] == n
    assert len(env.replicasets_of("web")) == 1


async def test_deleted_pod_is_replaced(env: Env) -> None:
    await env.kube.create(DEPLOYMENTS, NS, deployment("web", replicas=2))
    rs = await env.watch.until(
        lambda: next((r for r in env.replicasets_of("web") if len(env.active_pods(r)) == 2), None), "2 pods"
    )
    victim = env.active_pods(rs)[0]
    await env.kube.delete(PODS, NS, victim["metadata"]["name"])
    pods = await env.watch.until(
        lambda: len(ps := env.active_pods(rs)) == 2 and uid_of(victim) not in {uid_of(p) for p in ps} and ps,
        "a replacement pod",
    )
    assert all(p["metadata"]["name"].startswith(rs["metadata"]["name"] + "-") for p in pods)


async def test_template_change_rolls_out_a_new_replicaset(env: Env) -> None:
    async with env.kubelet():
        await env.kube.create(DEPLOYMENTS, NS, deployment("web", replicas=2))
        d = await env.watch.until(
            lambda: (
                (d := env.watch.get(DEPLOYMENTS, "web")) and (d.get("status") or {}).get("availableReplicas") == 2 and d
            ),
            "2 available replicas",
        )
        assert condition(d, "Available")["status"] == "True"
        [old] = env.replicasets_of("web")
        await env.kube.patch(
            DEPLOYMENTS,
            NS,
            "web",
            {
                "spec": {
                    "template": {
                        "spec": {
                            "containers": [
                                {"name": "ctr", "image": "busybox:2", "resources": {"claims": [{"name": "gpu"}]}}
                            ]
                        }
                    }
                }
            },
        )

        def rolled() -> Any:
            d = env.watch.get(DEPLOYMENTS, "web") or {}
            s, rss = d.get("status") or {}, env.replicasets_of("web")
            new = [r for r in rss if r["metadata"]["uid"] != old["metadata"]["uid"]]
            old_now = env.watch.get(REPLICASETS, old["metadata"]["name"]) or {}
            return (
                len(new) == 1
                and len(env.active_pods(new[0])) == 2
                and not env.active_pods(old)
                and old_now["spec"]["replicas"] == 0
                and s.get("updatedReplicas") == 2
                and s.get("availableReplicas") == 2
                and condition(d, "Progressing").get("reason") == "NewReplicaSetAvailable"
            ) and (d, new[0])

        d, new = await env.watch.until(rolled, "the rollout to a new ReplicaSet")
    assert new["metadata"]["labels"]["pod-template-hash"] != old["metadata"]["labels"]["pod-template-hash"]
    assert new["spec"]["template"]["spec"]["containers"][0]["image"] == "busybox:2"
    assert new["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "2"
    assert all(p["spec"]["containers"][0]["image"] == "busybox:2" for p in env.active_pods(new))


async def test_recreate_scales_the_old_replicaset_to_zero_first(env: Env) -> None:
    await env.kube.create(DEPLOYMENTS, NS, deployment("db", replicas=2, strategy={"type": "Recreate"}))
    old = await env.watch.until(
        lambda: next(
            (r for r in env.watch.owned(REPLICASETS, env.watch.get(DEPLOYMENTS, "db")) if len(env.active_pods(r)) == 2),
            None,
        ),
        "2 pods",
    )
    await env.kube.patch(DEPLOYMENTS, NS, "db", {"spec": {"template": {"metadata": {"labels": {"v": "2"}}}}})

    def rolled() -> Any:
        rss = env.watch.owned(REPLICASETS, env.watch.get(DEPLOYMENTS, "db"))
        new = [r for r in rss if uid_of(r) != uid_of(old)]
        return (
            len(new) == 1
            and len(env.active_pods(new[0])) == 2
            and not env.active_pods(old)
            and (env.watch.get(REPLICASETS, old["metadata"]["name"]) or {})["spec"]["replicas"] == 0
        ) and new[0]

    new = await env.watch.until(rolled, "the Recreate rollout")
    assert all(p["metadata"]["labels"]["v"] == "2" for p in env.active_pods(new))


async def test_deleting_the_deployment_collects_replicasets_and_pods(env: Env) -> None:
    await env.kube.create(DEPLOYMENTS, NS, deployment("web", replicas=2))
    await env.watch.until(lambda: len(env.watch.items(PODS)) == 2, "2 pods")
    await env.kube.delete(DEPLOYMENTS, NS, "web")
    await env.watch.until(
        lambda: not env.watch.items(DEPLOYMENTS) and not env.watch.items(REPLICASETS) and not env.watch.items(PODS),
        "everything gone",
    )


async def test_job_runs_pods_until_completions(env: Env) -> None:
    created = await env.kube.create(JOBS, NS, job("train", completions=2, parallelism=1))
    seen: list[str] = []
    for n in (1, 2):
        [pod] = await env.watch.until(
            lambda: [p for p in env.active_pods(env.watch.get(JOBS, "train")) if uid_of(p) not in seen],
            f"pod {n} of the job",
        )
        seen.append(uid_of(pod))
        labels, uid = pod["metadata"]["labels"], created["metadata"]["uid"]
        assert labels == {
            "app": "train",
            "batch.kubernetes.io/job-name": "train",
            "job-name": "train",
            "batch.kubernetes.io/controller-uid": uid,
            "controller-uid": uid,
        }
        assert re.fullmatch(r"train-[a-z0-9]{5}", pod["metadata"]["name"])
        assert controller_ref(pod)["uid"] == uid and controller_ref(pod)["kind"] == "Job"
        assert len(env.active_pods(env.watch.get(JOBS, "train"))) == 1  # parallelism 1
        await env.set_pod_status(pod, "Succeeded")
    done = await env.watch.until(
        lambda: (j := env.watch.get(JOBS, "train")) and condition(j, "Complete") and j, "the Job Complete"
    )
    status = done["status"]
    assert status["succeeded"] == 2 and not status.get("active") and not status.get("failed")
    assert status["completionTime"] >= status["startTime"]
    assert condition(done, "Complete")["status"] == "True"
    assert condition(done, "SuccessCriteriaMet")["status"] == "True"
    assert len(env.watch.owned(PODS, done)) == 2


async def test_job_past_its_backoff_limit_fails(env: Env) -> None:
    await env.kube.create(JOBS, NS, job("flaky", backoff=0))
    [pod] = await env.watch.until(lambda: env.active_pods(env.watch.get(JOBS, "flaky")), "the job's pod")
    await env.set_pod_status(pod, "Failed")
    failed = await env.watch.until(
        lambda: (j := env.watch.get(JOBS, "flaky")) and condition(j, "Failed") and j, "the Job Failed"
    )
    assert condition(failed, "Failed")["reason"] == "BackoffLimitExceeded"
    assert failed["status"]["failed"] == 1 and not failed["status"].get("active")
    assert not condition(failed, "Complete")
    assert [uid_of(p) for p in env.watch.owned(PODS, failed)] == [uid_of(pod)]  # no replacement


async def test_pods_owned_by_others_are_neither_adopted_nor_deleted(env: Env) -> None:
    # A pod whose owner does not exist would be collected by the API server: own it by a ConfigMap.
    owner = await env.kube.create(
        CONFIGMAPS, NS, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "other", "namespace": NS}}
    )
    stranger_ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "other",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    strangers = []
    for name, refs in (("owned-elsewhere", [stranger_ref]), ("orphan", [])):
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": "web"}, "ownerReferences": refs},
            "spec": {"containers": [{"name": "ctr", "image": "busybox:1"}]},
        }
        strangers.append(await env.kube.create(PODS, NS, body))
    await env.kube.create(DEPLOYMENTS, NS, deployment("web", replicas=1))
    rs = await env.watch.until(
        lambda: next(
            (
                r
                for r in env.replicasets_of("web")
                if (r.get("status") or {}).get("replicas") == 1 and len(env.active_pods(r)) == 1
            ),
            None,
        ),
        "1 pod of our own",
    )
    await env.kube.patch(DEPLOYMENTS, NS, "web", {"spec": {"replicas": 0}})
    await env.watch.until(
        lambda: (
            not env.active_pods(rs)
            and (env.watch.get(REPLICASETS, rs["metadata"]["name"]) or {}).get("status", {}).get("replicas") == 0
        ),
        "our pod gone",
    )
    for pod in strangers:
        now = await env.kube.get(PODS, NS, pod["metadata"]["name"])
        assert now["metadata"]["uid"] == pod["metadata"]["uid"]
        assert now["metadata"].get("ownerReferences") == pod["metadata"].get("ownerReferences")
        assert not now["metadata"].get("deletionTimestamp")


def test_informer_cache_relists_and_keeps_deleted_objects_deleting() -> None:
    seen: list[tuple[str, str]] = []
    inf = Informer(cast(Kube, None), PODS, lambda event, obj, old: seen.append((event, obj["metadata"]["name"])))

    def pod(name: str, rv: int, owner: str = "", uid: str = "") -> Obj:
        refs = [{"kind": "ReplicaSet", "name": owner, "uid": owner, "controller": True}] if owner else []
        return {
            "metadata": {
                "name": name,
                "namespace": NS,
                "uid": uid or f"uid-{name}",
                "resourceVersion": str(rv),
                "ownerReferences": refs,
            }
        }

    inf.replace_all([pod("a", 1, "rs1"), pod("b", 2)])
    assert seen == [("ADDED", "a"), ("ADDED", "b")] and [p["metadata"]["name"] for p in inf.owned_by("rs1")] == ["a"]
    inf.apply(pod("a", 3, "rs1"))
    inf.apply(pod("a", 2, "rs1"))  # older than the cache: ignored
    assert seen[2:] == [("MODIFIED", "a")] and (inf.get(NS, "a") or {})["metadata"]["resourceVersion"] == "3"
    inf.mark_deleted(inf.get(NS, "a") or {})
    inf.apply(pod("a", 4, "rs1"))  # a lagging event of the deleted pod: still deleting
    assert (inf.get(NS, "a") or {})["metadata"]["deletionTimestamp"] and not is_active(inf.get(NS, "a") or {})
    inf.apply(pod("a", 5, "rs1"), "DELETED")
    assert inf.get(NS, "a") is None and inf.owned_by("rs1") == [] and seen[-1] == ("DELETED", "a")
    del seen[:]
    inf.replace_all([pod("b", 2), pod("c", 6, "rs2")])  # a re-list: only the differences are news
    assert seen == [("ADDED", "c")]
    inf.replace_all([pod("c", 7, "rs2")])
    assert seen[1:] == [("DELETED", "b"), ("MODIFIED", "c")] and len(inf.owned_by("rs2")) == 1


async def test_controllers_command_runs_until_sigterm(tmp_path: Path) -> None:
    async with running_apiserver(tmp_path) as api, api.client() as client:
        kube = Kube(client)
        watch = Watcher(kube)
        stopping = asyncio.Event()
        task = asyncio.create_task(watch.informers[PODS.plural].run(stopping))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "shared.cli",
            "controllers",
            "--kubeconfig",
            str(api.kubeconfig_path),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            await kube.create(DEPLOYMENTS, NS, deployment("web", replicas=1))
            await watch.until(lambda: watch.items(PODS), "a pod made by the controllers process", timeout=20)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(proc.communicate(), 20)
            stopping.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert proc.returncode == 0, out.decode()
        assert b"controllers synced" in out


async def test_controllers_command_rejects_unknown_flags() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        "controllers",
        "--bogus",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert b"unrecognized arguments: --bogus" in err
