"""An S3 store: whole-object GETs through a lean client of its own (`s3_get.py`), the rest of the data path
(HEAD, PUT, ranges) through obstore (`s3_data.py`), the control path (buckets, listings, deletes) through the
MinIO SDK; bounded timeouts and retries, errors translated at this edge.

Every request has a deadline, so a server that stops answering (frozen, overloaded, partitioned; it may still
accept connections, the kernel does that for it) becomes `StoreUnavailable` in seconds, not minutes:

- data path: each attempt is bounded as a whole (`connect_timeout + read_timeout`, body included), and no
  retry starts once `deadline` could be passed, so one call takes at most about `deadline` (5 s by default);
  quick failures (refused, reset, 5xx) are retried, a timed-out attempt is not;
- control path: `connect_timeout`, then `control_read_timeout` between bytes (a listing page or a batch
  delete makes the server work before it answers); connection errors and 5xx are retried a bounded number
  of times, read errors and timeouts are not, so a frozen server fails one call in about 11 s.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn, TypeVar
from urllib.parse import urlsplit

import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import InvalidResponseError, MinioException, S3Error, ServerError
from minio.helpers import check_bucket_name
from typing_extensions import override

from kvstore.errors import BucketNotFound, ConfigError, StoreAuthError, StoreError, StoreUnavailable
from kvstore.stores.base import Buffer, Data, ObjectInfo, ObjectStore, check_range, validate_key
from kvstore.stores.buffers import reserve_buffers
from kvstore.stores.s3_data import AUTH_CODES, S3DataPath
from kvstore.stores.s3_get import GetOptions, ObjectGetter, Unsupported
from kvstore.stores.s3_get_many import ManyGets

__all__ = ["S3Options", "S3Store"]

_T = TypeVar("_T")

_MISSING_KEY_CODES = frozenset({"NoSuchKey", "NoSuchObject", "ResourceNotFound"})
_DEFAULT_REGION = "us-east-1"
_AWS_ENDPOINT = "https://s3.amazonaws.com"


@dataclass(frozen=True, slots=True)
class S3Options:
    """Network behaviour of an `S3Store` (see the module docstring). The defaults give up on a server that
    does not answer in about 5 s on the data path and 11 s on the control path."""

    connect_timeout: float = 1.0
    # Data path: one whole attempt (headers and body) may take `connect_timeout + read_timeout`.
    read_timeout: float = 3.0
    # Retries per request (connection errors, 5xx); backoff 0.1, 0.2, ... s, at most `backoff_max`.
    retries: int = 2
    backoff: float = 0.1
    backoff_max: float = 0.5
    # Data path: all attempts of one call together; a retry starts only if it can end before this.
    deadline: float = 5.0
    # Control path: the longest silence between bytes of an answer (listings, batch deletes, bucket checks).
    control_read_timeout: float = 10.0
    # Threads for `exists_many`; the connection pool is sized to match so parallel requests never queue.
    workers: int = 16

    def for_gets(self) -> GetOptions:
        """The data path's bounds as the GET client takes them."""
        return GetOptions(
            connect_timeout=self.connect_timeout,
            attempt_timeout=self.connect_timeout + self.read_timeout,
            deadline=self.deadline,
            retries=self.retries,
            backoff=self.backoff,
            backoff_max=self.backoff_max,
        )

    def __post_init__(self) -> None:
        timeouts = (self.connect_timeout, self.read_timeout, self.deadline, self.control_read_timeout)
        if not all(math.isfinite(t) and t > 0 for t in timeouts):
            raise ConfigError("S3 timeouts and deadlines must be finite and > 0")
        if not (math.isfinite(self.backoff) and math.isfinite(self.backoff_max)):
            raise ConfigError("S3 backoff must be finite")
        if self.retries < 0 or self.workers < 1:
            raise ConfigError("S3 retries must be >= 0 and workers >= 1")


def _parse_endpoint(endpoint: str | None, secure: bool | None) -> tuple[str, bool, str]:
    """Split an endpoint into (host[:port], secure, display URL). A scheme decides `secure` when given."""
    raw = endpoint or _AWS_ENDPOINT
    if "://" in raw:
        parts = urlsplit(raw)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"S3 endpoint {raw!r} must look like http(s)://host[:port]")
        if parts.path not in ("", "/") or parts.query or parts.username or parts.password:
            raise ConfigError(f"S3 endpoint {raw!r} must not carry a path, query or credentials")
        is_secure = parts.scheme == "https"
        if secure is not None and secure != is_secure:
            raise ConfigError(f"S3 endpoint {raw!r} contradicts secure={secure}")
        host = parts.netloc
    else:
        host, is_secure = raw.rstrip("/"), True if secure is None else secure
        if not host or "/" in host:
            raise ConfigError(f"S3 endpoint {raw!r} must be host[:port] or http(s)://host[:port]")
    return host, is_secure, f"{'https' if is_secure else 'http'}://{host}"


class S3Store(ObjectStore):
    """Objects in `bucket` under `prefix`, reached through one shared, bounded connection pool.

    Credentials come from the arguments, else from `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
    `AWS_SESSION_TOKEN`; the region from the argument, `AWS_REGION` or `AWS_DEFAULT_REGION`. They are never
    logged, shown in `repr` or in `url`.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        region: str | None = None,
        secure: bool | None = None,
        options: S3Options | None = None,
    ) -> None:
        try:
            check_bucket_name(bucket, strict=True)
        except ValueError as exc:
            raise ConfigError(
                f"S3 bucket name {bucket!r} is invalid (3-63 lowercase letters, digits, '.', '-')"
            ) from exc
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        if self._prefix:
            validate_key(self._prefix)
        host, is_secure, self._endpoint = _parse_endpoint(endpoint, secure)
        self._options = options or S3Options()
        env = os.environ
        access_key = access_key if access_key is not None else env.get("AWS_ACCESS_KEY_ID")
        secret_key = secret_key if secret_key is not None else env.get("AWS_SECRET_ACCESS_KEY")
        session_token = session_token if session_token is not None else env.get("AWS_SESSION_TOKEN")
        if bool(access_key) != bool(secret_key):
            raise ConfigError("S3 credentials need both an access key and a secret key")
        # A fixed region spares the SDK a GetBucketLocation round trip before the first request.
        self._region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or _DEFAULT_REGION
        opts = self._options
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=opts.connect_timeout, read=opts.control_read_timeout),
            maxsize=opts.workers + 4,
            block=False,
            retries=urllib3.Retry(
                total=opts.retries,
                # A read error or timeout means the server got the request and did not answer: asking again
                # would double the wait on a frozen server (and every call we make is idempotent anyway).
                read=0,
                backoff_factor=opts.backoff,
                backoff_max=opts.backoff_max,
                status_forcelist=(500, 502, 503, 504),
                allowed_methods=None,  # every S3 call we make is idempotent (create-only PUT included)
                raise_on_status=False,  # hand the final 5xx to the SDK, which parses the S3 error body
                respect_retry_after_header=False,  # a server must not stretch our bounded budget
            ),
        )
        try:
            self._client = Minio(
                host,
                access_key=access_key or None,
                secret_key=secret_key or None,
                session_token=session_token or None,
                secure=is_secure,
                region=self._region,
                http_client=self._http,
            )
        except ValueError as exc:
            raise ConfigError(f"S3 endpoint {self._endpoint!r}: {exc}") from exc
        self._data = S3DataPath(
            bucket,
            endpoint=self._endpoint if endpoint else None,
            secure=is_secure,
            access_key=access_key or None,
            secret_key=secret_key or None,
            session_token=session_token or None,
            region=self._region,
            connect_timeout=opts.connect_timeout,
            read_timeout=opts.read_timeout,
            retries=opts.retries,
            backoff=opts.backoff,
            backoff_max=opts.backoff_max,
            deadline=opts.deadline,
        )
        self._getter = ObjectGetter(
            bucket,
            endpoint=self._endpoint if endpoint else None,
            access_key=access_key or None,
            secret_key=secret_key or None,
            session_token=session_token or None,
            region=self._region,
            options=opts.for_gets(),
        )
        # The engine's GETs of many chunks at once, on one thread; any answer it does not read comes from the
        # blocking client above.
        self._many = ManyGets(self._getter, lambda name: self._get_named(name, f"GET {name!r}"))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- identity --

    @property
    @override
    def url(self) -> str:
        return f"s3://{self._bucket}/{self._prefix}" if self._prefix else f"s3://{self._bucket}"

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @override
    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self._endpoint!r}, region={self._region!r})"

    def _name(self, key: str) -> str:
        validate_key(key)
        return f"{self._prefix}/{key}" if self._prefix else key

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._options.workers, thread_name_prefix="kvstore-s3")
            return self._pool

    # -- error translation --

    def _raise(self, exc: BaseException, what: str) -> NoReturn:
        """Translate an SDK or transport exception into the library's error tree."""
        where = f"{what} ({self.url} at {self._endpoint})"
        if isinstance(exc, S3Error):
            if exc.code == "NoSuchBucket":
                raise BucketNotFound(f"bucket {self._bucket!r} does not exist at {self._endpoint}") from exc
            if exc.code in AUTH_CODES:
                raise StoreAuthError(f"{where}: access denied ({exc.code}); check the credentials") from exc
            status = exc.response.status if exc.response is not None else 0
            if status >= 500 or exc.code in ("SlowDown", "ServiceUnavailable", "InternalError"):
                raise StoreUnavailable(f"{where}: server error {exc.code}") from exc
            raise StoreError(f"{where}: {exc.code}: {exc.message}") from exc
        if isinstance(exc, ServerError):
            if exc.status_code >= 500:
                raise StoreUnavailable(f"{where}: HTTP {exc.status_code} after retries") from exc
            raise StoreError(f"{where}: HTTP {exc.status_code}") from exc
        if isinstance(exc, InvalidResponseError):
            raise StoreUnavailable(f"{where}: unexpected non-S3 response: {exc}") from exc
        if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
            raise StoreUnavailable(f"{where}: cannot reach {self._endpoint}: {type(exc).__name__}") from exc
        if isinstance(exc, MinioException):
            raise StoreError(f"{where}: {exc}") from exc
        raise exc

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            self._raise(exc, what)

    # -- reads and writes --

    @override
    def get(self, key: str) -> bytes | None:
        body = self.get_chunk(key)
        return None if body is None else bytes(body)

    @override
    def get_chunk(self, key: str) -> Buffer | None:
        return self._get_named(self._name(key), f"GET {key!r}")

    gets_many_at_once = True

    @override
    def reserve_bodies(self, length: int, count: int) -> int:
        return reserve_buffers(length, count)  # the pool every GET body of this process comes from

    @override
    def get_each(
        self,
        next_item: Callable[[], tuple[_T, str] | None],
        on_object: Callable[[_T, Buffer | None], None],
        *,
        at_once: int,
        on_found: Callable[[_T], None] | None = None,
    ) -> None:
        def named() -> tuple[_T, str] | None:
            item = next_item()
            return None if item is None else (item[0], self._name(item[1]))

        self._many.get_each(named, on_object, at_once=at_once, on_found=on_found)

    def _get_named(self, name: str, what: str) -> Buffer | None:
        try:
            return self._getter.get(name, what)
        except Unsupported:  # an answer the lean client does not read: the general one does
            return self._data.get_buffer(name, what)

    @override
    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        check_range(start, length)
        name = self._name(key)
        if length == 0:
            return b"" if self._data.head(name, f"HEAD {key!r}") else None
        return self._data.get_range(name, start, length, f"GET {key!r} range")

    @override
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        names = [self._name(key) for key in keys]
        if len(names) <= 1:
            return [self._data.head(name, f"HEAD {name!r}") for name in names]
        return list(self._executor().map(lambda name: self._data.head(name, f"HEAD {name!r}"), names))

    @override
    def put(self, key: str, data: Data) -> None:
        self._data.put(self._name(key), data, f"PUT {key!r}")

    @override
    def put_if_absent(self, key: str, data: Data) -> bool:
        return self._data.put(self._name(key), data, f"PUT-if-absent {key!r}", create_only=True)

    @override
    def delete(self, key: str) -> None:
        name = self._name(key)
        try:
            self._client.remove_object(self._bucket, name)
        except S3Error as exc:
            if exc.code in _MISSING_KEY_CODES:
                return
            self._raise(exc, f"DELETE {key!r}")
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            self._raise(exc, f"DELETE {key!r}")

    @override
    def delete_many(self, keys: Sequence[str]) -> None:
        objects = [DeleteObject(self._name(key)) for key in keys]
        if not objects:
            return

        def run() -> None:
            # The SDK sends batches of 1000 lazily; consuming the iterator is what performs the deletes.
            for error in self._client.remove_objects(self._bucket, iter(objects)):
                if error.code in _MISSING_KEY_CODES:
                    continue
                if error.code == "NoSuchBucket":
                    raise BucketNotFound(f"bucket {self._bucket!r} does not exist at {self._endpoint}")
                if error.code in AUTH_CODES:
                    raise StoreAuthError(f"DELETE {error.name!r} in {self.url}: access denied ({error.code})")
                raise StoreError(f"DELETE {error.name!r} in {self.url}: {error.code}: {error.message}")

        self._call(f"DELETE {len(objects)} objects", run)

    # -- listing --

    @override
    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        base = f"{self._prefix}/" if self._prefix else ""
        # ListObjectsV2 pages of 1000 are fetched lazily as the caller iterates.
        objects = self._client.list_objects(
            self._bucket,
            prefix=base + prefix,
            recursive=True,
            start_after=base + start_after if start_after is not None else None,
        )
        strip = len(base)
        iterator = iter(objects)
        while True:
            try:
                obj = next(iterator)
            except StopIteration:
                return
            except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
                self._raise(exc, f"LIST {prefix!r}")
            name = obj.object_name
            if name is None or obj.is_dir:
                continue
            modified = obj.last_modified.timestamp() if obj.last_modified is not None else 0.0
            yield ObjectInfo(name[strip:], obj.size or 0, modified)

    # -- health and lifecycle --

    @override
    def check(self) -> None:
        if not self._call("HEAD bucket", lambda: self._client.bucket_exists(self._bucket)):
            raise BucketNotFound(f"bucket {self._bucket!r} does not exist at {self._endpoint}")

    def create_bucket(self) -> bool:
        """Create the bucket if it is missing; `True` if this call created it."""
        try:
            check_bucket_name(self._bucket, strict=True, s3_check=True)
        except ValueError as exc:
            raise ConfigError(f"cannot create bucket {self._bucket!r}: {exc}") from exc
        try:
            self._client.make_bucket(self._bucket)
            return True
        except S3Error as exc:
            if exc.code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return False
            self._raise(exc, "create bucket")
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            self._raise(exc, "create bucket")

    @override
    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._getter.close()
        self._http.clear()
