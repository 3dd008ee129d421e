"""Everything around the model follows the new families: a dense model, a GLM-4.5 model
(two dense layers, then routed and shared experts) and a Llama 4 model (dense and MoE layers
interleaved: dense, MoE, MoE, dense) served through the real app, with the engine's default
settings matching transformers at f32 (gpt-oss too, its 40-token prompt five times its sliding
window; MiniMax-M2; Llama 4, its prompt five times its attention chunk), the expert cache and
its page counting only the layers with experts, `colibri info` naming the layers, and routing
traces holding the MoE layers only."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.app.schemas import ExpertCacheInfo  # noqa: E402
from tests.server_helpers import InProcessServer, wait_for  # noqa: E402
from tests.tiny_models import make_checkpoint  # noqa: E402

N_CTX = 128


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {a: make_checkpoint(a, root / a, seed=3)
            for a in ("llama", "glm4_moe", "gpt_oss", "minimax_m2", "llama4")}


def _llm(hf: Path, quant: str, **engine: Any) -> Any:
    from colibri.engine import LLM, EngineConfig

    return LLM(hf, threads=2, quant=quant, n_ctx=N_CTX, config=EngineConfig(**engine))


@pytest.mark.parametrize("arch", ["llama", "glm4_moe", "gpt_oss", "minimax_m2", "llama4"])
def test_default_settings_match_transformers_at_f32(ckpts: dict[str, Path], arch: str) -> None:
    """The engine's defaults (KV type auto: f32 for an f32 model) keep the 1e-4 parity."""
    llm = _llm(ckpts[arch], "f32")
    assert llm.model.kv_type == "f32"
    ids = np.random.default_rng(5).integers(0, 320, 40).astype(np.int32)
    ours = llm.logits(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpts[arch]), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    assert float(np.abs(ours - ref).max() / np.abs(ref).max()) <= 1e-4


def _app(llm: Any) -> Any:
    from colibri.app.server import create_app
    from colibri.app.settings import Settings

    return create_app(Settings(_env_file=None), loader=lambda: llm.core)  # type: ignore[call-arg]


@pytest.fixture(scope="module")
def glm_server(ckpts: dict[str, Path]) -> Iterator[InProcessServer]:
    from colibri.engine.core.options import ExpertCacheConfig

    llm = _llm(ckpts["glm4_moe"], "q8",
               expert_cache=ExpertCacheConfig(expert_cache_size=3, expert_pin=False))
    srv = InProcessServer(_app(llm)).start()
    wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 60, "ready")
    yield srv
    srv.stop()


def _complete(url: str) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", json={"prompt": "The river runs", "max_tokens": 12,
                                                   "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 12
    return body


def test_glm_serves_and_its_cache_counts_moe_layers_only(glm_server: InProcessServer) -> None:
    _complete(glm_server.url)
    info = ExpertCacheInfo.model_validate(httpx.get(glm_server.url + "/v1/expert_cache").json())
    assert info.enabled and (info.n_layer, info.n_moe_layers) == (4, 2)
    assert info.dense_layers == [0, 1]
    assert info.budget_bytes == 2 * 3 * info.expert_bytes
    assert info.state is not None and info.layers is not None
    for layer in (0, 1):  # a dense layer holds and loads nothing
        assert set(info.state[layer]) == {0} and info.layers[layer]["loads"] == 0
    for layer in (2, 3):
        assert sum(s >= 1 for s in info.state[layer]) == 3 and info.layers[layer]["loads"] > 0
    assert info.totals["resident_bytes"] == 2 * 3 * info.expert_bytes
    # the two shared experts of each MoE layer: apart from the routed ones, never budgeted
    assert info.shared_expert_bytes > 0 and info.n_expert == 8


def test_llama4_serves_and_its_cache_skips_its_interleaved_dense_layers(
        ckpts: dict[str, Path]) -> None:
    """Llama 4's dense layers sit between its MoE layers (dense, MoE, MoE, dense): the cache
    budgets, loads and draws the MoE layers only, wherever they are."""
    from colibri.engine.core.options import ExpertCacheConfig

    llm = _llm(ckpts["llama4"], "q8",
               expert_cache=ExpertCacheConfig(expert_cache_size=3, expert_pin=False))
    srv = InProcessServer(_app(llm)).start()
    try:
        wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 60, "ready")
        _complete(srv.url)
        info = ExpertCacheInfo.model_validate(
            httpx.get(srv.url + "/v1/expert_cache").json())
        assert httpx.get(srv.url + "/experts").status_code == 200
    finally:
        srv.stop()
    assert info.enabled and (info.n_layer, info.n_moe_layers) == (4, 2)
    assert info.dense_layers == [0, 3] and info.n_expert == 6
    assert info.budget_bytes == 2 * 3 * info.expert_bytes
    assert info.state is not None and info.layers is not None
    for layer in (0, 3):
        assert set(info.state[layer]) == {0} and info.layers[layer]["loads"] == 0
    for layer in (1, 2):
        assert 1 <= sum(s >= 1 for s in info.state[layer]) <= 3
        assert info.layers[layer]["loads"] > 0
    assert info.shared_expert_bytes > 0  # one shared expert per MoE layer, never budgeted


def test_dense_model_serves_without_an_expert_cache(ckpts: dict[str, Path],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from colibri.engine.core.options import ExpertCacheConfig

    with caplog.at_level(logging.INFO, logger="colibri.engine"):
        llm = _llm(ckpts["llama"], "q8", expert_cache=ExpertCacheConfig(expert_cache_size=4))
    assert "a dense model has no routed experts; the expert cache budget is ignored" \
        in caplog.text
    srv = InProcessServer(_app(llm)).start()
    try:
        wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 60, "ready")
        _complete(srv.url)
        info = ExpertCacheInfo.model_validate(httpx.get(srv.url + "/v1/expert_cache").json())
        assert not info.enabled and info.n_moe_layers == 0 and info.n_expert == 0
        assert info.reason == "a dense model has no routed experts"
        assert info.dense_layers == [0, 1]
    finally:
        srv.stop()


def test_info_names_the_layers(ckpts: dict[str, Path], tmp_path: Path) -> None:
    from colibri.engine.format.convert import convert
    from colibri.engine.tools.info import describe, render

    d = describe(convert(ckpts["glm4_moe"], tmp_path / "glm", quant="q8", progress=False))
    text = render(d)
    assert "layers        2 dense (0-1), 2 MoE (2-3)" in text
    assert "router=sigmoid_grouped" in text and "in shared experts (always resident)" in text
    assert d["experts_per_layer"] == [0, 0, 8, 8]
    # active parameters: all but 6 of each MoE layer's 8 experts
    per_expert = 3 * 64 * 32
    assert d["params_active"] == d["params_total"] - 2 * 6 * per_expert
    dense = render(describe(convert(ckpts["llama"], tmp_path / "llama", quant="q8",
                                    progress=False)))
    assert "layers        2 dense (0-1)" in dense and "experts/layer 0 0" in dense
    d4 = describe(convert(ckpts["llama4"], tmp_path / "llama4", quant="q8", progress=False))
    text4 = render(d4)
    assert "layers        2 dense (0-3 step 3), 2 MoE (1-2)" in text4
    assert d4["experts_per_layer"] == [0, 6, 6, 0]
    assert "router=sigmoid_topk" in text4 and "attn_chunk=8" in text4
    assert "nope_layers=[1, 3]" in text4 and "route_input=True" in text4
    # active: each MoE layer's one routed expert of 6, the shared expert always
    assert d4["params_active"] == d4["params_total"] - 2 * 5 * 3 * 64 * 32


def test_routing_trace_holds_the_moe_layers(ckpts: dict[str, Path], tmp_path: Path) -> None:
    from colibri.engine.executor.model import Model
    from colibri.engine.format.convert import convert
    from colibri.engine.tools.routing_trace import RouteRecorder, RoutingTrace, greedy_run

    m = Model.load(convert(ckpts["glm4_moe"], tmp_path / "glm", quant="q8", progress=False),
                   threads=2, n_ctx=64)
    rec = RouteRecorder(m)
    greedy_run(rec, np.arange(5, 25, dtype=np.int32), 6)
    trace = rec.trace("test")
    assert trace.n_layer == 2 and trace.n_tokens == 20 + 6  # the prompt, then 6 decode steps
    assert trace.routes.min() >= 0 and trace.routes.max() < 8
    again = RoutingTrace.load(trace.save(tmp_path / "t.npz"))
    np.testing.assert_array_equal(again.routes, trace.routes)


def test_llama4_routing_trace_holds_its_interleaved_moe_layers(ckpts: dict[str, Path],
                                                              tmp_path: Path) -> None:
    """The trace of a model whose MoE layers are 1 and 2 (of 0-3) holds those two layers'
    choices, in layer order: what the forward pass reported for them."""
    from colibri.engine.executor.model import Model
    from colibri.engine.format.convert import convert
    from colibri.engine.tools.routing_trace import RouteRecorder

    path = convert(ckpts["llama4"], tmp_path / "l4", quant="q8", progress=False)
    prompt = np.arange(5, 25, dtype=np.int32)
    rec = RouteRecorder(Model.load(path, threads=2, n_ctx=64))
    rec.forward(prompt, np.zeros(20, np.int32), np.arange(20, dtype=np.int32))
    trace = rec.trace("test")
    assert trace.n_layer == 2 and trace.n_tokens == 20
    m = Model.load(path, threads=2, n_ctx=64)
    routes = np.full((20, 4, 1), -1, np.int32)
    m.forward(prompt, np.zeros(20, np.int32), np.arange(20, dtype=np.int32), routes=routes)
    assert (routes[:, [0, 3]] == -1).all()
    np.testing.assert_array_equal(trace.routes, routes[:, [1, 2]])


@pytest.mark.parametrize("arch", ["llama", "glm4_moe"])
def test_bench_counts_dense_layers(ckpts: dict[str, Path], arch: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from colibri.app.cli import main
    from colibri.engine.format.convert import convert
    from colibri.engine.tools.bench import weight_bytes_per_token

    out = convert(ckpts[arch], tmp_path / "q8", quant="q8", progress=False)
    parts = weight_bytes_per_token(out)
    assert parts["dense"] > 0 and parts["attention"] > 0
    assert (parts["experts"] > 0) == (arch == "glm4_moe")
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert main(["bench", "--model", str(out), "--prompt-tokens", "12", "--gen-tokens", "6",
                 "--threads", "2", "--repeat", "1", "--probe-mib", "8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["architecture"] == ("llama" if arch == "llama" else "glm4_moe")
    assert r["kv_cache_type"] == "f16" and r["bytes_per_token_parts"]["dense"] == parts["dense"]


def _run(core: Any, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    from colibri.engine import SamplingParams

    core.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    toks, cached = [], -1
    while core.has_work():
        for o in core.step():
            toks.append(o.token_id)
            cached = o.n_cached_tokens
    return toks, cached


def test_prefix_cache_reuses_latent_blocks(tmp_path: Path) -> None:
    """A DeepSeek (MLA) model's cache blocks hold latent rows; a shared prompt prefix is reused
    from them and the tokens equal a run without the prefix cache."""
    hf = make_checkpoint("deepseek_v3", tmp_path / "hf", seed=6)
    llm = _llm(hf, "f32")
    core = llm.core
    system = list(range(3, 51))  # three full blocks of 16
    first = _run(core, "a", system + [60, 61], 6)
    second = _run(core, "b", system + [70, 71, 72], 6)
    assert first[1] == 0 and second[1] == 48
    plain = _llm(hf, "f32", prefix_cache=False)
    assert second[0] == _run(plain.core, "c", system + [70, 71, 72], 6)[0]
    assert core.blocks.n_free == core.blocks.n_blocks


def test_mla_batch_of_requests_equals_each_alone(tmp_path: Path) -> None:
    """Requests of different lengths decoded together give the tokens each gives alone."""
    hf = make_checkpoint("deepseek_v2", tmp_path / "hf", seed=8)
    llm = _llm(hf, "q8", max_num_seqs=4)
    prompts = [list(range(5, 5 + n)) for n in (7, 20, 33, 12)]
    alone = [_run(llm.core, f"alone{i}", p, 8)[0] for i, p in enumerate(prompts)]
    from colibri.engine import SamplingParams

    for i, p in enumerate(prompts):
        llm.core.add_request(f"b{i}", p, SamplingParams(max_tokens=8, temperature=0.0))
    got: dict[str, list[int]] = {}
    while llm.core.has_work():
        for o in llm.core.step():
            got.setdefault(o.request_id, []).append(o.token_id)
    assert [got[f"b{i}"] for i in range(4)] == alone
