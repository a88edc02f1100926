"""The adapter against a sidecar that wants credentials: a bearer token
(bound to a tenant) and mutual TLS on TCP. Certificates are made here, at
run time, with `cryptography` (an LMCache dependency)."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib

import pytest
import torch

from cxlkv_lmcache import auth
from cxlkv_testkit import Sidecar, free_port, make_adapter
from cxlkv_testkit.l2 import bits, key, load, lookup, obj, store

OPERATOR = "op-0123456789abcdef"
ACME = "acme-0123456789abcdef"


def _write(path: pathlib.Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _pki(d: pathlib.Path) -> dict[str, str]:
    """CA, server certificate for localhost/127.0.0.1, a client certificate
    from the CA and one from an unrelated CA; returns their file names."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(name, key, issuer_name, issuer_key, ca=False, sans=()):
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
             .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def save(stem, c, k=None):
        (d / f"{stem}.pem").write_bytes(c.public_bytes(serialization.Encoding.PEM))
        if k is not None:
            (d / f"{stem}.key").write_bytes(k.private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()))

    out = {}
    for ca_name in ("ca", "rogue-ca"):
        k = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
        out[ca_name] = (name, k, cert(ca_name, k, name, k, ca=True))
        save(ca_name, out[ca_name][2])
    for stem, ca_name, sans in (
        ("server", "ca", (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))),
        ("client", "ca", (x509.DNSName("client.test"),)),
        ("rogue", "rogue-ca", (x509.DNSName("client.test"),)),
    ):
        k = ec.generate_private_key(ec.SECP256R1())
        issuer_name, issuer_key, _ = out[ca_name]
        save(stem, cert(stem, k, issuer_name, issuer_key, sans=sans), k)
    return {n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                                   "rogue.pem", "rogue.key")}


def _sidecar(tmp_path: pathlib.Path, toml: str) -> tuple[Sidecar, str]:
    tcp = f"127.0.0.1:{free_port()}"
    cfg = _write(tmp_path / "cxlkv.toml", toml)
    return Sidecar(tmp_path, extra=("--config", cfg, "--tcp", tcp)).start(), tcp


def _roundtrip(a, salt: str) -> None:
    keys = [key(i, salt=salt) for i in range(3)]
    objs = [obj(8192, seed=i) for i in range(3)]
    assert store(a, keys, objs).is_successful()
    assert bits(lookup(a, keys), 3) == [True] * 3
    back = [obj(8192) for _ in range(3)]
    assert bits(load(a, keys, back), 3) == [True] * 3
    assert all(torch.equal(x.tensor, y.tensor) for x, y in zip(objs, back))
    a.submit_unlock(keys)


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"token_file": "/nonexistent/token"}, "token_file: cannot read"),
        ({"token_file": "SHORT"}, "at least 16 printable ASCII"),
        ({"tls_ca": "CA"}, "need tcp_address"),
        ({"tcp_address": "127.0.0.1:1", "tls_cert": "CERT", "tls_key": "KEY"}, "tls_ca is required"),
        ({"tcp_address": "127.0.0.1:1", "tls_ca": "CA", "tls_cert": "CERT"}, "tls_cert and tls_key go together"),
        ({"tcp_address": "127.0.0.1:1", "tls_ca": "/nonexistent/ca.pem"}, "tls_ca: cannot read"),
        ({"token_file": 5}, "token_file must be str"),
    ],
)
def test_credential_params_are_validated_at_startup(tmp_path, params, needle):
    files = {"SHORT": _write(tmp_path / "short", "abc\n"), "CA": _write(tmp_path / "ca.pem", "x"),
             "CERT": _write(tmp_path / "c.pem", "x"), "KEY": _write(tmp_path / "c.key", "x")}
    params = {k: files.get(v, v) if isinstance(v, str) else v for k, v in params.items()}
    with pytest.raises(ValueError) as e:
        make_adapter("/tmp/none.sock", **params)
    assert needle in str(e.value)
    assert "0123456789" not in str(e.value)


def test_the_token_file_is_reread_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(auth, "RELOAD_EVERY_S", 0.0)
    p = tmp_path / "token"
    p.write_text(OPERATOR + "\n")
    t = auth.TokenFile(str(p))
    assert t.header() == ("authorization", "Bearer " + OPERATOR)
    (tmp_path / "next").write_text(ACME)
    (tmp_path / "next").rename(p)
    assert t.header() == ("authorization", "Bearer " + ACME)
    (tmp_path / "next").write_text("bad")
    (tmp_path / "next").rename(p)
    assert t.header() == ("authorization", "Bearer " + ACME), "a broken file keeps the last good token"


def test_plugin_with_a_tenant_bound_token(tmp_path):
    tokens = _write(tmp_path / "tokens", f"{OPERATOR} *\n{ACME} acme\n")
    s, tcp = _sidecar(tmp_path, f'[auth]\ntokens_file = "{tokens}"\n')
    good = make_adapter(s.socket, tcp_address=tcp, token_file=_write(tmp_path / "acme", ACME + "\n"))
    none = make_adapter(s.socket, tcp_address=tcp, connect_timeout_ms=500, deadline_ms=1000)
    try:
        assert good.report_status()["is_healthy"] is True
        _roundtrip(good, salt="acme")
        # Bound to acme: another tenant's store is refused (PERMISSION_DENIED).
        assert not store(good, [key(9, salt="other")], [obj(100)]).is_successful()
        # No token on TCP: UNAUTHENTICATED, the adapter starts unhealthy and misses.
        assert none.report_status()["is_healthy"] is False
        assert not store(none, [key(1, salt="acme")], [obj(100)]).is_successful()
        assert bits(lookup(none, [key(0, salt="acme")]), 1) == [False]
    finally:
        good.close()
        none.close()
        s.kill()


def test_plugin_with_mutual_tls(tmp_path):
    f = _pki(tmp_path)
    s, tcp = _sidecar(tmp_path, f'[tls]\ncert = "{f["server.pem"]}"\nkey = "{f["server.key"]}"\n'
                                f'client_ca = "{f["ca.pem"]}"\n')
    tls = {"tcp_address": tcp, "tls_ca": f["ca.pem"], "tls_server_name": "localhost"}
    good = make_adapter(s.socket, **tls, tls_cert=f["client.pem"], tls_key=f["client.key"])
    refused = [make_adapter(s.socket, **tls, connect_timeout_ms=500, deadline_ms=1000, **extra)
               for extra in ({}, {"tls_cert": f["rogue.pem"], "tls_key": f["rogue.key"]})]
    try:
        assert good.report_status()["is_healthy"] is True
        _roundtrip(good, salt="")
        for a in refused:  # no client certificate; one from another CA
            assert a.report_status()["is_healthy"] is False
            assert not store(a, [key(7)], [obj(100)]).is_successful()
    finally:
        for a in (good, *refused):
            a.close()
        s.kill()
