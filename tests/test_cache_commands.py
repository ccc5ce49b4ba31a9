"""`cache list`, `cache verify`, `cache prune` and `cache stats` on a cache directory filled
through a real proxy process from the fake registry, run as operators run them
(`python -m proxy cache ...`, output to a pipe)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.audit import events
from tests.support.cache_cli import (
    NULL,
    RANDOM,
    TARBALL,
    Fetched,
    disk_index,
    expected,
    fill,
    listed,
    no_escapes,
    on_terminal,
    wait_for_h1,
)
from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import ProxyProcess, free_port

DAY = 86400


@pytest.fixture
def proxy(tmp_path: Path, write_config: Callable[..., Path]) -> Iterator[ProxyProcess]:
    """A proxy process on its own cache directory (started by the test)."""
    cache, port = tmp_path / "cache", free_port()
    server = ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                          tmp_path / "proxy.log")
    yield server
    server.stop()


@pytest.fixture
def filled(proxy: ProxyProcess, registry: FakeRegistry) -> list[Fetched]:
    """The proxy started, and four artifacts fetched through it (their fills done)."""
    proxy.start()
    fetched = fill(proxy, registry)
    wait_for_h1(proxy.cache_dir, fetched)
    return fetched


def _backdate(cache: Path, item: Fetched, days: float) -> None:
    """Its write and its last use (access time) days ago."""
    then = time.time() - days * DAY
    os.utime(cache / item.key, (then, then))


def test_list_shows_what_was_fetched_and_nothing_else_with_sizes(
        proxy: ProxyProcess, filled: list[Fetched]) -> None:
    result = proxy.cli("cache", "list", "--json")
    no_escapes(result)
    assert listed(result) == expected(filled)
    assert json.loads(result.stdout)["total_bytes"] == sum(len(f.data) for f in filled)

    text = proxy.cli("cache", "list")
    no_escapes(text)
    lines = text.stdout.splitlines()
    assert f"provider {NULL}" in lines and f"module {TARBALL}" in lines
    assert any("3.2.1" in line and "darwin_arm64" in line and "last used" in line
               for line in lines)
    assert lines[-1].startswith("3 provider packages (2 providers), 1 module archives "
                                "(1 modules)")


def test_reading_the_cache_deletes_nothing_even_over_its_limit(
        proxy: ProxyProcess, filled: list[Fetched]) -> None:
    # Opened as a starting server opens it, the store was measured and evicted down to
    # cache.max_size: a `cache list` with a smaller limit emptied the cache.
    tiny = {"TF_REGISTRY_PROXY_CACHE_MAX_SIZE": "1KiB"}
    for command in (("list",), ("stats",)):
        result = proxy.cli("cache", *command, env=tiny)
        assert result.returncode == 0, result.stderr
    assert listed(proxy.cli("cache", "list", "--json")) == expected(filled)


def test_list_filters_by_address_pattern(proxy: ProxyProcess, filled: list[Fetched]) -> None:
    null, random, module = filled[:2], filled[2:3], filled[3:]
    for pattern, wanted in (("hashicorp/null", null),
                            ("registry.terraform.io/hashicorp/*", null + random),
                            ("HashiCorp/Random", random),
                            ("registry.terraform.io/acme", module),
                            ("acme/tarball/aws", module),
                            ("*", filled),
                            ("example.com/hashicorp/null", [])):
        assert listed(proxy.cli("cache", "list", pattern, "--json")) == expected(wanted), \
            pattern


@pytest.mark.parametrize(("args", "message"), [
    (("list", "hashicorp/ null"), "is not an address pattern"),
    (("list", "a/b/c/d/e"), "more segments than an address"),
    (("prune", "--to-size", "10XB"), "is not a size"),
    (("prune", "--unused-for", "30"), "is not a duration"),
    (("prune",), "give what to remove"),
])
def test_bad_input_is_one_clear_line_and_exit_2(
        proxy: ProxyProcess, args: tuple[str, ...], message: str) -> None:
    result = proxy.cli("cache", *args)
    assert result.returncode == 2
    assert message in result.stderr
    no_escapes(result)


def test_a_missing_cache_directory_is_named_not_created(proxy: ProxyProcess) -> None:
    result = proxy.cli("cache", "list")
    assert result.returncode == 2, result.stdout
    assert f"no cache directory at {proxy.cache_dir}" in result.stderr
    assert not proxy.cache_dir.exists()
    no_escapes(result)


def test_a_cache_directory_the_store_cannot_open_is_one_line_not_a_traceback(
        proxy: ProxyProcess) -> None:
    proxy.cache_dir.mkdir()
    (proxy.cache_dir / "index").write_text("not the index")  # where the index must go
    result = proxy.cli("cache", "list")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith(f"tf-registry-proxy: list stopped: cache directory "
                           f"{proxy.cache_dir}: ")
    no_escapes(result)


def test_an_unreadable_cache_directory_is_one_clear_line(proxy: ProxyProcess) -> None:
    proxy.cache_dir.mkdir(mode=0o000)
    try:
        if os.access(proxy.cache_dir, os.R_OK):  # root reads anything: nothing to show
            pytest.skip("running as root: every directory is readable")
        result = proxy.cli("cache", "verify")
        assert result.returncode == 2
        assert "is not readable and writable by this user" in result.stderr
        no_escapes(result)
    finally:
        proxy.cache_dir.chmod(0o755)


def test_verify_passes_then_drops_a_corrupted_zip_which_is_then_fetched_again(
        proxy: ProxyProcess, filled: list[Fetched], registry: FakeRegistry) -> None:
    good = proxy.cli("cache", "verify")
    no_escapes(good)
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.splitlines()[-1].startswith("verify: 4 good")
    assert sum(line.startswith("ok ") for line in good.stdout.splitlines()) == 4

    # Bit rot: one byte changed in place, its write time put back. The server still takes
    # it for the file it checked (same identity); only reading it again tells.
    damaged = filled[1]
    path = proxy.cache_dir / damaged.key
    written = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(len(damaged.data) // 2)
        handle.write(bytes([damaged.data[len(damaged.data) // 2] ^ 0xFF]))
    os.utime(path, ns=(written.st_atime_ns, written.st_mtime_ns))

    # The dry run reports it as damaged; the real one drops it: both tell the audit log
    # and the running server's status page, not only the terminal.
    audit = proxy.cache_dir.parent / "audit.log"
    with_audit = {"TF_REGISTRY_PROXY_SERVER_AUDIT_LOG": str(audit)}
    assert proxy.cli("cache", "verify", "--dry-run", env=with_audit).returncode == 1
    bad = proxy.cli("cache", "verify", env=with_audit)
    no_escapes(bad)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"BAD {damaged.key}: the stored file has sha256" in bad.stdout
    _assert_reported(proxy, audit, damaged)
    assert "3 good" in bad.stdout and "1 bad (1 dropped" in bad.stdout
    assert not path.exists()
    index = disk_index(proxy.cache_dir)
    try:
        record = index.get(damaged.record)
        # The signed facts stay; what was recorded about the dropped file goes.
        assert record["shasum"] and (record["h1"], record["size"], record["stored_as"]) \
            == (None, None, None)
    finally:
        index.close()

    registry.requests.clear()
    assert fetch_again(proxy, damaged) == damaged.data
    assert registry.archive_requests(), "the dropped package was not fetched again"
    assert proxy.cli("cache", "verify").returncode == 0


def _assert_reported(proxy: ProxyProcess, audit: Path, damaged: Fetched) -> None:
    """The damaged package is in the audit log (damaged by the dry run, then dropped) and
    among the integrity failures on the status page of the proxy serving the cache."""
    host, namespace, type_ = damaged.address.split("/")
    assert damaged.platform is not None
    os_, arch = damaged.platform.split("_")
    identity = {"kind": "provider", "host": host, "namespace": namespace, "type": type_,
                "version": damaged.version, "os": os_, "arch": arch, "outcome": "integrity",
                "sha256_recorded": hashlib.sha256(damaged.data).hexdigest()}
    middle = len(damaged.data) // 2
    stored = damaged.data[:middle] + bytes([damaged.data[middle] ^ 0xFF]) \
        + damaged.data[middle + 1:]
    for event in ("damaged", "dropped"):
        [line] = events(audit, event, **identity)
        assert line["sha256_found"] == hashlib.sha256(stored).hexdigest()
        assert line["reason"].startswith("the stored file has sha256")
        assert line["client"] is None and line["token"] is None
    failures = json.loads(proxy.get("/status.json"))["integrity_failures"]
    named = [failure for failure in failures
             if failure["artifact"] == f"{damaged.address} {damaged.version} {damaged.platform}"]
    assert [failure["kind"] for failure in named] == ["stored", "stored"], failures
    assert named[0]["reason"].endswith("dropped, to be fetched again")
    assert named[1]["reason"].endswith("kept (--dry-run)")
    assert named[0]["time"] >= named[1]["time"]


def fetch_again(proxy: ProxyProcess, item: Fetched) -> bytes:
    type_ = item.address.rsplit("/", 1)[1]
    return proxy.get(f"/mirror/{item.address}/terraform-provider-{type_}_{item.version}_"
                     f"{item.platform}.zip")


def test_verify_reports_a_recorded_h1_that_the_bytes_do_not_have(
        proxy: ProxyProcess, filled: list[Fetched]) -> None:
    proxy.stop()
    index = disk_index(proxy.cache_dir)
    try:
        record = index.get(filled[0].record)
        index.set(filled[0].record, {**record, "h1": "h1:" + "A" * 43 + "="})
    finally:
        index.close()
    result = proxy.cli("cache", "verify", "hashicorp/null")
    assert result.returncode == 1
    assert f"BAD {filled[0].key}: the stored file has the right sha256 but h1" in result.stdout
    assert result.stdout.splitlines()[-1].startswith("verify: 1 good")  # null's other one


def test_verify_is_no_use_of_what_it_reads(proxy: ProxyProcess,
                                           filled: list[Fetched]) -> None:
    proxy.stop()
    _backdate(proxy.cache_dir, filled[2], 40)
    assert proxy.cli("cache", "verify").returncode == 0
    pruned = proxy.cli("cache", "prune", "--unused-for", "30d")
    assert f"removed {filled[2].key}" in pruned.stdout, pruned.stdout + pruned.stderr


def test_prune_by_age_filter_and_size_removes_the_right_entries(
        proxy: ProxyProcess, filled: list[Fetched]) -> None:
    proxy.stop()
    null_linux, null_darwin, random, module = filled
    _backdate(proxy.cache_dir, null_darwin, 40)
    everything = expected(filled)

    dry = proxy.cli("cache", "prune", "--unused-for", "30d", "--dry-run")
    no_escapes(dry)
    assert dry.returncode == 0, dry.stderr
    assert f"would remove {null_darwin.key} ({len(null_darwin.data)} bytes, unused)" \
        in dry.stdout
    assert listed(proxy.cli("cache", "list", "--json")) == everything  # dry: all there

    by_age = proxy.cli("cache", "prune", "--unused-for", "30d")
    assert by_age.stdout.splitlines()[-1].startswith("prune: removed 1 unused blobs and "
                                                     "1 records")
    assert listed(proxy.cli("cache", "list", "--json")) == expected([null_linux, random,
                                                                    module])

    by_filter = proxy.cli("cache", "prune", "registry.terraform.io/acme/*")
    assert f"removed {module.key}" in by_filter.stdout
    assert listed(proxy.cli("cache", "list", "--json")) == expected([null_linux, random])
    index = disk_index(proxy.cache_dir)
    try:
        assert index.get(module.record) is None and index.get(null_darwin.record) is None
    finally:
        index.close()

    _backdate(proxy.cache_dir, null_linux, 2)  # the least recently used of the two
    _backdate(proxy.cache_dir, random, 1)
    size = str(len(random.data))
    assert proxy.cli("cache", "prune", "--to-size", size, "--dry-run").returncode == 0
    assert listed(proxy.cli("cache", "list", "--json")) == expected([null_linux, random])
    # The top-level command is the same one.
    by_size = proxy.cli("prune", "--to-size", size)
    assert f"removed {null_linux.key} ({len(null_linux.data)} bytes, least recently used)" \
        in by_size.stdout, by_size.stdout + by_size.stderr
    assert listed(proxy.cli("cache", "list", "--json")) == expected([random])


def test_stats_counts_per_kind_and_host_with_the_limit(
        proxy: ProxyProcess, filled: list[Fetched]) -> None:
    result = proxy.cli("cache", "stats", "--json",
                       env={"TF_REGISTRY_PROXY_CACHE_MAX_SIZE": "10MiB"})
    no_escapes(result)
    stats = json.loads(result.stdout)
    packages = [f for f in filled if f.platform is not None]
    assert (stats["files"], stats["bytes"]) == (4, sum(len(f.data) for f in filled))
    assert (stats["providers"]["files"], stats["providers"]["addresses"]) == (3, 2)
    assert stats["providers"]["bytes"] == sum(len(f.data) for f in packages)
    assert (stats["modules"]["files"], stats["modules"]["addresses"]) == (1, 1)
    assert stats["hosts"]["registry.terraform.io"]["files"] == 4
    assert stats["limit_bytes"] == 10 << 20
    assert stats["oldest_use"] <= stats["newest_use"]
    text = proxy.cli("cache", "stats", env={"TF_REGISTRY_PROXY_CACHE_MAX_SIZE": "10MiB"})
    assert "limit: 10.0 MiB (cache.max_size)" in text.stdout
    assert f"  {RANDOM.split('/')[0]}: 4 files" in text.stdout


def test_on_a_terminal_verify_shows_a_progress_bar_instead_of_a_line_per_file(
        proxy: ProxyProcess, filled: list[Fetched], tmp_path: Path) -> None:
    out, terminal = on_terminal(proxy.config, tmp_path, "cache", "verify")
    assert "\x1b[" in terminal and "verify" in terminal, terminal  # the bar, drawn
    assert out.splitlines()[-1].startswith("verify: 4 good"), out
    assert not any(line.startswith("ok ") for line in out.splitlines())
    assert "\x1b" not in out
