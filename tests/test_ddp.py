"""Data-parallel training of a swapped transformers DeepseekV4 model under torchrun:
``examples/train_ddp.py`` on 2 ranks (DistributedDataParallel over gloo, each rank half
of the global batch) against the same script in one process on the whole batch.

Error budget: the two runs compute the same gradients with the batch's sums split in
two and added by gloo's all-reduce (one more rounding per element, and the mean taken
as (g1 + g2) / 2 instead of over all rows): ~1e-7 relative per element, a few 1e-6 after
the float32 sums of a layer's backward (measured 2.1e-6 worst, a Sapphire Rapids Xeon).
The bar is 1e-5 relative per parameter (norm-wise) and the printed losses of 10 AdamW
steps equal to 4 decimals (they print 6; the last may differ by the rounding above).
"""
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import deepseek_csa.transformers as dch  # noqa: E402

if not dch._supported(transformers.__version__):
    pytest.skip(f"deepseek_csa.transformers does not support transformers "
                f"{transformers.__version__}", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_ddp.py")


def _run(cmd, threads, tmp):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return [line.split() for line in out.stdout.splitlines() if line.startswith("step ")]


def _torchrun():
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if exe:
        return [exe]
    return [sys.executable, "-m", "torch.distributed.run"]


def test_two_ranks_equal_one_process(tmp_path):
    args = ["--steps", "10"]
    one = _run([sys.executable, SCRIPT, *args, "--dump-grads", str(tmp_path / "one.pt")], 2,
               tmp_path)
    two = _run(_torchrun() + ["--nproc-per-node", "2", "--master-port", "29517", SCRIPT, *args,
                              "--dump-grads", str(tmp_path / "two.pt")], 1, tmp_path)
    assert len(one) == len(two) == 10
    assert [f"{float(r[3]):.4f}" for r in one] == [f"{float(r[3]):.4f}" for r in two], (one, two)
    g1, g2 = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert set(g1) == set(g2) and len(g1) > 50
    for name, a in g1.items():
        b = g2[name]
        err = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
        assert err <= 1e-5, (name, err)
