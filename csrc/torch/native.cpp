// deepseek_csa.torch._native: C++ kernels for some torch.ops.deepseek_csa operators.
//
// Why: an operator whose kernels are Python pays the dispatcher's trip into the
// interpreter on every call (about 2.5 us a call, twice for a differentiable operator,
// whose autograd kernel is Python too), and a graph compiled with Inductor's C++
// wrapper calls operators through the C++ dispatcher (aoti_torch_call_dispatcher),
// where a Python kernel brings the interpreter back.  Here the plain case of an
// operator -- CPU tensors of the dtypes and layouts its C kernel reads, nothing for
// autograd to record -- runs in C++ straight into the package's C kernel; everything
// else (other layouts, empty tensors, hostile arguments, a failed status, gradients
// to record, tensor subclasses) goes to the operator's Python kernels, which keep the
// validation, the error messages and the autograd formula: one definition of each.
//
// The schemas, fake kernels and autograd formulas stay registered from Python
// (deepseek_csa/torch/ops.py); this module registers the CPU kernel (and, for a
// differentiable operator, the Autograd kernel) of each operator in OPERATORS when
// ops.py asks it to.  The C kernels are the ones in deepseek_csa._core, found with
// dlsym in that module: one copy of every kernel in the process, one ISA dispatch.
//
// This file compiles against torch's C++ headers, so the module is tied to the torch
// build it was compiled with: setup.py builds it only where torch is importable and
// writes torch's version beside it, and ops.py loads it only under that version.
#include <ATen/ATen.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

extern "C" {
#include "attn.h"
#include "gemm.h"
#include "norm.h"
#include "pool.h"
#include "qpack.h"
#include "quant.h"
#include "rope.h"
#include "sinkhorn.h"
}

namespace py = pybind11;

namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;

// ---------------------------------------------------------------------------- the C kernels
struct CoreKernels {
  decltype(&csa_rms_norm) rms_norm = nullptr;
  decltype(&csa_rms_norm_bf16) rms_norm_bf16 = nullptr;
  decltype(&csa_apply_rope) apply_rope = nullptr;
  decltype(&csa_apply_rope_bf16) apply_rope_bf16 = nullptr;
  decltype(&csa_quant_pack) quant_pack = nullptr;
  decltype(&csa_gemm) gemm = nullptr;
  decltype(&csa_gemm_indexed) gemm_indexed = nullptr;
  decltype(&csa_hc_sinkhorn) hc_sinkhorn = nullptr;
  decltype(&csa_sparse_attn) sparse_attn = nullptr;
  decltype(&csa_gated_pool) gated_pool = nullptr;
};
CoreKernels core;

template <class F>
void find(void *handle, const char *name, F &slot) {
  void *p = dlsym(handle, name);
  if (!p) throw std::runtime_error(std::string("deepseek_csa._core has no symbol ") + name);
  slot = reinterpret_cast<F>(p);
}

// Finds the C kernels in deepseek_csa._core (already loaded by Python).
void bind_core(const std::string &core_path) {
  void *h = dlopen(core_path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (!h) throw std::runtime_error("deepseek_csa._core is not loaded: " + core_path);
  find(h, "csa_rms_norm", core.rms_norm);
  find(h, "csa_rms_norm_bf16", core.rms_norm_bf16);
  find(h, "csa_apply_rope", core.apply_rope);
  find(h, "csa_apply_rope_bf16", core.apply_rope_bf16);
  find(h, "csa_quant_pack", core.quant_pack);
  find(h, "csa_gemm", core.gemm);
  find(h, "csa_gemm_indexed", core.gemm_indexed);
  find(h, "csa_hc_sinkhorn", core.hc_sinkhorn);
  find(h, "csa_sparse_attn", core.sparse_attn);
  find(h, "csa_gated_pool", core.gated_pool);
  dlclose(h);   // RTLD_NOLOAD took a reference; Python keeps the module loaded
}

// ---------------------------------------------------------------------------- shared pieces
// The Python kernels of an operator: its CPU implementation and, for a differentiable
// operator, its autograd kernel (called with the DispatchKeySet first).  Leaked on
// purpose: the registrations that call them live as long as the process.
struct PythonKernels {
  py::object *cpu = nullptr;
  py::object *autograd = nullptr;
  uint64_t cpu_calls = 0;   // how often the C++ CPU kernel handed a call on (under the GIL)
};
std::map<std::string, PythonKernels> python;

py::object to_python(const Tensor &t) { return py::cast(t); }
py::object to_python(const OptTensor &t) { return t ? py::cast(*t) : py::none(); }
py::object to_python(at::ScalarType s) {
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject *>(torch::getTHPDtype(s)));
}
py::object to_python(c10::string_view s) { return py::str(s.data(), s.size()); }
template <class T>
py::object to_python(const T &v) { return py::cast(v); }

// The operator's Python CPU kernel on the same arguments: the glue validates, raises
// its own error, or computes the cases the C++ kernel leaves to it.
template <class R, class... A>
R python_cpu(const char *name, const A &...args) {
  py::gil_scoped_acquire gil;
  PythonKernels &k = python.at(name);
  k.cpu_calls++;
  py::object r = (*k.cpu)(to_python(args)...);
  if constexpr (!std::is_void_v<R>) return r.template cast<R>();
}

// CPU time of the calling thread inside the C kernels, when asked for (time_kernels):
// cProfile does not see a kernel called from C++, and misses some calls from Python too
// (benchmarks/bench_decode_profile.py).  Off, it costs one relaxed load a call.
std::atomic<bool> timing{false};
std::atomic<int64_t> kernel_ns{0};

int64_t thread_ns() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// Runs the C kernel call f without the GIL: the kernel must not hold it (other Python
// threads keep running), whether the caller came from Python with the GIL held or not.
template <class F>
int without_gil(F &&f) {
  const bool timed = timing.load(std::memory_order_relaxed);
  const int64_t t0 = timed ? thread_ns() : 0;
  int st;
  if (PyGILState_Check()) {
    py::gil_scoped_release released;
    st = f();
  } else {
    st = f();
  }
  if (timed) kernel_ns += thread_ns() - t0;
  return st;
}

bool plain(const Tensor &t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && !t.is_neg() &&
         !t.is_conj();
}

bool plain_dense(const Tensor &t) { return plain(t) && t.numel() > 0 && t.is_contiguous(); }

bool is_bf16(const Tensor &t) { return t.scalar_type() == at::kBFloat16; }
bool f32_or_bf16(const Tensor &t) { return t.scalar_type() == at::kFloat || is_bf16(t); }

// True when no two elements of t share memory: the strides of its dims of size > 1,
// sorted, each at least the extent of the ones below (enough, not necessary: views the
// test cannot clear go to the Python kernel).
bool no_self_overlap(const Tensor &t) {
  std::vector<std::pair<int64_t, int64_t>> dims;   // (stride, size)
  for (int64_t i = 0; i < t.dim(); i++)
    if (t.size(i) > 1) dims.emplace_back(t.stride(i), t.size(i));
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;
  for (auto [stride, size] : dims) {
    if (stride < extent) return false;
    extent = stride * size;
  }
  return true;
}

// True when the byte ranges a and b span do not meet (two tensors over the same memory
// need not share a storage: from_numpy views of one array, say).
bool separate(const Tensor &a, const Tensor &b) {
  auto span = [](const Tensor &t) {
    int64_t last = 0;   // strides are >= 0
    for (int64_t i = 0; i < t.dim(); i++) last += (t.size(i) - 1) * t.stride(i);
    const char *lo = static_cast<const char *>(t.const_data_ptr());
    return std::make_pair(lo, lo + (last + 1) * t.element_size());
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a1 <= b0 || b1 <= a0;
}

// The keys below autograd of a plain dense CPU tensor (CPU, ADInplaceOrView): with
// nothing else there, no functorch level, functionalization or Python key would see
// the call, and the CPU kernel may be called from the autograd kernel directly.
// (A constant, not a tensor's keys: a tensor made here under a dispatch mode would be
// the mode's.  tests/test_ops.py checks it against torch.empty(0)'s keys.)
const c10::DispatchKeySet plain_keys =
    c10::DispatchKeySet(c10::DispatchKey::CPU) | c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView);

bool plain_below_autograd(c10::DispatchKeySet ks) {
  // raw bits: DispatchKeySet's operator- keeps the backend bits (CPUBit) on purpose
  return !((ks & c10::after_autograd_keyset).raw_repr() & ~plain_keys.raw_repr());
}

// The autograd kernel of a differentiable operator: nothing to record and plain tensors
// -> its CPU kernel right here (no redispatch); else its Python autograd kernel (the
// formula registered in ops.py), which records it.
bool requires_grad(const Tensor &t) { return t.requires_grad(); }
bool requires_grad(const OptTensor &t) { return t && t->requires_grad(); }
template <class T>
bool requires_grad(const T &) { return false; }

template <class R, class... A>
struct Autograd {
  template <R (*CPU)(A...), const char *NAME>
  static R kernel(c10::DispatchKeySet ks, A... args) {
    const bool record = at::GradMode::is_enabled() && (requires_grad(args) || ...);
    if (!record && plain_below_autograd(ks)) return CPU(args...);
    py::gil_scoped_acquire gil;
    return (*python.at(NAME).autograd)(ks, to_python(args)...).template cast<R>();
  }
};

// ---------------------------------------------------------------------------- rms_norm
// C-contiguous float32 / bfloat16 x, float32 unit-stride weight [d] or none, finite
// eps >= 0, at least one element.
Tensor rms_norm_cpu(const Tensor &x, const OptTensor &weight, double eps) {
  bool fast = plain_dense(x) && f32_or_bf16(x) && x.dim() >= 1 && std::isfinite(eps) &&
              eps >= 0;
  const int64_t d = fast ? x.size(-1) : 0;
  const float *w = nullptr;
  if (fast && weight) {
    const Tensor &t = *weight;
    fast = plain(t) && t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == d &&
           t.stride(0) == 1;
    w = fast ? t.const_data_ptr<float>() : nullptr;
  }
  if (!fast) return python_cpu<Tensor>("rms_norm", x, weight, eps);
  Tensor out = at::empty(x.sizes(), x.options());
  const csa_idx rows = x.numel() / d;
  const float e = static_cast<float>(eps);
  const int st = without_gil([&] {
    if (is_bf16(x))
      return core.rms_norm_bf16(static_cast<const csa_bf16 *>(x.const_data_ptr()), rows, d, d,
                                1, w, 1, e, static_cast<csa_bf16 *>(out.data_ptr()), d, 1);
    return core.rms_norm(x.const_data_ptr<float>(), rows, d, d, 1, w, 1, e,
                         out.data_ptr<float>(), d, 1);
  });
  if (st != CSA_OK) return python_cpu<Tensor>("rms_norm", x, weight, eps);   // its error
  return out;
}

constexpr char kRmsNorm[] = "rms_norm";

// ---------------------------------------------------------------------------- apply_rope_
// x float32 / bfloat16 [n0, n1, (n2,) d] without self-overlap, any strides; cos / sin
// float32 [n1, half] (any strides, separate from x), 2 * half <= d: the last 2 * half
// features rotate in place.
void apply_rope_cpu(const Tensor &x, const Tensor &cos, const Tensor &sin, bool inverse) {
  const bool fast = plain(x) && f32_or_bf16(x) && (x.dim() == 3 || x.dim() == 4) &&
                    x.numel() > 0 && plain(cos) && plain(sin) &&
                    cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == x.size(1) &&
                    2 * cos.size(1) <= x.size(-1) && no_self_overlap(x) && separate(x, cos) &&
                    separate(x, sin);
  if (!fast) return python_cpu<void>("apply_rope_", x, cos, sin, inverse);
  const int nd = static_cast<int>(x.dim());
  const int64_t half = cos.size(1), d = x.size(-1);
  const int64_t n2 = nd == 4 ? x.size(2) : 1, s2 = nd == 4 ? x.stride(2) : 0;
  const int64_t s3 = x.stride(nd - 1);
  const int64_t off = (d - 2 * half) * s3;   // the rotated features are the last 2 * half
  const float *c = cos.const_data_ptr<float>(), *s = sin.const_data_ptr<float>();
  const int st = without_gil([&] {
    if (is_bf16(x))
      return core.apply_rope_bf16(static_cast<csa_bf16 *>(x.data_ptr()) + off, x.size(0),
                                  x.size(1), n2, half, x.stride(0), x.stride(1), s2, s3, c,
                                  cos.stride(0), cos.stride(1), s, sin.stride(0), sin.stride(1),
                                  inverse);
    return core.apply_rope(x.data_ptr<float>() + off, x.size(0), x.size(1), n2, half,
                           x.stride(0), x.stride(1), s2, s3, c, cos.stride(0), cos.stride(1), s,
                           sin.stride(0), sin.stride(1), inverse);
  });
  if (st != CSA_OK) throw std::runtime_error("apply_rope(): kernel status " + std::to_string(st));
}

// ---------------------------------------------------------------------------- fp8_quant
// C-contiguous float32 / bfloat16 x [..., d], block dividing d, the released pairs of
// scale rule and scale dtype.
std::tuple<Tensor, Tensor> fp8_quant_cpu(const Tensor &x, int64_t block, c10::string_view scale,
                                         c10::string_view scale_dtype) {
  const bool ue8m0 = scale == "ue8m0", e8m0 = scale_dtype == "e8m0";
  const bool fast = plain_dense(x) && f32_or_bf16(x) && x.dim() >= 1 && block >= 1 &&
                    x.size(-1) % block == 0 && (ue8m0 || scale == "fp32") &&
                    (e8m0 || scale_dtype == "float32") && (ue8m0 || !e8m0);
  if (!fast)
    return python_cpu<std::tuple<Tensor, Tensor>>("fp8_quant", x, block, scale, scale_dtype);
  const int64_t d = x.size(-1), rows = x.numel() / d;
  Tensor q = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d / block;
  Tensor s = at::empty(shape, x.options().dtype(e8m0 ? at::kFloat8_e8m0fnu : at::kFloat));
  const int st = without_gil([&] {
    return core.quant_pack(x.const_data_ptr(), is_bf16(x), rows, d, d, 1, block, CSA_Q_E4M3,
                           ue8m0 ? CSA_QS_UE8M0 : CSA_QS_FP32,
                           static_cast<uint8_t *>(q.data_ptr()), d, s.data_ptr(), e8m0,
                           d / block, 1);
  });
  if (st != CSA_OK)
    return python_cpu<std::tuple<Tensor, Tensor>>("fp8_quant", x, block, scale, scale_dtype);
  return {q, s};
}

// ---------------------------------------------------------------------------- fp8 / fp4 gemm
// Codes and scales as the glue takes them: the torch dtype, or uint8 holding the codes.
bool codes(const Tensor &t, at::ScalarType dtype) {
  return t.scalar_type() == dtype || t.scalar_type() == at::kByte;
}
bool scale_dtype_ok(const Tensor &t) {
  return t.scalar_type() == at::kFloat || codes(t, at::kFloat8_e8m0fnu);
}

// a float8_e4m3fn [..., K] C-contiguous with a_s float32 / e8m0 [..., ceil(K / 128)]
// C-contiguous; b [N, K] float8_e4m3fn (FP8) or [N, K / 2] float4_e2m1fn_x2 (FP4, K
// even) with unit last stride; b_s float32 / e8m0 [ceil(N / 128), ceil(K / 128)] (FP8)
// or [N, ceil(K / 32)] (FP4), any strides; out_dtype float32 or bfloat16.  With
// b_index (int32 [...] = a.shape[:-1], C-contiguous, every entry in [-1, E)), b and
// b_s stack E weights along a new first dimension.  uint8 stands for any of the code
// dtypes, as in the glue.
template <int WFMT>
Tensor gemm_cpu(const Tensor &a, const Tensor &a_s, const Tensor &b, const Tensor &b_s,
                at::ScalarType out_dtype, const OptTensor &b_index) {
  constexpr bool fp8 = WFMT == CSA_W_E4M3;
  constexpr const char *name = fp8 ? "fp8_gemm" : "fp4_gemm";
  const int o = b_index ? 1 : 0;   // with b_index, b and b_s dims shift by one
  const int64_t K = a.dim() >= 1 ? a.size(-1) : 0, KB = (K + 127) / 128;
  const int64_t N = b.dim() == 2 + o ? b.size(o) : 0, E = o && b.dim() == 3 ? b.size(0) : 1;
  bool fast = plain_dense(a) && codes(a, at::kFloat8_e4m3fn) && K > 0 && plain_dense(a_s) &&
              scale_dtype_ok(a_s) && a_s.dim() == a.dim() && a_s.size(-1) == KB && plain(b) &&
              b.dim() == 2 + o && N > 0 && plain(b_s) && scale_dtype_ok(b_s) &&
              b_s.dim() == 2 + o && (!o || b_s.size(0) == E) &&
              (out_dtype == at::kFloat || out_dtype == at::kBFloat16);
  for (int64_t i = 0; fast && i + 1 < a.dim(); i++) fast = a_s.size(i) == a.size(i);
  if (fast && fp8)
    fast = codes(b, at::kFloat8_e4m3fn) && b.size(o + 1) == K &&
           b_s.size(o) == (N + 127) / 128 && b_s.size(o + 1) == KB;
  if (fast && !fp8)
    fast = codes(b, at::kFloat4_e2m1fn_x2) && K % 2 == 0 && b.size(o + 1) == K / 2 &&
           b_s.size(o) == N && b_s.size(o + 1) == (K + 31) / 32;
  if (fast) fast = b.size(o + 1) <= 1 || b.stride(o + 1) == 1;
  const int32_t *ix = nullptr;
  if (fast && o) {   // every entry is read here, so a bad one goes to the glue's message
    const Tensor &t = *b_index;
    fast = plain_dense(t) && t.scalar_type() == at::kInt && t.dim() == a.dim() - 1;
    for (int64_t i = 0; fast && i < t.dim(); i++) fast = t.size(i) == a.size(i);
    ix = fast ? t.const_data_ptr<int32_t>() : nullptr;
    for (int64_t i = 0, n = fast ? t.numel() : 0; i < n; i++)
      if (ix[i] < -1 || ix[i] >= E) {
        fast = false;
        break;
      }
  }
  if (!fast) return python_cpu<Tensor>(name, a, a_s, b, b_s, out_dtype, b_index);
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
  shape.back() = N;
  Tensor out = at::empty(shape, a.options().dtype(out_dtype));
  csa_gemm_args g{};
  g.a = static_cast<const uint8_t *>(a.const_data_ptr());
  g.M = a.numel() / K;
  g.K = K;
  g.sa_row = K;
  g.as = a_s.const_data_ptr();
  g.as_fmt = a_s.scalar_type() == at::kFloat ? CSA_S_F32 : CSA_S_E8M0;
  g.sas_row = KB;
  g.sas_col = 1;
  g.b = static_cast<const uint8_t *>(b.const_data_ptr());
  g.b_fmt = WFMT;
  g.N = N;
  g.sb_row = b.stride(o);   // bytes: one-byte elements
  g.bs = b_s.const_data_ptr();
  g.bs_fmt = b_s.scalar_type() == at::kFloat ? CSA_S_F32 : CSA_S_E8M0;
  g.sbs_row = b_s.stride(o);
  g.sbs_col = b_s.stride(o + 1);
  g.out = out.data_ptr();
  g.out_bf16 = out_dtype == at::kBFloat16;
  g.so_row = N;
  const int st = without_gil([&] {
    if (!o) return core.gemm(&g);
    return core.gemm_indexed(&g, ix, b.stride(0), b_s.stride(0) * b_s.element_size());
  });
  if (st != CSA_OK) return python_cpu<Tensor>(name, a, a_s, b, b_s, out_dtype, b_index);
  return out;
}

// ---------------------------------------------------------------------------- sparse_attn
// q float32 / bfloat16 [B, S, H, D] and kv of q's dtype [B, N, D] with unit inner
// strides; attn_sink float32 [H] unit stride; topk_idxs int32 [B, S, K] with unit inner
// stride; finite softmax_scale; no empty dimension.  A bad index (the kernel checks
// them before writing) goes to the glue's message.
std::tuple<Tensor, Tensor> sparse_attn_cpu(const Tensor &q, const Tensor &kv,
                                           const Tensor &sink, const Tensor &idx,
                                           double scale) {
  using R = std::tuple<Tensor, Tensor>;
  const bool fast = plain(q) && f32_or_bf16(q) && q.dim() == 4 && q.numel() > 0 && plain(kv) &&
                    kv.scalar_type() == q.scalar_type() && kv.dim() == 3 && kv.numel() > 0 &&
                    kv.size(0) == q.size(0) && kv.size(2) == q.size(3) && plain(sink) &&
                    sink.scalar_type() == at::kFloat && sink.dim() == 1 &&
                    sink.size(0) == q.size(2) && plain(idx) && idx.scalar_type() == at::kInt &&
                    idx.dim() == 3 && idx.numel() > 0 && idx.size(0) == q.size(0) &&
                    idx.size(1) == q.size(1) && std::isfinite(scale) &&
                    std::isfinite(static_cast<float>(scale)) &&
                    (q.size(3) == 1 || (q.stride(3) == 1 && kv.stride(2) == 1)) &&
                    (q.size(2) == 1 || sink.stride(0) == 1) &&
                    (idx.size(2) == 1 || idx.stride(2) == 1);
  if (!fast) return python_cpu<R>("sparse_attn", q, kv, sink, idx, scale);
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3);
  Tensor out = at::empty(q.sizes(), q.options());
  Tensor lse = at::empty({B, S, H}, q.options().dtype(at::kFloat));
  csa_attn_problem p{};
  p.q = q.const_data_ptr();
  p.sq_b = q.stride(0);
  p.sq_s = q.stride(1);
  p.sq_h = q.stride(2);
  p.kv = kv.const_data_ptr();
  p.skv_b = kv.stride(0);
  p.skv_n = kv.stride(1);
  p.sink = sink.const_data_ptr<float>();
  p.idx = idx.const_data_ptr<int32_t>();
  p.si_b = idx.stride(0);
  p.si_s = idx.stride(1);
  p.out = out.data_ptr();
  p.so_b = S * H * D;
  p.so_s = H * D;
  p.so_h = D;
  p.B = B;
  p.S = S;
  p.H = H;
  p.D = D;
  p.N = kv.size(1);
  p.K = idx.size(2);
  p.scale = static_cast<float>(scale);
  p.bf16 = is_bf16(q);
  p.lse = lse.data_ptr<float>();
  p.sl_b = S * H;
  p.sl_s = H;
  const int st = without_gil([&] { return core.sparse_attn(&p); });
  if (st != CSA_OK) return python_cpu<R>("sparse_attn", q, kv, sink, idx, scale);
  return {out, lse};
}

constexpr char kSparseAttn[] = "sparse_attn";

// ---------------------------------------------------------------------------- gated_pool
// kv float32 / bfloat16 [B, T, c * d] (c = 2 with overlap) and score of the same shape
// (float32 / bfloat16; None only for ratio 1 without overlap) with unit inner strides;
// ape None or float32 [ratio, c * d] with unit inner stride; at least one group.
Tensor gated_pool_cpu(const Tensor &kv, const OptTensor &score, int64_t ratio,
                      const OptTensor &ape, bool overlap) {
  const bool gate = ratio > 1 || overlap;
  const int64_t cd = kv.dim() == 3 ? kv.size(2) : 0;
  bool fast = plain(kv) && f32_or_bf16(kv) && kv.dim() == 3 && kv.numel() > 0 &&
              ratio >= 1 && ratio <= (int64_t(1) << 40) && kv.size(1) / ratio > 0 &&
              (!overlap || cd % 2 == 0) && (cd == 1 || kv.stride(2) == 1) && (score || !gate);
  if (fast && score) {
    const Tensor &t = *score;
    fast = plain(t) && f32_or_bf16(t) && t.sizes() == kv.sizes() && (cd == 1 || t.stride(2) == 1);
  }
  if (fast && ape) {
    const Tensor &t = *ape;
    fast = plain(t) && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == ratio &&
           t.size(1) == cd && (cd == 1 || t.stride(1) == 1);
  }
  if (!fast) return python_cpu<Tensor>("gated_pool", kv, score, ratio, ape, overlap);
  const int64_t B = kv.size(0), T = kv.size(1), d = overlap ? cd / 2 : cd, G = T / ratio;
  Tensor out = at::empty({B, G, d}, kv.options());
  csa_pool_problem p{};
  p.kv = kv.const_data_ptr();
  p.skb = kv.stride(0);
  p.skt = kv.stride(1);
  p.skf = 1;
  if (score) {
    p.score = score->const_data_ptr();
    p.ssb = score->stride(0);
    p.sst = score->stride(1);
    p.ssf = 1;
    p.sc_bf16 = is_bf16(*score);
  }
  if (ape) {
    p.ape = ape->const_data_ptr<float>();
    p.sar = ape->stride(0);
    p.saf = 1;
  }
  p.out = out.data_ptr();
  p.sob = G * d;
  p.sog = d;
  p.sof = 1;
  p.B = B;
  p.T = T;
  p.d = d;
  p.ratio = ratio;
  p.overlap = overlap;
  p.kv_bf16 = p.out_bf16 = is_bf16(kv);
  const int st = without_gil([&] { return core.gated_pool(&p); });
  if (st != CSA_OK) return python_cpu<Tensor>("gated_pool", kv, score, ratio, ape, overlap);
  return out;
}

constexpr char kGatedPool[] = "gated_pool";

// ---------------------------------------------------------------------------- moe_combine
// rows float32 / bfloat16 [P, H] (at most 2^18 elements: a decode step's few rows),
// index int64 [P] (any strides), num_tokens >= 0: out[t] = the rows with index t added
// in increasing p, each sum rounded to rows' dtype (what the Python kernel's index_add_
// calls compute); other indices skipped.  One thread: a prefill's rows go to the
// Python kernel, whose index_add_ runs on torch's threads.  (A torch thread pool woken
// here for a decode step's few rows made the whole step 15x slower at 2 threads: its
// threads and the C kernels' OpenMP threads then spin against each other.)
template <class T>
void moe_combine_rows(const Tensor &rows, const Tensor &index, Tensor &out) {
  const int64_t P = rows.size(0), H = rows.size(1), Tn = out.size(0);
  const int64_t sr = rows.stride(0), sh = rows.stride(1), si = index.stride(0);
  const T *r = rows.const_data_ptr<T>();
  const int64_t *ix = index.const_data_ptr<int64_t>();
  T *o = out.data_ptr<T>();
  for (int64_t p = 0; p < P; p++) {
    const int64_t t = ix[p * si];
    if (t < 0 || t >= Tn) continue;
    T *dst = o + t * H;
    const T *src = r + p * sr;
    for (int64_t h = 0; h < H; h++) dst[h] = dst[h] + src[h * sh];   // T's own rounding
  }
}

Tensor moe_combine_cpu(const Tensor &rows, const Tensor &index, c10::SymInt num_tokens) {
  const int64_t Tn = num_tokens.expect_int();
  const bool fast = plain(rows) && f32_or_bf16(rows) && rows.dim() == 2 &&
                    rows.numel() <= (int64_t(1) << 18) && plain(index) &&
                    index.scalar_type() == at::kLong && index.dim() == 1 &&
                    index.size(0) == rows.size(0) && Tn >= 0;
  if (!fast) return python_cpu<Tensor>("moe_combine", rows, index, Tn);
  Tensor out = at::zeros({Tn, rows.size(1)}, rows.options());
  without_gil([&] {
    if (is_bf16(rows))
      moe_combine_rows<c10::BFloat16>(rows, index, out);
    else
      moe_combine_rows<float>(rows, index, out);
    return 0;
  });
  return out;
}

// ---------------------------------------------------------------------------- hc_split_sinkhorn
// float32 mixes [..., (2 + h) * h] C-contiguous, hc_scale [3] and hc_base
// [(2 + h) * h] contiguous float32, h in [1, 64], iterations in [1, 2^20], finite
// eps >= 0.
std::tuple<Tensor, Tensor, Tensor> hc_split_sinkhorn_cpu(const Tensor &mixes,
                                                         const Tensor &hc_scale,
                                                         const Tensor &hc_base, int64_t h,
                                                         int64_t iters, double eps) {
  using R = std::tuple<Tensor, Tensor, Tensor>;
  const int64_t W = (2 + h) * h;
  const bool fast = h >= 1 && h <= 64 && iters >= 1 && iters <= (1 << 20) &&
                    std::isfinite(eps) && eps >= 0 && plain_dense(mixes) &&
                    mixes.scalar_type() == at::kFloat && mixes.dim() >= 1 &&
                    mixes.dim() < 31 && mixes.size(-1) == W && plain_dense(hc_scale) &&
                    hc_scale.scalar_type() == at::kFloat && hc_scale.dim() == 1 &&
                    hc_scale.size(0) == 3 && plain_dense(hc_base) &&
                    hc_base.scalar_type() == at::kFloat && hc_base.dim() == 1 &&
                    hc_base.size(0) == W;
  if (!fast)
    return python_cpu<R>("hc_split_sinkhorn", mixes, hc_scale, hc_base, h, iters, eps);
  std::vector<int64_t> shape(mixes.sizes().begin(), mixes.sizes().end());
  shape.back() = h;
  Tensor pre = at::empty(shape, mixes.options()), post = at::empty(shape, mixes.options());
  shape.push_back(h);
  Tensor comb = at::empty(shape, mixes.options());
  const int st = without_gil([&] {
    return core.hc_sinkhorn(mixes.const_data_ptr<float>(), mixes.numel() / W, W,
                            hc_scale.const_data_ptr<float>(), hc_base.const_data_ptr<float>(),
                            static_cast<int>(h), static_cast<int>(iters),
                            static_cast<float>(eps), pre.data_ptr<float>(),
                            post.data_ptr<float>(), comb.data_ptr<float>());
  });
  if (st != CSA_OK)
    return python_cpu<R>("hc_split_sinkhorn", mixes, hc_scale, hc_base, h, iters, eps);
  return {pre, post, comb};
}

// ---------------------------------------------------------------------------- registration
torch::Library &impl_library() {   // the registrations, kept for the process
  static torch::Library *lib = new torch::Library(torch::Library::IMPL, "deepseek_csa",
                                                   std::nullopt, __FILE__, __LINE__);
  return *lib;
}

void register_cpu(const std::string &name) {
  torch::Library &m = impl_library();
  const auto cpu = c10::DispatchKey::CPU, autograd = c10::DispatchKey::Autograd;
  if (name == "rms_norm") {
    m.impl("rms_norm", torch::dispatch(cpu, TORCH_FN(rms_norm_cpu)));
    m.impl("rms_norm", torch::dispatch(
        autograd, TORCH_FN((Autograd<Tensor, const Tensor &, const OptTensor &,
                                     double>::kernel<rms_norm_cpu, kRmsNorm>))));
  } else if (name == "sparse_attn") {
    m.impl("sparse_attn", torch::dispatch(cpu, TORCH_FN(sparse_attn_cpu)));
    m.impl("sparse_attn",
           torch::dispatch(autograd, TORCH_FN((Autograd<std::tuple<Tensor, Tensor>,
                                                        const Tensor &, const Tensor &,
                                                        const Tensor &, const Tensor &, double>::
                                                   kernel<sparse_attn_cpu, kSparseAttn>))));
  } else if (name == "gated_pool") {
    m.impl("gated_pool", torch::dispatch(cpu, TORCH_FN(gated_pool_cpu)));
    m.impl("gated_pool",
           torch::dispatch(autograd, TORCH_FN((Autograd<Tensor, const Tensor &, const OptTensor &,
                                                        int64_t, const OptTensor &, bool>::
                                                   kernel<gated_pool_cpu, kGatedPool>))));
  } else if (name == "apply_rope_") {
    m.impl("apply_rope_", torch::dispatch(cpu, TORCH_FN(apply_rope_cpu)));
  } else if (name == "fp8_quant") {
    m.impl("fp8_quant", torch::dispatch(cpu, TORCH_FN(fp8_quant_cpu)));
  } else if (name == "fp8_gemm") {
    m.impl("fp8_gemm", torch::dispatch(cpu, TORCH_FN(gemm_cpu<CSA_W_E4M3>)));
  } else if (name == "fp4_gemm") {
    m.impl("fp4_gemm", torch::dispatch(cpu, TORCH_FN(gemm_cpu<CSA_W_E2M1>)));
  } else if (name == "moe_combine") {
    m.impl("moe_combine", torch::dispatch(cpu, TORCH_FN(moe_combine_cpu)));
  } else if (name == "hc_split_sinkhorn") {
    m.impl("hc_split_sinkhorn", torch::dispatch(cpu, TORCH_FN(hc_split_sinkhorn_cpu)));
  } else {
    throw std::invalid_argument("deepseek_csa.torch._native has no kernel for '" + name + "'");
  }
}

// Registers the C++ kernels of `name` in front of its Python ones: `cpu` its Python
// CPU kernel, `autograd` its Python autograd kernel (None for an operator without a
// gradient formula).
void register_operator(const std::string &name, py::object cpu, py::object autograd) {
  if (python.count(name)) throw std::invalid_argument("'" + name + "' is registered already");
  PythonKernels &k = python[name];
  k.cpu = new py::object(std::move(cpu));
  k.autograd = new py::object(std::move(autograd));
  register_cpu(name);
}

// {name: calls the C++ CPU kernel handed to the Python one}: for tests and diagnosis.
py::dict python_calls() {
  py::dict d;
  for (const auto &[name, k] : python) d[py::str(name)] = k.cpu_calls;
  return d;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "C++ kernels of deepseek_csa's torch operators (see deepseek_csa/torch/ops.py)";
  m.attr("OPERATORS") = py::make_tuple("rms_norm", "apply_rope_", "fp8_quant", "fp8_gemm",
                                       "fp4_gemm", "hc_split_sinkhorn", "sparse_attn",
                                       "gated_pool", "moe_combine");
  m.attr("TORCH_VERSION") = CSA_TORCH_VERSION;
  m.def("bind_core", &bind_core, py::arg("core_path"));
  m.def("register_operator", &register_operator, py::arg("name"), py::arg("cpu"),
        py::arg("autograd"));
  m.def("python_calls", &python_calls);
  m.def("time_kernels", [](bool on) { timing = on; },
        "Start (True) or stop adding up the calling threads' CPU time inside the C kernels.");
  m.def("kernel_seconds", [] { return kernel_ns.exchange(0) * 1e-9; },
        "The CPU seconds added up since the last call (and reset to 0).");
  m.def("plain_keys", [] { return plain_keys.raw_repr(); },
        "The raw bits of the keys below autograd the C++ autograd kernels call plain.");
}
