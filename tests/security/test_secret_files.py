"""Issue 24 #8/#9: credentials read from mounted files, and a KEK (or token) file others can read refused at start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inferscale.errors import ConfigError
from inferscale.operator.settings import Settings as OperatorSettings
from inferscale.sealing import new_key_line
from inferscale.server.app import open_store
from inferscale.server.settings import Settings


def _file(path: Path, text: str, mode: int) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o660])
def test_a_kek_file_others_can_read_is_refused_at_start(tmp_path: Path, mode: int) -> None:
    kek = _file(tmp_path / "kek", new_key_line("k1"), mode)
    with pytest.raises(ConfigError, match=rf"KEK file .*kek is mode {mode:04o}"):
        open_store(Settings(data_dir=tmp_path / "data", kek_file=kek))


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o440])
def test_a_private_kek_file_opens(tmp_path: Path, mode: int) -> None:
    # 0440 with this process's own group: what kubelet makes of a Secret volume under the pod's fsGroup.
    kek = _file(tmp_path / "kek", new_key_line("k1"), mode)
    assert os.stat(kek).st_gid in {os.getgid(), *os.getgroups()}
    with open_store(Settings(data_dir=tmp_path / "data", kek_file=kek)):
        pass


def test_server_credentials_come_from_files(tmp_path: Path) -> None:
    token = _file(tmp_path / "internal-token", "tok-123\n", 0o440)
    peer = _file(tmp_path / "peer-secret", "peer-secret-456789", 0o400)
    s = Settings.from_env({"INFERSCALE_INTERNAL_TOKEN_FILE": str(token), "INFERSCALE_PEER_SECRET_FILE": str(peer)})
    assert (s.internal_token, s.peer_secret) == ("tok-123", "peer-secret-456789")


@pytest.mark.parametrize("env,match", [
    ({"INFERSCALE_INTERNAL_TOKEN": "x"}, "not both"),
    ({}, "mode 0644"),
])
def test_server_credential_files_are_checked(tmp_path: Path, env: dict[str, str], match: str) -> None:
    token = _file(tmp_path / "internal-token", "tok", 0o644 if not env else 0o600)
    with pytest.raises(ConfigError, match=match):
        Settings.from_env({**env, "INFERSCALE_INTERNAL_TOKEN_FILE": str(token)})
    with pytest.raises(ConfigError, match="is empty"):
        Settings.from_env({"INFERSCALE_PEER_SECRET_FILE": str(_file(tmp_path / "empty", "", 0o600))})


def test_operator_token_comes_from_a_file(tmp_path: Path) -> None:
    token = _file(tmp_path / "internal-token", "tok-123\n", 0o400)
    assert OperatorSettings.from_env({"INFERSCALE_INTERNAL_TOKEN_FILE": str(token)}).internal_token == "tok-123"
    token.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0644"):
        OperatorSettings.from_env({"INFERSCALE_INTERNAL_TOKEN_FILE": str(token)})


def test_otlp_headers_come_from_a_private_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from inferscale.server import tracing

    headers = _file(tmp_path / "headers", "authorization=Bearer abc\n", 0o440)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_HEADERS", raising=False)
    monkeypatch.setenv("INFERSCALE_OTEL_HEADERS_FILE", str(headers))
    tracing._headers_from_file()
    assert os.environ["OTEL_EXPORTER_OTLP_HEADERS"] == "authorization=Bearer abc"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_HEADERS")
    headers.chmod(0o644)
    with pytest.raises(ConfigError, match="INFERSCALE_OTEL_HEADERS_FILE"):
        tracing._headers_from_file()
