"""`--model owner/name`: a Hugging Face repo id, resolved through huggingface_hub's cache, here
a cache filled by the test and read offline (HF_HOME, HF_HUB_OFFLINE), then converted once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.tiny_models import make_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF_HOME whose hub cache holds test-org/tiny-glm at main, as huggingface_hub lays
    out a download (refs/main naming the snapshot folder)."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--test-org--tiny-glm"
    make_checkpoint("glm4_moe", repo / "snapshots" / COMMIT, seed=2)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return home


def _colibri(args: list[str], hf_home: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "COLIBRI_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", COLIBRI_CACHE_DIR=str(cache))
    code = "import sys; from app.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_repo_id_resolves_from_the_cache_and_converts_once(hf_home: Path,
                                                           tmp_path: Path) -> None:
    r = _colibri(["info", "--model", "test-org/tiny-glm", "--json"], hf_home, tmp_path)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["architecture"] == "glm4_moe" and info["hf_architecture"] == "Glm4MoeForCausalLM"
    entries = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and entries[0].startswith("test-org--tiny-glm-")
    r = _colibri(["generate", "--model", "test-org/tiny-glm", "--prompt", "The river",
                  "--max-tokens", "4", "--seed", "1"], hf_home, tmp_path)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == entries


def test_repo_id_missing_offline_is_a_clear_error(hf_home: Path, tmp_path: Path) -> None:
    r = _colibri(["info", "--model", "test-org/not-there"], hf_home, tmp_path)
    assert r.returncode == 2
    assert "test-org/not-there is not in the Hugging Face cache" in r.stderr
    assert "HF_HUB_OFFLINE" in r.stderr and "Traceback" not in r.stderr


def test_a_local_folder_wins_over_a_repo_id(hf_home: Path, tmp_path: Path) -> None:
    local = tmp_path / "test-org" / "tiny-glm"
    shutil.copytree(hf_home / "hub" / "models--test-org--tiny-glm" / "snapshots" / COMMIT,
                    local)
    (local / "config.json").unlink()  # so it is plainly not the cached repo that loads
    r = subprocess.run([sys.executable, "-c", "from engine.format.hub import is_repo_id; "
                        "print(is_repo_id('test-org/tiny-glm'))"], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True)
    assert r.stdout.strip() == "False"


def test_llm_serves_a_repo_id_under_its_name(hf_home: Path, tmp_path: Path) -> None:
    code = ("from engine import LLM; llm = LLM('test-org/tiny-glm', threads=1, n_ctx=64); "
            "print(llm.model_name); print(len(llm.generate_ids([5, 6, 7], 3)))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "COLIBRI_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", COLIBRI_CACHE_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["test-org/tiny-glm", "3"]
