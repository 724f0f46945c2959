"""Requests served, counted as kube-apiserver's `apiserver_request_total` (verb, group, resource,
subresource) and served in the Prometheus text format at `/metrics`: how many API round trips a
workload costs (`bench/cluster_bench.py` reads it per pod)."""

from __future__ import annotations

import collections

Key = tuple[str, str, str, str]  # (verb, group, resource, subresource)


def verb_of(method: str, named: bool, watch: bool) -> str:
    """The upstream verb of a resource request: GET/LIST/WATCH, CREATE, UPDATE, PATCH, DELETE(COLLECTION)."""
    if method == "GET":
        return "WATCH" if watch else "GET" if named else "LIST"
    if method == "POST":
        return "CREATE"
    if method == "PUT":
        return "UPDATE"
    if method == "DELETE":
        return "DELETE" if named else "DELETECOLLECTION"
    return method


class RequestCounter:
    def __init__(self) -> None:
        self.counts: collections.Counter[Key] = collections.Counter()

    def add(self, verb: str, group: str, resource: str, subresource: str) -> None:
        self.counts[(verb, group, resource, subresource)] += 1

    def exposition(self) -> str:
        lines = [
            "# HELP apiserver_request_total Resource requests served, by verb, group, resource and subresource.",
            "# TYPE apiserver_request_total counter",
        ]
        for (verb, group, resource, sub), n in sorted(self.counts.items()):
            lines.append(
                f'apiserver_request_total{{verb="{verb}",group="{group}",resource="{resource}",'
                f'subresource="{sub}"}} {n}'
            )
        return "\n".join(lines) + "\n"
