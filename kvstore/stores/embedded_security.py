"""What keeps the embedded SeaweedFS to the one door kvstore uses: its S3 port, with credentials.

`weed mini` also opens master, volume and filer HTTP ports and a gRPC port per component, on loopback but
open to every local user: the filer's HTTP port reads and writes any object, the master's deletes a whole
bucket (`/col/delete`), and `weed shell` lists and removes files over gRPC. So the server runs with:

- `-disableHttp`: no master or filer HTTP API (the S3 gateway does not need them);
- JWT signing keys for the volume and filer HTTP paths (`[jwt.*]`): the volume port, which S3 uploads use,
  accepts a read or write only with a token signed by a key only the server knows;
- mutual TLS on every gRPC port (`[grpc]`): a private CA and one certificate for the components, made here,
  kept in `<data_dir>/tls` (mode 0700), so a client without that key is refused;
- an environment built from scratch (`weed_environment`): the S3 credentials it needs and nothing of the
  caller's, so no admin token, cloud credential or stray `WEED_*` override reaches it.

`security.toml` is written next to the data (weed reads it from its working directory first) with mode 0600;
the JWT keys are new on every start, the certificates last ten years and are remade if missing or expired.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from pathlib import Path

__all__ = ["SECURITY_FILE", "weed_environment", "write_security_config"]

SECURITY_FILE = "security.toml"
_TLS_DIR = "tls"
# Every component serves and dials gRPC with the same certificate (SeaweedFS does not check host names).
_GRPC_COMPONENTS = ("master", "volume", "filer", "s3", "admin", "worker", "client")
# What weed needs from an environment: where programs are, and a locale.
_PASSED_THROUGH = ("PATH", "LANG", "LC_ALL", "TZ")


def weed_environment(home: Path, access_key: str, secret_key: str) -> dict[str, str]:
    """The whole environment of the weed process: a few neutral variables, a private HOME (so no
    `~/.seaweedfs/security.toml` of the user's applies) and the S3 identity."""
    env = {name: os.environ[name] for name in _PASSED_THROUGH if name in os.environ}
    env.setdefault("PATH", os.defpath)
    env.update(HOME=str(home), AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key)
    return env


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def _certificates_valid(tls: Path) -> bool:
    from cryptography import x509

    try:
        for name in ("ca.crt", "weed.crt"):
            cert = x509.load_pem_x509_certificate((tls / name).read_bytes())
            if cert.not_valid_after_utc < datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1):
                return False
        return (tls / "weed.key").is_file()
    except (OSError, ValueError):
        return False


def _make_certificates(tls: Path) -> None:
    """A private CA and one certificate it signs, for serving and dialing gRPC (mutual TLS)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    life = (now - datetime.timedelta(days=1), now + datetime.timedelta(days=3650))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore embedded S3 CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(life[0])
        .not_valid_after(life[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore-weed")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(life[0])
        .not_valid_after(life[1])
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    _write_private(tls / "ca.crt", ca.public_bytes(pem))
    _write_private(tls / "weed.crt", cert.public_bytes(pem))
    # The CA's key is not kept: nothing else will ever be signed.
    _write_private(
        tls / "weed.key",
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_security_config(data_dir: Path) -> Path:
    """Write `<data_dir>/security.toml` (and the certificates it names, if needed); returns its path."""
    tls = data_dir / _TLS_DIR
    tls.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(tls, 0o700)
    if not _certificates_valid(tls):
        _make_certificates(tls)
    lines = [
        "# Written by kvstore at every start of its embedded S3 server (kvstore/stores/embedded_security.py)"
    ]
    for section in ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read"):
        lines += [
            f"[{section}]",
            f"key = {_toml_string(secrets.token_urlsafe(32))}",
            "expires_after_seconds = 10",
        ]
    lines += ["[access]", "ui = false", "[filer.expose_directory_metadata]", "enabled = false"]
    lines += ["[grpc]", f"ca = {_toml_string(str(tls / 'ca.crt'))}"]
    for component in _GRPC_COMPONENTS:
        lines += [
            f"[grpc.{component}]",
            f"cert = {_toml_string(str(tls / 'weed.crt'))}",
            f"key = {_toml_string(str(tls / 'weed.key'))}",
        ]
    path = data_dir / SECURITY_FILE
    _write_private(path, ("\n".join(lines) + "\n").encode())
    return path
