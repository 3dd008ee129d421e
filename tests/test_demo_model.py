"""The bundled demo model: Colibri's greedy output equals transformers', and the server
serves it when started with no model argument."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import quick_params
from tests.server_helpers import SubprocessServer

PROMPTS = ["ROMEO.\n", "KING HENRY.\nNow, lords, "]


@pytest.fixture(scope="module")
def cache_dir(own_cache_dir: Path) -> Path:
    return own_cache_dir


def test_bundled_model_is_package_data() -> None:
    from colibri.engine.demo import default_model_path

    root = default_model_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (root / name).is_file(), name
    assert (root / "model.safetensors").stat().st_size <= 25 * 2**20


def test_bundled_model_routes_like_a_many_expert_moe() -> None:
    """Many small experts, top-k renormalised: the routing the expert cache is tuned on."""
    import json

    from colibri.engine.demo import default_model_path

    cfg = json.loads((default_model_path() / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    # transformers writes num_experts under its alias num_local_experts
    n_expert = cfg.get("num_experts", cfg.get("num_local_experts"))
    assert 32 <= n_expert <= 64 and 4 <= cfg["num_experts_per_tok"] <= 8
    assert cfg["norm_topk_prob"] is True
    assert cfg["moe_intermediate_size"] < cfg["hidden_size"]


# one prompt in the quick pass (the chat test there runs a second), both in the whole suite
@pytest.mark.parametrize("prompt", quick_params(PROMPTS, PROMPTS[:1]))
def test_greedy_f32_matches_transformers(cache_dir: Path, prompt: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from colibri.engine import LLM
    from colibri.engine.demo import default_model_path

    llm = LLM(None, quant="f32", threads=2)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=True)
    ours = llm.generate_ids(ids, max_tokens=32, ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    with torch.no_grad():
        ref = model.eval().generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids):].tolist()
    assert ours == ref


def test_chat_greedy_matches_transformers(cache_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from colibri.engine import LLM
    from colibri.engine.demo import default_model_path

    llm = LLM(None, quant="f32", threads=2)
    ids = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What say you, my lord? Shall we to the court?"}]
    )
    ours = llm.generate_ids(ids, max_tokens=24)
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    eos = sorted(llm.tokenizer.eos_token_ids)
    with torch.no_grad():
        ref = model.eval().generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
            pad_token_id=0,
        )[0, len(ids):].tolist()
    assert ours == ref
    assert any(t in eos for t in ours), "the chat reply should end with an end-of-turn token"


def test_server_with_no_arguments_answers_chat(tmp_path: Path) -> None:
    server = SubprocessServer(None, tmp_path)
    try:
        server.wait_ready(timeout=300)
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        name = models["data"][0]["id"]
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": name, "messages": [{"role": "user", "content": "Good morrow!"}],
                  "max_tokens": 24, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["message"]["content"].strip()
        assert body["usage"]["completion_tokens"] >= 1
    finally:
        assert server.stop() == 0
