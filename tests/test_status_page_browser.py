"""The status page in a real headless browser (Debian's Chromium): the DOM it renders shows
what the proxy did, hostile text stays text, and the screenshot is a real, non-blank picture
of the window. Fails, never skips, without chromium (CI installs it)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from proxy.web.routes import STATUS_KEY
from tests.conftest import AppClient
from tests.support.browser import dump_dom, screenshot
from tests.support.fake_registry import FakeRegistry
from tests.support.mirror_paths import archive_path
from tests.support.page_reader import PageReader

NULL = "registry.terraform.io/hashicorp/null"
RANDOM = "registry.terraform.io/hashicorp/random"
HOSTILE = '<script>document.title="pwned"</script><img src=x onerror="document.title=1">'
WIDTH, HEIGHT = 1280, 900
HEADER_COLOR = (0x1D, 0x35, 0x57)  # the page's header background


async def test_the_page_renders_what_the_proxy_did(make: AppClient, registry: FakeRegistry,
                                                   tmp_path: Path) -> None:
    client = await make(cache_max_size="10MiB")
    for _ in range(2):  # a miss, then a hit
        response = await client.get(archive_path("linux_amd64"))
        assert response.status == 200
        await response.read()
    registry.faults.add("badsig")
    response = await client.get(f"/mirror/{RANDOM}/3.6.0.json")
    assert response.status == 502
    registry.faults.clear()
    # What a hostile upstream could put into a failure's text.
    client.app[STATUS_KEY].activity.integrity_failure(HOSTILE, "checksum", HOSTILE)
    url = str(client.make_url("/"))

    page = PageReader(await dump_dom(url, tmp_path / "browser"))

    assert page.texts["mode"] == "online"
    assert page.body_rows("top-providers") == [[NULL, "2"]]
    assert [row[1:3] for row in page.body_rows("integrity")] == [
        [HOSTILE, "checksum"], [f"{RANDOM} 3.6.0 SHA256SUMS", "signature"]]
    assert page.body_rows("integrity")[0][3] == HOSTILE
    assert "script" not in page.tags and "img" not in page.tags
    assert page.title == "tf-registry-proxy status"
    upstreams = {row[0]: row for row in page.body_rows("upstreams")}
    assert set(upstreams) >= {"registry.terraform.io", "registry.opentofu.org"}
    assert upstreams["registry.terraform.io"][1] != "—"  # a last success
    assert "of 10.0 MiB" in page.texts["cache"] and "1 file" in page.texts["cache"]
    assert page.texts["hit-rate"].startswith("Hit rate 50.0% 1 of 2 files from the cache")
    assert page.texts["fills"].startswith("Fills in flight 0")
    assert [row[2:4] for row in page.body_rows("recent-pulls")] == [
        [f"{NULL} 3.2.1", "hit"], [f"{NULL} 3.2.1", "miss"]]

    # The inventory: what `cache list` lists (here: the one package the cache holds).
    inventory = PageReader(await dump_dom(str(client.make_url("/status/cache?q=null")),
                                          tmp_path / "browser"))
    [held] = inventory.body_rows("held")
    assert held[:4] == ["provider", NULL, "3.2.1", "linux_amd64"]
    assert held[5] != "—"  # its last use

    picture = tmp_path / "status.png"
    await screenshot(url, picture, tmp_path / "browser", WIDTH, HEIGHT)
    with Image.open(picture) as image:
        assert image.format == "PNG" and image.size == (WIDTH, HEIGHT)
        pixels = image.convert("RGB")
        colors = pixels.getcolors(maxcolors=WIDTH * HEIGHT)
        assert colors is not None and len(colors) > 50  # text, tables, cards: not blank
        assert pixels.getpixel((5, 5)) == HEADER_COLOR  # the inline CSS was applied
        assert pixels.getpixel((WIDTH // 2, HEIGHT - 5)) != HEADER_COLOR
