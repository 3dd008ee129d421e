"""End to end in a browser: the expert cache page at /experts in headless Chromium, against
`colibri serve --expert-cache-size 12` on the bundled demo model (4 layers, 64 experts).

The page reads the API key from its field, folded away at first: when the server asks for a
key, the page unfolds the field and says a key is needed (or that the one given was refused),
and the chat page does the same with its settings. After a few chats it must show the hit rate the
server reports, and its grid must show each expert in the colour of the state the server
gives it (read back from the canvas' pixels), with resident experts among them. With every
expert resident it says the cache is off and still draws the tokens/s and batch charts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser_helpers import DevTools, chromium_page
from tests.server_helpers import SubprocessServer, wait_for

KEY = "sk-page"
CHAT = {"messages": [{"role": "user", "content": "Tell me about the river."}],
        "max_tokens": 32}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("converted")  # one conversion for both servers


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevTools]:
    with chromium_page(tmp_path_factory.mktemp("chromium-profile")) as devtools:
        yield devtools


def _serve(tmp: Path, cache_dir: Path, *args: str) -> SubprocessServer:
    return SubprocessServer(None, tmp, "--api-key", KEY, *args,
                            env={"COLIBRI_CACHE_DIR": str(cache_dir)}).wait_ready()


def _chats(url: str, n: int) -> None:
    """n chats; the last one more than a second after the others, so that its engine steps
    add a point to the history."""
    for i in range(n):
        if i == n - 1:
            time.sleep(1.05)
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "seed": i}, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text


def _api(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/v1/expert_cache", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return dict(r.json())


KEY_FIELD = """(() => {
  const field = document.getElementById('api-key');
  return {open: field.closest('details').open, shown: field.offsetParent !== null,
          focused: document.activeElement === field};
})()"""


def _status(page: DevTools) -> str:
    return str(page.eval("document.getElementById('status').textContent"))


def _open(page: DevTools, url: str) -> None:
    page.call("Page.enable")
    page.call("Page.navigate", url=url + "/experts")
    wait_for(lambda: page.eval("document.readyState") == "complete", 30, "page load")
    # without the key the page says why it has nothing to show, with the field in sight
    wait_for(lambda: "API key" in _status(page), 30, "the missing key on the page")
    assert _status(page) == "this server needs an API key: enter it in the API key field"
    assert page.eval(KEY_FIELD) == {"open": True, "shown": True, "focused": True}
    assert page.eval("window.expertData") is None
    page.eval("document.getElementById('api-key').value = 'sk-wrong'")
    wait_for(lambda: "refused" in _status(page), 30, "the wrong key on the page")
    assert _status(page) == "the server refused this API key: check it in the API key field"
    page.eval(f"document.getElementById('api-key').value = {json.dumps(KEY)}")
    wait_for(lambda: page.eval("window.expertData !== null"), 30, "the first answer")


# The canvas pixel at the centre of each cell, [layer][expert] -> [r, g, b].
CELL_PIXELS = """(() => {
  const g = window.gridGeometry, d = window.expertData;
  const ctx = document.getElementById('grid').getContext('2d');
  const rows = [];
  for (let l = 0; l < d.n_layer; l++) {
    const row = [];
    for (let e = 0; e < d.n_expert; e++) {
      const x = Math.floor((g.x0 + (e + 0.5) * g.cw) * g.dpr);
      const y = Math.floor((g.y0 + (l + 0.5) * g.ch) * g.dpr);
      row.push(Array.from(ctx.getImageData(x, y, 1, 1).data.slice(0, 3)));
    }
    rows.push(row);
  }
  return {pixels: rows, state: d.state};
})()"""


def _state_of(rgb: list[int]) -> int:
    """The residency a cell's colour says: grey absent, amber loading, blue resident,
    green pinned (the shade, lighter or darker, is the heat)."""
    r, g, b = rgb
    if max(rgb) - min(rgb) < 16:
        return 0
    if b >= r and b >= g:
        return 2
    if g >= r:
        return 3
    return 1


def _numbers(page: DevTools) -> dict[str, str]:
    return dict(page.eval("""(() => {
      const out = {};
      for (const id of ['hit-rate', 'resident', 'bytes-read', 'stall', 'slots'])
        out[id] = document.getElementById(id).textContent;
      out.value = document.getElementById('hit-rate').dataset.value || '';
      return out;
    })()"""))


def _chart_ink(page: DevTools, chart: str) -> int:
    """Pixels of the line colour on a chart canvas."""
    return int(page.eval(f"""(() => {{
      const c = document.getElementById({json.dumps(chart)});
      const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      let n = 0;
      for (let i = 0; i < px.length; i += 4)
        if (px[i + 3] > 0 && px[i + 2] > 150 && px[i] < 100) n++;
      return n;
    }})()"""))


def test_page_shows_residency_and_hit_rate(tmp_path: Path, cache_dir: Path,
                                           page: DevTools) -> None:
    srv = _serve(tmp_path / "run", cache_dir, "--expert-cache-size", "12")
    try:
        _open(page, srv.url)
        assert page.eval("document.getElementById('off').hidden") is True
        before = _numbers(page)
        assert before["hit-rate"] == "–" and before["slots"] == "12 of 64", before
        _chats(srv.url, 3)
        # once the engine is idle the counters stand still: the page catches up with them
        want = _api(srv.url)
        wait_for(lambda: page.eval("window.expertData.totals") == want["totals"], 30,
                 "the page to show the latest counters")
        got = _numbers(page)
        rate = want["totals"]["hit_rate"]
        assert got["hit-rate"] != before["hit-rate"]
        assert float(got["value"]) == rate
        assert got["hit-rate"].endswith("%")
        assert abs(float(got["hit-rate"][:-1]) - 100 * rate) <= 0.05, (got, rate)
        budget_mb = want["budget_bytes"] / 1e6
        assert got["resident"].endswith(f" of {budget_mb:.2f} MB"), got
        assert got["bytes-read"].endswith(" MB") and got["stall"].endswith(" s"), got

        drawn = page.eval(CELL_PIXELS)
        states = drawn["state"]
        shown = [[_state_of(px) for px in row] for row in drawn["pixels"]]
        assert shown == states, (shown, states)
        assert states == want["state"]
        for row in shown:
            assert 1 <= sum(s >= 2 for s in row) <= 12, row
        # the tokens/s and batch charts have a line (or dots) on them
        assert _chart_ink(page, "chart-tok") > 0 and _chart_ink(page, "chart-batch") > 0
    finally:
        code = srv.stop()
    assert code == 0, srv.log()


def test_page_says_when_the_cache_is_off(tmp_path: Path, cache_dir: Path,
                                         page: DevTools) -> None:
    srv = _serve(tmp_path / "run", cache_dir, "--expert-cache-size", "64")
    try:
        _open(page, srv.url)
        _chats(srv.url, 2)
        wait_for(lambda: page.eval("window.expertData.history.length") > 0, 30,
                 "a history point on the page")
        assert page.eval("document.getElementById('off').hidden") is False
        text = page.eval("document.getElementById('off').textContent")
        assert "off" in text and "every expert is resident" in text, text
        visible = "(id) => document.getElementById(id).offsetParent !== null"
        assert page.eval(f"({visible})('grid')") is False
        assert page.eval(f"({visible})('chart-hit')") is False
        assert page.eval(f"({visible})('chart-tok')") is True
        assert page.eval(f"({visible})('chart-batch')") is True
        wait_for(lambda: _chart_ink(page, "chart-tok") > 0, 30, "the tokens/s chart")
        assert _chart_ink(page, "chart-batch") > 0
        assert _numbers(page)["slots"] == "64 of 64"
    finally:
        code = srv.stop()
    assert code == 0, srv.log()


def test_chat_page_unfolds_its_settings_for_the_key(tmp_path: Path, cache_dir: Path,
                                                    page: DevTools) -> None:
    srv = _serve(tmp_path / "run", cache_dir, "--expert-cache-size", "64")
    try:
        page.call("Page.enable")
        page.call("Page.navigate", url=srv.url + "/")
        wait_for(lambda: page.eval("document.readyState") == "complete", 30, "page load")
        model = "document.getElementById('model').textContent"
        wait_for(lambda: "API key" in page.eval(model), 30, "the missing key on the page")
        assert page.eval(model) == "this server needs an API key: enter it under Settings"
        assert page.eval(KEY_FIELD) == {"open": True, "shown": True, "focused": True}
        page.eval(f"""const f = document.getElementById('api-key');
                      f.value = {json.dumps(KEY)};
                      f.dispatchEvent(new Event('change'));""")
        wait_for(lambda: "API key" not in page.eval(model), 30, "the model name")
        assert page.eval(model) == httpx.get(srv.url + "/v1/models", headers={
            "Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
    finally:
        code = srv.stop()
    assert code == 0, srv.log()
