"""The llama.cpp peer's pin and build folder, shared by bench_llamacpp.py (op rows) and
bench_llamacpp_model.py (model rows); both import it, neither imports the other at
module level (bench_llamacpp.py calls bench_llamacpp_model.run when it runs)."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# llama-cpp-python's sdist vendors the llama.cpp tree (deepseek4 architecture) that
# benchmarks/build_llamacpp.sh builds (`make peers`)
LLAMACPP_VERSION = "0.3.36"
PEERS = Path(os.environ.get("PEERS_DIR") or ROOT / "build" / "peers")
