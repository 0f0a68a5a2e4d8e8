"""The runner with a checkpoint that carries a tokenizer.json (issue 29).

* test_json_tokenizer_without_transformers (always): with transformers made unimportable,
  the runner reads tokenizer.json through `tokenizers` alone and runs text prompts.
* test_fresh_venv_with_only_the_runner_extra (CSA_TEST_RUNNER_EXTRA=1, `make
  test-runner-extra`, a few minutes: a venv, torch 2.13.0, the package built from
  source): `pip install '<checkout>[runner]'` into a fresh venv, then
  `python -m deepseek_csa.generate` on the tiny checkpoint with a tokenizer.json and
  text prompts, in that venv (no transformers there)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

from test_generate import CFG, NEW, ROOT, TINY, decisive_state, save, shard  # noqa: E402
import deepseek_csa.torch as dct  # noqa: E402

WORDS = [f"w{i}" for i in range(96)]


def write_tokenizer(d):
    """A word-level tokenizer.json whose word wi is token i, eos w95."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()       # joins words with spaces
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w95"}))


@pytest.fixture(scope="module")
def ckpt_tok(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_tok")
    tiny = dct.load_model_py(TINY)
    _, state = decisive_state(tiny)
    d = root / "mp1"
    d.mkdir()
    save(shard(state, 0, 1), str(d / "model0-mp1.safetensors"))
    write_tokenizer(d)
    (root / "config.json").write_text(json.dumps(CFG))
    (root / "prompts.txt").write_text("w5 w17 w42 w3\nw70 w2 w33 w14\n")
    return root


def run(py, root, env_extra=None, pythonpath=None, cwd=None):
    out = root / "out.json"
    cmd = [py, "-m", "deepseek_csa.generate", "--inference-dir", TINY,
           "--ckpt-path", str(root / "mp1"), "--config", str(root / "config.json"),
           "--input-file", str(root / "prompts.txt"), "--max-new-tokens", str(NEW),
           "--output-json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env.update(env_extra or {})
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                       cwd=cwd or str(root))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout + p.stderr


def check_text(res, log):
    # the planted map of test_generate: after w3 come w24, w75, ... (w -> 7w + 3 mod 96)
    assert "[completion] w24 w75" in log, log[-2000:]


def test_json_tokenizer_without_transformers(ckpt_tok, tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "transformers.py").write_text("raise ImportError('transformers blocked')\n")
    res, log = run(sys.executable, ckpt_tok, pythonpath=f"{block}{os.pathsep}{ROOT}")
    check_text(res, log)


@pytest.mark.skipif(os.environ.get("CSA_TEST_RUNNER_EXTRA") != "1",
                    reason="a fresh venv with torch (minutes): make test-runner-extra")
def test_fresh_venv_with_only_the_runner_extra(ckpt_tok, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    shutil.copytree(os.path.join(ROOT, "csrc"), src / "csrc")
    shutil.copytree(os.path.join(ROOT, "deepseek_csa"), src / "deepseek_csa",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    r = subprocess.run([py, "-m", "pip", "install", "-q", f"{src}[runner]"],
                       capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = subprocess.run([py, "-c", "import importlib.util as u, torch; "
                        "print(torch.__version__, u.find_spec('transformers'))"],
                       capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.startswith("2.13.0") and "None" in r.stdout, \
        r.stdout + r.stderr
    res, log = run(py, ckpt_tok, cwd=str(tmp_path))
    check_text(res, log)
