"""Projections held as the released checkpoint holds them and computed as the released
``model.py`` computes them: ``FP8Linear`` (e4m3 weight codes with one ue8m0 scale per
128 x 128 block) and ``FP4Experts`` (routed experts as e2m1 codes, two a byte, one ue8m0
scale per 32 inputs), for inference.

    lin8 = FP8Linear.from_linear(linear)              # nn.Linear [N, K] -> codes + scales
    y = lin8(x)                                       # x [..., K] -> [..., N], x's dtype
    lin8 = FP8Linear.from_linear(linear, groups=8)    # transformers' grouped o_a_proj:
                                                      #   x [..., 8, K] -> [..., 8, N / 8]
    experts4 = FP4Experts.from_experts(experts)       # transformers' DeepseekV4Experts

A call quantizes its input per 128 features to e4m3 with power-of-two scales (the
released ``act_quant`` with ``scale_fmt`` set) and runs ``deepseek_csa.fp8_gemm`` /
``fp4_gemm``: each 128-block's product in float32, scaled and accumulated in float32,
one rounding to the output dtype.  That is the released Linear's arithmetic for an FP8
or FP4 weight, not transformers' (a bf16 x bf16 matmul on the dequantized weight): the
two differ by the activation's e4m3 rounding (relative ~2^-4 per element).

Quantizing the weights is exact for weights that are FP8 / FP4 values to begin with (a
released checkpoint, dequantized by a loader: a block's values are codes times one power
of two, and the power of two chosen here from the block's largest value is at most the
original, so every value is a code again).  Other weights are rounded; ``from_linear`` /
``from_experts`` record it in ``exact``.  The modules hold no float copy of a weight.
Inference only: a call that would need a gradient raises.
"""
from __future__ import annotations

import numpy as np

import deepseek_csa as _dc



def _torch():
    import torch
    return torch
from . import ops
from ._tensors import kernel_dtype as _as_kernel_input   # CPU float32 / bf16 as they are

__all__ = ["FP8Linear", "FP4Experts", "fp8_weight", "fp4_weight"]

_BLOCK = 128       # FP8: weight blocks 128 x 128, activation blocks of 128
_FP4_BLOCK = 32    # FP4 weights: one scale per 32 inputs
_E4M3_MAX = 448.0


def fp8_weight(w):
    """w [N, K] (any float dtype) -> (codes float8_e4m3fn [N, K], scales float8_e8m0fnu
    [ceil(N/128), ceil(K/128)], exact): per 128 x 128 block s = 2^ceil(log2(amax/448))
    (amax of an all-zero block taken as 448, s = 1), codes = e4m3(w / s) nearest-even;
    exact is True when codes * s reproduce w bit for bit."""
    torch = _torch()
    if w.dim() != 2:
        raise ValueError(f"fp8_weight: w must be [N, K], got shape {tuple(w.shape)}")
    N, K = w.shape
    nb, kb = -(-N // _BLOCK), -(-K // _BLOCK)
    codes = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    e_all = torch.empty(nb, kb, dtype=torch.int32)
    exact = True
    # 16 row blocks at a time: the float32 temporaries stay ~3 x 8 MB per 1K columns
    # instead of three copies of the whole weight
    step = 16 * _BLOCK
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        rb = -(-(r1 - r0) // _BLOCK)
        wf = w[r0:r1].detach().to("cpu", torch.float32)
        pad = torch.nn.functional.pad(wf, (0, kb * _BLOCK - K, 0, rb * _BLOCK - (r1 - r0)))
        amax = pad.view(rb, _BLOCK, kb, _BLOCK).abs().amax(dim=(1, 3))
        if not bool(torch.isfinite(amax).all()):
            raise ValueError("fp8_weight: w holds inf or NaN; it has no FP8 block scale")
        amax = torch.where(amax > 0, amax, torch.full_like(amax, _E4M3_MAX))
        mant, ex = torch.frexp(amax / _E4M3_MAX)             # amax/448 = mant * 2^ex
        e = torch.where(mant == 0.5, ex - 1, ex)             # ceil(log2(amax / 448))
        # amax/448 is rounded: one more power of two where amax / 2^e still exceeds 448
        e = torch.where(amax > _E4M3_MAX * torch.ldexp(torch.ones_like(amax), e), e + 1, e)
        if bool((e < -127).any()) or bool((e > 127).any()):
            raise ValueError("fp8_weight: a block's scale is outside e8m0's range "
                             "2^-127..2^127")
        inv = torch.ldexp(torch.ones_like(amax), -e)[:, None, :, None]   # exact: 2^-e
        q = (pad.view(rb, _BLOCK, kb, _BLOCK) * inv).to(torch.float8_e4m3fn)
        back = q.float().div_(inv).view(rb * _BLOCK, kb * _BLOCK)
        exact &= bool(torch.equal(back[:r1 - r0, :K], wf))
        codes[r0:r1] = q.view(rb * _BLOCK, kb * _BLOCK)[:r1 - r0, :K]
        e_all[r0 // _BLOCK:r0 // _BLOCK + rb] = e
    scales = (e_all + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return codes, scales, exact


def fp4_weight(w):
    """w [N, K] (K a multiple of 32) -> (codes uint8 [N, K/2], element 2i in the low
    nibble; scales float8_e8m0fnu [N, K/32]; exact): the released FP4 rounding
    (``deepseek_csa.fp4_quant``), exact as for fp8_weight."""
    torch = _torch()
    if w.dim() != 2 or w.shape[1] % _FP4_BLOCK:
        raise ValueError(f"fp4_weight: w must be [N, K] with K a multiple of 32, got shape "
                         f"{tuple(w.shape)}")
    wf = np.ascontiguousarray(w.detach().to("cpu", torch.float32).numpy())
    q, s = _dc.fp4_quant(wf, _FP4_BLOCK)
    rounded = wf.copy()                          # fp4_round: the same scales and rounding
    _dc.fp4_round(rounded, _FP4_BLOCK)
    exact = bool(np.array_equal(rounded, wf))
    return torch.from_numpy(q), torch.from_numpy(s).view(torch.float8_e8m0fnu), exact


def _no_grad_check(x, who):
    torch = _torch()
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError(f"{who}: FP8 / FP4 weights are for inference; run under "
                           "torch.no_grad() (training needs the float weights)")


def _act_q(x):
    """The released act_quant (scale_fmt set): e4m3 codes + e8m0 scales per 128, as
    float8_e4m3fn / float8_e8m0fnu tensors (the fp8_quant operator)."""
    return ops.call("fp8_quant", x, _BLOCK, "ue8m0", "e8m0")


def _out_dtype(x):
    torch = _torch()
    return x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32


# The nn.Module classes are made on first use (the module's __getattr__).
_CLASSES = {}


def __getattr__(name):
    if name in ("FP8Linear", "FP4Experts"):
        if not _CLASSES:
            _define_classes()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _define_classes():
    torch = _torch()

    class FP8Linear(torch.nn.Module):
        """A bias-free linear layer over FP8 weights (see the module docstring).

        weight_codes  : float8_e4m3fn [N, K]
        weight_scale  : float8_e8m0fnu [ceil(N/128), ceil(K/128)]
        groups        : 1, or G for a block-diagonal grouped layer (transformers'
                        DeepseekV4GroupedLinear): x [..., G, K/G] -> [..., G, N/G], group g
                        using weight rows g*N/G .. (g+1)*N/G - 1 (N/G and K/G multiples of 128).
        Forward: x [..., K] (or [..., G, K/G]) float32 / bfloat16 -> same dtype [..., N].
        """

        def __init__(self, codes, scales, groups=1, exact=True):
            super().__init__()
            N, K = codes.shape
            self.out_features, self.groups = int(N), int(groups)
            self.in_features = int(K) // self.groups if self.groups > 1 else int(K)
            self.exact = bool(exact)
            self.register_buffer("weight_codes", codes)
            self.register_buffer("weight_scale", scales)

        @classmethod
        def from_linear(cls, linear, groups=1):
            """From an ``nn.Linear`` (no bias) whose weight is [N, K] (grouped: [N, K/G]
            stacked per group, transformers' layout)."""
            if getattr(linear, "bias", None) is not None:
                raise ValueError(f"FP8Linear.from_linear: {type(linear).__name__} has a bias; "
                                 "the released FP8 layers have none")
            w = linear.weight
            N, Kin = w.shape
            G = int(groups)
            if G > 1:
                if N % G or (N // G) % _BLOCK or Kin % _BLOCK:
                    raise ValueError(f"FP8Linear.from_linear: a grouped weight needs N/groups and "
                                     f"K multiples of 128, got N={N}, groups={G}, K={Kin}")
            elif Kin % _BLOCK:
                raise ValueError(f"FP8Linear.from_linear: in_features must be a multiple of 128 "
                                 f"(the activation blocks), got {Kin}")
            codes, scales, exact = fp8_weight(w)
            m = cls(codes, scales, G, exact)
            m.in_features = Kin
            return m

        def extra_repr(self):
            g = f", groups={self.groups}" if self.groups > 1 else ""
            return (f"in_features={self.in_features}, out_features={self.out_features}{g}, "
                    "e4m3 weights, ue8m0 128x128 scales")

        def dequantized_weight(self):
            """The weight as float32 [N, K] (codes times their block's scale)."""
            torch = _torch()
            sc = self.weight_scale.view(torch.uint8).to(torch.int32) - 127
            full = torch.ldexp(torch.ones(sc.shape), sc)
            full = full.repeat_interleave(_BLOCK, 0).repeat_interleave(_BLOCK, 1)
            N, K = self.weight_codes.shape
            return self.weight_codes.float() * full[:N, :K]

        def forward(self, x):
            torch = _torch()
            _no_grad_check(x, "FP8Linear")
            dt = _out_dtype(x)
            xin = _as_kernel_input(x)
            G = self.groups
            if G == 1:
                if xin.shape[-1] != self.in_features:
                    raise ValueError(f"FP8Linear: x's last dim must be {self.in_features}, got "
                                     f"shape {tuple(x.shape)}")
                lead = xin.shape[:-1]
                x2 = xin.reshape(-1, self.in_features)
                q, s = _act_q(x2)
                out = ops.call("fp8_gemm", q, s, self.weight_codes, self.weight_scale, dt, None)
                return out.view(*lead, self.out_features)
            if xin.dim() < 2 or xin.shape[-2] != G or xin.shape[-1] != self.in_features:
                raise ValueError(f"FP8Linear: a grouped layer takes x [..., {G}, "
                                 f"{self.in_features}], got shape {tuple(x.shape)}")
            lead = xin.shape[:-2]
            x2 = xin.reshape(-1, G * self.in_features)   # per-128 blocks never cross a group
            q, s = _act_q(x2)
            M, Kg, Ng = x2.shape[0], self.in_features, self.out_features // G
            # one call: row t * G + g of the [M * G, Kg] activations against group g's
            # weight (fp8_gemm's b_index; the same bits as one call a group)
            groups = torch.arange(G, dtype=torch.int32).repeat(M)
            out = ops.call("fp8_gemm", q.reshape(M * G, Kg), s.reshape(M * G, Kg // _BLOCK),
                           self.weight_codes.view(G, Ng, Kg),
                           self.weight_scale.view(G, Ng // _BLOCK, Kg // _BLOCK), dt, groups)
            return out.view(*lead, G, Ng)


    class FP4Experts(torch.nn.Module):
        """Routed experts over FP4 weights, with transformers' ``DeepseekV4Experts`` call:
        ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.

        gate_up_codes [E, 2I, H/2], gate_up_scale [E, 2I, H/32], down_codes [E, H, I/2],
        down_scale [E, H, I/32]: uint8 e2m1 pairs and float8_e8m0fnu scales.  Per (token, slot)
        pair: the gate/up GEMM of its expert, transformers' own gate (``_apply_gate``:
        clamps and SiLU), the down GEMM, times the routing weight, added into the token's
        row in ascending expert order, one rounding per add (transformers' per-expert
        loop; the same bits).  Indices outside 0..E-1 are skipped (transformers' mask slot
        E).  Every shape is fixed by T and k, none by the routing: torch.compile traces it
        without a graph break."""

        def __init__(self, experts, gu, gus, dn, dns, exact):
            super().__init__()
            self.num_experts = int(gu.shape[0])
            self.hidden_dim = int(dn.shape[1])
            self.intermediate_dim = int(gu.shape[1]) // 2
            self.act_fn, self.limit = experts.act_fn, experts.limit
            self._gate_fn = type(experts)._apply_gate
            self.exact = bool(exact)
            self.register_buffer("gate_up_codes", gu)
            self.register_buffer("gate_up_scale", gus)
            self.register_buffer("down_codes", dn)
            self.register_buffer("down_scale", dns)

        @classmethod
        def from_experts(cls, experts):
            """From transformers' DeepseekV4Experts (gate_up_proj [E, 2I, H], down_proj
            [E, H, I]; H and I multiples of 128)."""
            torch = _torch()
            gu_w, dn_w = experts.gate_up_proj, experts.down_proj
            E, I2, H = gu_w.shape
            if H % _BLOCK or (I2 // 2) % _BLOCK:
                raise ValueError(f"FP4Experts.from_experts: hidden and intermediate sizes must be "
                                 f"multiples of 128, got {H} and {I2 // 2}")
            parts, exact = [[], [], [], []], True
            for e in range(E):
                for j, w in ((0, gu_w[e]), (2, dn_w[e])):
                    q, s, ex = fp4_weight(w)
                    parts[j].append(q)
                    parts[j + 1].append(s)
                    exact &= ex
            return cls(experts, *(torch.stack(p) for p in parts), exact)

        def extra_repr(self):
            return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, "
                    f"intermediate={self.intermediate_dim}, e2m1 weights, ue8m0 scales per 32")

        def _apply_gate(self, gate_up):
            return self._gate_fn(self, gate_up)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            torch = _torch()
            _no_grad_check(hidden_states, "FP4Experts")
            x_all = _as_kernel_input(hidden_states)
            dt = _out_dtype(hidden_states)
            T, k = hidden_states.shape[0], top_k_index.shape[-1]
            if T * k == 0:
                return torch.zeros_like(hidden_states)
            E = self.num_experts
            flat = top_k_index.reshape(-1)
            # Every (token, slot) pair is kept, so no shape depends on the routing
            # (torch.compile traces the layer as one graph: no bincount().tolist(), no
            # boolean mask, no loop over the experts chosen).  The pairs sorted by expert,
            # an empty slot (an index outside 0..E-1, transformers' mask slot E) sorted
            # last as E; stable: tokens ascending within one expert.  Each expert's rows
            # are then one contiguous run: the row-wise steps -- the activation rounding,
            # transformers' gate, the routing weight -- run once over all pairs (same
            # per-element arithmetic as one expert at a time).
            valid = (flat >= 0) & (flat < E)
            key = torch.where(valid, flat, E)
            order = torch.argsort(key, stable=True)
            e_sorted = key[order]
            empty = e_sorted == E
            tok, pos = order // k, order % k
            if torch.compiler.is_compiling():
                # the pairs' rows gathered first, then rounded (the rounding is per row:
                # the same bits): Inductor's C++ code has no float8_e8m0fnu type, and a
                # gather of the scales is a kernel it would generate over them
                xq, xs = _act_q(x_all[tok])
            else:
                xq, xs = _act_q(x_all)               # per row: round once, gather the pairs
                xq, xs = xq.view(torch.uint8)[tok], xs.view(torch.uint8)[tok]
            # each GEMM one call over every expert (fp4_gemm's b_index: each expert's rows
            # one GEMM, as one call an expert); an empty slot's b_index -1 gives a zero
            # row and leaves the experts' runs, hence their bits, as they were
            experts = torch.where(empty, -1, e_sorted).to(torch.int32)
            gu = ops.call("fp4_gemm", xq, xs, self.gate_up_codes, self.gate_up_scale, dt,
                          experts)
            hq, hs = _act_q(_as_kernel_input(self._apply_gate(gu)))
            y = ops.call("fp4_gemm", hq, hs, self.down_codes, self.down_scale, dt, experts)
            y = (y * top_k_weights[tok, pos, None]).to(hidden_states.dtype)
            # the pairs added into their tokens' rows in this order -- experts ascending,
            # one rounding per add -- as transformers' per-expert index_add_ loop adds them
            # (one index_add_ over all pairs rounds bf16 sums differently when a token
            # repeats); empty slots (index -1) add nothing
            return ops.call("moe_combine", y, torch.where(empty, -1, tok), T)

    for c in (FP8Linear, FP4Experts):
        c.__qualname__ = c.__name__          # importable (and picklable) by this name
    _CLASSES.update(FP8Linear=FP8Linear, FP4Experts=FP4Experts)
