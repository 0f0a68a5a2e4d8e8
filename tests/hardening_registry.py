"""One table of every public kernel, for the hardening suites.

test_hardening.py (bad inputs), test_leaks.py (reference counts, memory) and
test_threads.py (threads, determinism across OMP_NUM_THREADS, interrupts) all read
this table instead of knowing each kernel.  An entry says how to build a valid call
of a given size, which parameters are arrays (their shapes as symbols, dtype,
accepted ranks, whether the kernel writes them), ints with their valid range,
reals, choices and flags.  Entries whose function does not exist yet are skipped
(``Entry.available``).

Shapes are tuples of size symbols (str) or literal ints.  ``sizes`` draws each
symbol from a range; ``derive`` adds the symbols that follow from others (e.g.
``T = ratio * G + tail``) and may clamp drawn ones so a call is valid.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

import deepseek_csa as dc

NO = object()          # "parameter not passed"


# ---------------------------------------------------------------- parameter kinds

@dataclasses.dataclass
class Arr:
    """An array parameter.

    role: 'in' (read only), 'inout' (written in place, its values matter),
          'out' (an ``out=`` buffer: None in the canonical call).
    ndim: (lo, hi) ranks the function accepts (hi None = any); default the shape's rank.
    index: for integer index arrays, sizes -> (lo, hi) inclusive valid values.
    fill: (rng, shape, sizes) -> values for a valid call (default standard normal / index).
    optional: None is a valid value (the canonical call may still pass an array).
    """
    shape: Tuple[Any, ...]
    dtype: Any = np.float32
    role: str = "in"
    ndim: Optional[Tuple[int, Optional[int]]] = None
    index: Optional[Callable[[dict], Tuple[int, int]]] = None
    fill: Optional[Callable] = None
    optional: bool = False
    omit: bool = False          # canonical call omits it (passes the default)
    also: Tuple[str, ...] = ()  # other dtypes accepted, by name (e.g. "bfloat16")
    contiguous: bool = False    # an 'out' that must be C-contiguous (documented)

    def __post_init__(self):
        self.dtype = np.dtype(self.dtype)
        if self.ndim is None:
            self.ndim = (len(self.shape), len(self.shape))

    @property
    def written(self):
        return self.role in ("inout", "out")

    def concrete_shape(self, sizes):
        return tuple(sizes[s] if isinstance(s, str) else s for s in self.shape)


@dataclasses.dataclass
class Int:
    """An int parameter; ``value`` (sizes -> int) builds the valid one; values outside
    [lo, hi] must raise.  ``huge_ok``: an in-range but absurd value (2**40) may succeed
    (e.g. a ratio larger than T gives zero entries) instead of raising."""
    value: Callable[[dict], int]
    lo: int = 0
    hi: Optional[int] = None
    huge_ok: bool = False
    size_like: bool = False     # sizes an output: huge values may raise MemoryError
    exact: bool = False         # any other value must raise ValueError (e.g. start_pos)
    optional: bool = False      # None is valid (the default)


@dataclasses.dataclass
class Real:
    value: Callable[[dict], float]
    lo: float = -np.inf          # valid range, inclusive
    hi: float = np.inf
    finite: bool = True          # NaN / inf must raise
    lo_open: bool = False
    optional: bool = False       # None is valid


@dataclasses.dataclass
class Choice:
    value: Callable[[dict], str]
    choices: Sequence[str] = ()
    none_ok: bool = False        # None means the default


@dataclasses.dataclass
class Flag:
    value: Callable[[dict], bool]


def to_numpy(x):
    """An ndarray view of x (torch tensors included; bfloat16 as ml_dtypes.bfloat16)."""
    if type(x).__module__.startswith("torch"):
        import torch
        x = x.detach()
        if x.dtype == torch.bfloat16:
            from ml_dtypes import bfloat16
            return x.view(torch.int16).numpy().view(bfloat16)
        return x.numpy()
    return np.asarray(x)


def _S(name):
    return lambda s: s[name]


def _C(v):
    return lambda s: v


# ---------------------------------------------------------------- entries

@dataclasses.dataclass
class Entry:
    name: str                                   # id in test names
    func: str                                   # attribute of deepseek_csa ("A.b" for methods)
    params: Dict[str, Any]                      # in signature order
    positional: Tuple[str, ...]                 # passed positionally in the canonical call
    sizes: Dict[str, Tuple[int, int]]           # symbol -> (lo, hi) drawn by the tests
    derive: Callable[[dict], dict] = lambda s: s
    zero_ok: Tuple[str, ...] = ()               # symbols that may be 0 in a valid call
    zero_bad: Tuple[str, ...] = ()              # symbols whose 0 must raise
    result: Callable[[Any, dict], Tuple[np.ndarray, ...]] = None
    call: Optional[Callable] = None             # (fn, args, kwargs, sizes) -> ret
    loose: bool = False                         # layout variants compared at rtol 1e-5, not bitwise
    nan_ok: bool = True                         # NaN/inf inputs are a valid call
    in_place_ok: Tuple[str, ...] = ()           # 'out' may be the same array as these inputs
    big: Optional[Dict[str, int]] = None        # sizes of a long (seconds) call
    medium: Optional[Dict[str, int]] = None     # ~10-100 ms, several OpenMP threads
    long: Optional[Dict[str, int]] = None       # ~1 s: the Ctrl-C test (big: the report)
    huge_skip: Tuple[str, ...] = ()             # symbols whose length is the work itself
    examples: int = 12                          # hypothesis examples (size draws)
    notes: str = ""

    def resolve(self):
        obj = dc
        for part in self.func.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj

    def available(self):
        return self.resolve() is not None

    # ---- building a valid call

    def make_sizes(self, drawn):
        s = dict(drawn)
        s = self.derive(s)
        return s

    def build(self, sizes, seed):
        """Canonical valid arguments: an ordered dict name -> value (NO = not passed)."""
        rng = np.random.default_rng(seed)
        vals = {}
        for name, p in self.params.items():
            if isinstance(p, Arr):
                if p.role == "out" or p.omit:
                    vals[name] = NO
                    continue
                shape = p.concrete_shape(sizes)
                if p.fill is not None:
                    a = np.asarray(p.fill(rng, shape, sizes))
                    a = np.ascontiguousarray(a, dtype=p.dtype)
                elif p.index is not None:
                    lo, hi = p.index(sizes)
                    a = rng.integers(lo, hi + 1, size=shape, endpoint=False).astype(p.dtype) \
                        if hi >= lo else np.full(shape, lo, p.dtype)
                elif p.dtype == np.bool_:
                    a = rng.random(shape) < 0.5
                else:
                    a = rng.standard_normal(shape).astype(p.dtype)
                vals[name] = a
            else:
                vals[name] = p.value(sizes)
        return vals

    def split(self, vals):
        """Positional arguments up to the first one not passed, keywords for the rest."""
        args = []
        for n in self.positional:
            if vals.get(n, NO) is NO:
                break
            args.append(vals[n])
        kwargs = {n: v for n, v in vals.items() if n not in self.positional[:len(args)]
                  and v is not NO}
        return args, kwargs

    def invoke(self, vals, sizes):
        fn = self.resolve()
        args, kwargs = self.split(vals)
        if self.call is not None:
            return self.call(fn, args, kwargs, sizes)
        return fn(*args, **kwargs)

    def outputs(self, ret, vals):
        """The arrays a call produced: its return value(s) and every written array."""
        if self.result is not None:
            got = self.result(ret, vals)
        elif isinstance(ret, tuple):
            got = ret
        elif ret is None:
            got = ()
        else:
            got = (ret,)
        got = tuple(to_numpy(g) for g in got)
        written = tuple(to_numpy(vals[n]) for n, p in self.params.items()
                        if isinstance(p, Arr) and p.written and vals.get(n, NO) is not NO
                        and vals[n] is not None)
        return got + written

    def arrays(self):
        return [n for n, p in self.params.items() if isinstance(p, Arr)]

    def symbol_users(self, sym):
        return [n for n, p in self.params.items()
                if (isinstance(p, Arr) and sym in p.shape)]


# ---------------------------------------------------------------- the table

def _rope_tables(rng, shape, sizes):
    return np.cos(rng.uniform(-20, 20, shape))


def _rope_derive(s):
    s["D"] = 2 * s["Dh"] + s["extra"]
    return s


def _hadamard_derive(s):
    s["N"] = 1 << s["logN"]
    return s


def _pool_derive(s):
    s["T"] = s["ratio"] * s["G"] + min(s["tail"], s["ratio"] - 1)
    s["CD"] = s["c"] * s["D"]
    return s


def _index_derive(s):
    s["Tc"] = (s["p"] + s["S"]) // s["ratio"]
    return s


def _scores_derive(s):
    s["Tc"] = (s["p"] + s["S"]) // s["ratio"] + s["more"]
    return s


def _topk_derive(s):
    s["Tc"] = (s["p"] + s["S"]) // s["ratio"] + s["more"]
    s["K"] = min(s["topk"], (s["p"] + s["S"]) // s["ratio"])
    if "bs" in s:
        s["NB"] = -(-s["Tc"] // s["bs"])
    if "tb" in s:
        s["NB"] = -(-s["Tc"] // s["bs"])
    return s


def _window_derive(s):
    if s["p"] > 0:
        s["S"] = min(s["S"], 1)           # decode: one token
        s["Wn"] = s["W"]
    else:
        s["Wn"] = min(s["S"], s["W"])
    return s


def _hca_derive(s):
    if s["p"] > 0:
        s["S"] = min(s["S"], 1)
    s["Wn"] = (s["p"] + s["S"]) // s["ratio"]
    return s


_CACHE = {}


def _cached(key, make):
    if key not in _CACHE:
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = make()
    return _CACHE[key]


def _sizes_key(sizes):
    return tuple(sorted(sizes.items()))


def _compressor_new(sizes):
    c = 2 if sizes["c"] == 2 else 1

    def ape():
        rng = np.random.default_rng(sizes["ratio"] * 7 + sizes["D"])
        return rng.standard_normal((sizes["ratio"], c * sizes["D"])).astype(np.float32)
    return dc.Compressor(sizes["B"] + sizes["more"], sizes["ratio"], sizes["D"],
                         overlap=(c == 2), ape=_cached(("ape", _sizes_key(sizes)), ape))


def _compressor_prefill(fn, args, kwargs, sizes):
    comp = _compressor_new(sizes)
    y = comp.prefill(*args, **kwargs)
    return y, comp


def _step_data(sizes):
    """Prefill inputs, one valid step's inputs, and that step's result on a fresh
    Compressor (the reference for 'a step that raised left the state unchanged')."""
    B, T, CD = sizes["B"] + sizes["more"], sizes["T"], sizes["CD"]
    rng = np.random.default_rng(11)
    pre = [rng.standard_normal((B, T, CD)).astype(np.float32) for _ in range(2)]
    good = [rng.standard_normal((sizes["B"], 1, CD)).astype(np.float32) for _ in range(2)]
    ref = _compressor_new(sizes)
    ref.prefill(*pre)
    return pre, good, ref.step(*good, T)


def _compressor_step(fn, args, kwargs, sizes):
    """A Compressor that prefilled T tokens takes the step; a step that raises must
    leave the state as it was: the next valid step then gives the entry a fresh
    Compressor gives."""
    pre, good, want = _cached(("step", dc.get_isa(), _sizes_key(sizes)), lambda: _step_data(sizes))
    comp = _compressor_new(sizes)
    comp.prefill(*pre)
    try:
        y = comp.step(*args, **kwargs)
    except Exception:
        got = comp.step(*good, sizes["T"])
        if not (want is None and got is None) and not (
                want is not None and got is not None and np.array_equal(want, got)):
            raise AssertionError("Compressor state changed by a step that raised")
        raise
    return y, comp


def _compressor_result(ret, vals):
    y, comp = ret
    return (np.zeros(0, np.float32) if y is None else y, comp.positions)


def _blocks_derive(s):
    s["L"] = s["NB"] * s["blk"]
    return s


ENTRIES = [
    Entry("rms_norm", "rms_norm",
          dict(x=Arr(("R", "D"), ndim=(1, None), also=("bfloat16",)),
               weight=Arr(("D",), optional=True),
               eps=Real(_C(1e-6), lo=0.0),
               out=Arr(("R", "D"), role="out", ndim=(1, None))),
          positional=("x", "weight"), sizes=dict(R=(1, 9), D=(1, 70)),
          zero_ok=("R", "D"), in_place_ok=("x",), big=dict(R=65536, D=4096),
          medium=dict(R=8191, D=1031)),
    Entry("rope_table", "rope_table",
          dict(rope_dim=Int(lambda s: 2 * s["Dh"], lo=2, hi=8192),
               seqlen=Int(_S("S"), lo=0, hi=1 << 31, size_like=True),
               base=Real(_C(10000.0), lo=1.0, lo_open=True),
               original_seq_len=Int(_S("osl"), lo=0, hi=1 << 40, huge_ok=True),
               factor=Real(_C(16.0), lo=1e-30, hi=1e30),
               beta_fast=Real(_C(32.0), lo=1e-30, hi=1e30),
               beta_slow=Real(_C(1.0), lo=1e-30, hi=1e30)),
          positional=("rope_dim", "seqlen"), sizes=dict(Dh=(1, 40), S=(0, 50), osl=(0, 70000)),
          big=dict(Dh=32, S=1 << 19, osl=65536), medium=dict(Dh=32, S=100001, osl=65536)),
    Entry("apply_rope", "apply_rope",
          dict(x=Arr(("B", "S", "H", "D"), role="inout", ndim=(3, 4), also=("bfloat16",)),
               cos=Arr(("S", "Dh"), fill=_rope_tables),
               sin=Arr(("S", "Dh"), fill=_rope_tables),
               inverse=Flag(_C(False))),
          positional=("x", "cos", "sin"),
          sizes=dict(B=(1, 3), S=(1, 9), H=(1, 4), Dh=(1, 40), extra=(0, 9)),
          derive=_rope_derive, zero_ok=("B", "S", "H", "Dh"),
          big=dict(B=1, S=8192, H=64, Dh=32, extra=448),
          medium=dict(B=2, S=4001, H=16, Dh=32, extra=5)),

    # ---- the Compressor
    Entry("gated_pool", "gated_pool",
          dict(kv=Arr(("B", "T", "CD"), also=("bfloat16",)),
               score=Arr(("B", "T", "CD"), optional=True, also=("bfloat16",)),
               ratio=Int(_S("ratio"), lo=1, hi=1 << 40, huge_ok=True),
               ape=Arr(("ratio", "CD"), optional=True, also=("bfloat16",)),
               overlap=Flag(_C(False)),
               out=Arr(("B", "G", "D"), role="out")),
          positional=("kv", "score", "ratio"),
          sizes=dict(B=(1, 3), G=(0, 5), tail=(0, 7), ratio=(1, 9), D=(1, 24), c=(1, 1)),
          derive=_pool_derive, zero_ok=("B", "G", "D"),
          medium=dict(B=2, G=1501, tail=3, ratio=4, D=512, c=1)),
    Entry("gated_pool_overlap", "gated_pool",
          dict(kv=Arr(("B", "T", "CD"), also=("bfloat16",)),
               score=Arr(("B", "T", "CD"), also=("bfloat16",)),
               ratio=Int(_S("ratio"), lo=1, hi=1 << 40, huge_ok=True),
               ape=Arr(("ratio", "CD"), optional=True, also=("bfloat16",)),
               overlap=Flag(_C(True)),
               out=Arr(("B", "G", "D"), role="out")),
          positional=("kv", "score", "ratio"),
          sizes=dict(B=(1, 3), G=(0, 5), tail=(0, 7), ratio=(1, 9), D=(1, 24), c=(2, 2)),
          derive=_pool_derive, zero_ok=("B", "G", "D"),
          big=dict(B=1, G=2048, tail=0, ratio=4, D=512, c=2),
          medium=dict(B=2, G=301, tail=3, ratio=4, D=512, c=2)),
    Entry("Compressor", "Compressor",
          dict(batch=Int(_S("Bs"), lo=1, size_like=True),
               ratio=Int(_S("ratio"), lo=1, size_like=True),
               head_dim=Int(_S("D"), lo=1, size_like=True),
               overlap=Flag(lambda s: s["c"] == 2),
               ape=Arr(("ratio", "CD"), optional=True),
               norm_weight=Arr(("D",), optional=True),
               eps=Real(_C(1e-6), lo=0.0),
               model_dtype=Choice(_C("float32"), ("float32", "bfloat16")),
               quant=Choice(_C(None), ("fp8", "fp4", "hadamard_fp4", "fp4_e4m3"), none_ok=True),
               packed=Flag(_C(False))),
          positional=("batch", "ratio", "head_dim"),
          sizes=dict(Bs=(1, 3), ratio=(1, 9), D=(1, 24), c=(1, 2), G=(0, 0), tail=(0, 0)),
          derive=_pool_derive, result=lambda c, v: (c.positions,)),
    Entry("Compressor.prefill", "Compressor",
          dict(kv=Arr(("B", "T", "CD"), also=("bfloat16",)),
               score=Arr(("B", "T", "CD"), optional=True, also=("bfloat16",)),
               out=Arr(("B", "G", "D"), role="out", contiguous=True)),
          positional=("kv", "score"),
          sizes=dict(B=(1, 3), more=(0, 2), G=(0, 5), tail=(0, 7), ratio=(1, 9), D=(1, 24),
                     c=(1, 2)),
          derive=_pool_derive, zero_ok=("G", "tail", "more"), call=_compressor_prefill,
          result=_compressor_result),
    Entry("Compressor.step", "Compressor",
          dict(kv=Arr(("B", 1, "CD"), also=("bfloat16",)),
               score=Arr(("B", 1, "CD"), optional=True, also=("bfloat16",)),
               start_pos=Int(_S("T"), lo=0, exact=True)),
          positional=("kv", "score", "start_pos"),
          sizes=dict(B=(1, 3), more=(0, 2), G=(0, 5), tail=(0, 7), ratio=(1, 9), D=(1, 24),
                     c=(1, 2)),
          derive=_pool_derive, zero_ok=("G", "tail", "more"), call=_compressor_step,
          result=_compressor_result),

    # ---- the indexer
    Entry("index_scores", "index_scores",
          dict(q=Arr(("B", "S", "Hi", "Di"), also=("bfloat16",)),
               k=Arr(("B", "Tc", "Di"), also=("bfloat16",)),
               weights=Arr(("B", "S", "Hi"), also=("bfloat16",)),
               ratio=Int(_S("ratio"), lo=1, hi=2**31 - 1, huge_ok=True),
               start_pos=Int(_S("p"), lo=0, hi=1 << 40, huge_ok=True),
               out=Arr(("B", "S", "Tc"), role="out")),
          positional=("q", "k", "weights"),
          sizes=dict(B=(1, 2), S=(1, 9), Hi=(1, 5), Di=(1, 20), ratio=(1, 5), p=(0, 12),
                     more=(0, 2)),
          derive=_scores_derive, zero_ok=("B", "S", "Hi", "Di", "more"),
          huge_skip=("Hi", "Di"),   # 2**40 heads / features: valid, and the work itself
          medium=dict(B=1, S=257, Hi=64, Di=128, ratio=4, p=0, more=0)),
    Entry("index_topk", "index_topk",
          dict(q=Arr(("B", "S", "Hi", "Di"), also=("bfloat16",)),
               k=Arr(("B", "Tc", "Di"), also=("bfloat16",)),
               weights=Arr(("B", "S", "Hi"), also=("bfloat16",)),
               topk=Int(_S("topk"), lo=1, hi=2**31 - 1, huge_ok=True),
               ratio=Int(_S("ratio"), lo=1, hi=2**31 - 1, huge_ok=True),
               start_pos=Int(_S("p"), lo=0, hi=1 << 40, huge_ok=True),
               offset=Int(_S("off"), lo=0, huge_ok=True),
               order=Choice(_C("score"), ("score", "position")),
               out=Arr(("B", "S", "K"), dtype=np.int32, role="out")),
          positional=("q", "k", "weights", "topk"),
          sizes=dict(B=(1, 2), S=(1, 9), Hi=(1, 5), Di=(1, 20), ratio=(1, 5), p=(0, 12),
                     topk=(1, 8), off=(0, 9), more=(0, 2)),
          derive=_topk_derive, zero_ok=("B", "S", "Hi", "Di", "more"),
          huge_skip=("Hi", "Di"),   # 2**40 heads / features: valid, and the work itself
          big=dict(B=1, S=4096, Hi=64, Di=128, ratio=4, p=0, topk=512, off=4096, more=0),
          medium=dict(B=1, S=257, Hi=64, Di=128, ratio=4, p=0, topk=64, off=257, more=0)),
    Entry("index_topk_candidates", "index_topk",
          dict(q=Arr(("B", "S", "Hi", "Di"), also=("bfloat16",)),
               k=Arr(("B", "Tc", "Di"), also=("bfloat16",)),
               weights=Arr(("B", "S", "Hi"), also=("bfloat16",)),
               topk=Int(_S("topk"), lo=1, hi=2**31 - 1, huge_ok=True),
               ratio=Int(_S("ratio"), lo=1, hi=2**31 - 1, huge_ok=True),
               start_pos=Int(_S("p"), lo=0, hi=1 << 40, huge_ok=True),
               offset=Int(_S("off"), lo=0, huge_ok=True),
               order=Choice(_C("position"), ("score", "position")),
               candidates=Arr(("B", "S", "NB"), dtype=np.bool_, optional=True),
               block_size=Int(_S("bs"), lo=1, hi=2**31 - 1, huge_ok=True, optional=True),
               out=Arr(("B", "S", "K"), dtype=np.int32, role="out")),
          positional=("q", "k", "weights", "topk"),
          sizes=dict(B=(1, 2), S=(1, 9), Hi=(1, 5), Di=(1, 20), ratio=(1, 5), p=(0, 12),
                     topk=(1, 8), off=(0, 9), more=(0, 2), bs=(1, 4)),
          derive=_topk_derive, zero_ok=("B", "S", "Hi", "Di", "more"), huge_skip=("Hi", "Di")),
    Entry("topk_indices", "topk_indices",
          dict(scores=Arr(("B", "S", "Tc")),
               topk=Int(_S("topk"), lo=1, hi=2**31 - 1, huge_ok=True),
               ratio=Int(_S("ratio"), lo=1, hi=2**31 - 1, huge_ok=True),
               start_pos=Int(_S("p"), lo=0, hi=1 << 40, huge_ok=True),
               offset=Int(_S("off"), lo=0, huge_ok=True),
               order=Choice(_C("position"), ("score", "position")),
               out=Arr(("B", "S", "K"), dtype=np.int32, role="out")),
          positional=("scores", "topk"),
          sizes=dict(B=(1, 2), S=(1, 9), ratio=(1, 5), p=(0, 12), topk=(1, 8), off=(0, 9),
                     more=(0, 2)),
          derive=_topk_derive, zero_ok=("B", "S", "more"),
          # 2049 rows: at 1025 a call (0.3 ms since the histogram prefilter) was too short for
          # the GIL test's heartbeat thread to be scheduled inside half of them
          medium=dict(B=1, S=2049, ratio=4, p=0, topk=512, off=2049, more=0)),
    Entry("select_candidate_blocks", "select_candidate_blocks",
          dict(scores=Arr(("B", "S", "Tc")),
               topk_blocks=Int(_S("tb"), lo=1, hi=2**31 - 1, huge_ok=True),
               block_size=Int(_S("bs"), lo=1, hi=2**31 - 1, huge_ok=True),
               ratio=Int(_S("ratio"), lo=1, hi=2**31 - 1, huge_ok=True),
               start_pos=Int(_S("p"), lo=0, hi=1 << 40, huge_ok=True),
               out=Arr(("B", "S", "NB"), dtype=np.bool_, role="out")),
          positional=("scores", "topk_blocks", "block_size"),
          sizes=dict(B=(1, 2), S=(1, 9), ratio=(1, 5), p=(0, 12), tb=(1, 4), bs=(1, 4),
                     more=(0, 2), topk=(1, 1), off=(0, 0)),
          derive=_topk_derive, zero_ok=("B", "S", "more")),
    Entry("window_topk_idxs", "window_topk_idxs",
          dict(window=Int(_S("W"), lo=1, hi=2**31 - 1, size_like=True),
               batch=Int(_S("B"), lo=0, hi=2**31 - 1, size_like=True),
               seqlen=Int(_S("S"), lo=0, hi=2**31 - 1, size_like=True),
               start_pos=Int(_S("p"), lo=0, hi=1 << 40, huge_ok=True),
               out=Arr(("B", "S", "Wn"), dtype=np.int32, role="out")),
          positional=("window", "batch", "seqlen", "start_pos"),
          sizes=dict(W=(1, 9), B=(1, 3), S=(1, 9), p=(0, 20)),
          derive=_window_derive, zero_ok=("B", "S")),
    Entry("compress_topk_idxs", "compress_topk_idxs",
          dict(ratio=Int(_S("ratio"), lo=1, hi=2**31 - 1, huge_ok=True),
               batch=Int(_S("B"), lo=0, hi=2**31 - 1, size_like=True),
               seqlen=Int(_S("S"), lo=0, hi=2**31 - 1, size_like=True),
               start_pos=Int(_S("p"), lo=0, hi=1 << 40, huge_ok=True),
               offset=Int(_S("off"), lo=0, huge_ok=True),
               out=Arr(("B", "S", "Wn"), dtype=np.int32, role="out")),
          positional=("ratio", "batch", "seqlen", "start_pos", "offset"),
          sizes=dict(ratio=(1, 9), B=(1, 3), S=(1, 9), p=(0, 20), off=(0, 9)),
          derive=_hca_derive, zero_ok=("B", "S")),

    # ---- sparse attention
    Entry("sparse_attn", "sparse_attn",
          dict(q=Arr(("B", "S", "H", "D")), kv=Arr(("B", "N", "D")),
               attn_sink=Arr(("H",)),
               topk_idxs=Arr(("B", "S", "K"), dtype=np.int32,
                             index=lambda s: (-1, s["N"] - 1)),
               softmax_scale=Real(lambda s: s["D"] ** -0.5),
               out=Arr(("B", "S", "H", "D"), role="out")),
          positional=("q", "kv", "attn_sink", "topk_idxs", "softmax_scale"),
          sizes=dict(B=(1, 2), S=(1, 6), H=(1, 5), D=(1, 40), N=(1, 20), K=(0, 9)),
          zero_ok=("B", "S", "H", "K", "D"), loose=True,
          # K = 2**40 indices per query (zero strides) is valid and would take days
          huge_skip=("K",),
          big=dict(B=1, S=4096, H=64, D=512, N=4096 + 1024, K=640),
          long=dict(B=1, S=512, H=64, D=512, N=4096 + 1024, K=640),
          medium=dict(B=1, S=17, H=64, D=512, N=1200, K=640)),

    # ---- QAT rounding and Hadamard
    Entry("fp8_round", "fp8_round",
          dict(x=Arr(("R", "L"), role="inout", ndim=(1, None), also=("bfloat16",)),
               block=Int(_S("blk"), lo=1, hi=1 << 40, huge_ok=True),
               scale=Choice(_C("ue8m0"), ("ue8m0", "fp32"), none_ok=True),
               out=Arr(("R", "L"), role="out", ndim=(1, None))),
          positional=("x", "block"), sizes=dict(R=(1, 5), NB=(1, 4), blk=(1, 70)),
          derive=_blocks_derive, zero_ok=("R",), in_place_ok=("x",),
          big=dict(R=8192, NB=7, blk=64), medium=dict(R=8193, NB=7, blk=64)),
    Entry("fp4_round", "fp4_round",
          dict(x=Arr(("R", "L"), role="inout", ndim=(1, None), also=("bfloat16",)),
               block=Int(_S("blk"), lo=1, hi=1 << 40, huge_ok=True),
               scale=Choice(_C("ue8m0"), ("ue8m0", "e4m3"), none_ok=True),
               out=Arr(("R", "L"), role="out", ndim=(1, None))),
          positional=("x", "block"), sizes=dict(R=(1, 5), NB=(1, 4), blk=(1, 40)),
          derive=_blocks_derive, zero_ok=("R",), in_place_ok=("x",),
          medium=dict(R=16385, NB=4, blk=32)),
    Entry("hadamard", "hadamard",
          dict(x=Arr(("R", "N"), ndim=(1, None), also=("bfloat16",)),
               # a NaN / inf scale is not rejected: the documented product (NaN / inf)
               scale=Real(_C(None), optional=True, finite=False),
               out=Arr(("R", "N"), role="out", ndim=(1, None))),
          positional=("x",), sizes=dict(R=(1, 6), logN=(0, 8)),
          derive=_hadamard_derive, zero_ok=("R",), loose=True, in_place_ok=("x",),
          medium=dict(R=16385, logN=7)),
]

BY_NAME = {e.name: e for e in ENTRIES}

# Misbehaviours found by the suite and left to their owners: (entry, regex on the case
# description, what is wrong).  test_bad_inputs tolerates exactly these cases;
# test_hardening.py::test_known_issue runs each as xfail(strict=True), so a fix shows
# up as XPASS and its line must then be deleted here.
KNOWN = [
    # (entry name, regex over the case description, why): strict xfails for misbehaviours
    # found and not yet fixed.  Empty: the Compressor constructor's four were fixed.
]


def known_issue(entry_name, desc):
    import re
    for e, pat, why in KNOWN:
        if e == entry_name and re.search(pat, desc):
            return why
    return None


def available_entries():
    return [e for e in ENTRIES if e.available()]


def default_sizes(entry, pick=operator.itemgetter(1)):
    """Sizes of a deterministic mid-size valid call (hi end of every range)."""
    return entry.make_sizes({k: pick(v) for k, v in entry.sizes.items()})


# ---- the released kernel module's GEMMs, quantizers and Sinkhorn

def _e4m3_codes(rng, shape, sizes):
    u = rng.integers(0, 256, shape).astype(np.uint8)
    u[(u & 0x7F) == 0x7F] ^= 1          # no NaN codes in a valid call
    return u


def _bytes(rng, shape, sizes):
    return rng.integers(0, 256, shape).astype(np.uint8)


def _pos_scales(rng, shape, sizes):
    return (2.0 ** rng.integers(-9, -3, shape) * rng.uniform(0.5, 1, shape)).astype(np.float32)


def _gemm8_derive(s):
    s["K"] = 16 * s["K16"] + s["Kodd"]
    s["KB"] = -(-s["K"] // 128)
    s["NB"] = -(-s["N"] // 128)
    return s


def _gemm4_derive(s):
    s["K"] = 32 * s["K32"] + 2 * s["Kodd"]
    s["K2"] = s["K"] // 2
    s["KB"] = -(-s["K"] // 128)
    s["KB32"] = -(-s["K"] // 32)
    return s


def _quant4_derive(s):
    s["blk"] = 2 * s["blk2"]
    s["L"] = s["NB"] * s["blk"]
    return s


def _fp4rows_derive(s):
    s["L"] = 32 * s["NB"]
    s["W"] = 17 * s["NB"]
    return s


def _fp4rows_fill(rng, shape, sizes):
    """Valid FP4 rows: random codes, exponent bytes in a moderate range (no 0xff)."""
    u = rng.integers(0, 256, shape).astype(np.uint8)
    nb = shape[-1] // 17
    u[..., 16 * nb:] = rng.integers(110, 140, u[..., 16 * nb:].shape)
    return u


def _hc_derive(s):
    s["W"] = (2 + s["h"]) * s["h"]
    return s


# Arrays the glue reads with a unit last stride only (documented: weights are read as
# they are stored): a layout variant that changes the last stride must raise naming them
# (hardening_cases.py applies this to its "same" layout cases).
_GEMMS = ("fp8_gemm", "fp4_gemm", "fp8_gemm_indexed", "fp4_gemm_indexed")
UNIT_LAST_STRIDE = {name: ("b",) for name in _GEMMS}
# out= dtypes an entry accepts besides its canonical float32 (the GEMMs store bfloat16).
OUT_ALSO = {name: ("bfloat16",) for name in _GEMMS}
# b_index: row i of a against weight b[b_index[i]] of E stacked ones; -1: a zero row
_B_INDEX = Arr(("M",), dtype=np.int32, index=lambda s: (-1, s["E"] - 1), optional=True)

def _gemm_entry(fmt, indexed):
    """fp8_gemm / fp4_gemm; indexed: b and b_s stack E weights and b_index picks one a
    row (then a keeps its canonical rank: b_index has a's leading shape)."""
    fp8 = fmt == "fp8"
    lead = ("E",) if indexed else ()
    rank = {} if indexed else dict(ndim=(1, None))     # leading dims of a: any, unindexed
    kdim, ksym = ("K16", "K") if fp8 else ("K32", "K2")
    params = dict(a=Arr(("M", "K"), dtype=np.uint8, fill=_e4m3_codes, **rank),
                  a_s=Arr(("M", "KB"), fill=_pos_scales, also=("uint8",), **rank),
                  b=Arr(lead + ("N", ksym), dtype=np.uint8, fill=_e4m3_codes if fp8 else _bytes),
                  b_s=Arr(lead + (("NB", "KB") if fp8 else ("N", "KB32")), fill=_pos_scales,
                          also=("uint8",)))
    if indexed:
        params["b_index"] = _B_INDEX
    params.update(out_dtype=Choice(_C(None), ("bfloat16", "float32"), none_ok=True),
                  out=Arr(("M", "N"), role="out", also=("bfloat16",), **rank))
    sizes = dict(M=(1, 6), N=(1, 140 if fp8 else 70), Kodd=(0, 1), **{kdim: (0, 20 if fp8 else 10)})
    medium = dict(M=64 if fp8 else 32, N=2048, Kodd=0, **{kdim: 64})
    if indexed:
        sizes["E"], medium["E"] = (1, 4), 4
    return Entry(f"{fmt}_gemm" + ("_indexed" if indexed else ""), f"{fmt}_gemm", params,
                 positional=("a", "a_s", "b", "b_s"), sizes=sizes,
                 derive=_gemm8_derive if fp8 else _gemm4_derive,
                 zero_ok=("M", "N", kdim, "Kodd"), medium=medium)


ENTRIES += [_gemm_entry(fmt, indexed) for indexed in (False, True) for fmt in ("fp8", "fp4")]

# the weight-only FP8 GEMM (float activations as they are, e4m3 codes with 128 x 128
# scales).  wbf16_gemm is not here: its weight is bfloat16 only, a canonical dtype these
# suites' torch variants cannot build (tests/test_wfp8_gemm.py has its bad inputs)
UNIT_LAST_STRIDE.update(wfp8_gemm=("b",))
ENTRIES += [
    Entry("wfp8_gemm", "wfp8_gemm",
          dict(a=Arr(("M", "K"), ndim=(1, None), also=("bfloat16",)),
               b=Arr(("N", "K"), dtype=np.uint8, fill=_e4m3_codes),
               b_s=Arr(("NB", "KB"), fill=_pos_scales, also=("uint8",)),
               groups=Int(_C(1), lo=1, optional=False),
               out_dtype=Choice(_C(None), ("bfloat16", "float32"), none_ok=True)),
          positional=("a", "b", "b_s"), sizes=dict(M=(1, 6), N=(1, 140), Kodd=(0, 1), K16=(0, 20)),
          derive=_gemm8_derive, zero_ok=("M", "N", "K16", "Kodd"),
          medium=dict(M=4, N=8192, Kodd=0, K16=256)),
]
ENTRIES += [
    Entry("fp8_quant", "fp8_quant",
          dict(x=Arr(("R", "L"), ndim=(1, None), also=("bfloat16",)),
               block=Int(_S("blk"), lo=1, hi=1 << 40, huge_ok=True, optional=True),
               scale=Choice(_C("ue8m0"), ("ue8m0", "fp32"), none_ok=True),
               scale_dtype=Choice(_C("float32"), ("float32", "e8m0"), none_ok=True)),
          positional=("x",), sizes=dict(R=(1, 5), NB=(1, 4), blk=(1, 70)),
          derive=_blocks_derive, zero_ok=("R",), medium=dict(R=8193, NB=7, blk=64)),
    Entry("fp4_quant", "fp4_quant",
          dict(x=Arr(("R", "L"), ndim=(1, None), also=("bfloat16",)),
               block=Int(_S("blk"), lo=2, hi=1 << 40, huge_ok=True, optional=True),
               scale=Choice(_C("ue8m0"), ("ue8m0", "e4m3"), none_ok=True)),
          positional=("x",), sizes=dict(R=(1, 5), NB=(1, 4), blk2=(1, 20)),
          derive=_quant4_derive, zero_ok=("R",), medium=dict(R=16385, NB=4, blk2=16)),
    # FP4 key rows of the indexer (fp4_pack / fp4_unpack; round=True: any input packs)
    Entry("fp4_pack", "fp4_pack",
          dict(x=Arr(("R", "L"), ndim=(1, None), also=("bfloat16",)),
               round=Flag(_C(True)),
               out=Arr(("R", "W"), dtype=np.uint8, role="out", ndim=(1, None))),
          positional=("x",), sizes=dict(R=(1, 5), NB=(1, 4)),
          derive=_fp4rows_derive, zero_ok=("R",), medium=dict(R=8193, NB=4)),
    Entry("fp4_unpack", "fp4_unpack",
          dict(p=Arr(("R", "W"), dtype=np.uint8, ndim=(1, None), fill=_fp4rows_fill),
               out=Arr(("R", "L"), role="out", ndim=(1, None))),
          positional=("p",), sizes=dict(R=(1, 5), NB=(1, 4)),
          derive=_fp4rows_derive, zero_ok=("R",), medium=dict(R=8193, NB=4)),
    # index_scores with the released bf16 expression's roundings, from FP4 key rows (Di = 32 NB)
    Entry("index_scores_bf16_rounding", "index_scores",
          dict(q=Arr(("B", "S", "Hi", "L"), also=("bfloat16",)),
               k=Arr(("B", "Tc", "W"), dtype=np.uint8, fill=_fp4rows_fill),
               weights=Arr(("B", "S", "Hi"), also=("bfloat16",)),
               ratio=Int(_S("ratio"), lo=1, hi=2**31 - 1, huge_ok=True),
               start_pos=Int(_S("p"), lo=0, hi=1 << 40, huge_ok=True),
               rounding=Choice(_C("bf16"), ("bf16", "float32")),
               out=Arr(("B", "S", "Tc"), role="out")),
          positional=("q", "k", "weights"),
          sizes=dict(B=(1, 2), S=(1, 9), Hi=(1, 21), NB=(1, 4), ratio=(1, 5), p=(0, 12),
                     more=(0, 2)),
          derive=lambda s: _fp4rows_derive(_scores_derive(s)),
          zero_ok=("B", "S", "Hi", "more"), huge_skip=("Hi",),
          medium=dict(B=1, S=1, Hi=64, NB=4, ratio=4, p=65535, more=0)),
    Entry("hc_split_sinkhorn", "hc_split_sinkhorn",
          dict(mixes=Arr(("B", "S", "W"), ndim=(1, None)),
               hc_scale=Arr((3,)),
               hc_base=Arr(("W",)),
               hc_mult=Int(_S("h"), lo=1, hi=64, optional=True),
               sinkhorn_iters=Int(_S("it"), lo=1, hi=1 << 20, optional=True),
               eps=Real(_C(1e-6), lo=0.0, optional=True)),
          positional=("mixes", "hc_scale", "hc_base"),
          sizes=dict(B=(1, 3), S=(1, 9), h=(1, 6), it=(1, 25)),
          derive=_hc_derive, zero_ok=("B", "S"), huge_skip=("it",),
          medium=dict(B=1, S=4097, h=4, it=20)),
]


# ---------------------------------------------------------------- gradients: sparse attention
# sparse_attn_backward, sparse_attn_weights (and sparse_attn's return_lse).

_ATTN_SIZES = dict(B=(1, 2), S=(1, 6), H=(1, 5), D=(1, 40), N=(1, 20), K=(0, 9))
_ATTN_IDX = Arr(("B", "S", "K"), dtype=np.int32, index=lambda s: (-1, s["N"] - 1))

ENTRIES += [
    Entry("sparse_attn_lse", "sparse_attn",
          dict(q=Arr(("B", "S", "H", "D")), kv=Arr(("B", "N", "D")), attn_sink=Arr(("H",)),
               topk_idxs=_ATTN_IDX, softmax_scale=Real(lambda s: s["D"] ** -0.5),
               out=Arr(("B", "S", "H", "D"), role="out"), return_lse=Flag(_C(True))),
          positional=("q", "kv", "attn_sink", "topk_idxs", "softmax_scale"),
          sizes=_ATTN_SIZES, zero_ok=("B", "S", "H", "K", "D"), loose=True,
          huge_skip=("K",),
          medium=dict(B=1, S=17, H=64, D=512, N=1200, K=640)),
    Entry("sparse_attn_weights", "sparse_attn_weights",
          dict(q=Arr(("B", "S", "H", "D")), kv=Arr(("B", "N", "D")), attn_sink=Arr(("H",)),
               topk_idxs=_ATTN_IDX, softmax_scale=Real(lambda s: s["D"] ** -0.5),
               out=Arr(("B", "S", "K"), role="out")),
          positional=("q", "kv", "attn_sink", "topk_idxs", "softmax_scale"),
          sizes=_ATTN_SIZES, zero_ok=("B", "S", "H", "K", "D"), loose=True,
          huge_skip=("K",),
          medium=dict(B=1, S=17, H=64, D=512, N=1200, K=640)),
    Entry("sparse_attn_backward", "sparse_attn_backward",
          # grad_out may be bfloat16 on its own; q, kv and out only all three together
          dict(grad_out=Arr(("B", "S", "H", "D"), also=("bfloat16",)), q=Arr(("B", "S", "H", "D")),
               kv=Arr(("B", "N", "D")), attn_sink=Arr(("H",)), topk_idxs=_ATTN_IDX,
               softmax_scale=Real(lambda s: s["D"] ** -0.5),
               out=Arr(("B", "S", "H", "D")), lse=Arr(("B", "S", "H")),
               grad_q=Arr(("B", "S", "H", "D"), role="out"),
               grad_kv=Arr(("B", "N", "D"), role="out"),
               grad_sink=Arr(("H",), role="out")),
          positional=("grad_out", "q", "kv", "attn_sink", "topk_idxs", "softmax_scale", "out",
                      "lse"),
          sizes=_ATTN_SIZES, zero_ok=("B", "S", "H", "K", "D", "N"), loose=True,
          huge_skip=("K",),
          medium=dict(B=1, S=17, H=64, D=512, N=1200, K=640)),
]


# ---------------------------------------------------------------- gradients: norm / rope / pool
# rms_norm_backward, gated_pool_backward.

ENTRIES += [
    Entry("rms_norm_backward", "rms_norm_backward",
          dict(grad_out=Arr(("R", "D"), ndim=(1, None), also=("bfloat16",)),
               x=Arr(("R", "D"), ndim=(1, None), also=("bfloat16",)),
               weight=Arr(("D",), optional=True),
               eps=Real(_C(1e-6), lo=0.0),
               grad_x=Arr(("R", "D"), role="out", ndim=(1, None)),
               grad_weight=Arr(("D",), role="out")),
          positional=("grad_out", "x", "weight", "eps"), sizes=dict(R=(1, 9), D=(1, 70)),
          zero_ok=("R", "D"), medium=dict(R=8191, D=1031)),
    Entry("gated_pool_backward", "gated_pool_backward",
          dict(grad_out=Arr(("B", "G", "D"), also=("bfloat16",)),
               kv=Arr(("B", "T", "CD"), also=("bfloat16",)),
               score=Arr(("B", "T", "CD"), optional=True, also=("bfloat16",)),
               ratio=Int(_S("ratio"), lo=1, hi=1 << 40, huge_ok=True),
               ape=Arr(("ratio", "CD"), optional=True, also=("bfloat16",)),
               overlap=Flag(_C(False)),
               grad_kv=Arr(("B", "T", "CD"), role="out"),
               grad_score=Arr(("B", "T", "CD"), role="out"),
               grad_ape=Arr(("ratio", "CD"), role="out")),
          positional=("grad_out", "kv", "score", "ratio"),
          sizes=dict(B=(1, 3), G=(0, 5), tail=(0, 7), ratio=(1, 9), D=(1, 24), c=(1, 1)),
          derive=_pool_derive, zero_ok=("B", "G", "D"),
          medium=dict(B=2, G=1501, tail=3, ratio=4, D=512, c=1)),
    Entry("gated_pool_backward_overlap", "gated_pool_backward",
          dict(grad_out=Arr(("B", "G", "D"), also=("bfloat16",)),
               kv=Arr(("B", "T", "CD"), also=("bfloat16",)),
               score=Arr(("B", "T", "CD"), also=("bfloat16",)),
               ratio=Int(_S("ratio"), lo=1, hi=1 << 40, huge_ok=True),
               ape=Arr(("ratio", "CD"), optional=True, also=("bfloat16",)),
               overlap=Flag(_C(True)),
               grad_kv=Arr(("B", "T", "CD"), role="out"),
               grad_score=Arr(("B", "T", "CD"), role="out"),
               grad_ape=Arr(("ratio", "CD"), role="out")),
          positional=("grad_out", "kv", "score", "ratio"),
          sizes=dict(B=(1, 3), G=(0, 5), tail=(0, 7), ratio=(1, 9), D=(1, 24), c=(2, 2)),
          derive=_pool_derive, zero_ok=("B", "G", "D"),
          medium=dict(B=2, G=301, tail=3, ratio=4, D=512, c=2)),
]


# ---------------------------------------------------------------- gradients: the indexer
# index_scores_backward, indexer_kl_loss (and its backward).

def _kl_derive(s):
    s["Tc"] = (s["p"] + s["S"]) // s["ratio"]
    return s


def _kl_idx_fill(rng, shape, sizes):
    """topk_idxs of a valid call: per row -1 or an entry it can see."""
    out = np.full(shape, -1, np.int32)
    for s in range(shape[1]):
        nv = min((sizes["p"] + s + 1) // sizes["ratio"], sizes["Tc"])
        if nv > 0:
            out[:, s, :] = rng.integers(-1, nv, size=(shape[0], shape[2]))
    return out


def _kl_target_fill(rng, shape, sizes):
    return rng.random(shape).astype(np.float32)


def _kl_joint_fill(rng, shape, sizes):
    """Joint probabilities: a row's K slots sum to at most 1."""
    return rng.random(shape).astype(np.float32) / max(shape[-1], 1)


def _kl_positions_fill(rng, shape, sizes):
    """Every query at p + s, as start_pos would put it (the same for each batch row)."""
    return np.broadcast_to(sizes["p"] + np.arange(shape[1], dtype=np.int32), shape)


def _kl_result(ret, vals):
    if isinstance(ret, tuple):   # the metrics (last, with return_metrics) as an array
        return (np.float64(ret[0]),) + tuple(np.array(tuple(r)) if isinstance(r, tuple) else r
                                             for r in ret[1:])
    return (np.float64(ret),)


def _kl_dense_call(fn, args, kwargs, sizes):
    """The dense warm-up: topk_idxs=None, attn_target [B, S, Tc]."""
    kw = dict(zip(("q", "k", "weights", "attn_target"), args))
    kw.update(kwargs)
    return fn(topk_idxs=None, **kw)


_IXG_QKW = dict(q=Arr(("B", "S", "Hi", "Di")), k=Arr(("B", "Tc", "Di")),
                weights=Arr(("B", "S", "Hi")))

ENTRIES += [
    Entry("index_scores_backward", "index_scores_backward",
          dict(grad_scores=Arr(("B", "S", "Tc")), **_IXG_QKW,
               ratio=Int(_S("ratio"), lo=1, hi=2**31 - 1, huge_ok=True),
               start_pos=Int(_S("p"), lo=0, hi=1 << 40, huge_ok=True),
               grad_q=Arr(("B", "S", "Hi", "Di"), role="out"),
               grad_k=Arr(("B", "Tc", "Di"), role="out"),
               grad_weights=Arr(("B", "S", "Hi"), role="out")),
          positional=("grad_scores", "q", "k", "weights"),
          sizes=dict(B=(1, 2), S=(1, 9), Hi=(1, 5), Di=(1, 20), ratio=(1, 5), p=(0, 12),
                     more=(0, 2)),
          derive=_scores_derive, zero_ok=("B", "S", "Hi", "Di", "more"),
          huge_skip=("Hi", "Di"),
          medium=dict(B=1, S=257, Hi=64, Di=128, ratio=4, p=0, more=0)),
    Entry("indexer_kl_loss", "indexer_kl_loss",
          dict(**_IXG_QKW,
               topk_idxs=Arr(("B", "S", "K"), dtype=np.int32, fill=_kl_idx_fill,
                             index=lambda s: (-1, s["Tc"] - 1), optional=True),
               attn_target=Arr(("B", "S", "K"), fill=_kl_target_fill),
               ratio=Int(_S("ratio"), lo=1, hi=2**31 - 1, huge_ok=True),
               start_pos=Int(_S("p"), lo=0, hi=1 << 40, huge_ok=True),
               return_grads=Flag(_C(True))),
          positional=("q", "k", "weights", "topk_idxs", "attn_target"),
          sizes=dict(B=(1, 2), S=(1, 9), Hi=(1, 5), Di=(1, 20), ratio=(1, 4), p=(0, 12),
                     K=(1, 7)),
          derive=_kl_derive, zero_ok=("B", "S", "Hi", "Di", "K"), huge_skip=("Hi", "Di", "K"),
          result=_kl_result,
          medium=dict(B=1, S=1024, Hi=64, Di=128, ratio=4, p=0, K=64)),
    Entry("indexer_kl_loss_dense", "indexer_kl_loss",
          dict(**_IXG_QKW,
               attn_target=Arr(("B", "S", "Tc"), fill=_kl_target_fill),
               ratio=Int(_S("ratio"), lo=1, hi=2**31 - 1, huge_ok=True),
               start_pos=Int(_S("p"), lo=0, hi=1 << 40, huge_ok=True),
               return_grads=Flag(_C(True))),
          positional=("q", "k", "weights", "attn_target"),
          sizes=dict(B=(1, 2), S=(1, 9), Hi=(1, 5), Di=(1, 20), ratio=(1, 4), p=(0, 12)),
          derive=_kl_derive, zero_ok=("B", "S", "Hi", "Di"), huge_skip=("Hi", "Di"),
          call=_kl_dense_call, result=_kl_result,
          medium=dict(B=1, S=512, Hi=64, Di=128, ratio=4, p=0)),
    # the variants: joint target (rows sum to <= 1), clip, per-query positions, metrics
    Entry("indexer_kl_loss_variants", "indexer_kl_loss",
          dict(**_IXG_QKW,
               topk_idxs=Arr(("B", "S", "K"), dtype=np.int32, fill=_kl_idx_fill,
                             index=lambda s: (-1, s["Tc"] - 1), optional=True),
               attn_target=Arr(("B", "S", "K"), fill=_kl_joint_fill),
               ratio=Int(_S("ratio"), lo=1, hi=2**31 - 1, huge_ok=True),
               positions=Arr(("B", "S"), dtype=np.int32, fill=_kl_positions_fill,
                             optional=True),
               target=Choice(_C("joint"), ("selected", "joint"), none_ok=True),
               clip=Real(_C(-1.0), optional=True),
               return_grads=Flag(_C(True)), return_metrics=Flag(_C(True))),
          positional=("q", "k", "weights", "topk_idxs", "attn_target"),
          sizes=dict(B=(1, 2), S=(1, 9), Hi=(1, 5), Di=(1, 20), ratio=(1, 4), p=(0, 12),
                     K=(1, 7)),
          derive=_kl_derive, zero_ok=("B", "S", "Hi", "Di", "K"), huge_skip=("Hi", "Di", "K"),
          result=_kl_result,
          medium=dict(B=1, S=1024, Hi=64, Di=128, ratio=4, p=0, K=64)),
]


BY_NAME = {e.name: e for e in ENTRIES}
