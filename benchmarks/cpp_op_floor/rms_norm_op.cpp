// A prototype, not part of the package: rms_norm registered as a torch operator in
// C++ (namespace deepseek_csa_cpp), to measure the floor of a custom operator's
// overhead when neither its CPU kernel nor its autograd kernel is Python.  It calls
// the package's own C kernel (csa_rms_norm, found in deepseek_csa._core by address),
// float32 only, no backward.  Built by benchmarks/bench_ops_overhead.py with
// torch.utils.cpp_extension when torch's headers and a C++ compiler are present.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstddef>
#include <cstdint>

namespace {

using rms_norm_fn = int (*)(const float *, std::ptrdiff_t, std::ptrdiff_t, std::ptrdiff_t,
                            std::ptrdiff_t, const float *, std::ptrdiff_t, float, float *,
                            std::ptrdiff_t, std::ptrdiff_t);
rms_norm_fn kernel = nullptr;

void bind(int64_t address) { kernel = reinterpret_cast<rms_norm_fn>(address); }

// The CPU kernel: what ops.py's Python kernel does (validate, allocate, run).
at::Tensor rms_norm_cpu(const at::Tensor &x, const std::optional<at::Tensor> &weight,
                        double eps) {
  TORCH_CHECK(kernel, "deepseek_csa_cpp::rms_norm: bind() first");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1,
              "rms_norm(): 'x' must be a float32 tensor of rank >= 1");
  const int64_t d = x.size(-1);
  const float *w = nullptr;
  int64_t sw = 0;
  if (weight.has_value()) {
    const at::Tensor &t = *weight;
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == d,
                "rms_norm(): 'weight' must be float32 [x.shape[-1]]");
    w = t.const_data_ptr<float>();
    sw = t.stride(0);
  }
  const at::Tensor xc = x.contiguous();   // the prototype folds rows of C-contiguous x only
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = d ? x.numel() / d : 0;
  const int st = kernel(xc.const_data_ptr<float>(), rows, d, d, 1, w, sw,
                        static_cast<float>(eps), out.data_ptr<float>(), d, 1);
  TORCH_CHECK(st == 0, "rms_norm(): kernel status ", st);
  return out;
}

// The autograd kernel when nothing is to be recorded: below autograd, redispatched.
at::Tensor rms_norm_autograd(c10::DispatchKeySet ks, const at::Tensor &x,
                             const std::optional<at::Tensor> &weight, double eps) {
  TORCH_CHECK(!(at::GradMode::is_enabled() &&
                (x.requires_grad() || (weight.has_value() && weight->requires_grad()))),
              "deepseek_csa_cpp::rms_norm: the prototype has no backward");
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("deepseek_csa_cpp::rms_norm", "")
          .typed<at::Tensor(const at::Tensor &, const std::optional<at::Tensor> &, double)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.redispatch(ks & c10::after_ADInplaceOrView_keyset, x, weight, eps);
}

}  // namespace

TORCH_LIBRARY(deepseek_csa_cpp, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("bind(int address) -> ()", &bind);
}

TORCH_LIBRARY_IMPL(deepseek_csa_cpp, CPU, m) { m.impl("rms_norm", &rms_norm_cpu); }

TORCH_LIBRARY_IMPL(deepseek_csa_cpp, Autograd, m) { m.impl("rms_norm", &rms_norm_autograd); }
