"""Speculative decoding through the server and the command line, on the bundled demo model
(a small MoE whose greedy Shakespeare repeats itself, so prompt lookup drafts are accepted):
`--speculative ngram` and `auto` answer /v1/completions with the text, logprobs and usage the server
gives without it, and /metrics counts the drafts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_helpers import InProcessServer, wait_for

PROMPT = "KING HENRY.\nWhat say you, my lord? What say you, my lord? What say you"


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("COLIBRI_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def _serve(**settings: Any) -> InProcessServer:
    from colibri.app.server import create_app
    from colibri.app.settings import Settings

    app = create_app(Settings(_env_file=None, threads=2, **settings))  # type: ignore[call-arg]
    srv = InProcessServer(app).start()
    wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 120, "ready")
    return srv


def _complete(url: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "logprobs": 2, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    out.pop("id"), out.pop("created")
    return out


def test_completions_are_the_same_with_ngram_and_auto_speculation() -> None:
    plain = _serve()
    try:
        want = [_complete(plain.url), _complete(plain.url, n=2, stop=["my lord,"])]
        assert plain.metrics().get(
            'vllm:spec_decode_num_draft_tokens_total{model_name="demo_model"}') == 0
    finally:
        plain.stop()
    for method in ("ngram", "auto"):
        spec = _serve(speculative=method, num_speculative_tokens=4)
        try:
            got = [_complete(spec.url), _complete(spec.url, n=2, stop=["my lord,"])]
            m = spec.metrics()
        finally:
            spec.stop()
        assert got == want, method
        assert want[0]["usage"]["completion_tokens"] == 48
        lab = '{model_name="demo_model"}'
        drafted = m[f"vllm:spec_decode_num_draft_tokens_total{lab}"]
        accepted = m[f"vllm:spec_decode_num_accepted_tokens_total{lab}"]
        steps = m[f"vllm:spec_decode_num_drafts_total{lab}"]
        assert accepted <= drafted <= 4 * steps
        if method == "ngram":  # auto drafts what its cost model finds worth it, maybe nothing
            assert 0 < accepted
        if steps:
            assert m["colibri_spec_decode_mean_accepted_length"] == pytest.approx(
                accepted / steps)


def test_generate_command_takes_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    from colibri.engine.tools.cli import main

    args = ["generate", "--prompt", PROMPT, "--max-tokens", "24", "--temperature", "0",
            "--threads", "2"]
    assert main(args) == 0
    want = capsys.readouterr().out
    assert main([*args, "--speculative", "ngram", "--num-speculative-tokens", "2"]) == 0
    assert capsys.readouterr().out == want
    assert main([*args, "--speculative", "auto"]) == 0
    assert capsys.readouterr().out == want
    assert main([*args, "--num-speculative-tokens", "17"]) == 2
    assert "--num-speculative-tokens must be at most 16" in capsys.readouterr().err
