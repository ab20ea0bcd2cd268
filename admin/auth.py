"""Bearer-token protection for the admin API's `/v1` routes (`/healthz` and `/metrics` stay open).

No token configured means no protection (a local, loopback-only service); with `KVSTORE_ADMIN_TOKEN` set,
requests without a token get 401 and with a wrong one 403.
"""

from __future__ import annotations

import hmac
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


Authorized = Depends(require_token)
