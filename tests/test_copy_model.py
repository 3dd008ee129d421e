"""scripts/make_copy_model.py, the model the edit workload of the speculative benchmark runs on:
a Mixtral rewritten so that it repeats its prompt from a fixed distance back, its tensors'
shapes unchanged. Checked on a tiny random Mixtral with transformers: the positional head's
rotary weighting peaks at the distance alone, without noise every greedy token is a copy, and
the noise makes the copy imperfect."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.scripts_loader import load_script


def _script() -> Any:
    return load_script("make_copy_model")


def test_the_rotary_weighting_peaks_at_the_lag_alone() -> None:
    """Over every distance 0..reach, the weighted cosines are largest at the lag, by the
    margin the program reports being positive for every other distance."""
    mod = _script()
    theta = 1e6 ** (-np.arange(16) * 2.0 / 32)
    for lag, reach in ((49, 120), (453, 700)):
        w, margin = mod.rope_weights(theta, lag, reach)
        assert w.min() >= -1e-12 and abs(w.sum() - 1.0) < 1e-9
        score = [(w * np.cos(theta * (d - lag))).sum() for d in range(reach + 1)]
        best = max(s for d, s in enumerate(score) if d != lag)
        assert int(np.argmax(score)) == lag and score[lag] - best > 0.05
        assert abs(score[lag] - best - margin) < 1e-6


def _greedy(tensors: dict[str, np.ndarray], cfg: dict[str, Any], prompt: list[int],
            n: int) -> list[int]:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    model = MixtralForCausalLM(MixtralConfig(**cfg)).eval()
    model.load_state_dict({k: torch.from_numpy(v.astype(np.float32))
                           for k, v in tensors.items()})
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 64,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 512,
           "rope_theta": 1e6, "tie_word_embeddings": False}
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**cfg))
    return cfg, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_without_noise_every_token_is_the_one_a_period_back(tiny: Any) -> None:
    mod = _script()
    cfg, base = tiny
    shapes = {k: v.shape for k, v in base.items()}
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 256, 60)]
    period, n = 50, 40
    tensors = dict(base)
    mod.rewrite(tensors, cfg, period, len(prompt) + n + 8, noise=0.0, seed=0)
    assert {k: v.shape for k, v in tensors.items()} == shapes
    out = _greedy(tensors, cfg, prompt, n)
    full = prompt + out
    assert out == [full[len(prompt) + i - period] for i in range(n)]


def test_noise_makes_the_copy_imperfect(tiny: Any) -> None:
    """With the other layers' outputs at full scale some greedy tokens are not copies, and
    the copy goes on after them (most tokens still are)."""
    mod = _script()
    cfg, base = tiny
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, 256, 60)]
    period, n = 50, 40
    copied = []
    for noise in (0.0, 40.0):
        tensors = dict(base)
        mod.rewrite(tensors, cfg, period, len(prompt) + n + 8, noise=noise, seed=0)
        full = prompt + _greedy(tensors, cfg, prompt, n)
        copied.append(sum(full[i] == full[i - period] for i in range(len(prompt), len(full))))
    assert copied[0] == n and copied[1] < n


def test_the_routers_read_the_tokens_not_the_constant(tiny: Any) -> None:
    """Every router keeps its random weights but for the constant dimension (a bias every
    token's choice would share), which it does not read."""
    mod = _script()
    cfg, base = tiny
    tensors = dict(base)
    mod.rewrite(tensors, cfg, 50, 100, noise=1.0, seed=0)
    gates = [k for k in tensors if k.endswith(mod.ROUTERS)]
    assert len(gates) == cfg["num_hidden_layers"]
    for k in gates:
        assert not tensors[k][:, -1].any()
        np.testing.assert_array_equal(tensors[k][:, :-1], base[k][:, :-1])
