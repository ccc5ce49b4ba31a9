"""The storage compliance suite: what every backend must do (proxy.store.protocol), run
against each of them. A new backend is done when it passes here."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.store.damage import DamagedFile
from proxy.store.file_identity import FileIdentity
from proxy.store.protocol import BlobInfo, BlobStore
from proxy.verification.stored_hashes import CheckedFiles, Vouch
from tests.support.seaweedfs import S3Server
from tests.support.stores import BACKENDS, OpenedStore, open_store

KEY = "archives/registry.example/acme/thing/1.0.0/terraform-provider-thing_1.0.0_linux_amd64.zip"
OTHER = "archives/registry.example/acme/thing/1.1.0/terraform-provider-thing_1.1.0_linux_amd64.zip"
MODULE = "modules/registry.example/acme/net/aws/2.0.0.tar.gz"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def s3(backend: str, request: pytest.FixtureRequest) -> S3Server | None:
    """The test S3 server, started (once a session) only when the s3 backend runs."""
    return request.getfixturevalue("s3_server") if backend == "s3" else None


@pytest.fixture
async def store(backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                s3: S3Server | None) -> AsyncIterator[OpenedStore]:
    async with open_store(backend, tmp_path, monkeypatch, s3=s3) as opened:
        yield opened


async def pieces(data: bytes, size: int = 1000, fail_after: int | None = None
                 ) -> AsyncIterator[bytes]:
    for offset in range(0, len(data), size):
        if fail_after is not None and offset >= fail_after:
            raise ConnectionResetError("the source went away")
        yield data[offset:offset + size]
        await asyncio.sleep(0)


async def content(blobs: BlobStore, key: str, start: int = 0, end: int | None = None) -> bytes:
    blob = await blobs.open(key)
    assert blob is not None, f"{key} is not stored"
    try:
        return b"".join([chunk async for chunk in blob.chunks(start, end)])
    finally:
        blob.close()


DATA = bytes(range(256)) * 40  # 10240 bytes


# --- damage to the local copy a hit is served from ------------------------------------------

async def served_as_checked(store: OpenedStore, key: str, sha256: str, stored_as: FileIdentity
                            ) -> bytes | None:
    """What a hit serves, checked as the services check a hit (proxy.verification.
    stored_hashes.CheckedFiles against a record that vouches for sha256 and stored_as), the
    damage dropped as they drop it; None: nothing left to serve (fetched again upstream)."""
    async def record(_found: BlobInfo) -> Vouch:
        return Vouch(sha256, stored_as)

    async def noted(_sha256: str, _identity: FileIdentity) -> None:
        return None

    async def damaged(damage: DamagedFile) -> None:
        await store.blobs.drop_damaged(key, damage.identity, damage.expected)

    found = await CheckedFiles(store.blobs).vouched(key, record=record, checked=noted,
                                                    damaged=damaged)
    return None if found is None else await content(store.blobs, key)


DAMAGE = {"in place": lambda data: bytes(len(data)), "truncated": lambda data: data[:100],
          "emptied": lambda _data: b""}


@pytest.fixture(params=[backend for backend in BACKENDS if backend != "memory"])
async def store_on_disk(request: pytest.FixtureRequest, tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OpenedStore]:
    """The backends that serve hits from a local file (memory keeps bytes in a dict)."""
    backend = str(request.param)
    s3 = request.getfixturevalue("s3_server") if backend == "s3" else None
    async with open_store(backend, tmp_path, monkeypatch, s3=s3) as opened:
        yield opened


@pytest.mark.parametrize("how", DAMAGE)
async def test_a_local_copy_damaged_in_place_truncated_or_emptied_is_never_served(
        store_on_disk: OpenedStore, how: str) -> None:
    store = store_on_disk
    info = await store.blobs.put(KEY, pieces(DATA))
    sha256 = hashlib.sha256(DATA).hexdigest()
    await store.index.set("package/registry.example/acme/thing/1.0.0/linux_amd64",
                          {"shasum": sha256})  # the record that vouches for it
    assert await served_as_checked(store, KEY, sha256, info.identity) == DATA
    local = store.local_file(KEY)
    assert local is not None
    await asyncio.sleep(0.02)  # a write in the same clock tick would keep the mtime
    local.write_bytes(DAMAGE[how](DATA))
    for _ in range(2):  # and again, from what the first look left
        served = await served_as_checked(store, KEY, sha256, info.identity)
        assert served in (DATA, None), "damaged bytes served"


# --- publishing ----------------------------------------------------------------------------

async def test_a_put_blob_reads_back_whole_with_its_size(store: OpenedStore) -> None:
    info = await store.blobs.put(KEY, pieces(DATA))
    assert (info.key, info.size) == (KEY, len(DATA))
    assert await store.blobs.stat(KEY) == info
    assert await content(store.blobs, KEY) == DATA
    blob = await store.blobs.open(KEY)
    assert blob is not None
    try:
        assert blob.info == info
        assert await asyncio.to_thread(lambda: blob.file().read()) == DATA
    finally:
        blob.close()
    assert store.leftovers() == []


async def test_a_published_spool_becomes_the_blob_and_is_consumed(store: OpenedStore) -> None:
    spool = store.blobs.spool_path()
    spool.write_bytes(DATA)
    info = await store.blobs.publish(KEY, spool)
    assert info.size == len(DATA)
    assert await content(store.blobs, KEY) == DATA
    assert not spool.exists()
    assert store.leftovers() == []


async def test_a_failed_put_leaves_nothing_visible_and_nothing_behind(
        store: OpenedStore) -> None:
    with pytest.raises(ConnectionResetError):
        await store.blobs.put(KEY, pieces(DATA, fail_after=3000))
    assert await store.blobs.stat(KEY) is None
    assert await store.blobs.open(KEY) is None
    assert await store.blobs.list("archives/") == []
    assert store.leftovers() == []


async def test_a_cancelled_put_leaves_nothing_visible_and_nothing_behind(
        store: OpenedStore) -> None:
    started = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield DATA[:1000]
        started.set()
        await asyncio.Event().wait()
        yield DATA[1000:]

    put = asyncio.create_task(store.blobs.put(KEY, stalls()))
    await started.wait()
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    assert await store.blobs.stat(KEY) is None
    assert store.leftovers() == []


async def test_a_blob_is_never_visible_in_part(store: OpenedStore) -> None:
    await store.blobs.put(KEY, pieces(b"old" * 1000))
    seen: list[bytes] = []

    async def watched() -> AsyncIterator[bytes]:
        async for chunk in pieces(DATA):
            seen.append(await content(store.blobs, KEY))  # while the new one is written
            yield chunk

    await store.blobs.put(KEY, watched())
    assert seen and all(found == b"old" * 1000 for found in seen)
    assert await content(store.blobs, KEY) == DATA


async def test_a_reader_of_a_replaced_blob_still_reads_the_old_one_whole(
        store: OpenedStore) -> None:
    await store.blobs.put(KEY, pieces(b"old" * 1000))
    reading = await store.blobs.open(KEY)
    assert reading is not None
    try:
        await store.blobs.put(KEY, pieces(DATA))
        assert b"".join([chunk async for chunk in reading.chunks()]) == b"old" * 1000
    finally:
        reading.close()
    assert await content(store.blobs, KEY) == DATA


async def test_an_open_blob_says_whether_its_close_may_wait(store: OpenedStore) -> None:
    # A hit closes what it sent on the event loop, unless the close may wait: the last
    # descriptor of a local file removed meanwhile (evicted, replaced) frees its blocks.
    await store.blobs.put(KEY, pieces(DATA))
    reading = await store.blobs.open(KEY)
    assert reading is not None
    try:
        assert reading.quick_to_close()
        local = store.local_file(KEY)
        if local is not None:
            local.unlink()
            assert not reading.quick_to_close()
            assert b"".join([chunk async for chunk in reading.chunks()]) == DATA
    finally:
        reading.close()
    assert reading.quick_to_close()  # closed already: nothing left to wait for


async def test_concurrent_writers_of_one_key_leave_one_intact_blob(store: OpenedStore) -> None:
    versions = [bytes([n]) * (5000 + n) for n in range(6)]
    await asyncio.gather(*(store.blobs.put(KEY, pieces(data, 700)) for data in versions))
    stored = await content(store.blobs, KEY)
    assert stored in versions
    info = await store.blobs.stat(KEY)
    assert info is not None and info.size == len(stored)
    assert [found.key for found in await store.blobs.list("archives/")] == [KEY]
    assert store.leftovers() == []


@pytest.mark.parametrize("key", ["", "../x", "archives/../x", "archives//x", "archives/./x",
                                 "archives/a\\b", "archives/a\0b", "/archives/x"])
async def test_unsafe_keys_are_refused(store: OpenedStore, key: str) -> None:
    with pytest.raises(ValueError):
        await store.blobs.stat(key)
    with pytest.raises(ValueError):
        await store.blobs.put(key, pieces(DATA))
    assert await store.blobs.list("") == []


# --- reading -------------------------------------------------------------------------------

@pytest.mark.parametrize(("start", "end", "expected"), [
    (0, None, DATA),
    (0, 1, DATA[:1]),
    (1000, 3000, DATA[1000:3000]),
    (len(DATA) - 10, None, DATA[-10:]),
    (5000, len(DATA) + 999, DATA[5000:]),   # past the end: clamped
    (len(DATA), None, b""),
    (len(DATA) + 5, len(DATA) + 50, b""),
])
async def test_range_reads(store: OpenedStore, start: int, end: int | None,
                           expected: bytes) -> None:
    await store.blobs.put(KEY, pieces(DATA))
    assert await content(store.blobs, KEY, start, end) == expected


async def test_listing_under_a_prefix(store: OpenedStore) -> None:
    for key in (OTHER, KEY, MODULE):
        await store.blobs.put(key, pieces(key.encode()))
    under = await store.blobs.list("archives/registry.example/acme/thing/")
    assert [info.key for info in under] == [KEY, OTHER]
    assert [info.size for info in under] == [len(KEY), len(OTHER)]
    assert [info.key for info in await store.blobs.list("modules/")] == [MODULE]
    assert [info.key for info in await store.blobs.list("archives/registry.example/acme/th")] \
        == [KEY, OTHER]
    assert await store.blobs.list("archives/registry.example/other/") == []
    assert [info.key for info in await store.blobs.list("")] == [KEY, OTHER, MODULE]


async def test_delete_spares_a_blob_that_replaced_the_one_judged(store: OpenedStore) -> None:
    first = await store.blobs.put(KEY, pieces(b"first" * 300))
    second = await store.blobs.put(KEY, pieces(b"second" * 300))
    assert first.identity != second.identity
    assert not await store.blobs.delete(KEY, first.identity)
    assert await content(store.blobs, KEY) == b"second" * 300
    assert await store.blobs.delete(KEY, second.identity)
    assert await store.blobs.stat(KEY) is None
    assert not await store.blobs.delete(KEY)
    await store.blobs.put(KEY, pieces(DATA))
    assert await store.blobs.delete(KEY)
    assert (store.blobs.used_bytes, store.blobs.file_count) == (0, 0)


# --- eviction ------------------------------------------------------------------------------

async def test_eviction_keeps_the_store_under_its_limit_least_recently_used_first(
        backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend == "s3":
        pytest.skip("the bucket is not bounded (cache.max_size bounds its hot copies: "
                    "test_s3_store.py)")
    keys = [f"archives/h/n/t/1.0.{n}/f.zip" for n in range(4)]
    async with open_store(backend, tmp_path, monkeypatch, max_size=2500) as store:
        blobs = store.blobs
        await blobs.put(keys[0], pieces(b"a" * 1000))
        await blobs.put(keys[1], pieces(b"b" * 1000))
        await content(blobs, keys[0])  # a use: keys[1] is now the least recently used
        await store.settle()
        await blobs.put(keys[2], pieces(b"c" * 1000))  # over the limit: one must go
        assert [await blobs.stat(key) is not None for key in keys[:3]] == [True, False, True]
        assert (blobs.used_bytes, blobs.file_count) == (2000, 2)

        # The least recently used blob is being read: it stays, the next one goes.
        reading = await blobs.open(keys[0])
        assert reading is not None
        try:
            await content(blobs, keys[2])
            await store.settle()
            await blobs.put(keys[3], pieces(b"d" * 1000))
            assert [await blobs.stat(key) is not None for key in keys] == \
                [True, False, False, True]
            assert b"".join([chunk async for chunk in reading.chunks()]) == b"a" * 1000
        finally:
            reading.close()
        assert blobs.used_bytes <= 2500


# --- fill locks ----------------------------------------------------------------------------

async def test_a_fill_lock_admits_one_holder_at_a_time(store: OpenedStore) -> None:
    order: list[str] = []

    async def fill(name: str, hold: float) -> None:
        async with store.blobs.fill_lock("registry.example/acme/thing/1.0.0/linux_amd64",
                                         "package"):
            order.append(f"{name} in")
            await asyncio.sleep(hold)
            order.append(f"{name} out")

    first = asyncio.create_task(fill("first", 0.2))
    await asyncio.sleep(0.05)
    await asyncio.gather(fill("second", 0), first)
    assert order == ["first in", "first out", "second in", "second out"]


# --- the index -----------------------------------------------------------------------------

async def test_index_documents_are_stored_replaced_and_deleted(store: OpenedStore) -> None:
    index = store.index
    assert await index.get("package/a") is None
    await index.set("package/a", {"shasum": "1", "list": [1, 2]})
    document = await index.get("package/a")
    assert document == {"shasum": "1", "list": [1, 2]}
    assert document is not None
    document["list"].append(3)  # a copy: changing it changes nothing stored
    assert await index.get("package/a") == {"shasum": "1", "list": [1, 2]}
    await index.set("package/a", {"shasum": "2"})
    assert await index.get("package/a") == {"shasum": "2"}
    await index.set("package/b", {"x": 1})
    await index.set("sums/a", {"x": 2})
    assert await index.keys("package/") == ["package/a", "package/b"]
    await index.delete("package/a")
    await index.delete("package/missing")
    assert await index.get("package/a") is None
    assert await index.keys("") == ["package/b", "sums/a"]


async def test_create_if_absent_has_exactly_one_winner(store: OpenedStore) -> None:
    won = await asyncio.gather(*(store.index.create("lease/fill", {"owner": n})
                                 for n in range(16)))
    assert won.count(True) == 1
    assert await store.index.get("lease/fill") == {"owner": won.index(True)}
    assert not await store.index.create("lease/fill", {"owner": 99})
    await store.index.delete("lease/fill")  # released: the next one takes it
    assert await store.index.create("lease/fill", {"owner": 100})
    assert await store.index.get("lease/fill") == {"owner": 100}


# --- compare-and-set (leases) --------------------------------------------------------------

async def test_every_write_gives_a_document_a_new_version(store: OpenedStore) -> None:
    index = store.index
    assert await index.get_versioned("lease/fill") is None
    await index.set("lease/fill", {"owner": 1})
    found = await index.get_versioned("lease/fill")
    assert found is not None and found[0] == {"owner": 1}
    first = found[1]
    await index.set("lease/fill", {"owner": 1, "write": "another"})
    second = await index.get_versioned("lease/fill")
    assert second is not None and second[1] != first
    replaced = await index.replace("lease/fill", {"owner": 2}, second[1])
    assert replaced is not None and replaced not in (first, second[1])
    assert await index.get_versioned("lease/fill") == ({"owner": 2}, replaced)
    assert await index.get("lease/fill") == {"owner": 2}


async def test_a_stale_version_is_refused(store: OpenedStore) -> None:
    index = store.index
    assert await index.create("lease/fill", {"owner": 1})
    found = await index.get_versioned("lease/fill")
    assert found is not None
    stale = found[1]
    current = await index.replace("lease/fill", {"owner": 2}, stale)
    assert current is not None
    assert await index.replace("lease/fill", {"owner": 3}, stale) is None
    assert not await index.delete_if("lease/fill", stale)  # a former holder's release
    assert await index.get_versioned("lease/fill") == ({"owner": 2}, current)
    assert await index.delete_if("lease/fill", current)
    assert await index.get("lease/fill") is None
    assert not await index.delete_if("lease/fill", current)
    assert await index.replace("lease/fill", {"owner": 4}, current) is None  # gone
    assert await index.get("lease/fill") is None


async def test_racing_replaces_on_several_replicas_have_exactly_one_winner(
        store: OpenedStore) -> None:
    await store.index.set("lease/fill", {"owner": "dead"})
    async with store.replica() as second, store.replica() as third:
        indexes = [store.index, second.index, third.index]
        observed = [await index.get_versioned("lease/fill") for index in indexes]
        assert all(found is not None and found == observed[0] for found in observed)
        assert observed[0] is not None
        version = observed[0][1]
        won = await asyncio.gather(*(
            indexes[n % 3].replace("lease/fill", {"owner": n}, version) for n in range(12)))
        winners = [n for n, new in enumerate(won) if new is not None]
        assert len(winners) == 1
        for index in indexes:  # every replica sees the winner's document
            assert await index.get_versioned("lease/fill") == (
                {"owner": winners[0]}, won[winners[0]])
