"""Test-only stand-ins: a KMock Kubernetes emulator patched for kmock 0.8's gaps, and a serving pod.

Both run in background threads so the tests stay synchronous and the operator (KopfRunner) runs in its
own thread and event loop, as it does in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import http.server
import json
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import jsonpatch
from inferscale import uploadtoken
from inferscale.contract import is_valid_id
from inferscale.errors import UploadDenied, UploadRefused
import kmock
from kmock._internal import rendering

T = TypeVar("T")
TOKEN = "test-internal-token"  # the operator tests' INFERSCALE_INTERNAL_TOKEN (conftest.py)

RESOURCES: dict[str, kmock.ResourceInfo] = {
    "inferscale.io/v1alpha1/usermemories": kmock.ResourceInfo(
        kind="UserMemory", singular="usermemory", namespaced=True, shortnames={"um"}, subresources={"status"}),
    "batch/v1/jobs": kmock.ResourceInfo(kind="Job", singular="job", namespaced=True, subresources={"status"}),
    "v1/pods": kmock.ResourceInfo(kind="Pod", singular="pod", namespaced=True, subresources={"status"}),
    "v1/configmaps": kmock.ResourceInfo(kind="ConfigMap", singular="configmap", namespaced=True),
    "v1/secrets": kmock.ResourceInfo(kind="Secret", singular="secret", namespaced=True),
    "v1/events": kmock.ResourceInfo(kind="Event", singular="event", namespaced=True),
    "v1/nodes": kmock.ResourceInfo(kind="Node", singular="node", namespaced=False),
    # Discovery only: Kopf waits for both to exist before it starts any watcher (with -A, it never
    # lists namespaces, which kmock 0.8 would answer with a 500).
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", singular="namespace", namespaced=False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False),
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
# The API server's rule for a label value (apimachinery IsValidLabelValue), written out here independently of the
# operator's own so a test cannot agree with a wrong rule.
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _check_labels(meta: dict[str, Any]) -> None:
    for key, value in (meta.get("labels") or {}).items():
        if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
            raise kmock.KubernetesError(status=422, reason="Invalid",
                                        message=f"metadata.labels: Invalid value: {value!r} (label {key})")


def _merge_patch_between(old: Any, new: Any) -> Any:
    """An RFC 7386 merge patch that turns `old` into `new` (None deletes a key)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old:
            out[k] = copy.deepcopy(v)
        elif old[k] != v:
            out[k] = _merge_patch_between(old[k], v)
    return out


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors only (`a=b,c!=d,e`): all the operator uses."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.strip().rstrip("=")) != v.strip():
                return False
        elif term.strip() not in labels:
            return False
    return True


class Emulator(kmock.KubernetesEmulator):
    """KMock's emulator with what a real API server does and kmock 0.8 does not.

    - metadata.uid / resourceVersion / generation / creationTimestamp set on create, bumped on patch
      (Kopf's finalizer JSON-patch starts with a `test` op on resourceVersion);
    - JSON patches (application/json-patch+json) applied, with `test` failures answered 422;
    - label selectors honoured on lists;
    - label values checked on create and patch (422 when invalid).
    """

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv = 0
        for res, info in RESOURCES.items():
            info.verbs = set(VERBS)
            self.resources[res] = info

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    async def _handle(self, request: rendering.Request) -> Any:
        if request.resource is not None:
            try:
                self._stamp(request)
            except kmock.KubernetesError as e:
                return await self._render_error(e)
        return await super()._handle(request)

    def _stamp(self, request: rendering.Request) -> None:
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):  # e.g. Kopf's Events
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
            if request.namespace and not meta.get("namespace"):
                meta["namespace"] = request.namespace
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = self._next_rv()
            meta["generation"] = 1
            meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            _check_labels(meta)
        elif request.action == kmock.action.UPDATE and request.name is not None:
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                return  # the parent answers 404
            current = copy.deepcopy(self.objects[key].raw)
            data = request.data
            if isinstance(data, list):  # JSON patch
                try:
                    wanted = jsonpatch.apply_patch(current, data)
                except jsonpatch.JsonPatchTestFailed as e:
                    raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from None
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                    raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from None
                data = _merge_patch_between(current, wanted)
            if not isinstance(data, dict):
                return
            if request.subresource == "status":
                data = {"status": data.get("status")}  # the status subresource changes status only
            meta = data.setdefault("metadata", {}) or {}
            data["metadata"] = meta
            _check_labels(meta)
            meta["resourceVersion"] = self._next_rv()
            if "spec" in data and request.subresource != "status":
                gen = int((current.get("metadata") or {}).get("generation") or 1)
                meta["generation"] = gen + 1
            # Request is frozen (attrs); the parent applies `request.data`, so swap it in place.
            object.__setattr__(request, "data", data)

    async def _serve_watch(self, request: rendering.Request) -> Any:
        # kmock 0.8 subscribes to its event bus only after streaming the current objects, so a change
        # in between is lost and Kopf waits forever for it. Subscribe under the lock, then stream.
        # Also, like a real API server, a watch from a list's resourceVersion N streams only what
        # changed after N (kmock replays everything, and Kopf then acts on stale duplicates).
        yield b""
        assert request.resource is not None
        since = int((request.params or {}).get("resourceVersion") or 0)
        async with self._lock:
            objs = [o for o in self._KubernetesEmulator__get_objs(request, strict=False) if not o.deleted]
            events = [{"type": "ADDED" if not since else "MODIFIED", "object": o.raw} for o in objs
                      if int((o.raw.get("metadata") or {}).get("resourceVersion") or 0) > since]
            bus = self._buses[request.resource]
            marker = await bus.mark()
        try:
            for event in events:
                yield event
            async for event in bus.stream(since=marker):
                meta = event.get("object", {}).get("metadata", {})
                if self._KubernetesEmulator__check(request, request.resource, meta.get("namespace"),
                                                   meta.get("name"), strict=False):
                    yield event
        finally:
            await bus.unmark(marker)

    async def _serve_list(self, request: rendering.Request) -> Any:
        result = await super()._serve_list(request)
        selector = (request.params or {}).get("labelSelector")
        if selector and isinstance(result, dict):
            result["items"] = [o for o in result["items"]
                               if _selector_matches(selector, (o.get("metadata") or {}).get("labels") or {})]
        result["metadata"] = {"resourceVersion": str(self._rv)}
        return result


class EmulatorThread:
    """Runs the emulator + its HTTP server on an event loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="kmock")
        self._stack = contextlib.AsyncExitStack()
        self.emulator: Emulator
        self.url = ""

    def start(self) -> EmulatorThread:
        self._thread.start()

        async def enter() -> str:
            self.emulator = await self._stack.enter_async_context(Emulator())
            server = await self._stack.enter_async_context(kmock.Server(self.emulator))
            return str(server.url).rstrip("/")

        self.url = self.run(enter())
        return self

    def run(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the emulator's loop (its object store is not thread-safe)."""
        async def wrapper() -> T:
            return fn()
        return self.run(wrapper())

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self._stack.aclose(), timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class ServingPodStandIn:
    """TEST STAND-IN for a serving pod's internal API (docs/interfaces.md), on loopback. A Job's delivery
    (`/internal/v1/ingest/{tenant}/{user}`) is checked with the real upload credential rule (uploadtoken.verify)
    and its body names the item ids it delivers (`deliver`), not blobs.

    Keeps {(tenant, user): {item ids}} and records every call, so tests can assert pulls and purges.
    `fail_purges` / `fail_pulls` make the next N such calls answer 500.
    """

    def __init__(self, node: str, pod: str, capacity: int = 10**9, used: int = 0, token: str = TOKEN) -> None:
        self.node, self.pod, self.capacity, self.used = node, pod, capacity, used
        self.store: dict[tuple[str, str], set[str]] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.auth: list[str | None] = []
        self.fail_purges = 0
        self.fail_pulls = 0
        self.peers: list[str] = []  # what the operator published (PUT /internal/v1/peers)
        self.token = token  # the internal token: an upload credential is checked under its derived key
        self._lock = threading.Lock()
        standin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, body: Any) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _ingest(self, body: dict[str, Any]) -> None:
                tenant, user = self.path.split("/")[4:6]
                bearer = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                try:
                    uploadtoken.verify(uploadtoken.upload_key(standin.token), bearer, tenant, user)
                except (UploadRefused, UploadDenied) as e:
                    standin.calls.append(("ingest-refused", {"tenant": tenant, "user": user, "why": str(e)}))
                    return self._reply(403 if isinstance(e, UploadDenied) else 401, {"detail": str(e)})
                standin.calls.append(("ingest", {"tenant": tenant, "user": user, "items": body["items"]}))
                held = standin.store.setdefault((tenant, user), set())
                held.update(body["items"])
                self._reply(200, {"tenant": tenant, "user": user, "blocks": len(held), "bytes": len(held) * 1000,
                                  "tokens": len(held) * 10, "tier": "dram"})

            def do_GET(self) -> None:
                if self.path != "/internal/v1/capacity":
                    return self._reply(404, {"detail": "not found"})
                with standin._lock:
                    standin.calls.append(("capacity", {}))
                    users = len(standin.store)
                self._reply(200, {"node": standin.node, "pod": standin.pod, "bytes_used": standin.used,
                                  "bytes_capacity": standin.capacity, "users": users})

            def do_PUT(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path != "/internal/v1/peers":
                    return self._reply(404, {"detail": "not found"})
                with standin._lock:
                    standin.auth.append(self.headers.get("Authorization"))
                    standin.calls.append(("peers", body))
                    standin.peers = list(body.get("peers") or [])
                self._reply(200, {"peers": standin.peers})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with standin._lock:
                    standin.auth.append(self.headers.get("Authorization"))
                    if self.path.startswith("/internal/v1/ingest/"):  # a Job's delivery: its credential only
                        return self._ingest(body)
                    if not is_valid_id(body.get("user")):  # as the real server: the store refuses such an id
                        standin.calls.append(("refused", body))
                        return self._reply(400, {"detail": f"invalid user id {body.get('user')!r}"})
                    if self.path == "/internal/v1/pull":
                        standin.calls.append(("pull", body))
                        if standin.fail_pulls > 0:
                            standin.fail_pulls -= 1
                            return self._reply(500, {"detail": "injected pull failure"})
                        held = standin.store.setdefault((body["tenant"], body["user"]), set())
                        held.update(body.get("items") or [])
                        n = len(held)
                        return self._reply(200, {"tenant": body["tenant"], "user": body["user"], "blocks": n,
                                                 "bytes": n * 1000, "tokens": n * 10, "tier": "dram"})
                    if self.path == "/internal/v1/purge":
                        standin.calls.append(("purge", body))
                        if standin.fail_purges > 0:
                            standin.fail_purges -= 1
                            return self._reply(500, {"detail": "injected purge failure"})
                        key = (body["tenant"], body["user"])
                        held = standin.store.get(key, set())
                        gone = set(held) if body.get("items") is None else held & set(body["items"])
                        held -= gone
                        if not held:
                            standin.store.pop(key, None)
                        return self._reply(200, {"removed_blocks": len(gone), "removed_bytes": len(gone) * 1000})
                self._reply(404, {"detail": "not found"})

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name=f"pod-{pod}")
        self._thread.start()

    def calls_of(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [body for k, body in self.calls if k == kind]

    def held(self, tenant: str, user: str) -> set[str]:
        with self._lock:
            return set(self.store.get((tenant, user), set()))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def deliver(job: dict[str, Any], credential: str) -> httpx.Response:
    """What an encode Job's `--deliver` step does, for the stand-in: POST its `--only` ids to its `--deliver` URL."""
    cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    url, ids = cmd[cmd.index("--deliver") + 1], cmd[cmd.index("--only") + 1].split(",")
    return httpx.post(url, json={"items": ids}, headers={"Authorization": f"Bearer {credential}"}, timeout=10)


@contextlib.contextmanager
def serving_pods(n: int, **kw: Any) -> Iterator[list[ServingPodStandIn]]:
    pods = [ServingPodStandIn(node=f"node-{i}", pod=f"inferscale-server-{i}", **kw) for i in range(n)]
    try:
        yield pods
    finally:
        for p in pods:
            p.close()
