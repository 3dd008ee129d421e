"""lm-evaluation-harness' `local-completions` model on a small multiple-choice task built
from local files, against `python -m colibri.app serve` on the bundled model: every loglikelihood it
reports equals the one computed from Colibri's own LLM.logits (same precision) within 1e-4,
and prompt scoring with max_tokens 0 answers in OpenAI's echo + logprobs shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from colibri.engine import LLM
from colibri.engine.demo import default_model_path
from tests.server_helpers import SubprocessServer

MODEL = "demo"
DOCS = [
    {"question": "Wherefore art thou", "choices": [" Romeo?", " Hamlet?", " a sea?"],
     "answer": 0},
    {"question": "To be, or not to", "choices": [" be", " run", " sleep"], "answer": 0},
    {"question": "Now is the winter of our", "choices": [" discontent", " cheese", " lamp"],
     "answer": 0},
    {"question": "Friends, Romans,", "choices": [" countrymen", " horses", " ships"],
     "answer": 0},
]
TASK = """task: colibri_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    tmp = tmp_path_factory.mktemp("lmeval")
    srv = SubprocessServer(None, tmp / "run", "--served-model-name", MODEL,
                           env={"COLIBRI_CACHE_DIR": str(tmp / "cache")}).wait_ready()
    srv.cache_dir = tmp / "cache"  # type: ignore[attr-defined]
    yield srv
    assert srv.stop() == 0, srv.log()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def test_lm_eval_loglikelihoods_equal_engine_logits(server: SubprocessServer, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    args = (f"model={MODEL},base_url={server.url}/v1/completions,"
            f"tokenizer={default_model_path()},tokenizer_backend=huggingface,"
            "tokenized_requests=True,num_concurrent=1,max_retries=1")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args,
                                  tasks=["colibri_mc"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path)))
    assert out is not None
    samples = out["samples"]["colibri_mc"]
    assert len(samples) == len(DOCS)
    lm = get_model("local-completions").create_from_arg_string(args)
    # the server converted the bundled model at its default precision into this cache
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(server.cache_dir))  # type: ignore[attr-defined]
    llm = LLM(None, quant="q8")
    n_checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"],
                                                 strict=True):
            ll_reported = resp[0][0]
            ctx, cont = lm._encode_pair(context, continuation)
            ids = ctx + cont
            logp = _log_softmax(llm.logits(ids))
            ours = sum(logp[len(ctx) + j - 1, t] for j, t in enumerate(cont))
            assert abs(ll_reported - ours) < 1e-4, (context, continuation, ll_reported, ours)
            n_checked += 1
    assert n_checked == sum(len(d["choices"]) for d in DOCS)
    assert 0.0 <= out["results"]["colibri_mc"]["acc,none"] <= 1.0


def test_prompt_scoring_with_max_tokens_0(server: SubprocessServer) -> None:
    llm = LLM(None, quant="q8")
    ids = llm.tokenizer.encode("ROMEO.\nBut soft, what light", add_special_tokens=True)
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]) == choice["text"]
    logp = _log_softmax(llm.logits(ids))
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - logp[i - 1, ids[i]]) < 1e-9
        assert len(lp["top_logprobs"][i]) <= 2
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(logp[i - 1].max(), abs=1e-9)
    # with generation: prompt entries, then one per generated token
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 1,
        "temperature": 0, "ignore_eos": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3


def test_streamed_echo_with_logprobs(server: SubprocessServer) -> None:
    body = {"model": MODEL, "prompt": "ROMEO.\nBut soft", "max_tokens": 2, "echo": True,
            "logprobs": 1, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    tokens: list[str] = []
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                if c["logprobs"]:
                    tokens += c["logprobs"]["tokens"]
    ref = whole["choices"][0]
    assert text == ref["text"] and tokens == ref["logprobs"]["tokens"]
