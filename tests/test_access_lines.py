"""The access log as the server writes it: each line built in one step, byte for byte what
the logging formatters made of it before, written in batches by a thread that never blocks
a request (a stuck reader costs dropped, counted lines) and writes everything out on a
clean stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from aiohttp import hdrs, web
from aiohttp.test_utils import make_mocked_request
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.cli.logs import JsonLineFormatter
from proxy.core.line_writer import CHUNK_BYTES, MAKE_AT_ONCE, MOST_TURNS, BatchedLineWriter
from proxy.core.redaction import mask_secrets
from proxy.web import access_log
from proxy.web.access_log import (
    ACCESS_FIELDS,
    ACCESS_LOGGER,
    AccessLines,
    PlainAccessLogger,
    plain_text,
)
from proxy.web.quick_answers import QuickAnswer
from tests.support.proxy_process import ProxyProcess, free_port

FIELDS = {"remote": "10.0.0.7", "method": "GET", "path": "/mirror/a.zip?sig=***",
          "status": 200, "bytes": 5911040, "duration_ms": 12.3, "cache": "hit", "aborted": "-"}


def _record(created: float, json_fields: bool) -> logging.LogRecord:
    record = logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 1, "%s",
                               (json.dumps(FIELDS, separators=(",", ":")) if json_fields
                                else plain_text(FIELDS),), None)
    record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0
    if json_fields:
        setattr(record, ACCESS_FIELDS, FIELDS)
    return record


class _Drain:
    """Reads a pipe to its end on a thread of its own: what was written to it."""

    def __init__(self, read_end: int) -> None:
        self._received = bytearray()
        self._thread = threading.Thread(target=self._read, args=(read_end,))
        self._thread.start()

    def _read(self, read_end: int) -> None:
        while chunk := os.read(read_end, 65536):
            self._received.extend(chunk)

    def lines(self) -> list[str]:
        """Once every write end is closed: the lines read."""
        self._thread.join(10)
        return bytes(self._received).decode(errors="replace").splitlines()


@pytest.mark.parametrize("worker", [None, 1])
@pytest.mark.parametrize("log_format", ["text", "json"])
@pytest.mark.parametrize("access_format", ["plain", "json"])
def test_each_line_is_what_the_formatters_wrote(access_format: str, log_format: str,
                                                worker: int | None) -> None:
    """The formatters the server configured before (the root handler's for plain lines,
    the JSON one for JSON access lines), against the line built in one step."""
    created = 1_795_000_000.0437
    if access_format == "json" or log_format == "json":
        formatter: logging.Formatter = JsonLineFormatter(worker)
    else:
        who = f"w{worker} " if worker is not None else ""
        formatter = logging.Formatter(f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s")
    expected = formatter.format(_record(created, access_format == "json"))
    writer = BatchedLineWriter(os.open(os.devnull, os.O_WRONLY))
    try:
        built = AccessLines(access_format, log_format, worker, writer).line(FIELDS, created)
    finally:
        writer.close()
    assert built == expected + "\n"


@pytest.mark.parametrize("worker", [None, 1])
@pytest.mark.parametrize(("method", "status"), [("GET", 200), ("HEAD", 200), ("GET", 304)])
def test_a_kept_answers_line_is_the_line_of_any_answer(
        method: str, status: int, worker: int | None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A QuickAnswer's line (its fixed part made once: GET 200 in text lines) has the same
    characters as the line of a handler's answer with the same fields."""
    monkeypatch.setattr("proxy.web.access_log.time.time", lambda: 1_795_000_000.0437)
    transport = mock.Mock()
    transport.get_extra_info.return_value = ("10.0.0.7", 50123)
    request = make_mocked_request(method, "/mirror/h/n/t/index.json?token=s3cr3t",
                                  transport=transport)
    body = b'{"versions":{"1.0.0":{}}}'
    headers = {hdrs.ETAG: '"x"', hdrs.CONTENT_TYPE: "application/json"}
    kept = QuickAnswer(mask_secrets(request.path_qs), status=status,
                       body=body if status == 200 else None, headers=headers)
    handled = web.Response(status=status, body=body if status == 200 else None,
                           headers=headers)
    built_from_fields: list[int] = []
    from_fields = access_log.request_line_fields

    def counted(*args: Any) -> dict[str, Any]:
        built_from_fields.append(1)
        return from_fields(*args)

    monkeypatch.setattr(access_log, "request_line_fields", counted)
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    logger = logging.Logger(ACCESS_LOGGER)  # its own, outside logging's tree
    lines = AccessLines("plain", "text", worker, BatchedLineWriter(fd))
    logger.addHandler(lines)
    logger.propagate = False
    try:
        access = PlainAccessLogger(logger, "")
        for response in (kept, handled):
            access.log(request, response, 0.01234)
    finally:
        lines.close()
        os.close(fd)
    written = out.read_text().splitlines()
    assert len(written) == 2
    assert written[0] == written[1]
    assert "token=***" in written[0] and "s3cr3t" not in written[0]
    # A 200 to a GET, in text lines: the kept answer's line was not built from fields.
    assert len(built_from_fields) == (1 if (method, status) == ("GET", 200) else 2)


async def test_a_line_is_made_with_its_batch_not_while_its_request_is_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the loop, a request leaves its fields; its line is made when its batch is handed
    over (one after another, lines cost less), in the order the requests ended."""
    made: list[str] = []
    plain = access_log.plain_text

    def counted(fields: dict[str, Any]) -> str:
        made.append(fields["path"])
        return plain(fields)

    monkeypatch.setattr(access_log, "plain_text", counted)
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    writer = BatchedLineWriter(fd)
    lines = AccessLines("plain", "text", None, writer)
    try:
        for number in range(3):
            lines.write({**FIELDS, "path": f"/mirror/{number}.zip"})
        writer.add("a line made already\n")
        assert made == []  # nothing made while requests are answered
        await asyncio.sleep(0.1)  # the batch is handed over
        assert made == [f"/mirror/{number}.zip" for number in range(3)]
    finally:
        lines.close()
        os.close(fd)
    written = out.read_text().splitlines()
    assert [line.split('"')[1] for line in written[:3]] == [
        f"GET /mirror/{number}.zip" for number in range(3)]
    assert written[3] == "a line made already"


@pytest.mark.parametrize("count", [MOST_TURNS * MAKE_AT_ONCE - 5, 40 * MAKE_AT_ONCE])
async def test_a_busy_batch_is_made_a_few_lines_per_loop_turn_and_written_whole(
        tmp_path: Path, count: int) -> None:
    """Several hundred lines made in one callback held the loop about a millisecond (the p99
    of kept answers): the loop gets its turns between every MAKE_AT_ONCE lines (a bigger
    batch: in MOST_TURNS turns, so that making keeps up with any load); the batch still
    goes out in one write, and lines added meanwhile follow it, in the order added."""
    turns = 0
    ticking = True

    def tick() -> None:
        nonlocal turns
        turns += 1
        if ticking:
            asyncio.get_running_loop().call_soon(tick)

    made_at: list[int] = []

    def make(number: int) -> str:
        made_at.append(turns)
        return f"line {number}\n"

    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    writer = BatchedLineWriter(fd)
    try:
        for number in range(count):
            writer.add((make, number))
        tick()
        for _poll in range(5000):  # until the batch is being made: what comes then is next
            if made_at:
                break
            await asyncio.sleep(0.001)
        assert made_at
        writer.add((make, count))
        await asyncio.sleep(0.2)  # both handed over, made, written
    finally:
        ticking = False
        writer.close()
        os.close(fd)
    assert out.read_text() == "".join(f"line {number}\n" for number in range(count + 1))
    first = made_at[:count]
    per_turn = [first.count(turn) for turn in sorted(set(first))]
    assert len(per_turn) == MOST_TURNS
    assert max(per_turn) == max(MAKE_AT_ONCE, -(-count // MOST_TURNS))


@pytest.mark.parametrize("log_format", ["text", "json"])
@pytest.mark.parametrize("access_format", ["plain", "json"])
def test_a_record_logged_another_way_is_the_line_the_formatters_wrote(
        access_format: str, log_format: str, tmp_path: Path) -> None:
    """A record that reaches the handler through logging (the access loggers' own path when
    the handler is not theirs alone): written as it was, never wrapped in made-up fields."""
    record = _record(1_795_000_000.0437, access_format == "json")
    if access_format == "json" or log_format == "json":
        formatter: logging.Formatter = JsonLineFormatter(1)
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s w1 %(name)s: %(message)s")
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    handler = AccessLines(access_format, log_format, 1, BatchedLineWriter(fd))
    handler.emit(record)
    handler.close()
    os.close(fd)
    assert out.read_text() == formatter.format(record) + "\n"


# Steps between lines: seconds later (often within the same millisecond or second as the
# line before, sometimes not), the request's duration, the level of a line logged another way.
_STEPS = st.lists(st.tuples(
    st.one_of(st.just(0.0), st.floats(0, 0.002), st.floats(0, 3)),
    st.one_of(st.floats(0, 0.01), st.floats(0, 600)),
    st.sampled_from(["INFO", "INFO", "WARNING"])), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(start=st.floats(1_700_000_000, 1_900_000_000), steps=_STEPS)
# Times whose milliseconds come out one lower from (t - int(t)) * 1000, as logging counts
# them, than from t * 1000.
@example(start=1712692115.429, steps=[(0.0, 0.0123, "INFO")])
@example(start=1897491186.231, steps=[(0.0, 1.5, "WARNING"), (0.0, 0.5, "INFO")])
def test_lines_made_one_after_another_are_what_the_formatters_wrote(
        start: float, steps: list[tuple[float, float, str]]) -> None:
    """Lines made in a row (a batch: each reuses what the line before made for its
    millisecond and second) have the characters logging's formatter gives each alone; a kept
    answer's line those of a handler's answer with the same fields."""
    formatter = logging.Formatter("%(asctime)s %(levelname)s w1 %(name)s: %(message)s")
    writer = BatchedLineWriter(os.open(os.devnull, os.O_WRONLY))
    made: list[str] = []
    writer.add = lambda line: made.append(  # type: ignore[method-assign]
        line if isinstance(line, str) else line[0](*line[1:]))
    lines = AccessLines("plain", "text", 1, writer)
    created = start
    try:
        for later, seconds, level in steps:
            created += later
            fields = {**FIELDS, "duration_ms": round(seconds * 1000, 1), "cache": "-"}
            record = logging.LogRecord(ACCESS_LOGGER, getattr(logging, level), __file__, 1,
                                       "%s", (plain_text(fields),), None)
            record.created = created
            record.msecs = int((created - int(created)) * 1000) + 0.0
            expected = formatter.format(record) + "\n"
            if level != "INFO":  # a record logged to the access logger another way
                lines.emit(record)
                assert made.pop() == expected
                continue
            assert lines.line(fields, created) == expected
            kept = QuickAnswer(str(fields["path"]), status=200, body=b"x" * 5911040,
                               headers={})
            with mock.patch("proxy.web.access_log.time.time", return_value=created):
                lines.write_quick(str(fields["remote"]), kept, seconds)
            assert made.pop() == expected
    finally:
        writer.close()


def test_a_stuck_reader_drops_and_counts_lines_but_never_blocks(
        caplog: pytest.LogCaptureFixture) -> None:
    read_end, write_end = os.pipe()  # nobody reads until the end: the pipe fills
    writer = BatchedLineWriter(write_end, backlog_size=200_000)
    line = "x" * 99 + "\n"
    started = time.monotonic()
    for _ in range(20_000):  # 2 MB: far beyond the pipe (64 KiB) and the backlog
        writer.add(line)
    assert time.monotonic() - started < 2  # never waited on the pipe
    deadline = time.monotonic() + 5
    while writer.dropped == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.dropped > 0
    reader = _Drain(read_end)
    writer.close()
    os.close(write_end)
    lines = reader.lines()
    assert set(lines) == {line.strip()}  # whole lines only
    assert len(lines) + writer.dropped == 20_000
    # Reported by the writer thread once it got through (it alone may wait on the output).
    assert f"({writer.dropped} dropped since the start)" in caplog.text


def test_the_drop_report_does_not_wait_on_the_stuck_output() -> None:
    """The report goes to the log, which a server writes to the same stuck stderr: it must
    not block the thread that adds lines (the event loop) either."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    with contextlib.suppress(BlockingIOError):
        while True:  # the pipe full before the first line
            os.write(write_end, b"." * 4096)
    os.set_blocking(write_end, True)
    stuck = open(write_end, "w", closefd=False)  # closed below
    handler = logging.StreamHandler(stuck)
    reports = logging.getLogger("proxy.core.line_writer")
    reports.addHandler(handler)
    writer = BatchedLineWriter(write_end, backlog_size=100_000)
    adding = threading.Thread(target=lambda: [writer.add("z" * 99 + "\n")
                                              for _ in range(20_000)])
    try:
        adding.start()
        adding.join(5)
        assert not adding.is_alive(), "adding lines waited on the stuck output"
    finally:
        drained = _Drain(read_end)
        adding.join(10)
        writer.close()
        reports.removeHandler(handler)
        stuck.close()
        os.close(write_end)
        drained.lines()
        os.close(read_end)


def _write_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the writes the line writer makes from now on."""
    sizes: list[int] = []
    real_write = os.write

    def recorded(fd: int, data: bytes | memoryview) -> int:
        sizes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr("proxy.core.line_writer.os.write", recorded)
    return sizes


def _write_served(fd: int, lines: list[str]) -> None:
    """lines added on a loop, as a server adds them (handed over in batches), then written
    out by a clean stop."""
    writer = BatchedLineWriter(fd)

    async def serving() -> None:
        for line in lines:
            writer.add(line)
        await asyncio.sleep(0.1)

    asyncio.run(serving())
    writer.close()
    os.close(fd)


def test_chunks_are_counted_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines with multi-byte characters (a path's) still go in writes of at most PIPE_BUF
    bytes, so that no write of whole lines is split on a pipe."""
    sizes = _write_sizes(monkeypatch)
    # Each 1,000+ bytes in 500+ characters.
    lines = [f"GET /mirror/{number}/" + "é" * 500 + "\n" for number in range(200)]
    _write_served(os.open(os.devnull, os.O_WRONLY), lines)
    assert sum(sizes) == sum(len(line.encode()) for line in lines)
    assert max(sizes) <= CHUNK_BYTES


def test_a_regular_file_takes_each_batch_in_one_write(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A log file (not a pipe) gets a batch in one write: every write the thread makes
    wants the GIL back from the serving loop."""
    sizes = _write_sizes(monkeypatch)
    out = tmp_path / "access.log"
    lines = [f"GET /mirror/{number}/index.json 200\n" for number in range(1000)]
    _write_served(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND), lines)
    assert out.read_text() == "".join(lines)
    assert sizes == [len("".join(lines))]


def test_undecodable_bytes_come_out_as_escapes_as_before(tmp_path: Path) -> None:
    """What a StreamHandler on stderr wrote for a path with bytes that are not UTF-8."""
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    writer = BatchedLineWriter(fd)
    writer.add("GET /mirror/\udcff.json\n")
    writer.close()
    os.close(fd)
    assert out.read_bytes() == b"GET /mirror/\\udcff.json\n"


def test_lines_lost_to_a_failed_output_are_counted_and_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read: every write fails (EPIPE)
    writer = BatchedLineWriter(write_end)
    for _ in range(10):
        writer.add("GET /\n")
    writer.close()
    os.close(write_end)
    assert writer.dropped == 10
    assert "(10 dropped since the start)" in caplog.text


def test_lines_of_writers_sharing_a_pipe_never_interleave() -> None:
    read_end, write_end = os.pipe()
    reader = _Drain(read_end)
    writers = [BatchedLineWriter(write_end) for _ in range(2)]

    def write(index: int) -> None:
        async def serving() -> None:  # on a loop, lines are handed over (and written) in batches
            for number in range(5000):
                writers[index].add(f"{index}:{number:05d}:" + "y" * (37 + number % 90) + "\n")
                if number % 500 == 499:
                    await asyncio.sleep(0.001)

        asyncio.run(serving())

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for writer in writers:
        writer.close()
    os.close(write_end)
    lines = reader.lines()
    assert len(lines) == 10_000
    assert all(re.fullmatch(r"[01]:\d{5}:y+", line) for line in lines)


def test_a_clean_stop_writes_every_access_line(tmp_path: Path,
                                               write_config: Callable[..., Path]) -> None:
    port, cache, log = free_port(), tmp_path / "cache", tmp_path / "proxy.log"
    with ProxyProcess(write_config(cache_dir=cache, port=port), cache, port, log,
                      env={"TF_REGISTRY_PROXY_SERVER_ACCESS_LOG": "json",
                           # Workers leave by os._exit: no logging.shutdown writes for them.
                           "TF_REGISTRY_PROXY_SERVER_WORKERS": "2"}) as proxy:
        for number in range(300):
            proxy.get(f"/healthz?n={number}")
    written = [json.loads(line) for line in log.read_text().splitlines()
               if line.startswith("{")]
    numbers = {line["path"] for line in written if line["path"].startswith("/healthz?n=")}
    assert numbers == {f"/healthz?n={n}" for n in range(300)}


def test_a_line_that_cannot_be_made_costs_that_line_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    writer = BatchedLineWriter(fd)

    def broken() -> str:
        raise ValueError("cannot")

    writer.add("before\n")
    writer.add((broken,))
    writer.add(("{}\n".format, "after"))
    writer.close()
    os.close(fd)
    assert out.read_text() == "before\nafter\n"
    assert writer.dropped == 1
