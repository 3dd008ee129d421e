"""End to end in a browser: the expert cache page at /experts in headless Chromium, against
`colibri serve --expert-cache-size 12` on the bundled demo model (4 layers, 64 experts).

The page reads the API key from its field, folded away at first: when the server asks for a
key, the page unfolds the field and says a key is needed (or that the one given was refused),
and the chat page does the same with its settings. After a few chats it must show the hit rate the
server reports, and its grid must show each expert in the colour of the state the server
gives it (read back from the canvas' pixels), with resident experts among them. With every
expert resident it says the cache is off and still draws the tokens/s and batch charts.
With routed experts on a GPU (`--device torch-cpu --gpu-memory-mb`, the torch path on the CPU,
on a tiny Mixtral), /v1/expert_cache lists the experts the placement put on the device, and
the grid draws exactly those cells in the GPU's colour and every other one in RAM's, beside
the GPU tier's counters (every counter the tier keeps, those the page has no label for too).
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
  return {pixels: rows, state: d.state, gpu_tier: d.gpu_tier};
})()"""


ON_GPU = 4  # after the cache's states 0 to 3


def _state_of(rgb: list[int]) -> int:
    """Where a cell's colour says its expert is: grey absent, amber loading, blue resident,
    green pinned, purple on the GPU (the shade, lighter or darker, is the heat)."""
    r, g, b = rgb
    if max(rgb) - min(rgb) < 16:
        return 0
    if b >= r and b >= g:
        return ON_GPU if r > g else 2
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


# -- routed experts on a GPU (the torch path on the CPU) -----------------------------------------

N_CTX = 64
@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny Mixtral (2 MoE layers of 4 experts), a simulated device profile, a budget that
    fits the layers' always-used work and 3 routed experts, and the placement it plans."""
    pytest.importorskip("torch")
    from colibri.engine.executor.costmodel import (
        CpuProfile,
        DeviceProfile,
        GpuProfile,
        model_costs,
    )
    from colibri.engine.executor.placement import plan_placement
    from colibri.engine.format.convert import convert
    from colibri.engine.models.config import ModelConfig
    from tests.tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("gpu")
    path = convert(make_checkpoint("mixtral", root / "hf", seed=3), root / "f32", quant="f32",
                   progress=False)
    cfg = ModelConfig.from_dir(path)
    sim = DeviceProfile("sim", "simulated", CpuProfile(20.0, {"f32": 25.0}),
                        GpuProfile("sim-gpu", 1000, 2000.0, 10000.0, 10.0, 0.0, 0.0))
    profile = root / "sim.json"
    profile.write_text(sim.to_json())
    mc = model_costs(path, cfg, context=N_CTX)
    per = mc.experts[cfg.moe_layers[0]].gpu_bytes
    mb = (sum(i.gpu_bytes for i in mc.always) + 3 * per + per // 2) / 1e6
    placement, _text, _plan = plan_placement(path, cfg, sim, mb, N_CTX)
    assert placement is not None
    want = [[int(il in cfg.moe_layers and placement.of_expert(il, e) == "torch")
             for e in range(cfg.n_expert)] for il in range(cfg.n_layer)]
    assert sum(map(sum, want)) == 3
    return {"path": path, "profile": profile, "mb": mb, "want": want, "cfg": cfg}


def _completions(url: str, n: int) -> None:
    """n completions, the last one more than a second after the others (a history point)."""
    for i in range(n):
        if i == n - 1:
            time.sleep(1.05)
        r = httpx.post(url + "/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"prompt": "The river runs", "max_tokens": 16, "seed": i})
        assert r.status_code == 200, r.text


def _tier_numbers(page: DevTools) -> dict[str, str]:
    return dict(page.eval("""(() => {
      const out = {};
      for (const el of document.querySelectorAll('#tier-numbers .num span:last-child'))
        out[el.id] = el.textContent;
      return out;
    })()"""))


def test_page_shows_the_experts_on_the_gpu(tmp_path: Path, gpu_model: dict[str, Any],
                                           page: DevTools) -> None:
    srv = SubprocessServer(gpu_model["path"], tmp_path / "run", "--api-key", KEY,
                           "--device", "torch-cpu", "--gpu-memory-mb", str(gpu_model["mb"]),
                           "--device-profile", str(gpu_model["profile"]),
                           "--n-ctx", str(N_CTX), "--threads", "2").wait_ready()
    try:
        # before any step the device holds what the placement put there, and nothing else
        first = _api(srv.url)
        tier = first["gpu_tier"]
        assert first["enabled"] is False and first.get("state") is None
        assert tier["on_device"] == gpu_model["want"]
        assert tier["experts_on_device"] == 3
        assert tier["layers"] == gpu_model["cfg"].moe_layers
        assert {"hits", "misses", "uploads", "upload_bytes", "evictions", "steps"} <= set(
            tier["counter_names"])
        assert all(tier[k] == 0 for k in tier["counter_names"])
        assert "device: torch-cpu, placement under" in srv.log()

        _open(page, srv.url)
        _completions(srv.url, 3)
        want = _api(srv.url)
        wait_for(lambda: page.eval("window.expertData.gpu_tier") == want["gpu_tier"], 30,
                 "the page to show the latest counters")
        tier = want["gpu_tier"]
        used = tier["hits"] + tier["misses"]
        cfg = gpu_model["cfg"]
        # every token chose n_expert_used experts in each layer on the GPU
        assert used > 0 and used % (cfg.n_expert_used * len(cfg.moe_layers)) == 0
        # the tier swaps experts, never adds one: 3 stay on the device
        assert tier["experts_on_device"] == 3 == sum(map(sum, tier["on_device"]))
        assert tier["uploads"] == tier["evictions"]

        drawn = page.eval(CELL_PIXELS)
        shown = [[_state_of(px) for px in row] for row in drawn["pixels"]]
        expected = [[ON_GPU if on else 2 for on in row] for row in tier["on_device"]]
        assert shown == expected, (shown, tier["on_device"])

        visible = "(id) => document.getElementById(id).offsetParent !== null"
        assert page.eval(f"({visible})('grid')") is True
        assert page.eval(f"({visible})('tier-numbers')") is True
        assert page.eval(f"({visible})('chart-hit')") is False  # the cache's own: off
        legend = page.eval("""Array.from(document.querySelectorAll('.legend span'))
            .filter((el) => el.offsetParent !== null).map((el) => el.textContent)""")
        assert legend[:2] == ["in RAM (resident)", "on the GPU"], legend
        text = page.eval("document.getElementById('off').textContent")
        assert "in RAM or on the GPU" in text, text

        nums = _tier_numbers(page)
        n_experts = len(cfg.moe_layers) * cfg.n_expert
        assert nums["tier-on-device"].startswith(f"3 of {n_experts} ("), nums
        assert abs(float(nums["tier-hit-rate"][:-1]) - 100 * tier["hits"] / used) <= 0.05, nums
        assert nums["tier-uploads"].startswith(f"{tier['uploads']} ("), nums
        assert nums["tier-evictions"] == str(tier["evictions"])
        # a counter the page has no label for is shown by its name
        assert nums["tier-steps"] == str(tier["steps"]) and tier["steps"] > 0, nums
        metrics = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        for key in tier["counter_names"]:
            assert f"colibri_gpu_tier_{key}_total {tier[key]}" in metrics, key
        assert "colibri_gpu_tier_experts_on_device 3" in metrics
    finally:
        code = srv.stop()
    assert code == 0, srv.log()
