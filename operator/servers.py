"""Serving pods: finding them (label selector) and calling their internal API (docs/interfaces.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from .settings import ANNOTATION_ENDPOINT, Settings


@dataclasses.dataclass(frozen=True)
class ServingPod:
    name: str
    namespace: str
    node: str
    endpoint: str
    peer: str | None  # host:port of its NIXL control port: podIP + INFERSCALE_NIXL_PORT (None without a podIP)
    uid: str = ""  # a pod recreated under the same name holds nothing: compare uids, not just names

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any], port: int, require_ready: bool = True,
                 nixl_port: int = 5555, scheme: str = "http") -> ServingPod | None:
        """The pod as a placement target, or None when it cannot serve (not Running/Ready, deleting).

        `require_ready=False` is for purging: a Running pod that fails readiness may still hold blocks.
        """
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("phase") != "Running":
            return None
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        annotations = meta.get("annotations") or {}
        endpoint = annotations.get(ANNOTATION_ENDPOINT)
        if not endpoint and status.get("podIP"):
            endpoint = f"{scheme}://{status['podIP']}:{port}"
        if (require_ready and not ready) or not endpoint or not spec.get("nodeName"):
            return None
        # The peer address is the operator's to publish, from the pod's status (set by the kubelet), never an
        # annotation a human (or anyone who can edit the pod) sets.
        ip = status.get("podIP")
        peer = (f"[{ip}]:{nixl_port}" if ":" in ip else f"{ip}:{nixl_port}") if ip else None
        return cls(name=meta["name"], namespace=meta.get("namespace", ""), node=spec["nodeName"],
                   endpoint=endpoint.rstrip("/"), peer=peer,
                   uid=str(meta.get("uid") or ""))


def serving_pods(pods: Sequence[Mapping[str, Any]], port: int, require_ready: bool = True,
                 nixl_port: int = 5555, scheme: str = "http") -> list[ServingPod]:
    found = (ServingPod.from_pod(p, port, require_ready, nixl_port, scheme) for p in pods)
    return sorted((p for p in found if p is not None), key=lambda p: (p.node, p.name))


class ServerCallError(Exception):
    def __init__(self, pod: ServingPod, message: str) -> None:
        super().__init__(f"serving pod {pod.namespace}/{pod.name}: {message}")
        self.pod = pod


class ServerClient:
    """One AsyncClient per handler call: cheap, and nothing to close at operator shutdown.

    With TLS (settings.tls) every call is HTTPS, the server's certificate checked against the CA for the fleet's
    server name (sent as SNI; the URL holds the pod IP), and an endpoint that is not https is refused before
    anything is sent: the internal token never travels in clear."""

    def __init__(self, settings: Settings) -> None:
        headers = {"Authorization": f"Bearer {settings.internal_token}"} if settings.internal_token else {}
        self._tls = settings.tls
        verify = True if self._tls is None else self._tls.client_context()
        self._extensions = {} if self._tls is None else {"sni_hostname": self._tls.server_name}
        self._client = httpx.AsyncClient(headers=headers, timeout=settings.http_timeout_seconds, verify=verify)

    async def __aenter__(self) -> ServerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def _call(self, pod: ServingPod, method: str, path: str, body: Any = None) -> dict[str, Any]:
        if self._tls is not None and not pod.endpoint.startswith("https://"):
            raise ServerCallError(pod, f"{method} {path}: endpoint {pod.endpoint} is not https, and TLS is on "
                                       "(INFERSCALE_TLS_CA_FILE): not sending the internal token in clear")
        try:
            resp = await self._client.request(method, pod.endpoint + path, json=body, extensions=self._extensions)
        except httpx.HTTPError as e:
            raise ServerCallError(pod, f"{method} {path}: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise ServerCallError(pod, f"{method} {path}: HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            data = resp.json()
        except ValueError:
            raise ServerCallError(pod, f"{method} {path}: response is not JSON") from None
        if not isinstance(data, dict):
            raise ServerCallError(pod, f"{method} {path}: response is not a JSON object")
        return data

    async def capacity(self, pod: ServingPod) -> dict[str, Any]:
        return await self._call(pod, "GET", "/internal/v1/capacity")

    async def pull(self, pod: ServingPod, tenant: str, user: str, source: Mapping[str, Any],
                   items: list[str] | None) -> dict[str, Any]:
        body = {"tenant": tenant, "user": user, "source": dict(source), "items": items}
        return await self._call(pod, "POST", "/internal/v1/pull", body)

    async def purge(self, pod: ServingPod, tenant: str, user: str, items: list[str] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"tenant": tenant, "user": user, "items": items}
        return await self._call(pod, "POST", "/internal/v1/purge", body)

    async def set_peers(self, pod: ServingPod, peers: list[str]) -> dict[str, Any]:
        """Tell the pod which other serving pods to ask, in turn, for a user it lacks (inferscale/store/fleet.py)."""
        return await self._call(pod, "PUT", "/internal/v1/peers", {"peers": peers})
