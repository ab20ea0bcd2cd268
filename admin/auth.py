"""Bearer-token protection for the admin API's `/v1` routes (`/healthz` and `/metrics` stay open).

No token configured means no protection, which `kvstore serve` allows only on a loopback address (or with
`--insecure-no-auth`, see `is_loopback`); with `KVSTORE_ADMIN_TOKEN` set, requests without a token get 401
and with a wrong one 403.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_bearer = HTTPBearer(auto_error=False)


def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    expected = request.app.state.admin_token
    if expected is None:
        return
    if credentials is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "missing bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
    if not hmac.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "invalid bearer token")


def is_loopback(host: str) -> bool:
    """Whether binding `host` can only be reached from this machine: a loopback address, `localhost`, or a
    name that resolves to loopback addresses only. An empty host (all interfaces) or an unresolvable one
    is not."""
    name = host.strip().strip("[]")
    if not name:
        return False
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0])).is_loopback for info in infos)
