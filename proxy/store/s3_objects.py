"""The object store as the S3 backend uses it: a bucket and a key prefix reached with
aiobotocore, each request timed and counted (tfproxy_store_operations_total), and every way
the store can be unreachable told as one error (StoreUnavailable: a 503, never a 500).
Uploads carry the SHA-256 of each part, so the store checks the bytes it got. A full download
returns the sha256 of the bytes it wrote, for the caller to compare with what vouches for the
blob: the store's own checksum cannot be relied on for that (a client checks it only for an
object stored in one piece with a full-object checksum, not for multipart objects nor for
stores that send none)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import aiofiles
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from proxy.config.settings import S3Config
from proxy.core.errors import Unavailable
from proxy.core.executors import quick, slow
from proxy.core.metrics import Metrics

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client
else:
    S3Client = Any

log = logging.getLogger(__name__)
BACKEND = "s3"
# Blobs up to this size are one PutObject; larger ones a multipart upload of such parts
# (S3's parts are 5 MiB at least, except the last).
SINGLE_PUT_LIMIT = 16 << 20
PART_SIZE = 8 << 20
LIST_PAGE = 1000  # S3's own most keys per listing page
_CHUNK = 256 << 10
# How long after a failure to reach the store requests fail at once, instead of each waiting
# for its own connection attempt; a probe ends it sooner.
_DOWN_FOR = 5.0
# A probe that takes longer than this marks the store unreachable (a black-holed endpoint
# must show within seconds, not after the client's own connect retries).
_PROBE_WITHIN = 4.0
_ABSENT = ("404", "NoSuchKey", "NotFound")
_CONFLICT = ("412", "409", "PreconditionFailed", "ConditionalRequestConflict")


class StoreUnavailable(Unavailable):
    """The object store cannot be reached (or fails): try again later."""


class Conflict(Exception):
    """A conditional request found the object in another state (412 or 409)."""


@dataclass(frozen=True)
class Uploaded:
    """An object just written: its ETag, and the sha256 of the bytes sent."""

    etag: str
    sha256: str


@dataclass(frozen=True)
class ObjectInfo:
    """An object as HEAD or a listing describes it (the key without the prefix)."""

    key: str
    size: int
    etag: str
    mtime: int  # whole seconds: listings and HEAD agree only to the second


class ObjectStore:
    """A bucket below a prefix: the requests the S3 backend makes, and whether the store
    answered lately (for /readyz)."""

    def __init__(self, client: S3Client, config: S3Config, metrics: Metrics) -> None:
        # Untyped on purpose: requests pass conditional options (IfMatch, IfNoneMatch) as
        # keyword dicts, which the stubs' per-argument literals cannot follow.
        self._client: Any = client
        self.bucket = config.bucket
        self.prefix = config.prefix
        self._metrics = metrics
        self._down_since: float | None = None
        self._down_reason = ""
        self._up = metrics.store_up.labels(BACKEND)

    @classmethod
    async def connect(cls, config: S3Config, metrics: Metrics,
                      opened: AsyncExitStack) -> ObjectStore:
        """A client for the configured bucket, closed by `opened`."""
        client = await opened.enter_async_context(get_session().create_client(
            "s3", region_name=config.region, endpoint_url=config.endpoint_url,
            config=AioConfig(signature_version="s3v4", s3={"addressing_style": "path"},
                              connect_timeout=3, read_timeout=30,
                              retries={"max_attempts": 2, "mode": "standard"})))
        return cls(client, config, metrics)

    # --- health --------------------------------------------------------------------------

    def problem(self) -> str | None:
        """Why the store is taken as unreachable now, or None."""
        if self._down_since is None:
            return None
        return f"the object store (bucket {self.bucket}) is unreachable: {self._down_reason}"

    async def probe(self, within: float = _PROBE_WITHIN) -> None:
        """One HeadBucket, given `within` seconds: marks the store reachable (or not)."""
        try:
            async with asyncio.timeout(within):
                await self._probe_call(self._client.head_bucket, Bucket=self.bucket)
        except TimeoutError as exc:
            raise self._unreachable("head_bucket", exc) from None

    # --- objects ---------------------------------------------------------------------------

    async def head(self, key: str) -> ObjectInfo | None:
        """The object at key, or None."""
        try:
            found = await self._call("head", self._client.head_object,
                                     Bucket=self.bucket, Key=self.prefix + key)
        except LookupError:
            return None
        return ObjectInfo(key, found["ContentLength"], found["ETag"],
                          int(found["LastModified"].timestamp()))

    async def upload(self, key: str, path: Path) -> Uploaded:
        """The file at path as the object at key (one PutObject, or a multipart upload for a
        large one), each part with its SHA-256 for the store to check on arrival; returns its
        ETag and the sha256 of the whole file, computed from the bytes that were sent."""
        size = (await slow(path.stat)).st_size
        if size <= SINGLE_PUT_LIMIT:
            body = await slow(path.read_bytes)
            digest = await slow(_sha256_hex, body)
            return Uploaded(await self.put_bytes(key, body), digest)
        return await self._upload_parts(key, path)

    async def _upload_parts(self, key: str, path: Path) -> Uploaded:
        name = self.prefix + key
        started = await self._call("multipart", self._client.create_multipart_upload,
                                   Bucket=self.bucket, Key=name, ChecksumAlgorithm="SHA256")
        upload_id = started["UploadId"]
        parts: list[dict[str, Any]] = []
        whole = hashlib.sha256()
        try:
            async with aiofiles.open(path, "rb") as handle:
                while body := await handle.read(PART_SIZE):
                    number, checksum = len(parts) + 1, await slow(_hashed_part, whole, body)
                    done = await self._call(
                        "part", self._client.upload_part, Bucket=self.bucket, Key=name,
                        UploadId=upload_id, PartNumber=number, Body=body,
                        ChecksumSHA256=checksum)
                    parts.append({"PartNumber": number, "ETag": done["ETag"],
                                  "ChecksumSHA256": checksum})
            done = await self._call("multipart", self._client.complete_multipart_upload,
                                    Bucket=self.bucket, Key=name, UploadId=upload_id,
                                    MultipartUpload={"Parts": parts})
            return Uploaded(str(done["ETag"]), whole.hexdigest())
        except BaseException:
            await self._abort_quietly(name, upload_id)
            raise

    async def _abort_quietly(self, name: str, upload_id: str) -> None:
        try:
            await self._call("multipart", self._client.abort_multipart_upload,
                             Bucket=self.bucket, Key=name, UploadId=upload_id)
        except (StoreUnavailable, LookupError) as exc:
            log.warning("could not abort the upload of %s (the bucket's lifecycle rule for "
                        "incomplete uploads removes it): %s", name, exc)

    async def download(self, info: ObjectInfo, path: Path) -> str:
        """The whole object, exactly as described (If-Match), into the file at path, flushed
        to the disk (fsync) before this returns; returns the sha256 of the bytes written.
        Conflict if it was replaced; LookupError if it is gone. (The store's own checksum is
        asked for too, but a client checks it only for objects stored in one piece with a
        full-object checksum: the sha256 returned is what the caller must compare.)"""
        digest = hashlib.sha256()
        async with self._get(info.key, "download", IfMatch=info.etag,
                             ChecksumMode="ENABLED") as body:
            with open(path, "wb") as handle:  # noqa: ASYNC230 - written on the quick pool
                async for chunk in body:
                    await quick(_write_hashed, handle, digest, chunk)
                await slow(_flushed, handle)
        return digest.hexdigest()

    async def read_range(self, info: ObjectInfo, start: int, end: int
                         ) -> AsyncGenerator[bytes, None]:
        """Bytes start..end (end exclusive, within the object) of exactly this object."""
        if start >= end:
            return
        async with self._get(info.key, "get_range", IfMatch=info.etag,
                             Range=f"bytes={start}-{end - 1}") as body:
            async for chunk in body:
                yield chunk

    @asynccontextmanager
    async def _get(self, key: str, operation: str, **options: Any
                   ) -> AsyncIterator[AsyncIterator[bytes]]:
        answer = await self._call(operation, self._client.get_object,
                                  Bucket=self.bucket, Key=self.prefix + key, **options)
        stream = answer["Body"]

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream.iter_chunks(_CHUNK):
                    yield chunk
            except (BotoCoreError, OSError, TimeoutError) as exc:
                raise self._unreachable(operation, exc) from exc

        try:
            yield chunks()
        finally:
            stream.close()

    async def delete(self, key: str, etag: str | None = None) -> None:
        """Delete the object at key (only while it has etag, where the store checks that)."""
        options: dict[str, Any] = {} if etag is None else {"IfMatch": etag}
        await self._call("delete", self._client.delete_object,
                         Bucket=self.bucket, Key=self.prefix + key, **options)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with prefix, in key order (every page)."""
        found: list[ObjectInfo] = []
        token: str | None = None
        while True:
            options: dict[str, Any] = {} if token is None else {"ContinuationToken": token}
            page = await self._call("list", self._client.list_objects_v2,
                                    Bucket=self.bucket, Prefix=self.prefix + prefix,
                                    MaxKeys=LIST_PAGE, **options)
            found += [ObjectInfo(item["Key"][len(self.prefix):], item["Size"], item["ETag"],
                                 int(item["LastModified"].timestamp()))
                      for item in page.get("Contents", [])]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(found, key=lambda info: info.key)

    async def get_bytes(self, key: str) -> bytes | None:
        """A small object's bytes, or None."""
        try:
            async with self._get(key, "get") as body:
                return b"".join([chunk async for chunk in body])
        except LookupError:
            return None

    async def get_tagged(self, key: str) -> tuple[bytes, str] | None:
        """A small object's bytes and ETag (one GET: the ETag is that of these bytes), or
        None."""
        try:
            answer = await self._call("get", self._client.get_object, Bucket=self.bucket,
                                      Key=self.prefix + key)
        except LookupError:
            return None
        stream = answer["Body"]
        try:
            body = await stream.read()
        except (BotoCoreError, OSError, TimeoutError) as exc:
            raise self._unreachable("get", exc) from exc
        finally:
            stream.close()
        return bytes(body), str(answer["ETag"])

    async def put_bytes(self, key: str, body: bytes, if_absent: bool = False,
                        if_match: str | None = None, operation: str = "put") -> str:
        """A small object (only if key holds none, if_absent; only over the object with
        ETag if_match: else Conflict); its ETag. operation: what the request is counted
        as."""
        options: dict[str, Any] = {"IfNoneMatch": "*"} if if_absent else {}
        if if_match is not None:
            options["IfMatch"] = if_match
        checksum = await slow(_sha256_b64, body) if len(body) > _CHUNK else _sha256_b64(body)
        done = await self._call(operation, self._client.put_object, Bucket=self.bucket,
                                Key=self.prefix + key, Body=body, ChecksumSHA256=checksum,
                                **options)
        return str(done["ETag"])

    # --- every request -------------------------------------------------------------------

    async def _probe_call(self, request: Callable[..., Awaitable[Any]], **options: Any) -> None:
        await self._call("head_bucket", request, probing=True, **options)

    async def _call(self, operation: str, request: Callable[..., Awaitable[Any]],
                    *, probing: bool = False, **options: Any) -> Any:
        """request(**options), timed and counted: LookupError for a missing object, Conflict
        for a failed condition, StoreUnavailable when the store cannot be reached or fails
        (at once for a few seconds after it could not be reached: no request waits for a
        connection attempt that is bound to fail)."""
        if self._down_since is not None and not probing \
                and time.monotonic() - self._down_since < _DOWN_FOR:
            self._count(operation, "unreachable")
            raise StoreUnavailable(self.problem() or "the object store is unreachable")
        started = time.monotonic()
        try:
            answer = await request(**options)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in _ABSENT or status == "404":
                self._count(operation, "absent", started)
                raise LookupError(operation) from None
            if code in _CONFLICT or status in _CONFLICT:
                self._count(operation, "conflict", started)
                raise Conflict(operation) from None
            self._count(operation, "error", started)
            if status.startswith("5"):
                raise self._unreachable(operation, exc) from None
            raise StoreUnavailable(f"the object store refused {operation} "
                                   f"({code or status})") from None
        except (BotoCoreError, OSError, TimeoutError) as exc:
            self._count(operation, "unreachable", started)
            raise self._unreachable(operation, exc) from None
        self._count(operation, "ok", started)
        if self._down_since is not None:
            log.info("the object store (bucket %s) answers again", self.bucket)
            self._down_since = None
        self._up.set(1)
        return answer

    def _unreachable(self, operation: str, exc: BaseException) -> StoreUnavailable:
        reason = f"{type(exc).__name__} on {operation}"
        if self._down_since is None:
            log.warning("the object store (bucket %s) is unreachable: %s", self.bucket, reason)
        self._down_since, self._down_reason = time.monotonic(), reason
        self._up.set(0)
        return StoreUnavailable(f"the object store is unreachable ({reason}); try again")

    def _count(self, operation: str, outcome: str, started: float | None = None) -> None:
        self._metrics.store_operations.labels(BACKEND, operation, outcome).inc()
        if started is not None:
            self._metrics.store_latency.labels(BACKEND, operation).observe(
                time.monotonic() - started)

    async def presigned_get(self, key: str, expires: int) -> str:
        """A URL that fetches the object at key without credentials, for expires seconds."""
        return str(await self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self.prefix + key},
            ExpiresIn=expires))


def _sha256_b64(body: bytes) -> str:
    return base64.b64encode(hashlib.sha256(body).digest()).decode()


def _sha256_hex(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _hashed_part(whole: hashlib._Hash, body: bytes) -> str:
    """The part's own SHA-256 (base64, for the store), its bytes added to the whole's."""
    whole.update(body)
    return _sha256_b64(body)


def _write_hashed(handle: BinaryIO, digest: hashlib._Hash, chunk: bytes) -> None:
    handle.write(chunk)
    digest.update(chunk)


def _flushed(handle: BinaryIO) -> None:
    handle.flush()
    os.fsync(handle.fileno())

