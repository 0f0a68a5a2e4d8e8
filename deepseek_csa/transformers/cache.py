"""The CSA / HCA cache layers: transformers' own, their class switched on first use to
ours (``CSACacheLayer`` / ``HCACacheLayer``: the same fields plus ``crop`` and the past
recording it needs)."""
from __future__ import annotations

from .versions import _check_version, _torch

# ----------------------------------------------------------------------------- cache layers
_CLASSES = {}


def _cache_classes():
    """(HCACacheLayer, CSACacheLayer), built on first use (transformers imported lazily)."""
    if _CLASSES:
        return _CLASSES["hca"], _CLASSES["csa"]
    mdl = _check_version()
    torch = _torch()

    def _tb(self):
        """The transformers class a layer of ours extends."""
        return (mdl.DeepseekV4CSACache if isinstance(self, mdl.DeepseekV4CSACache)
                else mdl.DeepseekV4HCACache)

    class _Mixin:
        """Crop support and its bookkeeping on top of transformers' CSA/HCA cache layers.

        Recording (``activate_past_recording()``, the switch of transformers' sliding
        layers) keeps every window row and, per compressor state and per forward call,
        the state at the call's start and the call's raw projections, so that
        ``crop(-n)`` can roll back any number of tokens of the calls since the last crop.
        """
        _layer_type = None   # never register in transformers' cache-layer mapping

        def _dc_log(self):
            log = self.__dict__.get("_dc_snapshots")
            if log is None:
                log = self._dc_snapshots = {}
            return log

        def update(self, key_states, value_states, *args, **kwargs):
            if not getattr(self, "record_past", False):
                return _tb(self).update(self, key_states, value_states, *args, **kwargs)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.values = self.keys
            self.cumulative_length += key_states.shape[-2]
            full = torch.cat([self.keys, key_states], dim=-2)
            self.keys = self.values = full      # kept whole until crop()
            n = self.sliding_window - 1 + key_states.shape[-2]
            return full[:, :, -n:], full[:, :, -n:]

        def store_compression_weights(self, name, kv, gate):
            if getattr(self, "record_past", False):
                snap = {"count": self.entry_count[name], "buf_kv": self.buffer_kv[name],
                        "buf_gate": self.buffer_gate[name], "kv": kv.detach(),
                        "gate": gate.detach()}
                if hasattr(self, "overlap_kv"):
                    snap["ov_kv"] = self.overlap_kv[name]
                    snap["ov_gate"] = self.overlap_gate[name]
                self._dc_log().setdefault(name, []).append(snap)
            return _tb(self).store_compression_weights(self, name, kv, gate)

        def reset(self):
            _tb(self).reset(self)
            self._dc_snapshots = {}

        def reorder_cache(self, beam_idx):
            _tb(self).reorder_cache(self, beam_idx)
            for snaps in self._dc_log().values():
                for snap in snaps:
                    for key, t in snap.items():
                        if isinstance(t, torch.Tensor):
                            snap[key] = t.index_select(0, beam_idx.to(t.device))

        def crop(self, tokens_to_remove: int) -> None:
            """Removes the last ``-tokens_to_remove`` tokens (a negative int, as
            transformers' ``Cache.crop``); ``crop(0)`` only trims the recorded window
            rows back to ``sliding_window - 1``.  Rolling back needs the rows and states
            recorded since ``activate_past_recording()`` (RuntimeError otherwise)."""
            if tokens_to_remove > 0:
                raise ValueError(f"crop() takes a negative number of tokens to remove, got "
                                 f"{tokens_to_remove}")
            r = -int(tokens_to_remove)
            cum = self.cumulative_length
            if r > cum:
                raise ValueError(f"crop({tokens_to_remove}): the cache holds {cum} tokens")
            n = cum - r
            if r and self.is_initialized:
                rows = self.keys.shape[-2]
                need = min(self.sliding_window - 1, n)
                if rows - r < need:
                    raise RuntimeError(
                        f"crop({tokens_to_remove}) needs window rows this cache layer no "
                        f"longer holds: call activate_past_recording() before the forward "
                        f"calls to roll back")
            plans = {}
            if r:
                for name in self.entry_count:
                    if self.entry_count[name] == 0 and self.buffer_kv[name] is None:
                        continue
                    snaps = self._dc_log().get(name, [])
                    pos = [s["count"] * self.compress_rate
                           + (0 if s["buf_kv"] is None else s["buf_kv"].shape[1]) for s in snaps]
                    ok = [i for i, p in enumerate(pos) if p <= n]
                    if not ok:
                        raise RuntimeError(
                            f"crop({tokens_to_remove}): the compressor state of "
                            f"{name!r} before token {n} was not recorded: call "
                            f"activate_past_recording() before the forward calls to roll back")
                    plans[name] = (snaps[ok[-1]], n - pos[ok[-1]])
            if self.is_initialized:
                keys = self.keys[:, :, :self.keys.shape[-2] - r]
                keys = keys[:, :, max(0, keys.shape[-2] - self.sliding_window + 1):]
                self.keys = self.values = keys
            self.cumulative_length = n
            for name, (snap, extra) in plans.items():
                count = snap["count"]
                self.entry_count[name] = count
                ckv = self.compressed_kv[name]
                if ckv is not None:
                    self.compressed_kv[name] = ckv[:, :count]
                parts_kv = [t for t in (snap["buf_kv"], snap["kv"][:, :extra]) if t is not None]
                parts_g = [t for t in (snap["buf_gate"], snap["gate"][:, :extra]) if t is not None]
                self.buffer_kv[name] = torch.cat(parts_kv, dim=1)
                self.buffer_gate[name] = torch.cat(parts_g, dim=1)
                if "ov_kv" in snap:
                    self.overlap_kv[name] = snap["ov_kv"]
                    self.overlap_gate[name] = snap["ov_gate"]
            self._dc_snapshots = {}

    # One base each (no mixin in the bases), so the object layout stays transformers'
    # and a live layer can switch class (see _adopt_layer).
    ns = {k: v for k, v in _Mixin.__dict__.items()
          if k not in ("__dict__", "__weakref__", "__module__", "__qualname__")}
    ns["is_croppable"] = True
    HCACacheLayer = type("HCACacheLayer", (mdl.DeepseekV4HCACache,),
                         dict(ns, __doc__="transformers' ``DeepseekV4HCACache`` (same "
                              "fields) plus ``crop``.\n\n" + _Mixin.__doc__))
    CSACacheLayer = type("CSACacheLayer", (mdl.DeepseekV4CSACache,),
                         dict(ns, __doc__="transformers' ``DeepseekV4CSACache`` (same "
                              "fields) plus ``crop``.\n\n" + _Mixin.__doc__))
    for c in (HCACacheLayer, CSACacheLayer):
        c.__module__ = __package__       # deepseek_csa.transformers, where they are public
    _CLASSES["hca"], _CLASSES["csa"] = HCACacheLayer, CSACacheLayer
    return HCACacheLayer, CSACacheLayer


def _adopt_layer(cache, idx):
    """The cache layer at idx, its class switched to ours (same fields: lossless).
    Not while torch.compile traces (it cannot reassign ``__class__``): a layer first
    met there keeps transformers' class -- the attention reads the same fields -- and
    gets ours (``crop``, the past recording) on its first eager call."""
    hca, csa = _cache_classes()
    layer = cache.layers[idx]
    if isinstance(layer, (hca, csa)) or _torch().compiler.is_compiling():
        return layer
    mdl = _check_version()
    if type(layer) is mdl.DeepseekV4CSACache:
        layer.__class__ = csa
    elif type(layer) is mdl.DeepseekV4HCACache:
        layer.__class__ = hca
    return layer
