// The op-list kernel in C++: what mpnb/oplists/override.py's Python kernel does, without the
// Python call on every listed op (about 15 us a call on a 2-core CPU, measured in
// benchmarks/oplist_overhead.py).
//
// A kernel sits on an Autocast dispatch key in place of torch's own. It casts the tensors
// torch.autocast itself would cast (floating, on the autocast device, not float64: autocast's
// is_autocast_eligible) to fp32 or to the current autocast dtype, at every call (not through
// autocast's weight cache, which would give a stale copy of a weight changed in place within an
// autocast region, and the Python kernel has none), calls
// the op again with that key excluded (as torch's WrapFunction kernels do), and copies back into
// the caller's tensor whatever the op wrote into a cast copy. Which arguments may hold tensors is
// read from the schema in Python and passed in, so this file knows nothing of particular ops.
//
// Kernels are registered in groups (one torch::Library per call of `register`); releasing a group
// destroys its library, which puts back the kernels that were there before.

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

namespace {

// (caller's tensor, its cast copy, the copy's version counter before the call)
using CastCopies = c10::SmallVector<std::tuple<at::Tensor, at::Tensor, uint32_t>, 4>;

class ListKernel final : public c10::OperatorKernel {
 public:
  ListKernel(c10::DispatchKey key, c10::DeviceType device, bool to_fp32, std::vector<int64_t> positions)
      : key_(key), device_(device), to_fp32_(to_fp32), positions_(std::move(positions)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(key_);
    const at::ScalarType target = to_fp32_ ? at::kFloat : at::autocast::get_autocast_dtype(device_);
    const size_t first = stack->size() - op.schema().arguments().size();
    CastCopies copies;
    for (int64_t position : positions_) {
      c10::IValue& value = (*stack)[first + position];
      if (value.isTensor()) {
        value = cast(value.toTensor(), target, copies);
      } else if (value.isTensorList()) {  // Tensor[]
        c10::List<at::Tensor> cast_items;
        for (const at::Tensor& item : value.toTensorList().vec()) cast_items.push_back(cast(item, target, copies));
        value = std::move(cast_items);
      } else if (value.isList()) {  // Tensor?[]
        c10::List<std::optional<at::Tensor>> cast_items;
        for (const c10::IValue& item : value.toListRef()) {
          cast_items.push_back(item.isTensor() ? std::optional<at::Tensor>(cast(item.toTensor(), target, copies))
                                               : std::nullopt);
        }
        value = std::move(cast_items);
      }
    }
    op.callBoxed(stack);
    for (auto& [original, copy, version] : copies) {
      if (copy._version() != version) {
        at::NoGradGuard no_grad;
        original.copy_(copy);
      }
    }
  }

 private:
  at::Tensor cast(const at::Tensor& tensor, at::ScalarType target, CastCopies& copies) const {
    if (!tensor.defined() || !tensor.is_floating_point() || tensor.scalar_type() == at::kDouble ||
        tensor.scalar_type() == target || !at::autocast::is_autocast_eligible(tensor, device_)) {
      return tensor;
    }
    at::Tensor copy = tensor.to(target);
    // Inference tensors keep no version counter; only arguments no listed op writes are cast there.
    if (!copy.is_inference()) copies.emplace_back(tensor, copy, copy._version());
    return copy;
  }

  const c10::DispatchKey key_;
  const c10::DeviceType device_;
  const bool to_fp32_;
  const std::vector<int64_t> positions_;
};

// Replacing torch's own autocast kernel is the point, so the dispatcher's warning that a kernel is
// overridden is dropped (it would otherwise print once per process, outside Python's warnings).
class DropOverrideWarnings final : public c10::WarningHandler {
 public:
  explicit DropOverrideWarnings(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Overriding a previously registered kernel") == std::string::npos) next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

std::mutex groups_lock;
std::unordered_map<int64_t, std::unique_ptr<torch::Library>> groups;
int64_t next_group = 1;

// Registers one kernel per name on `dispatch_key`; kernel i casts to fp32 when to_fp32[i], and
// looks for tensors at the next counts[i] entries of `positions`. Returns the group's handle.
int64_t register_kernels(std::string dispatch_key, std::string device_type, std::vector<std::string> names,
                         std::vector<int64_t> to_fp32, std::vector<int64_t> positions, std::vector<int64_t> counts) {
  TORCH_CHECK(names.size() == to_fp32.size() && names.size() == counts.size(), "one entry per name");
  const c10::DispatchKey key = c10::parseDispatchKey(dispatch_key);
  const c10::DeviceType device = c10::Device(device_type).type();
  DropOverrideWarnings drop_override_warnings(c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::WarningHandlerGuard warnings_guard(&drop_override_warnings);
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
  auto next = positions.begin();
  for (size_t i = 0; i < names.size(); ++i) {
    TORCH_CHECK(counts[i] >= 0 && counts[i] <= positions.end() - next, "positions run out at ", names[i]);
    std::vector<int64_t> own(next, next + counts[i]);
    next += counts[i];
    library->impl(names[i].c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<ListKernel>(
                                        key, device, to_fp32[i] != 0, std::move(own))));
  }
  std::lock_guard<std::mutex> guard(groups_lock);
  const int64_t handle = next_group++;
  groups.emplace(handle, std::move(library));
  return handle;
}

void release_kernels(int64_t handle) {
  std::lock_guard<std::mutex> guard(groups_lock);
  groups.erase(handle);
}

}  // namespace

TORCH_LIBRARY(mpnb_list_kernels, m) {
  m.def("register(str dispatch_key, str device_type, str[] names, int[] to_fp32, int[] positions, int[] counts) -> int",
        &register_kernels);
  m.def("release(int handle) -> ()", &release_kernels);
}
