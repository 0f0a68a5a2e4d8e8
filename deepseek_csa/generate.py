"""A CPU runner for DeepSeek's released inference code and checkpoints (docs/runner.md).

    python -m deepseek_csa.generate --inference-dir DIR --ckpt-path CKPT --config CONFIG \\
        [--interactive | --input-file F] [--max-new-tokens N] [--temperature T]
    torchrun --nproc-per-node 2 -m deepseek_csa.generate ...      # tensor parallel, gloo

DIR/model.py is imported through ``deepseek_csa.torch.load_model_py`` (our CPU ``kernel``
and ``fast_hadamard_transform``), CONFIG (a config.json) fills the file's ``ModelArgs``,
and each rank loads ``CKPT/model{rank}-mp{world}.safetensors`` (the layout of the released
convert.py) into the parameters the model allocated, tensor by tensor: FP8 / FP4 weights
stay FP8 / FP4 and no float32 copy of a weight is ever made.  Prefill and decode run on
the CPU with the default dtype bfloat16; temperature 0 is greedy, otherwise tokens are
sampled from softmax(logits / T).

Under torchrun (WORLD_SIZE > 1) torch.distributed is initialized with the gloo backend;
rank 0 reads the prompts and broadcasts them.  Prompts are text when a tokenizer is found
(tokenizer files in DIR or CKPT: transformers.AutoTokenizer, offline, when transformers
is installed; otherwise a tokenizer.json through the `tokenizers` package alone, which
`pip install 'deepseek_csa[runner]'` brings) or lines of whitespace-separated token ids.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import sys
import time

__all__ = ["main", "load_checkpoint", "shard_path", "check_layout", "generate",
           "CheckpointError"]


class CheckpointError(RuntimeError):
    """The checkpoint does not fit the runner: missing shard, wrong layout, a shape or
    dtype that differs from what model.py allocated."""


def _torch():
    import torch
    return torch


def _status_bytes(field):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes():
    """This process's peak resident set size so far: VmHWM of /proc/self/status (reset
    by exec, unlike ru_maxrss, which a child started from a large parent inherits), else
    ru_maxrss."""
    v = _status_bytes("VmHWM")
    return v if v is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes():
    """Current resident set size (VmRSS), else the peak."""
    v = _status_bytes("VmRSS")
    return v if v is not None else peak_rss_bytes()


def shard_path(ckpt_path, rank, world_size):
    return os.path.join(ckpt_path, f"model{rank}-mp{world_size}.safetensors")


_HF_NAMES = ("model.safetensors.index.json", "model.safetensors")
_HF_SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")
_MP_SHARD = re.compile(r"^model(\d+)-mp(\d+)\.safetensors$")


def check_layout(ckpt_path, rank, world_size):
    """Path of this rank's shard, or a CheckpointError saying what the folder holds."""
    if not os.path.isdir(ckpt_path):
        raise CheckpointError(f"--ckpt-path {ckpt_path!r} is not a directory")
    path = shard_path(ckpt_path, rank, world_size)
    if os.path.isfile(path):
        return path
    names = sorted(os.listdir(ckpt_path))
    hf = [n for n in names if n in _HF_NAMES or _HF_SHARD.match(n)]
    mp = sorted({int(m.group(2)) for m in map(_MP_SHARD.match, names) if m})
    if hf and not mp:
        raise CheckpointError(
            f"{ckpt_path!r} holds a Hugging Face layout checkpoint ({hf[0]}"
            f"{', ...' if len(hf) > 1 else ''}), not the per-rank shards this runner loads "
            f"(model{{rank}}-mp{{world}}.safetensors).  Convert it with DeepSeek's "
            f"inference/convert.py: python convert.py --hf-ckpt-path {ckpt_path} "
            f"--save-path NEW_DIR --n-experts N_ROUTED_EXPERTS --model-parallel {world_size}")
    if mp:
        raise CheckpointError(
            f"no shard for rank {rank} of world size {world_size}: {path!r} is missing; "
            f"{ckpt_path!r} has shards for model-parallel size(s) {mp} (run with "
            f"--nproc-per-node {mp[0]} or convert with --model-parallel {world_size})")
    raise CheckpointError(f"no shard for rank {rank} of world size {world_size}: "
                          f"{path!r} is missing and {ckpt_path!r} holds no .safetensors shards")


def read_config(path, model_args_cls):
    """config.json -> the file's ModelArgs; keys ModelArgs has no field for are reported
    and ignored."""
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    names = {f.name for f in dataclasses.fields(model_args_cls)}
    unknown = sorted(set(cfg) - names)
    args = model_args_cls(**{k: v for k, v in cfg.items() if k in names})
    return args, unknown


def check_divisible(args, world_size):
    """World size must divide what the released layout splits across ranks."""
    for field in ("n_heads", "n_routed_experts", "vocab_size"):
        n = getattr(args, field, None)
        if isinstance(n, int) and n % world_size:
            raise ValueError(f"world size {world_size} does not divide {field}={n} of the "
                             f"config: run with a --nproc-per-node that divides it")


_ST_TORCH_ELEMS = {"F4": 2}     # torch.float4_e2m1fn_x2 packs two e2m1 values per element


def _st_dtype(name):
    torch = _torch()
    return {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
            "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
            "F4": getattr(torch, "float4_e2m1fn_x2", None), "BF16": torch.bfloat16,
            "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
            "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
            "I64": torch.int64, "BOOL": torch.bool}.get(name)


def _st_shape(sl):
    shape = list(sl.get_shape())
    per = _ST_TORCH_ELEMS.get(sl.get_dtype(), 1)
    if per > 1 and shape:
        shape[-1] //= per
    return tuple(shape)


def _widens(src, dst):
    """A 16-bit float stored for a float32 parameter: the released model.py keeps its
    norms, compressor projections and head in float32 while the released checkpoints
    store them in bf16 ("stored in bf16, while the parameter here is stored in fp32"),
    and its generate.py loads through load_state_dict, which converts; so does this
    loader, exactly (every bf16 / f16 value is a float32 value).  Nothing else converts:
    FP8 / FP4 codes, scales and integers must match."""
    torch = _torch()
    return dst == torch.float32 and src in (torch.bfloat16, torch.float16)


def load_checkpoint(model, path, chunk_bytes=64 << 20, strict=False, log=print):
    """Copies the tensors of the safetensors file ``path`` into ``model``'s parameters
    and persistent buffers in place (same dtype required, FP8 / FP4 stay as stored;
    the one conversion is a bf16 / f16 tensor into a float32 parameter, exact, as the
    released loader does).
    Every shape and dtype is checked against the model before any data is read.  The
    file is opened again for each ~``chunk_bytes`` of tensors (row ranges of larger
    ones) so that at most that much of its mapping is resident on top of the model.  ``strict=False`` (as the released
    generate.py loads, for the MTP keys that alias the main model's) reports keys
    missing on either side instead of failing.  Returns (missing, unexpected)."""
    torch = _torch()
    from safetensors import safe_open
    targets = dict(model.state_dict(keep_vars=True))
    with safe_open(path, framework="pt") as f:
        meta = {k: (f.get_slice(k).get_dtype(), _st_shape(f.get_slice(k))) for k in f.keys()}
    missing = sorted(set(targets) - set(meta))
    unexpected = sorted(set(meta) - set(targets))
    for k, (dt, shape) in meta.items():
        if k not in targets:
            continue
        t = targets[k]
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{os.path.basename(path)}: tensor {k!r} has shape {list(shape)} in the "
                f"checkpoint but {list(t.shape)} in the model built from the config "
                f"(config and checkpoint disagree, or the shard is for another world size)")
        want = _st_dtype(dt)
        if want is not None and want != t.dtype and not _widens(want, t.dtype):
            raise CheckpointError(
                f"{os.path.basename(path)}: tensor {k!r} is {want} in the checkpoint but "
                f"{t.dtype} in the model (check the config's dtype / expert_dtype / scale_fmt)")
    if strict and (missing or unexpected):
        raise CheckpointError(f"{path}: missing keys {missing[:8]}, unexpected {unexpected[:8]}")
    # pieces of at most ~chunk_bytes (row ranges of large tensors), grouped; one open
    # per group: its mapped pages are let go when it closes
    pieces = []
    for k in (k for k in meta if k in targets):
        t = targets[k]
        nb = t.numel() * t.element_size()
        rows = t.shape[0] if t.dim() > 1 else 1
        step = rows if nb <= chunk_bytes else max(1, rows * chunk_bytes // nb)
        for a in range(0, rows, step):
            pieces.append((k, a, min(rows, a + step), nb * (min(rows, a + step) - a) // rows))
    groups, cur, size = [], [], 0
    for pc in pieces:
        if cur and size + pc[3] > chunk_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(pc)
        size += pc[3]
    if cur:
        groups.append(cur)
    with torch.no_grad():
        for g in groups:
            with safe_open(path, framework="pt") as f:
                for k, a, b, _ in g:
                    dst = targets[k]
                    whole = a == 0 and (dst.dim() <= 1 or b == dst.shape[0])
                    src = f.get_tensor(k) if whole else f.get_slice(k)[a:b]
                    if src.dtype != dst.dtype and not _widens(src.dtype, dst.dtype):
                        raise CheckpointError(
                            f"{os.path.basename(path)}: tensor {k!r} is {src.dtype} in the "
                            f"checkpoint but {dst.dtype} in the model (check the config's "
                            f"dtype / expert_dtype / scale_fmt)")
                    (dst if whole else dst[a:b]).copy_(src)
                    del src
    if missing:
        log(f"[load] {len(missing)} model tensor(s) not in the checkpoint (left as "
            f"initialized): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        log(f"[load] {len(unexpected)} checkpoint tensor(s) the model has no place for "
            f"(ignored): {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    return missing, unexpected


HC_POST_ROWS = 2048


def _rows_hc_post(mod):
    """The released ``Block.hc_post`` broadcasts to [batch, S, hc, hc, dim] in float32
    before it sums (8.6 GB at 32K prompt tokens, V4-Flash's width, 16 bytes a weight of
    the model); it is elementwise per token, so the runner hands it at most
    HC_POST_ROWS tokens at a time and writes each slice into the output: the same
    values bit for bit (tests/test_generate.py), a 2048-token slice's transient
    instead of the whole prompt's.  ``mod`` is the runner's own import of model.py."""
    blk = getattr(mod, "Block", None)
    orig = getattr(blk, "hc_post", None)
    if orig is None or getattr(orig, "_by_rows", False):
        return
    torch = _torch()

    def hc_post(self, x, residual, post, comb):
        s = x.shape[1]
        if x.dim() != 3 or s <= HC_POST_ROWS:
            return orig(self, x, residual, post, comb)
        out = None
        for a in range(0, s, HC_POST_ROWS):
            b = min(s, a + HC_POST_ROWS)
            y = orig(self, x[:, a:b], residual[:, a:b], post[:, a:b], comb[:, a:b])
            if out is None:
                out = torch.empty((y.shape[0], s) + tuple(y.shape[2:]), dtype=y.dtype)
            out[:, a:b] = y
        return out

    hc_post._by_rows = True
    blk.hc_post = hc_post


INDEX_SCORE_EQ = "bshd,btd->bsht"
INDEX_ROWS = 256


def _index_score_mm(einsum):
    """model.py's indexer score einsum at decode as one 2-D matmul over a column count
    rounded up to INDEX_ROWS (see _index_scores_mm); anything else goes to ``einsum``."""
    torch = _torch()

    def index_einsum(eq, *ops):
        if len(ops) == 1 and isinstance(ops[0], (tuple, list)):
            ops = tuple(ops[0])
        if eq != INDEX_SCORE_EQ or len(ops) != 2:
            return einsum(eq, *ops)
        q, kv = ops
        if (type(q) is not torch.Tensor or type(kv) is not torch.Tensor
                or q.dim() != 4 or kv.dim() != 3 or q.shape[0] * q.shape[1] != 1
                or kv.shape[0] != 1 or q.dtype != torch.bfloat16 or kv.dtype != q.dtype
                or q.shape[3] != kv.shape[2] or kv.stride(2) != 1 or kv.shape[1] == 0):
            return einsum(eq, *ops)
        h, d = q.shape[2], q.shape[3]
        t, row = kv.shape[1], kv.stride(1)
        # the rows of kv's storage past its view: the indexer's cache, allocated for
        # max_seq_len // ratio keys, of which the step reads the first t
        room = (kv.untyped_storage().nbytes() // kv.element_size() - kv.storage_offset()
                - d) // row + 1 if row > 0 else 0
        cols = max(t, min(-(-t // INDEX_ROWS) * INDEX_ROWS, room))
        keys = kv.as_strided((cols, d), (row, 1))
        return torch.mm(q.reshape(h, d), keys.t())[:, :t].reshape(1, 1, h, t)
    index_einsum._index_mm = True
    return index_einsum


def _index_scores_mm(mod):
    """The released ``Indexer.forward`` scores a decode step's query against the t
    compressed keys in its cache with ``torch.einsum("bshd,btd->bsht", q, kv)``: a
    batched bf16 matmul of a new shape whenever t grows (every compress_ratio-th
    token), and oneDNN builds a new kernel for each new shape.  Measured (Sapphire
    Rapids, 2 threads, load ~4.4): 2.4-6.0 ms when t had grown, 0.24-0.66 ms when not
    -- ~0.8-2 ms a step on average, the largest piece of a released-width step outside
    our kernels (docs/runner.md, "What it does" 10).  The runner's own import of
    model.py gets a ``torch`` whose ``einsum`` runs that product, for one query row of
    batch 1, as one 2-D bf16 ``torch.mm`` (the same oneDNN matmul) of q against the
    cache's rows up to the next multiple of INDEX_ROWS (the cache holds them; their
    columns are dropped): a new shape every INDEX_ROWS x ratio tokens, 0.08-0.2 ms a
    step.  Each output element is the same dot product, and the values are bit for bit
    the einsum's (tests/test_generate.py: every t of caches of 5, 64 and 150 rows;
    measured at 85 values of t up to 5000 under oneDNN's AMX, AVX-512 BF16, AVX-512 and
    AVX2 levels; tests/test_model_py.py: the released Transformer's logits).
    Everything else model.py does with ``torch`` is the torch module's own."""
    import types
    torch = _torch()
    cur = getattr(mod, "torch", None)
    if cur is None or getattr(getattr(cur, "einsum", None), "_index_mm", False):
        return

    class _ModelPyTorch(types.ModuleType):
        def __getattr__(self, name):          # anything torch gains after the copy
            return getattr(torch, name)
    proxy = _ModelPyTorch(torch.__name__, torch.__doc__)
    proxy.__dict__.update({k: v for k, v in vars(torch).items()
                           if k not in ("__name__", "__doc__")})
    proxy.einsum = _index_score_mm(torch.einsum)
    mod.torch = proxy


def sample(logits, temperature, generator=None):
    """Greedy at temperature 0, else a draw from softmax(logits / temperature)."""
    torch = _torch()
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(model, prompts, max_new_tokens, eos_id=None, temperature=0.0, seed=0,
             max_seq_len=None, log=None):
    """Prefill of the common prompt prefix, then one token per call (rows whose prompt
    is longer keep their prompt tokens).  Returns (the new tokens of each prompt,
    stats: prefill / decode seconds and token counts, 'prefill_logits' the prefill's
    last-position logits)."""
    torch = _torch()
    bsz = len(prompts)
    lens = [len(p) for p in prompts]
    if min(lens) < 1:
        raise ValueError("empty prompt")
    total = max(lens) + max_new_tokens
    if max_seq_len is not None and total > max_seq_len:
        raise ValueError(f"prompt ({max(lens)} tokens) + --max-new-tokens {max_new_tokens} "
                         f"exceeds the model's max_seq_len={max_seq_len}")
    tokens = torch.full((bsz, total), -1, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    in_prompt = tokens != -1
    done = torch.zeros(bsz, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    prev, t0, c0 = 0, time.perf_counter(), time.process_time()
    stats = {"prefill_tokens": bsz * min(lens), "decode_steps": 0}
    for cur in range(min(lens), total):
        logits = model.forward(tokens[:, prev:cur], prev)
        if prev == 0:
            stats["prefill_s"] = time.perf_counter() - t0
            stats["prefill_cpu_s"] = time.process_time() - c0
            stats["prefill_logits"] = logits
            t1, c1 = time.perf_counter(), time.process_time()
            if log:
                log(f"[generate] prefill {bsz} x {min(lens)} tokens: {stats['prefill_s']:.3f} s")
        else:
            stats["decode_steps"] += 1
        nxt = sample(logits, temperature, gen)
        nxt = torch.where(in_prompt[:, cur], tokens[:, cur], nxt)
        tokens[:, cur] = nxt
        if eos_id is not None:
            done |= ~in_prompt[:, cur] & (nxt == eos_id)
        prev = cur
        if log and stats["decode_steps"] and stats["decode_steps"] % 16 == 0:
            log(f"[generate] {cur + 1 - min(lens)} / {total - min(lens)} tokens")
        if done.all():
            break
    stats["decode_s"] = time.perf_counter() - t1 if total > min(lens) else 0.0
    stats["decode_cpu_s"] = time.process_time() - c1 if total > min(lens) else 0.0
    out = []
    for i, p in enumerate(prompts):
        row = tokens[i, len(p):prev + 1].tolist()
        if eos_id is not None and eos_id in row:
            row = row[:row.index(eos_id) + 1]
        out.append(row)
    return out, stats


def _find_tokenizer(*dirs):
    for d in dirs:
        if d and any(os.path.isfile(os.path.join(d, n)) for n in
                     ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return d
    return None


class _JsonTokenizer:
    """A tokenizer.json through the `tokenizers` package: encode / decode / eos_token_id,
    all the runner uses of a tokenizer (transformers' AutoTokenizer is not needed)."""

    def __init__(self, d):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        self.eos_token_id = None
        cfg = os.path.join(d, "tokenizer_config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                self.eos_token_id = self.tok.token_to_id(eos)

    def encode(self, text):
        return self.tok.encode(text).ids

    def decode(self, ids):
        return self.tok.decode(list(ids))


def load_tokenizer(d):
    """transformers' AutoTokenizer (offline) when transformers is installed, otherwise
    d/tokenizer.json through `tokenizers`; ImportError naming both when neither works."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        AutoTokenizer = None
    if AutoTokenizer is not None:
        return AutoTokenizer.from_pretrained(d, local_files_only=True)
    if not os.path.isfile(os.path.join(d, "tokenizer.json")):
        raise ImportError(f"the tokenizer in {d} has no tokenizer.json: reading it needs "
                          f"transformers (pip install transformers), or give token ids")
    try:
        return _JsonTokenizer(d)
    except ImportError as e:
        raise ImportError("reading tokenizer.json needs the `tokenizers` package "
                          "(pip install 'deepseek_csa[runner]')") from e


def _parse_ids(line, vocab_size):
    try:
        ids = [int(t) for t in line.split()]
    except ValueError:
        return None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return ids


def _encode(line, tok, vocab_size):
    ids = _parse_ids(line, vocab_size)
    if ids is not None:
        return ids
    if tok is None:
        raise ValueError("no tokenizer files in --inference-dir or --ckpt-path: give "
                         f"prompts as whitespace-separated token ids, got {line[:60]!r}")
    return tok.encode(line)


def _decode(ids, tok):
    return tok.decode(ids) if tok is not None else " ".join(map(str, ids))


def _parser():
    p = argparse.ArgumentParser(prog="python -m deepseek_csa.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inference-dir", required=True, help="folder holding model.py")
    p.add_argument("--ckpt-path", required=True,
                   help="folder of model{rank}-mp{world}.safetensors (convert.py's layout)")
    p.add_argument("--config", required=True, help="config.json for the file's ModelArgs")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--interactive", action="store_true")
    g.add_argument("--input-file", help="one prompt per line (text or token ids)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-id", type=int, default=None,
                   help="stop token (default: the tokenizer's eos, none without one)")
    p.add_argument("--output-json", help="rank 0 writes tokens, timings and peak RSS here")
    p.add_argument("--swap", default="", metavar="OPS",
                   help="route the attention layers' OPS (comma-separated names of "
                        "deepseek_csa.torch.OPS, or 'all') through deepseek_csa's drop-ins; "
                        "'indexer' is what long prompts need: the released Indexer scores "
                        "[S, heads, S/4] at once (34 GB in bf16 at 32K tokens)")
    p.add_argument("--wo-a", choices=("fp8", "bf16"), default="fp8",
                   help="fp8 (default): the attention's wo_a, which convert.py widens to "
                        "bf16, is read as FP8 again (exactly requantized; at decode a "
                        "weight-only FP8 GEMV, half the bytes; docs/runner.md); bf16: "
                        "model.py's bf16 einsum as released")
    p.add_argument("--f32-weights", choices=("bf16", "f32"), default="bf16",
                   help="bf16 (default): the float32 weights model.py multiplies by F.linear "
                        "(the compressors', the head's) whose values are bf16 -- the "
                        "checkpoint stores them so -- are held in bf16 and read at half the "
                        "bytes (a float32 GEMV at decode; docs/runner.md); f32: as released")
    p.add_argument("--moe", choices=("fused", "loop"), default="fused",
                   help="fused (default): the MoE's routed FP4 experts as three fp4_gemm "
                        "calls over every (token, expert) pair, the same bits as model.py's "
                        "per-expert loop (deepseek_csa.torch.fused_moe; docs/runner.md); "
                        "loop: model.py's MoE.forward as released")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="before the first prompt, generate 2 tokens after its first N "
                        "tokens and discard them (first-call costs out of the timings)")
    p.add_argument("--output-logits", action="store_true",
                   help="--output-json also holds the prefill's last-position logits "
                        "(float32, one list per prompt)")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    if not args.interactive and not args.input_file:
        _parser().error("give --interactive or --input-file")
    torch = _torch()
    import torch.distributed as dist
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1:
        dist.init_process_group("gloo")
    log = print if rank == 0 else (lambda *a, **k: None)
    try:
        return _run(args, torch, dist, world_size, rank, log)
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _run(args, torch, dist, world_size, rank, log):
    import deepseek_csa.torch as dct
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(args.seed)
    rss0 = rss_bytes()         # interpreter + torch + deepseek_csa, before model.py
    mod = dct.load_model_py(args.inference_dir)
    margs, unknown = read_config(args.config, mod.ModelArgs)
    if unknown:
        log(f"[config] ignored keys ModelArgs has no field for: {', '.join(unknown)}")
    check_divisible(margs, world_size)
    path = check_layout(args.ckpt_path, rank, world_size)
    t0 = time.perf_counter()
    _rows_hc_post(mod)
    _index_scores_mm(mod)
    with torch.device("cpu"):
        model = mod.Transformer(margs)
    if args.moe == "fused":
        # before loading: the experts' parameters become views of the stacks, into which
        # the loader copies (stacked after, the freed copies stay resident in the heap)
        from deepseek_csa.torch.fused_moe import fuse_moe
        n = fuse_moe(model)
        log(f"[moe] {n} MoE(s) run their routed experts as one fp4_gemm call a projection "
            "(--moe loop: as released)")
    load_checkpoint(model, path, log=log)
    if args.wo_a == "fp8":
        from deepseek_csa.torch.checkpoint_width import fp8_wo_a
        n = fp8_wo_a(model)
        log(f"[wo_a] {n} attention output projection(s) read as FP8 (--wo-a bf16: as released)")
    if args.f32_weights == "bf16":
        from deepseek_csa.torch.checkpoint_width import bf16_f32_weights
        n = bf16_f32_weights(model)
        log(f"[f32 weights] {n} float32 weight(s) with bf16 values held in bf16 "
            "and router(s) (--f32-weights f32: as released)")
    if args.swap:
        ops = None if args.swap == "all" else [o.strip() for o in args.swap.split(",")]
        routed = dct.swap(model, ops=ops).routed
        log(f"[swap] {args.swap}: " + "; ".join(f"layer {k}: {', '.join(v) or '-'}"
                                                for k, v in routed.items()))
    t_load = time.perf_counter() - t0
    ckpt_bytes = os.path.getsize(path)
    log(f"[load] rank 0 of {world_size}: {path} ({ckpt_bytes / 2**20:.1f} MiB) in "
        f"{t_load:.2f} s, {torch.get_num_threads()} thread(s) per rank")
    tokdir = _find_tokenizer(args.inference_dir, args.ckpt_path)
    tok = load_tokenizer(tokdir) if tokdir else None
    eos = args.eos_id if args.eos_id is not None else (tok.eos_token_id if tok else None)
    vocab = margs.vocab_size

    def bcast(obj):
        if world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    warm = [args.warmup > 0]

    def run(prompts):
        if warm[0]:
            # the thread pool's start, first touches of the caches and workspaces, lazy
            # tables: paid here, not in the timed call (llama.cpp's harness warms up too);
            # the timed prefill starts at position 0 and rewrites every cache row and
            # compressor state slot it later reads
            warm[0] = False
            generate(model, [prompts[0][:args.warmup]], 2, None, 0.0, args.seed,
                     getattr(margs, "max_seq_len", None))
        outs, st = generate(model, prompts, args.max_new_tokens, eos, args.temperature,
                            args.seed, getattr(margs, "max_seq_len", None), log)
        return outs, st

    if args.input_file:
        prompts = None
        if rank == 0:
            with open(args.input_file, encoding="utf-8") as f:
                lines = [ln.strip() for ln in f if ln.strip()]
            mb = getattr(margs, "max_batch_size", len(lines))
            if len(lines) > mb:
                raise ValueError(f"{len(lines)} prompts in {args.input_file} exceed "
                                 f"max_batch_size={mb} of the config")
            prompts = [_encode(ln, tok, vocab) for ln in lines]
        prompts = bcast(prompts)
        outs, st = run(prompts)
        for p, o in zip(prompts, outs):
            log(f"[prompt] {_decode(p, tok)}")
            log(f"[completion] {_decode(o, tok)}")
        _report(args, st, outs, world_size, rank, dist, rss0, ckpt_bytes, t_load, log)
        return outs
    history = []
    while True:
        line = None
        if rank == 0:
            try:
                line = input(">>> ")
            except EOFError:
                line = "/exit"
        line = bcast(line)
        if line.strip() == "/exit":
            return history
        if not line.strip():
            continue
        try:
            ids = _encode(line, tok, vocab) if rank == 0 else None
        except ValueError as e:
            log(f"error: {e}")
            ids = []
        ids = bcast(ids)
        if not ids:
            continue
        outs, st = run([ids])
        log(_decode(outs[0], tok))
        _report(args, st, outs, world_size, rank, dist, rss0, ckpt_bytes, t_load, log)
        history.append(outs[0])


def _report(args, st, outs, world_size, rank, dist, rss0, ckpt_bytes, t_load, log):
    peak = peak_rss_bytes()
    rows = [(rank, peak, rss0, ckpt_bytes)]
    if world_size > 1:
        rows = [None] * world_size
        dist.all_gather_object(rows, (rank, peak, rss0, ckpt_bytes))
    bsz = len(outs)
    pre = st["prefill_tokens"] / st["prefill_s"] if st.get("prefill_s") else 0.0
    dec = bsz * st["decode_steps"] / st["decode_s"] if st["decode_s"] else 0.0
    log(f"[speed] prefill {pre:.1f} tokens/s, decode {dec:.2f} tokens/s "
        f"({st['decode_steps']} steps x {bsz} row(s))")
    for r, pk, r0, cb in rows:
        log(f"[memory] rank {r}: peak RSS {pk / 2**20:.1f} MiB (before loading model.py "
            f"{r0 / 2**20:.1f} MiB), shard {cb / 2**20:.1f} MiB on disk")
    if rank == 0 and args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"tokens": outs, "world_size": world_size,
                       "prefill_tokens_per_s": pre, "decode_tokens_per_s": dec,
                       "prefill_s": st.get("prefill_s"), "decode_s": st["decode_s"],
                       "prefill_cpu_s": st.get("prefill_cpu_s"),
                       "decode_cpu_s": st.get("decode_cpu_s"),
                       "decode_steps": st["decode_steps"], "load_s": t_load,
                       "ranks": [{"rank": r, "peak_rss": pk, "rss_before_model": r0,
                                  "shard_bytes": cb} for r, pk, r0, cb in rows],
                       **({"prefill_logits": st["prefill_logits"].float().tolist()}
                          if args.output_logits else {})}, f)


def _passive_wait_exec():
    """OpenMP threads that spin at barriers (the runtime's default) lose most of a shared
    host: a thread spins while the peer it waits for is descheduled.  Measured on the
    2-core test host at load average 12-15, decode of the V4-Flash-width 3-layer model
    (benchmarks/bench_llamacpp_model.py) at 2 threads: 3.5 s a step by default, 0.42-0.50
    s with OMP_WAIT_POLICY=passive (1 thread: 0.34 s).  The runtime reads the variable
    when it loads (importing deepseek_csa already has), so when the user has not set it
    the CLI runs itself again with it set to passive; any value set is kept."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "passive"
    os.execv(sys.executable, [sys.executable, "-m", "deepseek_csa.generate"] + sys.argv[1:])


if __name__ == "__main__":
    _passive_wait_exec()
    try:
        main()
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
