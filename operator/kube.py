"""The few Kubernetes API calls the operator makes besides Kopf's own, as plain dicts.

The `kubernetes` client is synchronous: handlers call these through `asyncio.to_thread` so one slow call
does not stall the other UserMemories. Responses are read raw (`_preload_content=False`) and parsed as
JSON, so objects stay dicts (the same shape Kopf hands to handlers) and no model class is involved.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from .settings import GROUP, LABEL_MEMORIES_SOURCE, PLURAL, VERSION
from .spec import SpecError


def api_client() -> client.ApiClient:
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except ConfigException:
        # The client reads $KUBECONFIG once, at import: pass it explicitly so the current value counts.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg)
    return client.ApiClient(cfg)


def _json(resp: Any) -> dict[str, Any]:
    return json.loads(resp.data or b"{}")


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)

    def read_key(self, namespace: str, kind: str, name: str, key: str) -> str:
        """The text under `key` of a ConfigMap or Secret that opted in (LABEL_MEMORIES_SOURCE); SpecError names what
        is missing or not opted in."""
        try:
            if kind == "ConfigMap":
                obj = _json(self.core.read_namespaced_config_map(name, namespace, _preload_content=False))
            else:
                obj = _json(self.core.read_namespaced_secret(name, namespace, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                raise SpecError("ReferenceNotFound", f"{kind} {namespace}/{name} not found") from None
            raise
        if ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_MEMORIES_SOURCE) != "true":
            raise SpecError("ReferenceNotOptedIn", f"{kind} {namespace}/{name} is not labelled "
                                                   f"{LABEL_MEMORIES_SOURCE}=true; only objects so labelled are read "
                                                   "as memoriesFrom")
        data = obj.get("data") or {}
        if key not in data:
            raise SpecError("ReferenceNotFound", f"{kind} {namespace}/{name} has no key {key!r}")
        if kind == "ConfigMap":
            return str(data[key])
        try:
            return base64.b64decode(data[key], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise SpecError("InvalidMemory", f"Secret {namespace}/{name} key {key!r} is not UTF-8 text") from None

    def create_configmap(self, body: dict[str, Any]) -> bool:
        return _create(self.core.create_namespaced_config_map, body)

    def read_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _read(lambda: self.core.read_namespaced_config_map(name, namespace, _preload_content=False))

    def list_configmaps(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        resp = self.core.list_namespaced_config_map(namespace, label_selector=label_selector, _preload_content=False)
        return list(_json(resp).get("items") or [])

    def patch_configmap(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        self.core.patch_namespaced_config_map(name, namespace, body, _preload_content=False,
                                              _content_type="application/merge-patch+json")

    def delete_configmap(self, namespace: str, name: str) -> None:
        _delete(lambda: self.core.delete_namespaced_config_map(name, namespace, _preload_content=False))

    def create_secret(self, body: dict[str, Any]) -> bool:
        return _create(self.core.create_namespaced_secret, body)

    def list_secret_names(self, namespace: str, label_selector: str) -> list[str]:
        """Names only: the operator never needs the data of the Secrets it lists."""
        resp = self.core.list_namespaced_secret(namespace, label_selector=label_selector, _preload_content=False)
        return [str((s.get("metadata") or {}).get("name")) for s in _json(resp).get("items") or []]

    def patch_secret(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        self.core.patch_namespaced_secret(name, namespace, body, _preload_content=False,
                                          _content_type="application/merge-patch+json")

    def delete_secret(self, namespace: str, name: str) -> None:
        _delete(lambda: self.core.delete_namespaced_secret(name, namespace, _preload_content=False))

    def create_job(self, body: dict[str, Any]) -> bool:
        return _create(self.batch.create_namespaced_job, body)

    def read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _read(lambda: self.batch.read_namespaced_job(name, namespace, _preload_content=False))

    def list_jobs(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        resp = self.batch.list_namespaced_job(namespace, label_selector=label_selector, _preload_content=False)
        return list(_json(resp).get("items") or [])

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        if namespace:
            resp = self.core.list_namespaced_pod(namespace, label_selector=label_selector, _preload_content=False)
        else:
            resp = self.core.list_pod_for_all_namespaces(label_selector=label_selector, _preload_content=False)
        return list(_json(resp).get("items") or [])

    def node_labels(self, name: str) -> dict[str, str] | None:
        """A node's labels; None when the node is gone."""
        try:
            node = _json(self.core.read_node(name, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return dict((node.get("metadata") or {}).get("labels") or {})

    def read_usermemory(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A UserMemory, or None when it is gone."""
        return _read(lambda: client.CustomObjectsApi(self.core.api_client).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, _preload_content=False))

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch a UserMemory's status now (Kopf's own `patch` lands only when the handler ends)."""
        client.CustomObjectsApi(self.core.api_client).patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}, _preload_content=False)


def connection_info(api: client.ApiClient) -> kopf.ConnectionInfo:
    """Kopf's credentials from the same client configuration the operator's own calls use.

    (Kopf's stock `login_via_client` re-reads the kubeconfig from the path fixed at import time.)
    """
    cfg = api.configuration
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        username=cfg.username or None, password=cfg.password or None, scheme=scheme, token=token,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
    )


def _read(call) -> dict[str, Any] | None:
    """The object, or None on 404."""
    try:
        return _json(call())
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _delete(call) -> None:
    """Delete; already gone (404) is done."""
    try:
        call()
    except ApiException as e:
        if e.status != 404:
            raise


def _create(create, body: dict[str, Any]) -> bool:
    """Create; False when it already exists (409 counts as success: names are content-derived)."""
    try:
        create(body["metadata"]["namespace"], body, _preload_content=False)
        return True
    except ApiException as e:
        if e.status == 409:
            return False
        raise
