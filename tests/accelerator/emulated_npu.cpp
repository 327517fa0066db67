// An emulated accelerator for tests: a PrivateUse1 device whose memory is host memory, written for
// sparse_ckpt's device tests (tests/accelerator/emulated_npu.py builds it with
// torch.utils.cpp_extension and renames PrivateUse1 to "npu").
//
// What it provides, and how little it pretends:
// * an allocator for device memory (64-byte aligned host memory, tagged with the current device
//   index) and a pinned host allocator (host memory, remembered so that is_pinned() answers true);
// * two devices (npu:0, npu:1) with a per-thread current device, a device guard, streams and events
//   that exist but never wait: every kernel runs synchronously on the calling thread;
// * the kernels that must be native to a device (empty, empty_strided, the backend-specific view ops,
//   resize_, the set_ overloads, _copy_from, _copy_from_and_resize); every other operator runs through torch's boxed CPU fallback
//   (at::native::cpu_fallback: arguments copied to the CPU, the CPU kernel run, results and mutated
//   arguments copied back), so fused, foreach and capturable optimizer kernels run as their CPU
//   kernels do.
// It is not a model of any real accelerator's numerics or speed.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace emulated_npu {

constexpr c10::DeviceIndex kDeviceCount = 2;
thread_local c10::DeviceIndex current_device = 0;
std::atomic<int64_t> device_bytes{0};
std::atomic<int64_t> pinned_allocations{0};

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < kDeviceCount, "emulated npu: device index ", static_cast<int>(index),
              " out of range (this emulator has ", static_cast<int>(kDeviceCount), " devices)");
}

void* host_alloc(size_t n) {
  if (n == 0) return nullptr;
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, 64, n) == 0, "emulated npu: out of host memory allocating ", n, " bytes");
  return p;
}

// Device memory: host memory; its size is remembered so that memory_allocated() can report it.
std::mutex device_mutex;
std::map<void*, size_t> device_blocks;

void device_free(void* p) {
  if (p == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(device_mutex);
    auto it = device_blocks.find(p);
    if (it != device_blocks.end()) {
      device_bytes -= static_cast<int64_t>(it->second);
      device_blocks.erase(it);
    }
  }
  free(p);
}

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = host_alloc(n);
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(device_mutex);
      device_blocks[p] = n;
      device_bytes += static_cast<int64_t>(n);
    }
    return {p, p, &device_free, c10::Device(c10::DeviceType::PrivateUse1, current_device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &device_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
DeviceAllocator device_allocator;

// Pinned host memory: host memory whose blocks are remembered, so is_pinned() can answer.
std::mutex pinned_mutex;
std::map<const void*, size_t> pinned_blocks;

void pinned_free(void* p) {
  if (p == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned_blocks.erase(p);
  }
  free(p);
}

bool is_pinned_ptr(const void* data) {
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto it = pinned_blocks.upper_bound(data);
  if (it == pinned_blocks.begin()) return false;
  --it;
  auto base = static_cast<const char*>(it->first);
  return static_cast<const char*>(data) < base + it->second || data == it->first;
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = host_alloc(n);
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned_blocks[p] = n;
      ++pinned_allocations;
    }
    return {p, p, &pinned_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
PinnedAllocator pinned_allocator;

// Device guard: a per-thread current device; streams and events exist but never wait.
struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType static_type = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override { return static_type; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(static_type, current_device); }
  void setDevice(c10::Device d) const override {
    check_index(d.index());
    current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(c10::Device d, int priority = 0) const override {
    static std::atomic<c10::StreamId> next{1};
    return c10::Stream(c10::Stream::UNSAFE, d, next++);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool is_high_priority = false) const override {
    return getNewStream(d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override { return c10::Stream(c10::Stream::DEFAULT, s.device()); }
  c10::DeviceIndex deviceCount() const noexcept override { return kDeviceCount; }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override { delete static_cast<int*>(event); }
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new int(0);
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// Hooks: what torch asks an accelerator (availability, devices, pinned memory, generators).
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return kDeviceCount; }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    check_index(d);
    current_device = d;
  }
  c10::DeviceIndex getCurrentDevice() const override { return current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = current_device;
    setCurrentDevice(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  at::Device getDeviceFromPtr(void*) const override { return at::Device(c10::DeviceType::PrivateUse1, current_device); }
  // Random numbers come from the CPU generator (the kernels are the CPU's).
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::detail::createCPUGenerator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "emulated npu: trying to resize storage that is not resizable");
    c10::DataPtr fresh = device_allocator.allocate(newsize);
    size_t keep = std::min(newsize, impl->nbytes());
    if (keep > 0) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

// Host memory of a device tensor seen as a CPU tensor (no copy): the emulator's copies and views use it.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().is_cpu()) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), at::TensorOptions().dtype(t.dtype()).device(at::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                               std::optional<at::Device> device, std::optional<bool>,
                               std::optional<at::MemoryFormat> memory_format) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_generic(size, &device_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, &device_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking: always synchronous*/) {
  TORCH_CHECK(self.sizes() == dst.sizes(), "emulated npu: _copy_from needs equal sizes, got ", self.sizes(), " and ",
              dst.sizes());
  if (self.numel() == 0) return dst;
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  c10::DeviceGuard guard(dst.device());  // a resize allocates on the current device
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(self.device());  // a resize allocates on the current device
  return at::native::resize_(self, size, memory_format);
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source, int64_t storage_offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  c10::DeviceGuard guard(self.device());
  return at::native::set_storage_cpu_(self, std::move(source), storage_offset, size, stride);
}

at::Tensor& set_whole_storage(at::Tensor& self, at::Storage source) {
  c10::DeviceGuard guard(self.device());
  return at::native::set_(self, std::move(source));
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  c10::DeviceGuard guard(self.device());
  return at::native::set_tensor_(self, source);
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { at::native::cpu_fallback(op, stack); }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("resize_", resize);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_whole_storage);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>()); }

struct Registration {
  Registration() {
    c10::SetAllocator(c10::DeviceType::PrivateUse1, &device_allocator);
    static Hooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
  }
};
Registration registration;

}  // namespace emulated_npu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("device_count", [] { return static_cast<int>(emulated_npu::kDeviceCount); });
  m.def("current_device", [] { return static_cast<int>(emulated_npu::current_device); });
  m.def("set_device", [](int index) {
    emulated_npu::check_index(static_cast<c10::DeviceIndex>(index));
    emulated_npu::current_device = static_cast<c10::DeviceIndex>(index);
  });
  m.def("memory_allocated", [] { return emulated_npu::device_bytes.load(); });
  m.def("pinned_allocations", [] { return emulated_npu::pinned_allocations.load(); },
        "How many blocks the pinned host allocator has handed out since the process started.");
}
