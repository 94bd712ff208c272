"""The metadata client against a real etcd that speaks only TLS (client certificates required), and
one with user/password authentication: `etcd+tls://…?ca=&cert=&key=`, `user@` + password."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from kvstore.metadata import open_metadata
from kvstore_testing.ports import free_port

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None or shutil.which("openssl") is None,
                                reason="needs etcd and openssl")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1, a client certificate, and a stranger's CA."""
    d = tmp_path_factory.mktemp("pki")
    files = {n: d / f"{n}.pem" for n in ("ca", "ca-key", "server", "server-key", "client", "client-key",
                                          "other-ca", "other-ca-key")}
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN=test-{ca}",
                "-keyout", str(files[f"{ca}-key"]), "-out", str(files[ca]))
    ext = d / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name, cn in (("server", "etcd"), ("client", "kvstore")):
        csr = d / f"{name}.csr"
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", str(files[f"{name}-key"]),
                "-out", str(csr))
        openssl("x509", "-req", "-in", str(csr), "-CA", str(files["ca"]), "-CAkey", str(files["ca-key"]),
                "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(files[name]))
    return files


class TlsEtcd:
    """etcd listening on https only."""

    def __init__(self, pki: dict[str, Path], client_cert_auth: bool) -> None:
        self.port, peer = free_port(), free_port()
        self.data = tempfile.mkdtemp(prefix="kvstore-etcd-tls-")
        url = f"https://127.0.0.1:{self.port}"
        cmd = [shutil.which("etcd"), "--name", "tls", "--data-dir", self.data, "--listen-client-urls", url,
               "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-cluster", f"tls=http://127.0.0.1:{peer}", "--cert-file", str(pki["server"]),
               "--key-file", str(pki["server-key"]), "--log-level", "error", "--logger", "zap"]
        if client_cert_auth:
            cmd += ["--client-cert-auth", "--trusted-ca-file", str(pki["ca"])]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        shutil.rmtree(self.data, ignore_errors=True)


async def round_trip(url: str, key: str = "/tls-test/k") -> bytes | None:
    metadata = open_metadata(url, timeout=2.0)
    try:
        await metadata.put(key, b"over tls")
        kv = await metadata.get(key)
        return None if kv is None else kv.value
    finally:
        await metadata.close()


def eventually(url: str, timeout: float = 20.0) -> bytes | None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return asyncio.run(round_trip(url))
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def fails(url: str) -> bool:
    try:
        asyncio.run(round_trip(url))
    except Exception:  # noqa: BLE001 - any refusal will do; what matters is that nothing got through
        return True
    return False


def test_etcd_over_tls_with_client_certificates(pki):
    etcd = TlsEtcd(pki, client_cert_auth=True)
    try:
        base = f"etcd+tls://127.0.0.1:{etcd.port}"
        good = f"{base}?ca={pki['ca']}&cert={pki['client']}&key={pki['client-key']}"
        assert eventually(good) == b"over tls"
        assert fails(f"etcd://127.0.0.1:{etcd.port}")  # plaintext gRPC to a TLS port
        assert fails(f"{base}?ca={pki['ca']}")  # no client certificate
        assert fails(f"{base}?ca={pki['other-ca']}&cert={pki['client']}&key={pki['client-key']}")  # wrong CA
    finally:
        etcd.close()


async def enable_auth(url: str, password: str) -> None:
    """Create root with `password` and turn authentication on (what `etcdctl auth enable` does)."""
    from aetcd import rpc

    metadata = open_metadata(url, timeout=5.0)
    try:
        await metadata._client.connect()
        auth = rpc.AuthStub(metadata._client.channel)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"))
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=password))
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
        await auth.AuthEnable(rpc.AuthEnableRequest())
    finally:
        await metadata.close()


def test_etcd_user_and_password_over_tls(pki, tmp_path, monkeypatch):
    etcd = TlsEtcd(pki, client_cert_auth=False)
    try:
        base = f"127.0.0.1:{etcd.port}?ca={pki['ca']}"
        assert eventually(f"etcd+tls://{base}") == b"over tls"
        asyncio.run(enable_auth(f"etcd+tls://{base}", "s3cret-pw"))
        assert fails(f"etcd+tls://{base}")  # anonymous: refused now
        password_file = tmp_path / "pw"
        password_file.write_text("s3cret-pw\n")
        assert eventually(f"etcd+tls://root@{base}&password_file={password_file}") == b"over tls"
        monkeypatch.setenv("KVSTORE_ETCD_PASSWORD", "s3cret-pw")
        assert eventually(f"etcd+tls://root@{base}") == b"over tls"
        monkeypatch.setenv("KVSTORE_ETCD_PASSWORD", "wrong")
        assert fails(f"etcd+tls://root@{base}")
    finally:
        etcd.close()


def test_metadata_urls_are_checked():
    for url in ("etcd://127.0.0.1:2379?ca=/x.pem", "etcd+tls://127.0.0.1:2379?bogus=1", "etcd+tls://127.0.0.1"):
        with pytest.raises(ValueError):
            open_metadata(url)
    with pytest.raises(ValueError, match="password"):
        open_metadata("etcd://someone@127.0.0.1:2379")
