"""What an OCI repository has handed out, by digest: every manifest and index (so a digest
stays resolvable in every replica and after restarts) and what each layer's sha256 names
(a provider package, a module zip). Recorded in the store's index, held in memory once read:
a hit reads nothing from the store."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from proxy.core.errors import BadRequest, NotFound
from proxy.core.held import keep_recent
from proxy.protocols.oci_manifests import INDEX_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, Document
from proxy.store import layout
from proxy.store.protocol import MetadataIndex

_HELD = 4096
_MEDIA_TYPES = frozenset({INDEX_MEDIA_TYPE, MANIFEST_MEDIA_TYPE})


class ManifestUnknown(NotFound):
    """No manifest of this repository has that tag or digest (OCI: MANIFEST_UNKNOWN)."""


class BlobUnknown(NotFound):
    """No blob of this repository has that digest (OCI: BLOB_UNKNOWN)."""


class DigestInvalid(BadRequest):
    """Not a digest this registry can name (OCI: DIGEST_INVALID)."""


def digest_hex(digest: str) -> str:
    """The hex of a `sha256:HEX` digest (DigestInvalid for any other)."""
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or \
            hexdigest.strip("0123456789abcdef"):
        raise DigestInvalid(f"not a sha256 digest: {digest[:80]!r}")
    return hexdigest


def is_digest(reference: str) -> bool:
    """Whether a manifest reference is a digest (`algorithm:hex`) rather than a tag (tags
    cannot hold a colon)."""
    return ":" in reference


class OciRecords:
    """Documents and layers by (repository, sha256)."""

    def __init__(self, index: MetadataIndex) -> None:
        self._index = index
        self._documents: OrderedDict[tuple[str, str], Document] = OrderedDict()
        self._layers: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()

    async def record_document(self, repository: str, document: Document) -> None:
        """Keep document resolvable by its digest in repository."""
        key = (repository, document.digest.removeprefix("sha256:"))
        if key in self._documents:
            return
        await self._index.create(layout.oci_document_record(*key),
                                 {"media_type": document.media_type,
                                  "body": document.body.decode()})
        keep_recent(self._documents, key, document, _HELD)

    async def document(self, repository: str, hexdigest: str) -> Document:
        """The document handed out under this digest (ManifestUnknown if none was)."""
        key = (repository, hexdigest)
        held = self._documents.get(key)
        if held is not None:
            self._documents.move_to_end(key)
            return held
        record = await self._index.get(layout.oci_document_record(repository, hexdigest))
        document = _document_from_record(record, hexdigest)
        if document is None:
            raise ManifestUnknown(f"{repository} has no manifest sha256:{hexdigest}")
        keep_recent(self._documents, key, document, _HELD)
        return document

    async def record_layer(self, repository: str, sha256: str, names: dict[str, Any]) -> None:
        """Note what the layer with this sha256 is (a small JSON object of the caller's)."""
        key = (repository, sha256)
        if self._layers.get(key) == names:
            return
        await self._index.set(layout.oci_layer_record(repository, sha256), names)
        keep_recent(self._layers, key, names, _HELD)

    async def layer(self, repository: str, sha256: str) -> dict[str, Any] | None:
        """What record_layer noted for this sha256 (None: no such layer was handed out)."""
        key = (repository, sha256)
        held = self._layers.get(key)
        if held is not None:
            return held
        record = await self._index.get(layout.oci_layer_record(repository, sha256))
        if record is not None:
            keep_recent(self._layers, key, record, _HELD)
        return record


def _document_from_record(record: dict[str, object] | None, hexdigest: str) -> Document | None:
    """The recorded document, only if its bytes still have the digest it is filed under."""
    if record is None:
        return None
    body, media_type = record.get("body"), record.get("media_type")
    if not isinstance(body, str) or media_type not in _MEDIA_TYPES:
        return None
    document = Document(body.encode(), str(media_type))
    return document if document.digest == f"sha256:{hexdigest}" else None
