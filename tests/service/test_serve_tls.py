"""``busctl serve`` over TLS on a run with keys (service.proc.tls_files, api_server): the real FastAPI app under
real uvicorn with the certificate ``busctl keys`` made for 127.0.0.1, read by the official Tinker SDK trusting the
run's CA through ``SSL_CERT_FILE`` and by httpx; a client without the CA, or plain HTTP, gets nothing, and the
API key is still checked. No trainer: the routes used here answer from the service's own state.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

import httpx
import pytest

from bus.auth import create_keys
from configs.schema import load_config
from service.app import build_app
from service.futures import Futures
from service.proc import api_server, tls_files
from service.state import ServiceState
from tests.service.conftest import API_KEY


@pytest.fixture(scope="module")
def https_api(tmp_path_factory):
    """``(url, ca.crt path)`` of the API served over TLS on 127.0.0.1 for a run with keys."""
    keys = tmp_path_factory.mktemp("keys") / "keys"
    create_keys(keys)
    cfg = load_config(None, ["bus.transport=tcp", f"bus.curve_keys_dir={keys}", "model.path=tiny-policy"])
    assert tls_files(load_config(None, []).bus, "127.0.0.1") is None  # ipc, no keys: plain HTTP
    certs = tls_files(cfg.bus, "127.0.0.1")
    assert certs is not None and certs[0].endswith(".crt")
    server = api_server(build_app(ServiceState(cfg, frozenset({API_KEY}), Futures(lambda call: None))), certs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"https://127.0.0.1:{sock.getsockname()[1]}", keys / "tls" / "ca.crt"
    server.should_exit = server.force_exit = True  # the SDK's keep-alive connection is not waited for
    thread.join(10)
    assert not thread.is_alive()


def test_httpx_with_the_runs_ca(https_api):
    url, ca = https_api
    trusted = ssl.create_default_context(cafile=str(ca))
    r = httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": API_KEY}, verify=trusted)
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    r = httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": "tml-wrong"}, verify=trusted)
    assert (r.status_code, r.json()) == (401, {"detail": "invalid or missing API key"})
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": API_KEY}, verify=ssl.create_default_context())
    with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP to the TLS port: no answer
        httpx.get(url.replace("https", "http") + "/api/v1/healthz", headers={"X-API-Key": API_KEY})


def test_tinker_sdk_trusts_the_ca_from_ssl_cert_file(https_api, monkeypatch):
    tinker = pytest.importorskip("tinker")
    url, ca = https_api
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # httpx's default context reads it (the SDK makes no own)
    client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    try:
        caps = client.get_server_capabilities()
    finally:
        client.close("success").result(timeout=30)
    assert [m.model_name for m in caps.supported_models] == ["tiny-policy"]
