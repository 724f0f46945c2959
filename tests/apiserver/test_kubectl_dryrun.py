"""`--dry-run=server` with the real kubectl, every verb that writes: the answer says what would happen and
nothing is stored (the store's resourceVersion does not move)."""

from __future__ import annotations

from embedded.apiserver.testing import RunningApiServer
from tests.apiserver.conftest import Kubectl

CONFIGMAP = """\
apiVersion: v1
kind: ConfigMap
metadata: {name: settings, namespace: default, labels: {tier: one}}
data: {mode: "1"}
"""
DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: default}
spec:
  replicas: 1
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: c, image: busybox}]}
"""


async def test_no_verb_writes_anything_on_a_server_dry_run(kubectl: Kubectl, api: RunningApiServer) -> None:
    await kubectl("apply", "-f", "-", stdin=CONFIGMAP)
    await kubectl("apply", "-f", "-", stdin=DEPLOYMENT)
    await kubectl("create", "namespace", "team")
    store = api.server.store
    before = store.rv
    dry = "--dry-run=server"
    verbs = [
        ("delete", "configmap", "settings", dry),
        ("delete", "configmaps", "--all", dry),
        ("delete", "namespace", "team", dry),
        ("create", "configmap", "other", "--from-literal=a=b", dry),
        ("label", "configmap", "settings", "tier=two", "--overwrite", dry),
        ("annotate", "configmap", "settings", "note=x", dry),
        ("patch", "configmap", "settings", "-p", '{"data":{"mode":"2"}}', dry),
        ("scale", "deployment", "web", "--replicas=3", dry),
        ("set", "image", "deployment/web", "c=busybox:2", dry),
        ("create", "serviceaccount", "robot", dry),
    ]
    for args in verbs:
        _, out, _ = await kubectl(*args)
        assert "(server dry run)" in out or args[0] == "patch", (args, out)  # kubectl patch does not say it
        assert store.rv == before, f"kubectl {' '.join(args)} wrote to the store"
    changed = CONFIGMAP.replace('mode: "1"', 'mode: "3"')
    for args in (("apply", "-f", "-", dry), ("apply", "--server-side", "-f", "-", dry), ("replace", "-f", "-", dry)):
        _, out, _ = await kubectl(*args, stdin=changed)
        assert "(server dry run)" in out, (args, out)
        assert store.rv == before, f"kubectl {' '.join(args)} wrote to the store"
    _, out, _ = await kubectl("get", "configmap", "settings", "-o", "jsonpath={.data.mode} {.metadata.labels.tier}")
    assert out == "1 one"
    _, out, _ = await kubectl("get", "namespace", "team", "-o", "jsonpath={.status.phase}")
    assert out == "Active"
