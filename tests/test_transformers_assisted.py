"""Rolling a swapped model's cache back (``crop``) and assisted decoding through
``generate(assistant_model=...)`` (docs/transformers.md, "Assisted decoding").

Crops: after recorded forward calls, ``cache.crop(-r)`` must leave the state a fresh
prefill of the kept tokens has, at every offset of the crop point modulo the compressor
ratios (CSA 4, HCA 8), across group boundaries and past the sliding window (16).  The
kept state and the fresh one are compared after both continue with the same tokens
(a crop leaves the groups it reopens buffered; the continuation pools them again).

Error budget: the cropped and the fresh state are the same float32 function of the same
tokens; the projections and pooled sums run in differently shaped calls (GEMM blocking,
summation order), measured 8e-8 (states) and 2e-7 (logits) relative on the model
below.  The bar is the bridge tests' 1e-5; a wrong rollback (a rejected token left in a
buffer, entries or window) is off by O(1) (measured 0.2-1.9 with the drafted tokens kept).
"""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import deepseek_csa.transformers as dch  # noqa: E402

if not dch._supported(transformers.__version__):
    pytest.skip(f"deepseek_csa.transformers supports transformers {dch.SUPPORTED_VERSIONS}, "
                f"found {transformers.__version__}", allow_module_level=True)

from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl  # noqa: E402

from test_transformers_bridge import ids_for, make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny models, one thread

TOL = 1e-5
NEW = 32                        # generated tokens (the close assistant: crops of 0..12 seen)
WINDOW, D, C = 16, 20, 5        # sliding window, draft length, continuation length
# transformers 5.23 / 5.24 refuse assisted decoding for the model class (``_is_stateful``);
# 5.25 lets it run when the main model's cache can be cropped (``is_croppable``).
REFUSES = bool(getattr(mdl.DeepseekV4ForCausalLM, "_is_stateful", False))


@pytest.fixture(scope="module")
def model4():
    return make_model(window=WINDOW)


def fwd(m, x, cache=None):
    return m(x, past_key_values=cache, use_cache=True)


def state(cache):
    """Every cache layer's fields as a flat dict: the window rows a next call reads (a
    recording layer keeps older rows too, until the next crop), the compressor state."""
    out = []
    for layer in cache.layers:
        n = int(layer.get_seq_length())
        d = {"len": n, "keys": layer.keys[:, :, -min(WINDOW - 1, n):]}
        for f in ("compressed_kv", "buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate",
                  "entry_count"):
            for k, v in getattr(layer, f, {}).items():
                d[f"{f}.{k}"] = v
        out.append(d)
    return out


def worst(a, b):
    """The largest relative difference between two states; shapes and counts exact."""
    err = 0.0
    for i, (la, lb) in enumerate(zip(a, b)):
        assert la.keys() == lb.keys()
        for k in la:
            x, y = la[k], lb[k]
            if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
                assert x == y, (i, k, x, y)
                continue
            empty = [t is None or t.numel() == 0 for t in (x, y)]
            assert empty[0] == empty[1], (i, k)
            if empty[0]:
                continue
            assert x.shape == y.shape, (i, k, x.shape, y.shape)
            err = max(err, float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)))
    return err


def check_crop(m, cache, ids, n, refs):
    """cache (just cropped to n tokens) against a fresh prefill of ids[:, :n]: the window
    rows at once, the whole state and the logits after both continue with C tokens."""
    assert cache.get_seq_length() == n
    ref_keys, ref_state, ref_logits = refs[n]
    for layer, rk in zip(cache.layers, ref_keys):
        k = layer.keys[:, :, -rk.shape[2]:]
        assert k.shape == rk.shape and float((k - rk).abs().max() / rk.abs().max()) < TOL
    logits = fwd(m, ids[:, n:n + C], cache).logits
    assert worst(state(cache), ref_state) < TOL
    assert float((logits - ref_logits).abs().max() / ref_logits.abs().max()) < TOL


def fresh_refs(m, ids, ns):
    refs = {}
    for n in ns:
        c = fwd(m, ids[:, :n]).past_key_values
        keys = [layer.keys[:, :, -min(WINDOW - 1, n):].clone() for layer in c.layers]
        logits = fwd(m, ids[:, n:n + C], c).logits
        refs[n] = (keys, state(c), logits)
    return refs


def test_crop_every_offset(model4):
    """Prefill P, one recorded call of D = 20 tokens whose last r are wrong drafts,
    crop(-r) for every r in 1..D: the crop lands at every offset mod 8 (HCA) and 4 (CSA),
    past the window from r = 16 on; the call starts at offsets 0, 1, 6 and 7 mod 8 (every
    offset mod 4)."""
    m = model4
    ids = ids_for(2, 100, seed=21)
    junk = (ids + 1 + ids_for(2, 100, seed=5, vocab=90)) % 97     # differs everywhere
    with torch.no_grad(), dch.swapped(m):
        refs = fresh_refs(m, ids, range(40, 48 + D))
        for P in (40, 41, 46, 47):
            prefilled = fwd(m, ids[:, :P]).past_key_values
            for r in range(1, D + 1):
                n = P + D - r
                cache = copy.deepcopy(prefilled)
                cache.activate_past_recording()
                fwd(m, torch.cat([ids[:, P:n], junk[:, n:n + r]], 1), cache)
                cache.crop(-r)
                check_crop(m, cache, ids, n, refs)


def test_crop_into_the_prefill_and_across_calls(model4):
    """Recording from the first call on (as generate() does): a crop back into the
    prefill call itself, and a crop across three calls (9, 1 and 6 tokens)."""
    m = model4
    ids = ids_for(2, 100, seed=31)
    junk = (ids + 1 + ids_for(2, 100, seed=6, vocab=90)) % 97
    with torch.no_grad(), dch.swapped(m):
        refs = fresh_refs(m, ids, range(40, 60))
        for r in range(1, D + 1):
            n = 60 - r
            cache = transformers.DynamicCache(config=m.config)
            cache.activate_past_recording()
            fwd(m, torch.cat([ids[:, :n], junk[:, n:60]], 1), cache)
            cache.crop(-r)
            check_crop(m, cache, ids, n, refs)
        P = 43
        prefilled = fwd(m, ids[:, :P]).past_key_values
        for r in range(1, 17):
            n = P + 16 - r
            seq = torch.cat([ids[:, :n], junk[:, n:P + 16]], 1)
            cache = copy.deepcopy(prefilled)
            cache.activate_past_recording()
            for a, b in ((P, P + 9), (P + 9, P + 10), (P + 10, P + 16)):
                fwd(m, seq[:, a:b], cache)
            cache.crop(-r)
            check_crop(m, cache, ids, n, refs)


def drafter(m, scale, seed=7):
    """A copy of m with noise on its weights (scale x each tensor's std): drafts that
    are partly accepted.  12 tokens a draft, always (no confidence cut-off)."""
    a = copy.deepcopy(m)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in a.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    a.generation_config.num_assistant_tokens = 12
    a.generation_config.num_assistant_tokens_schedule = "constant"
    a.generation_config.assistant_confidence_threshold = 0.0
    return a


@pytest.mark.skipif(REFUSES, reason="this transformers refuses assisted decoding for "
                    "DeepseekV4 (test_assisted_refused_by_transformers)")
@pytest.mark.parametrize("assistant", ["itself", "close", "prompt lookup"])
def test_assisted_generate_is_greedy(model4, assistant, monkeypatch):
    """generate(assistant_model=...) on a swapped model gives greedy decoding's tokens.
    A close assistant's 12-token drafts are cut at every length (measured: crops of 1 to
    12 tokens), so the crops land at every offset of the compressor groups.  Prompt
    lookup (drafts copied from the prompt, ``prompt_lookup_num_tokens``) crops the same
    way."""
    m = model4
    ids = ids_for(1, 50, seed=3)
    kw = dict(max_new_tokens=NEW, do_sample=False)
    a = None
    if assistant == "prompt lookup":
        ids = torch.cat([ids[:, :12]] * 4 + [ids[:, :5]], 1)      # something to look up
        kw["prompt_lookup_num_tokens"] = 6
    else:
        a = kw["assistant_model"] = m if assistant == "itself" else drafter(m, 0.3)
    crops = []
    hca, csa = dch._cache_classes()
    for cls in (hca, csa):
        orig = cls.crop

        def rec(self, r, orig=orig):
            crops.append(-r)
            return orig(self, r)
        monkeypatch.setattr(cls, "crop", rec)
    with torch.no_grad():
        ref = m.generate(ids, max_new_tokens=NEW, do_sample=False)
        with dch.swapped(m), (dch.swapped(a) if a is not None else _null()):
            got = m.generate(ids, **kw)
    assert torch.equal(got, ref)
    if assistant == "close":
        assert len(set(crops) - {0}) >= 8 and max(crops) > 8, sorted(set(crops))
    elif assistant == "prompt lookup":
        assert set(crops) - {0}, sorted(set(crops))              # drafts were rolled back


@pytest.mark.skipif(REFUSES, reason="this transformers refuses assisted decoding for "
                    "DeepseekV4 (test_assisted_refused_by_transformers)")
def test_assisted_refusals(model4):
    """What cannot roll back is refused by name: the main model's unswapped compressed
    layers by transformers (its cache is not croppable), an assistant's by us."""
    m = model4
    ids = ids_for(1, 30, seed=4)
    kw = dict(max_new_tokens=4, do_sample=False)
    a = drafter(make_model(seed=9), 0)
    with torch.no_grad():
        for layers in (None, [0, 1]):           # unswapped; CSA layer 3 / HCA 2 unswapped
            with (dch.swapped(m, layers) if layers else _null()), dch.swapped(a):
                with pytest.raises(ValueError, match="cache that can be cropped"):
                    m.generate(ids, assistant_model=a, **kw)
        with dch.swapped(m):
            with pytest.raises(ValueError, match=r"assistant model's compressed attention "
                               r"layers \[1, 2, 3\] are not swapped.*roll back"):
                m.generate(ids, assistant_model=a, **kw)
            with dch.swapped(a, [1, 3]):
                with pytest.raises(ValueError, match=r"layers \[2\] are not swapped"):
                    m.generate(ids, assistant_model=a, **kw)
            with dch.swapped(a, [1, 2, 3]):     # the sliding layer crops in transformers
                assert torch.equal(m.generate(ids, assistant_model=a, **kw),
                                   m.generate(ids, **kw))
    assert "generate" not in m.__dict__


@pytest.mark.skipif(not REFUSES, reason="this transformers runs assisted decoding "
                    "(test_assisted_generate_is_greedy)")
def test_assisted_refused_by_transformers(model4):
    """transformers 5.23 / 5.24 refuse assisted decoding for DeepseekV4 by its class,
    swapped or not."""
    ids = ids_for(1, 30, seed=4)
    with torch.no_grad(), dch.swapped(model4):
        with pytest.raises(ValueError, match="not supported with stateful models"):
            model4.generate(ids, max_new_tokens=4, do_sample=False, assistant_model=model4)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
