"""``conveyor credentials DIR``: what a deployment needs to keep its internal traffic private, made once.

Writes, into ``DIR`` (only what is missing, so a restart keeps what clients and peers already use):

- ``ca.pem``, ``cert.pem``, ``key.pem``: a private CA and one certificate for every internal service
  (subjectAltName ``DNS:conveyor-internal``, the name ``conveyor.grpc_util`` checks), for internal
  mutual TLS with ``CONVEYOR_INTERNAL_TLS_DIR=DIR``. The CA's key is not kept: nobody can add a peer.
- ``redis.conf``: ``requirepass`` with a random password (``redis-server DIR/redis.conf``);
- ``redis_url``: ``redis://:PASSWORD@HOST:6379/0`` for the services (``CONVEYOR_*_REDIS_URL_FILE``);
- ``grafana_password``: a random password for Grafana's admin (``GF_SECURITY_ADMIN_PASSWORD__FILE``).

Every file is mode 0600, owned by whoever runs this; ``--redis-uid`` gives ``redis.conf`` to the user
Redis runs as (999 in the official image), ``--grafana-uid`` ``grafana_password`` to Grafana's (472). The
compose stack runs it as an init service on a volume.
"""

from __future__ import annotations

import datetime
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conveyor.grpc_util import INTERNAL_TLS_NAME

VALID_DAYS = 3650


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_internal_certificates() -> dict[str, bytes]:
    """{"ca.pem", "cert.pem", "key.pem"}: a fresh CA and a certificate it signed for ``conveyor-internal``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(minutes=5),
                 not_valid_after=now + datetime.timedelta(days=VALID_DAYS))
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder(**valid).subject_name(_name("conveyor-internal-ca"))
          .issuer_name(_name("conveyor-internal-ca")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder(**valid).subject_name(_name(INTERNAL_TLS_NAME)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(INTERNAL_TLS_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    return {"ca.pem": ca.public_bytes(serialization.Encoding.PEM),
            "cert.pem": cert.public_bytes(serialization.Encoding.PEM), "key.pem": _pem_key(key)}


def _write(path: Path, data: bytes, uid: int | None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if uid is not None:
        os.chown(path, uid, -1)


def make_internal_tls(folder: str | Path) -> list[str]:
    """The internal certificates in ``folder`` (made 0700), unless all three are there; returns the names written."""
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if all((folder / name).exists() for name in ("ca.pem", "cert.pem", "key.pem")):
        return []
    written = []
    for name, data in make_internal_certificates().items():
        (folder / name).unlink(missing_ok=True)
        _write(folder / name, data, None)
        written.append(name)
    return written


def make_credentials(folder: str | Path, redis_host: str = "redis", redis_uid: int | None = None,
                     grafana_uid: int | None = None) -> list[str]:
    """Write what is missing in ``folder`` (see the module doc); returns the names written."""
    folder = Path(folder)
    written = make_internal_tls(folder)
    if not (folder / "redis.conf").exists() or not (folder / "redis_url").exists():
        password = secrets.token_urlsafe(32)
        for name, text in (("redis.conf", f"requirepass {password}\n"),
                           ("redis_url", f"redis://:{password}@{redis_host}:6379/0\n")):
            (folder / name).unlink(missing_ok=True)
            _write(folder / name, text.encode(), redis_uid if name == "redis.conf" else None)
            written.append(name)
    if not (folder / "grafana_password").exists():
        _write(folder / "grafana_password", secrets.token_urlsafe(24).encode(), grafana_uid)
        written.append("grafana_password")
    return written
