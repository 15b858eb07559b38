// oneDNN's bf16 matmul on a prepacked weight (mkldnn::_linear_pointwise), re-registered as llmserve's own op so
// that a torch.compile graph calls it from C++. The Python custom op that otherwise stands in for it (inductor's
// own lowering expects weights frozen into the graph) costs a call back into Python per projection: ~120 per step.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<c10::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(stack);
  return stack.back().toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_kernels, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

// The packed weight is an opaque oneDNN tensor, so calls dispatch on MkldnnCPU.
TORCH_LIBRARY_IMPL(llmserve_kernels, MkldnnCPU, m) {
  m.impl("packed_linear", &packed_linear);
}
