// q8kv8's eager fast path: a CPython extension, built against torch and linked to TVM-FFI, that takes one
// call from its Python arguments to the kernel launch (q8kv8/native.py builds, loads and configures it).
//
// launch(call) takes a q8kv8.prefill_call.PrefillCall. It reads the torch tensors directly (their
// TensorImpl, as DLPack views), runs the checks below and, when the call is in the common case, allocates
// the outputs of a call given no buffers (with the allocator at::empty uses), calls the registered kernel
// variant (a TVM-FFI function) with the arguments the Python path passes (q8kv8/kernels.py,
// launch_sparse_prefill) on torch's current stream, and returns (out, max_logits, lse). Otherwise it returns
// None having launched and kept nothing, and the Python path takes the call (and raises the contract's
// message for an invalid one). It declines every call the contract (q8kv8/contract.py) rejects and every
// valid one outside the common case: head counts that need padding, tensors that need copies for alignment,
// empty extents, buffers given in part, scalars of other Python types, tensors it does not read with
// certainty (subclasses other than nn.Parameter, wrapper or Python-dispatch TensorImpls, negative or
// conjugate views), and devices and kernel variants that are not registered. Each check is one of the
// contract's, or narrower. An error raised by the variant's launch becomes the Python exception of its
// TVM-FFI error kind. q is e4m3 with a q_scale tensor, or bfloat16 with q_scale None (the kernel scales each
// row of it); each q dtype has kernel variants of its own.
//
// The names of PrefillCall's fields, the supported sizes, alignments, flag bits and the schedule's
// constants all come from q8kv8's Python modules through configure(). Every function runs with the GIL
// held, so the registry is never read and written at once.

#include <Python.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <exception>
#include <string>
#include <tuple>
#include <typeinfo>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kDeclined = -1;

// The PrefillCall fields read here; configure() maps each name to its position in the tuple.
enum Field {
  kQ,
  kKv,
  kIndices,
  kSmScale,
  kQScale,
  kKvScale,
  kDv,
  kAttnSink,
  kTopkLength,
  kOut,
  kMaxLogits,
  kLse,
  kPrecision,
  kNumFields,
};
constexpr const char* kFieldNames[kNumFields] = {
    "q", "kv", "indices", "sm_scale", "q_scale", "kv_scale", "d_v", "attn_sink", "topk_length", "out",
    "max_logits", "lse", "precision",
};

// Set by configure() from q8kv8's Python constants.
struct Config {
  bool configured = false;
  Py_ssize_t num_fields = 0;
  Py_ssize_t field_index[kNumFields] = {};
  std::vector<int64_t> supported_d_qk;
  std::vector<int64_t> small_head_counts;  // head counts of the small-head kernel (a tile is a token's heads)
  std::vector<DLDataType> q_dtypes;  // the dtypes q may have
  std::vector<bool> q_row_scaled;  // per q dtype: scaled per row by the kernel (q_scale None)
  int64_t d_v = 0;
  std::vector<PyObject*> precisions;  // str, owned
  int64_t head_alignment = 0;
  int64_t topk_alignment = 0;
  int64_t q_alignment_bytes = 0;
  int64_t kv_row_alignment_bytes = 0;
  int64_t out_alignment_bytes = 0;
  double log2_e = 0.0;
  int64_t topk_length_flag = 0;
  int64_t sink_flag = 0;
  int64_t split_tail_flag = 0;
  int64_t persistent_max_topk = 0;
  int64_t persistent_max_tiles_per_cta = 0;
  int64_t small_head_max_tiles_per_cta = 0;
  int64_t small_head_split_min_parts = 0;  // small heads run split tiles of 64 heads from this many parts
  int64_t persistent_min_waves = 0;
  std::vector<int64_t> split_parts;  // the split kernel's part counts, ascending
  std::vector<int64_t> split_cluster_sms;  // SMs counted for a tile split in split_parts[i]
  int64_t split_min_slots = 0;
  int64_t split_tail_min_topk = 0;
  PyObject* error_kinds = nullptr;  // dict: TVM-FFI error kind -> Python exception type, owned
};

// A device the launch may run on, with the multiprocessor count the schedule reads.
struct Device {
  int32_t type;
  int32_t id;
  int64_t sm_count;
};

struct Registry {
  Config config;
  std::vector<Device> devices;
  // TVM-FFI functions (owned references, or null), [q dtype][d_qk][precision][schedule kind][heads]: heads 0
  // the tiles of 64 heads, 1 + i the small-head kernel of small_head_counts[i].
  std::vector<TVMFFIObjectHandle> variants;
};

// Schedule kinds of the registry's variants (q8kv8.schedule.ONE_TILE, PERSISTENT, SPLIT).
enum ScheduleKind : size_t { kOneTile = 0, kPersistent = 1, kSplit = 2, kScheduleKinds = 3 };

// Never destroyed: releasing what it holds may need the interpreter, which is gone when static destructors
// run; q8kv8.native empties it at exit instead (reset()).
Registry& registry = *new Registry();

void ReleaseAll() {
  Registry& r = registry;
  for (TVMFFIObjectHandle& variant : r.variants) {
    if (variant != nullptr) TVMFFIObjectDecRef(variant);
  }
  r.variants.clear();
  r.devices.clear();
  for (PyObject* name : r.config.precisions) Py_DECREF(name);
  Py_XDECREF(r.config.error_kinds);
  r.config = Config();
}

// ---------------------------------------------------------------------------------------------------
// Reading the call
// ---------------------------------------------------------------------------------------------------

// The allocator at::empty used on each CUDA device, learned from its first allocation there: an allocating
// call then makes its outputs with at::detail::empty_generic directly (what at::empty reaches through the
// dispatcher). torch lets the CUDA allocator be replaced only before its first allocation, so the learned
// one stays the current one.
std::array<c10::Allocator*, 64> g_cuda_allocators{};

// DLPack's dtype of the scalar types the checks accept; an opaque handle (no check accepts it) for others.
DLDataType DLDtypeOf(c10::ScalarType type) {
  switch (type) {
    case at::kFloat8_e4m3fn:
      return {kDLFloat8_e4m3fn, 8, 1};
    case at::kInt:
      return {kDLInt, 32, 1};
    case at::kFloat:
      return {kDLFloat, 32, 1};
    case at::kBFloat16:
      return {kDLBfloat, 16, 1};
    default:
      return {kDLOpaqueHandle, 0, 0};
  }
}

// A DLPack view of a plain strided CPU or CUDA tensor; false for anything else.
bool FillDLTensor(const at::Tensor& tensor, DLTensor* view) {
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  // No wrapper TensorImpl (functorch, functionalisation, nested, sparse), no Python dispatch, no lazy
  // negative or conjugate view (the kernel would read the wrong values).
  if (typeid(*impl) != typeid(c10::TensorImpl) || impl->is_python_dispatch() ||
      impl->layout() != c10::kStrided || impl->is_neg() || impl->is_conj() || !impl->has_storage()) {
    return false;
  }
  switch (impl->device_type()) {
    case c10::DeviceType::CPU:
      view->device = {kDLCPU, 0};
      break;
    case c10::DeviceType::CUDA:
      view->device = {kDLCUDA, impl->device().index()};
      break;
    default:
      return false;
  }
  view->dtype = DLDtypeOf(impl->dtype().toScalarType());
  try {
    view->data = const_cast<void*>(impl->data());  // what Tensor.data_ptr() returns (offset included)
  } catch (const std::exception&) {
    return false;  // a storage that cannot be read from here
  }
  view->ndim = static_cast<int32_t>(impl->dim());
  view->shape = const_cast<int64_t*>(impl->sizes().data());
  view->strides = const_cast<int64_t*>(impl->strides().data());
  view->byte_offset = 0;
  return true;
}

// A tensor argument: a plain torch.Tensor (or nn.Parameter) that FillDLTensor can view.
const at::Tensor* ReadTensor(PyObject* object, DLTensor* view) {
  if (!THPVariable_CheckExact(object)) return nullptr;
  const at::Tensor& tensor = THPVariable_Unpack(object);
  return FillDLTensor(tensor, view) ? &tensor : nullptr;
}

// A call's arguments as read: DLPack views (valid while the call's objects are alive) and scalars.
struct Views {
  DLTensor q, kv, indices, q_scale, kv_scale, attn_sink, topk_length, out, max_logits, lse;
  bool has_q_scale = false;  // false: None (a row-scaled q)
  bool has_sink = false;
  bool has_topk_length = false;
  bool has_outputs = false;  // false: all three absent, allocated after the checks
  const at::Tensor* q_tensor = nullptr;
  double sm_scale = 0.0;
  size_t precision = 0;  // index into Config::precisions
};

// What the checks decided.
struct Plan {
  int64_t tiles = kDeclined;  // tiles per CTA (0: the one-tile kernel), or kDeclined
  int64_t splits = 1;  // the one-tile kernel: parts per split tile (> 1: the split variant)
  int64_t split_from = 0;  // splits > 1: the first token split (> 0: the one-tile variant runs those before)
  TVMFFIObjectHandle variant = nullptr;  // the first launch's
  TVMFFIObjectHandle split_variant = nullptr;  // a split tail's (split_from > 0), launched second
  int64_t flags = 0;
  double logit_scale = 0.0;
  std::string declined;  // why, when declined
};

Plan Declined(std::string reason) {
  Plan plan;
  plan.declined = std::move(reason);
  return plan;
}

bool HasDtype(const DLTensor& t, uint8_t code, uint8_t bits) {
  return t.dtype.code == code && t.dtype.bits == bits && t.dtype.lanes == 1;
}

bool SameDtype(const DLDataType& a, const DLDataType& b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

int64_t Stride(const DLTensor& t, int dim) { return t.strides[dim]; }

uintptr_t Address(const DLTensor& t) { return reinterpret_cast<uintptr_t>(t.data) + t.byte_offset; }

bool SameDevice(const DLTensor& a, const DLTensor& b) {
  return a.device.device_type == b.device.device_type && a.device.device_id == b.device.device_id;
}

// Tensor.is_contiguous(): size-1 dims may have any stride, a tensor with no elements is contiguous.
bool IsContiguous(const DLTensor& t) {
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) return true;
  }
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1) {
      if (Stride(t, i) != expected) return false;
      expected *= t.shape[i];
    }
  }
  return true;
}

// The half-open byte interval a tensor's elements may touch (contract._span); empty when it has none.
struct Span {
  uintptr_t start;
  uintptr_t end;
};

Span SpanOf(const DLTensor& t) {
  int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) return {0, 0};
    last += (t.shape[i] - 1) * Stride(t, i);
  }
  const uintptr_t start = Address(t);
  return {start, start + static_cast<uintptr_t>((last + 1) * ((t.dtype.bits + 7) / 8))};
}

bool Overlap(const Span& a, const Span& b) {
  return a.start != a.end && b.start != b.end && a.start < b.end && b.start < a.end;
}

// schedule.tiles_per_cta, on the constants configure() received.
int64_t TilesPerCta(int64_t num_tiles, int64_t topk, bool has_topk_length, int64_t sm_count) {
  const Config& c = registry.config;
  if (!(has_topk_length || topk <= c.persistent_max_topk)) return 0;
  const int64_t tiles = std::min(c.persistent_max_tiles_per_cta, num_tiles / (c.persistent_min_waves * sm_count));
  return tiles >= 2 ? tiles : 0;
}

// schedule.small_head_tiles_per_cta (without a forced answer): the tokens per CTA, up to the maximum, that
// keep the fewest tokens in a row on an SM (waves of CTAs times tokens per CTA); on a tie the most.
int64_t SmallHeadTilesPerCta(int64_t s_q, int64_t sm_count) {
  const Config& c = registry.config;
  int64_t best = 1, best_rounds = -1;
  for (int64_t tiles = 1; tiles <= c.small_head_max_tiles_per_cta; ++tiles) {
    const int64_t rounds = ((s_q + tiles - 1) / tiles + sm_count - 1) / sm_count * tiles;
    if (best_rounds < 0 || rounds <= best_rounds) {
      best = tiles;
      best_rounds = rounds;
    }
  }
  return best;
}

// schedule.splits (without a forced answer: the fast path is suspended while one is set).
int64_t Splits(int64_t num_tiles, int64_t topk, int64_t sm_count) {
  const Config& c = registry.config;
  const int64_t tiles = std::max<int64_t>(num_tiles, 1);
  int64_t splits = 1;
  for (size_t i = 0; i < c.split_parts.size(); ++i) {
    const int64_t p = c.split_parts[i];
    if (tiles * c.split_cluster_sms[i] <= sm_count && p * c.split_min_slots <= topk) splits = p;
  }
  return splits;
}

// schedule.split_tokens: {splits, split_from}, the tokens from split_from on split (the last, partial wave).
std::pair<int64_t, int64_t> SplitTokens(int64_t s_q, int64_t groups, int64_t topk, int64_t sm_count) {
  const int64_t tail_tokens = (s_q * groups % sm_count + groups - 1) / groups;
  const int64_t split_from = s_q - tail_tokens;
  if (tail_tokens == 0 || (split_from > 0 && topk < registry.config.split_tail_min_topk)) return {1, 0};
  const int64_t parts = Splits(tail_tokens * groups, topk, sm_count);
  return parts > 1 ? std::pair<int64_t, int64_t>{parts, split_from} : std::pair<int64_t, int64_t>{1, 0};
}

// The registry's slot of a variant: [q dtype][d_qk][precision][schedule kind][heads], by index into the
// Config's lists (heads: 0 for tiles of 64 heads, 1 + i for small_head_counts[i]).
size_t VariantIndex(size_t q_dtype, size_t d_qk, size_t precision, size_t schedule_kind, size_t heads) {
  const Config& c = registry.config;
  const size_t kind = ((q_dtype * c.supported_d_qk.size() + d_qk) * c.precisions.size() + precision) *
                          kScheduleKinds +
                      schedule_kind;
  return kind * (1 + c.small_head_counts.size()) + heads;
}

// The registry's heads slot of a call of h_q heads: 1 + i when h_q is small_head_counts[i], else 0.
size_t HeadsSlot(int64_t h_q) {
  const Config& c = registry.config;
  const auto found = std::find(c.small_head_counts.begin(), c.small_head_counts.end(), h_q);
  return found == c.small_head_counts.end() ? 0 : 1 + static_cast<size_t>(found - c.small_head_counts.begin());
}

// The outputs' checks (contract._check_signatures, _check_no_overlap, Problem.launch_ready for out): an
// empty string when they pass, else why not.
std::string CheckOutputs(const Views& v) {
  const Config& c = registry.config;
  const int64_t s_q = v.q.shape[0], h_q = v.q.shape[1];
  const DLTensor& out = v.out;
  if (out.ndim != 3 || out.shape[0] != s_q || out.shape[1] != h_q || out.shape[2] != c.d_v ||
      !HasDtype(out, kDLBfloat, 16) || !IsContiguous(out)) {
    return "out is not a contiguous [s_q, h_q, " + std::to_string(c.d_v) + "] bfloat16 tensor";
  }
  for (const DLTensor* row_stats : {&v.max_logits, &v.lse}) {
    if (row_stats->ndim != 2 || row_stats->shape[0] != s_q || row_stats->shape[1] != h_q ||
        !HasDtype(*row_stats, kDLFloat, 32) || !IsContiguous(*row_stats)) {
      return "max_logits or lse is not a contiguous [s_q, h_q] float32 tensor";
    }
  }
  // No output shares memory with another output or an input (contract._check_no_overlap).
  const Span outputs[3] = {SpanOf(v.out), SpanOf(v.max_logits), SpanOf(v.lse)};
  Span inputs[7] = {SpanOf(v.q), SpanOf(v.kv), SpanOf(v.indices), {0, 0}, SpanOf(v.kv_scale), {0, 0}, {0, 0}};
  if (v.has_q_scale) inputs[3] = SpanOf(v.q_scale);
  if (v.has_sink) inputs[5] = SpanOf(v.attn_sink);
  if (v.has_topk_length) inputs[6] = SpanOf(v.topk_length);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < i; ++j) {
      if (Overlap(outputs[i], outputs[j])) return "two output buffers overlap";
    }
    for (const Span& input : inputs) {
      if (Overlap(outputs[i], input)) return "an output buffer overlaps an input";
    }
  }
  for (const DLTensor* t : {&v.out, &v.max_logits, &v.lse}) {
    if (!SameDevice(*t, v.q)) return "the tensors are on more than one device";
  }
  if (Address(out) % c.out_alignment_bytes != 0) return "q, kv or out does not meet the launch's alignment";
  return std::string();
}

// Every check, on the call's views; the outputs' only when given (else they are allocated after, and
// checked then).
Plan Check(const Views& v) {
  const Config& c = registry.config;
  const DLTensor &q = v.q, &kv = v.kv, &indices = v.indices;

  // Ranks, dtypes, shapes (contract._check_signatures), in the common case: no head padding, no empty
  // extent.
  if (q.ndim != 3 || kv.ndim != 3 || indices.ndim != 3) return Declined("q, kv or indices is not 3-D");
  size_t q_dtype = 0;
  while (q_dtype < c.q_dtypes.size() && !SameDtype(q.dtype, c.q_dtypes[q_dtype])) ++q_dtype;
  if (q_dtype == c.q_dtypes.size() || !HasDtype(kv, kDLFloat8_e4m3fn, 8) || !HasDtype(indices, kDLInt, 32)) {
    return Declined("q, kv or indices has another dtype");
  }
  if (Stride(q, 2) != 1 || Stride(kv, 2) != 1 || Stride(indices, 2) != 1) {
    return Declined("q, kv or indices has a strided last dimension");
  }
  const int64_t s_q = q.shape[0], h_q = q.shape[1], d_qk = q.shape[2];
  const int64_t s_kv = kv.shape[0], topk = indices.shape[2];
  if (s_q < 1 || s_kv < 1 || h_q < 1) return Declined("s_q, s_kv or h_q is 0");
  const auto d_qk_found = std::find(c.supported_d_qk.begin(), c.supported_d_qk.end(), d_qk);
  if (kv.shape[1] != 1 || d_qk_found == c.supported_d_qk.end() || kv.shape[2] != d_qk) {
    return Declined("kv's shape does not match q's, or d_qk is not supported");
  }
  if (indices.shape[0] != s_q || indices.shape[1] != 1) return Declined("indices' shape does not match q's");
  if (topk <= 0 || topk % c.topk_alignment != 0) {
    return Declined("topk is not a positive multiple of " + std::to_string(c.topk_alignment));
  }
  // A row-scaled q (bfloat16) comes without q_scale, any other with it.
  if (v.has_q_scale == c.q_row_scaled[q_dtype]) {
    return Declined(v.has_q_scale ? "q_scale is given for a q that the kernel scales per row (it must be None)"
                                  : "q_scale is None for a q that needs it");
  }
  for (const DLTensor* scale : {&v.q_scale, &v.kv_scale}) {
    if (scale == &v.q_scale && !v.has_q_scale) continue;
    if (scale->ndim != 1 || scale->shape[0] != 1 || !HasDtype(*scale, kDLFloat, 32)) {
      return Declined("q_scale or kv_scale is not a 1-D one-element float32 tensor");
    }
  }
  if (v.has_sink && (v.attn_sink.ndim != 1 || v.attn_sink.shape[0] != h_q ||
                     !HasDtype(v.attn_sink, kDLFloat, 32) || !IsContiguous(v.attn_sink))) {
    return Declined("attn_sink is not a contiguous [h_q] float32 tensor");
  }
  if (v.has_topk_length && (v.topk_length.ndim != 1 || v.topk_length.shape[0] != s_q ||
                            !HasDtype(v.topk_length, kDLInt, 32) || !IsContiguous(v.topk_length))) {
    return Declined("topk_length is not a contiguous [s_q] int32 tensor");
  }
  if (v.has_outputs) {
    std::string reason = CheckOutputs(v);
    if (!reason.empty()) return Declined(std::move(reason));
  }

  // One device for all, registered (a device the Python path has launched on: the contract checked it).
  for (const DLTensor* t : {&kv, &indices, &v.kv_scale}) {
    if (!SameDevice(*t, q)) return Declined("the tensors are on more than one device");
  }
  if ((v.has_q_scale && !SameDevice(v.q_scale, q)) || (v.has_sink && !SameDevice(v.attn_sink, q)) ||
      (v.has_topk_length && !SameDevice(v.topk_length, q))) {
    return Declined("the tensors are on more than one device");
  }
  const Device* device = nullptr;
  for (const Device& registered : registry.devices) {
    if (registered.type == q.device.device_type && registered.id == q.device.device_id) {
      device = &registered;
      break;
    }
  }
  if (device == nullptr) return Declined("the device is not registered");

  // The launch's layout needs (contract.Problem.launch_ready): else the Python path copies.
  if (Address(q) % c.q_alignment_bytes != 0 || !IsContiguous(q) || Address(kv) % c.kv_row_alignment_bytes != 0 ||
      Stride(kv, 0) % c.kv_row_alignment_bytes != 0) {
    return Declined("q, kv or out does not meet the launch's alignment");
  }

  // schedule.choose: the small-head kernel (persistent, never split), unless a grid of one tile a token would
  // split in small_head_split_min_parts or more (then tiles of 64 heads, split); else tiles of 64 heads.
  size_t heads = HeadsSlot(h_q);
  int64_t tiles = 0, splits = 1, split_from = 0;
  if (heads > 0) {
    const int64_t parts = Splits(s_q, topk, device->sm_count);
    if (parts >= c.small_head_split_min_parts) {
      heads = 0;
      splits = parts;
    } else {
      tiles = SmallHeadTilesPerCta(s_q, device->sm_count);
    }
  } else {
    const int64_t groups = (h_q + c.head_alignment - 1) / c.head_alignment;
    tiles = TilesPerCta(s_q * groups, topk, v.has_topk_length, device->sm_count);
    if (tiles == 0) std::tie(splits, split_from) = SplitTokens(s_q, groups, topk, device->sm_count);
  }
  const size_t d_qk_index = static_cast<size_t>(d_qk_found - c.supported_d_qk.begin());
  auto variant_of = [&](size_t kind) {
    return registry.variants[VariantIndex(q_dtype, d_qk_index, v.precision, kind, heads)];
  };
  // A split tail runs the one-tile variant first, then the split one.
  const size_t kind = tiles > 0 ? kPersistent : splits > 1 && split_from == 0 ? kSplit : kOneTile;
  TVMFFIObjectHandle variant = variant_of(kind);
  TVMFFIObjectHandle split_variant = split_from > 0 ? variant_of(kSplit) : nullptr;
  if (variant == nullptr || (split_from > 0 && split_variant == nullptr)) {
    return Declined("the kernel variant is not registered");
  }
  Plan plan;
  plan.tiles = tiles;
  plan.splits = splits;
  plan.split_from = split_from;
  plan.variant = variant;
  plan.split_variant = split_variant;
  plan.logit_scale = v.sm_scale * c.log2_e;
  plan.flags = (v.has_topk_length ? c.topk_length_flag : 0) | (v.has_sink ? c.sink_flag : 0);
  return plan;
}

// Reads the call into `v` and checks it. `call` is a tuple of Config::num_fields items.
Plan Inspect(PyObject* call, Views* v) {
  const Config& c = registry.config;
  if (!c.configured) return Declined("the fast path is not configured");
  auto field = [&](Field f) { return PyTuple_GET_ITEM(call, c.field_index[f]); };

  // Scalars: exactly the Python types of the common case (a float, the int d_v, a str).
  PyObject* sm_scale = field(kSmScale);
  if (!PyFloat_CheckExact(sm_scale)) return Declined("sm_scale is not a Python float");
  v->sm_scale = PyFloat_AS_DOUBLE(sm_scale);
  if (!std::isfinite(v->sm_scale)) return Declined("sm_scale is not finite");
  PyObject* d_v = field(kDv);
  int overflow = 0;
  if (!PyLong_CheckExact(d_v) || PyLong_AsLongLongAndOverflow(d_v, &overflow) != c.d_v || overflow != 0) {
    PyErr_Clear();
    return Declined("d_v is not the Python int " + std::to_string(c.d_v));
  }
  PyObject* precision = field(kPrecision);
  if (!PyUnicode_CheckExact(precision)) return Declined("precision is not a str");
  v->precision = c.precisions.size();
  for (size_t i = 0; i < c.precisions.size(); ++i) {
    if (PyUnicode_Compare(precision, c.precisions[i]) == 0) {
      v->precision = i;
      break;
    }
  }
  if (v->precision == c.precisions.size()) return Declined("precision is not a supported precision");

  // Tensors: read directly, or declined.
  static const char* const kNotRead =
      " is not a tensor read here (a plain CPU or CUDA torch.Tensor: no subclass but nn.Parameter, no "
      "wrapper, no negative or conjugate view)";
  const std::pair<Field, DLTensor*> required[] = {
      {kQ, &v->q}, {kKv, &v->kv}, {kIndices, &v->indices}, {kKvScale, &v->kv_scale}};
  for (const auto& [f, view] : required) {
    const at::Tensor* tensor = ReadTensor(field(f), view);
    if (tensor == nullptr) return Declined(std::string(kFieldNames[f]) + kNotRead);
    if (f == kQ) v->q_tensor = tensor;
  }
  const std::pair<Field, DLTensor*> optional[] = {
      {kQScale, &v->q_scale}, {kAttnSink, &v->attn_sink}, {kTopkLength, &v->topk_length}};
  for (const auto& [f, view] : optional) {
    PyObject* value = field(f);
    if (value == Py_None) continue;
    if (ReadTensor(value, view) == nullptr) return Declined(std::string(kFieldNames[f]) + kNotRead);
    (f == kQScale ? v->has_q_scale : f == kAttnSink ? v->has_sink : v->has_topk_length) = true;
  }
  const std::pair<Field, DLTensor*> outputs[] = {{kOut, &v->out}, {kMaxLogits, &v->max_logits}, {kLse, &v->lse}};
  int given = 0;
  for (const auto& [f, view] : outputs) {
    PyObject* value = field(f);
    if (value == Py_None) continue;
    ++given;
    if (ReadTensor(value, view) == nullptr) return Declined(std::string(kFieldNames[f]) + kNotRead);
  }
  if (given != 0 && given != 3) return Declined("only some of out, max_logits and lse are given");
  v->has_outputs = given == 3;
  return Check(*v);
}

// ---------------------------------------------------------------------------------------------------
// Allocating and launching
// ---------------------------------------------------------------------------------------------------

// at::empty(sizes, q.options().dtype(dtype)), without the dispatcher on a CUDA device whose allocator is
// known (and deterministic filling of new memory off).
at::Tensor Empty(const at::Tensor& q, c10::IntArrayRef sizes, c10::ScalarType dtype) {
  const c10::Device device = q.device();
  const auto index = static_cast<size_t>(device.index());
  if (device.is_cuda() && index < g_cuda_allocators.size()) {
    at::Context& context = at::globalContext();
    const bool deterministic_fill =
        context.deterministicAlgorithms() && context.deterministicFillUninitializedMemory();
    c10::Allocator* allocator = g_cuda_allocators[index];
    if (allocator != nullptr && !deterministic_fill) {
      const c10::DeviceGuard guard(device);  // the caching allocator allocates on the current device
      return at::detail::empty_generic(sizes, allocator, c10::DispatchKeySet(c10::DispatchKey::CUDA), dtype,
                                       std::nullopt);
    }
    at::Tensor tensor = at::empty(sizes, q.options().dtype(dtype).requires_grad(false));
    if (allocator == nullptr) g_cuda_allocators[index] = tensor.storage().allocator();
    return tensor;
  }
  return at::empty(sizes, q.options().dtype(dtype).requires_grad(false));
}

struct Outputs {
  at::Tensor out, max_logits, lse;
};

// [s_q, h, d_v] bfloat16, [s_q, h] float32, [s_q, h] float32 on q's device (eager.output_buffers).
Outputs AllocateOutputs(const at::Tensor& q, int64_t d_v) {
  const int64_t s_q = q.size(0);
  const int64_t h = q.size(1);
  return {Empty(q, {s_q, h, d_v}, at::kBFloat16), Empty(q, {s_q, h}, at::kFloat), Empty(q, {s_q, h}, at::kFloat)};
}

PyObject* WrapOutputs(Outputs outputs) {
  PyObject* result = PyTuple_New(3);
  if (result == nullptr) return nullptr;
  PyTuple_SET_ITEM(result, 0, THPVariable_Wrap(std::move(outputs.out)));
  PyTuple_SET_ITEM(result, 1, THPVariable_Wrap(std::move(outputs.max_logits)));
  PyTuple_SET_ITEM(result, 2, THPVariable_Wrap(std::move(outputs.lse)));
  for (Py_ssize_t i = 0; i < 3; ++i) {
    if (PyTuple_GET_ITEM(result, i) == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
  }
  return result;
}

// Raises, as a Python exception, the error a TVM-FFI call just returned (its kind mapped through
// Config::error_kinds, RuntimeError for other kinds); returns nullptr.
PyObject* RaiseFfiError() {
  TVMFFIObjectHandle error = nullptr;
  TVMFFIErrorMoveFromRaised(&error);
  if (error == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "q8kv8: the kernel launch failed");
    return nullptr;
  }
  const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
  const std::string kind(cell->kind.data, cell->kind.size);
  // A Python exception already set (raised by Python code under the call, or a signal) is the error.
  if (!(kind == "EnvErrorAlreadySet" && PyErr_Occurred())) {
    PyErr_Clear();
    PyObject* type = PyExc_RuntimeError;
    PyObject* kinds = registry.config.error_kinds;
    PyObject* found = kinds == nullptr ? nullptr : PyDict_GetItemString(kinds, kind.c_str());
    if (found != nullptr && PyExceptionClass_Check(found)) type = found;
    PyObject* message = PyUnicode_DecodeUTF8(cell->message.data, static_cast<Py_ssize_t>(cell->message.size),
                                             "replace");
    if (message != nullptr) {
      PyErr_SetObject(type, message);
      Py_DECREF(message);
    }
  }
  TVMFFIObjectDecRef(error);
  return nullptr;
}

void SetTensor(TVMFFIAny* any, const DLTensor* t) {
  // DLTensor* is how TVM-FFI passes a borrowed tensor view (kTVMFFIDLTensorPtr); the callee only reads it.
  any->type_index = kTVMFFIDLTensorPtr;
  any->zero_padding = 0;
  any->v_ptr = const_cast<DLTensor*>(t);
}

// Calls `function` (held for the call: Python code under it, a Python-defined variant, may let another thread
// reset()); returns TVM-FFI's status.
int CallFunction(TVMFFIObjectHandle function, TVMFFIAny* args, int32_t num_args) {
  TVMFFIObjectIncRef(function);
  TVMFFIAny result = {};
  result.type_index = kTVMFFINone;
  const int status = TVMFFIFunctionCall(function, args, num_args, &result);
  TVMFFIObjectDecRef(function);
  if (status == 0 && result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
  return status;
}

// Rows [first, first + count) of a tensor's first dimension: a view of `t` (same strides) with its own
// shape, valid while `t`'s tensor is alive.
struct RowsView {
  DLTensor tensor;
  int64_t shape[3];
};

void ViewRows(const DLTensor& t, int64_t first, int64_t count, RowsView* rows) {
  rows->tensor = t;
  std::copy(t.shape, t.shape + t.ndim, rows->shape);
  rows->shape[0] = count;
  rows->tensor.shape = rows->shape;
  rows->tensor.data = static_cast<char*>(t.data) + first * Stride(t, 0) * ((t.dtype.bits + 7) / 8);
}

// Calls `variant` with the Python path's arguments on tokens [first, first + count) of the call
// (kernels.launch_sparse_prefill), `schedule_count` its tiles per CTA or parts. Returns TVM-FFI's status.
int CallVariant(const Views& v, const Plan& plan, TVMFFIObjectHandle variant, int64_t first, int64_t count,
                int64_t schedule_count) {
  // A row-scaled q has no q_scale: the kernel does not read that argument, which gets kv_scale. An absent
  // topk_length / attn_sink is passed as a view of the call's own one-element scales (q_scale's bytes as
  // int32, or kv_scale's without a q_scale; kv_scale), never read (the flags say absent): nothing is
  // allocated or kept per call, so a launch under CUDA graph capture leaves no allocation behind
  // (kernels.placeholders).
  const DLTensor& q_scale = v.has_q_scale ? v.q_scale : v.kv_scale;
  DLTensor no_topk_length = q_scale;
  no_topk_length.dtype = {kDLInt, 32, 1};
  const DLTensor* sink = v.has_sink ? &v.attn_sink : &v.kv_scale;
  const bool all = first == 0 && count == v.q.shape[0];
  RowsView q, indices, topk_length, out, max_logits, lse;
  const DLTensor* per_token[] = {&v.q, &v.indices, v.has_topk_length ? &v.topk_length : &no_topk_length,
                                 &v.out, &v.max_logits, &v.lse};
  if (!all) {  // a split tail's launch: its tokens' rows
    RowsView* views[] = {&q, &indices, &topk_length, &out, &max_logits, &lse};
    for (size_t i = 0; i < 6; ++i) {
      if (per_token[i] == &no_topk_length) continue;
      ViewRows(*per_token[i], first, count, views[i]);
      per_token[i] = &views[i]->tensor;
    }
  }
  TVMFFIAny args[13] = {};
  SetTensor(&args[0], per_token[0]);
  SetTensor(&args[1], &v.kv);
  SetTensor(&args[2], per_token[1]);
  SetTensor(&args[3], per_token[2]);
  SetTensor(&args[4], sink);
  SetTensor(&args[5], &q_scale);
  SetTensor(&args[6], &v.kv_scale);
  SetTensor(&args[7], per_token[3]);
  SetTensor(&args[8], per_token[4]);
  SetTensor(&args[9], per_token[5]);
  args[10].type_index = kTVMFFIFloat;
  args[10].v_float64 = plan.logit_scale;
  args[11].type_index = kTVMFFIInt;
  // A split tail's two launches overlap (the flag tells both).
  args[11].v_int64 = plan.flags | (plan.split_from > 0 ? registry.config.split_tail_flag : 0);
  args[12].type_index = kTVMFFIInt;
  args[12].v_int64 = schedule_count;
  return CallFunction(variant, args, 13);
}

// Launches the plan's variants (a split tail: the one-tile one on the tokens before split_from, then the
// split one on the others), on `stream` (set as TVM-FFI's environment stream of q's device for the call
// when set_stream). Returns nullptr with a Python exception set when a launch raised, else Py_None
// (borrowed).
PyObject* Run(const Views& v, const Plan& plan, bool set_stream, void* stream) {
  const DLDevice device = v.q.device;
  TVMFFIStreamHandle previous = nullptr;
  if (set_stream && TVMFFIEnvSetStream(device.device_type, device.device_id, stream, &previous) != 0) {
    return RaiseFfiError();
  }
  const int64_t s_q = v.q.shape[0];
  int status = 0;
  if (plan.split_from > 0) {
    // Held across both launches: Python code under the first (a Python-defined variant) may let another
    // thread reset().
    TVMFFIObjectIncRef(plan.split_variant);
    status = CallVariant(v, plan, plan.variant, 0, plan.split_from, 1);
    if (status == 0) {
      status = CallVariant(v, plan, plan.split_variant, plan.split_from, s_q - plan.split_from, plan.splits);
    }
    TVMFFIObjectDecRef(plan.split_variant);
  } else {
    // schedule_count: tiles per CTA, or parts
    status = CallVariant(v, plan, plan.variant, 0, s_q, plan.tiles == 0 ? plan.splits : plan.tiles);
  }
  PyObject* raised = status == 0 ? Py_None : RaiseFfiError();
  if (set_stream && TVMFFIEnvSetStream(device.device_type, device.device_id, previous, nullptr) != 0) {
    if (raised != nullptr) return RaiseFfiError();
    TVMFFIObjectHandle error = nullptr;  // the launch's error is the one raised; drop the restore's
    TVMFFIErrorMoveFromRaised(&error);
    if (error != nullptr) TVMFFIObjectDecRef(error);
  }
  return raised;
}

// ---------------------------------------------------------------------------------------------------
// The module's functions
// ---------------------------------------------------------------------------------------------------

// Whether `call` may be read as a PrefillCall (a tuple of its fields' count), else a TypeError; anything
// passes while not configured (Inspect then declines).
bool IsCall(PyObject* call) {
  const Config& c = registry.config;
  if (!c.configured || (PyTuple_Check(call) && PyTuple_GET_SIZE(call) == c.num_fields)) return true;
  PyErr_SetString(PyExc_TypeError, "expected a q8kv8.prefill_call.PrefillCall");
  return false;
}

PyObject* Launch(PyObject* /*module*/, PyObject* call) {
  if (!IsCall(call)) return nullptr;
  Views v;
  const Plan plan = Inspect(call, &v);
  if (plan.tiles == kDeclined) Py_RETURN_NONE;

  HANDLE_TH_ERRORS  // an allocation that fails raises torch's error (torch.OutOfMemoryError)
  Outputs outputs;
  if (!v.has_outputs) {
    outputs = AllocateOutputs(*v.q_tensor, registry.config.d_v);
    if (!FillDLTensor(outputs.out, &v.out) || !FillDLTensor(outputs.max_logits, &v.max_logits) ||
        !FillDLTensor(outputs.lse, &v.lse) || !CheckOutputs(v).empty()) {
      Py_RETURN_NONE;
    }
  }
  // The stream TVM-FFI would set for a torch CUDA tensor: torch's current stream on the device.
  void* stream = nullptr;
  const bool on_cuda = v.q_tensor->is_cuda();
  if (on_cuda) {
    const c10::Device device = v.q_tensor->device();
    stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
  }
  if (Run(v, plan, on_cuda, stream) == nullptr) return nullptr;
  if (!v.has_outputs) return WrapOutputs(std::move(outputs));
  const Config& c = registry.config;
  return PyTuple_Pack(3, PyTuple_GET_ITEM(call, c.field_index[kOut]),
                      PyTuple_GET_ITEM(call, c.field_index[kMaxLogits]), PyTuple_GET_ITEM(call, c.field_index[kLse]));
  END_HANDLE_TH_ERRORS
}

PyObject* PlanCall(PyObject* /*module*/, PyObject* call) {
  if (!IsCall(call)) return nullptr;
  Views v;
  const Plan plan = Inspect(call, &v);
  if (plan.tiles == kDeclined) return PyLong_FromLongLong(kDeclined);
  return Py_BuildValue("(LLL)", static_cast<long long>(plan.tiles), static_cast<long long>(plan.splits),
                       static_cast<long long>(plan.split_from));
}

PyObject* DeclineReason(PyObject* /*module*/, PyObject* call) {
  if (!IsCall(call)) return nullptr;
  Views v;
  const Plan plan = Inspect(call, &v);
  return PyUnicode_FromStringAndSize(plan.declined.data(), static_cast<Py_ssize_t>(plan.declined.size()));
}

PyObject* Allocate(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "allocate(q, d_v) takes 2 arguments (%zd given)", nargs);
    return nullptr;
  }
  const int64_t d_v = PyLong_AsLongLong(args[1]);
  if (d_v == -1 && PyErr_Occurred()) return nullptr;
  if (d_v < 0) {
    PyErr_SetString(PyExc_ValueError, "allocate: d_v must be >= 0");
    return nullptr;
  }
  if (!THPVariable_CheckExact(args[0])) return PyTuple_Pack(3, Py_None, Py_None, Py_None);
  const at::Tensor& q = THPVariable_Unpack(args[0]);
  if (q.dim() != 3) return PyTuple_Pack(3, Py_None, Py_None, Py_None);
  HANDLE_TH_ERRORS
  return WrapOutputs(AllocateOutputs(q, d_v));
  END_HANDLE_TH_ERRORS
}

// configure() helpers: one entry of the constants dict, or a Python exception.
PyObject* Entry(PyObject* constants, const char* name) {
  PyObject* value = PyDict_GetItemString(constants, name);
  if (value == nullptr) PyErr_Format(PyExc_KeyError, "configure: no constant %s", name);
  return value;
}

bool GetInt(PyObject* constants, const char* name, int64_t* out, int64_t minimum) {
  PyObject* value = Entry(constants, name);
  if (value == nullptr) return false;
  *out = PyLong_AsLongLong(value);
  if (*out == -1 && PyErr_Occurred()) return false;
  if (*out < minimum) {
    PyErr_Format(PyExc_ValueError, "configure: %s must be >= %lld", name, static_cast<long long>(minimum));
    return false;
  }
  return true;
}

// A tuple (or list) entry, as a new reference to a tuple.
PyObject* GetSequence(PyObject* constants, const char* name) {
  PyObject* value = Entry(constants, name);
  return value == nullptr ? nullptr : PySequence_Tuple(value);
}

bool Configure(PyObject* constants, Config* c) {
  PyObject* fields = GetSequence(constants, "fields");
  if (fields == nullptr) return false;
  c->num_fields = PyTuple_GET_SIZE(fields);
  for (int f = 0; f < kNumFields; ++f) {
    c->field_index[f] = -1;
    for (Py_ssize_t i = 0; i < c->num_fields; ++i) {
      PyObject* name = PyTuple_GET_ITEM(fields, i);
      if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, kFieldNames[f]) == 0) {
        c->field_index[f] = i;
      }
    }
    if (c->field_index[f] < 0) {
      Py_DECREF(fields);
      PyErr_Format(PyExc_ValueError, "configure: the call has no field %s", kFieldNames[f]);
      return false;
    }
  }
  Py_DECREF(fields);

  for (const auto& [name, values] : {std::pair<const char*, std::vector<int64_t>*>{"supported_d_qk", &c->supported_d_qk},
                                     {"small_head_counts", &c->small_head_counts},
                                     {"split_parts", &c->split_parts},
                                     {"split_cluster_sms", &c->split_cluster_sms}}) {
    PyObject* sequence = GetSequence(constants, name);
    if (sequence == nullptr) return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sequence); ++i) {
      values->push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(sequence, i)));
    }
    Py_DECREF(sequence);
    if (PyErr_Occurred()) return false;
  }

  PyObject* q_dtypes = GetSequence(constants, "q_dtypes");
  if (q_dtypes == nullptr) return false;
  PyObject* row_scaled = GetSequence(constants, "row_scaled_q_dtypes");
  if (row_scaled == nullptr) {
    Py_DECREF(q_dtypes);
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(q_dtypes); ++i) {
    PyObject* dtype = PyTuple_GET_ITEM(q_dtypes, i);
    const DLDataType dl_dtype = THPDtype_Check(dtype) ? DLDtypeOf(reinterpret_cast<THPDtype*>(dtype)->scalar_type)
                                                      : DLDataType{kDLOpaqueHandle, 0, 0};
    if (dl_dtype.code == kDLOpaqueHandle) {
      PyErr_SetString(PyExc_TypeError, "configure: q_dtypes must be torch dtypes the checks read");
      break;
    }
    c->q_dtypes.push_back(dl_dtype);
    const int contains = PySequence_Contains(row_scaled, dtype);
    if (contains < 0) break;
    c->q_row_scaled.push_back(contains == 1);
  }
  Py_DECREF(q_dtypes);
  Py_DECREF(row_scaled);
  if (PyErr_Occurred()) return false;
  if (c->q_dtypes.empty()) {
    PyErr_SetString(PyExc_ValueError, "configure: q_dtypes must not be empty");
    return false;
  }

  PyObject* precisions = GetSequence(constants, "precisions");
  if (precisions == nullptr) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(precisions); ++i) {
    PyObject* name = PyTuple_GET_ITEM(precisions, i);
    if (!PyUnicode_Check(name)) {
      PyErr_SetString(PyExc_TypeError, "configure: precisions must be str");
      break;
    }
    Py_INCREF(name);
    c->precisions.push_back(name);
  }
  Py_DECREF(precisions);
  if (PyErr_Occurred()) return false;

  PyObject* log2_e = Entry(constants, "log2_e");
  if (log2_e == nullptr) return false;
  c->log2_e = PyFloat_AsDouble(log2_e);
  if (PyErr_Occurred()) return false;

  PyObject* error_kinds = Entry(constants, "error_kinds");
  if (error_kinds == nullptr) return false;
  if (!PyDict_Check(error_kinds)) {
    PyErr_SetString(PyExc_TypeError, "configure: error_kinds must be a dict");
    return false;
  }
  Py_INCREF(error_kinds);
  c->error_kinds = error_kinds;

  return GetInt(constants, "d_v", &c->d_v, 1) && GetInt(constants, "head_alignment", &c->head_alignment, 1) &&
         GetInt(constants, "topk_alignment", &c->topk_alignment, 1) &&
         GetInt(constants, "q_alignment_bytes", &c->q_alignment_bytes, 1) &&
         GetInt(constants, "kv_row_alignment_bytes", &c->kv_row_alignment_bytes, 1) &&
         GetInt(constants, "out_alignment_bytes", &c->out_alignment_bytes, 1) &&
         GetInt(constants, "topk_length_flag", &c->topk_length_flag, 1) &&
         GetInt(constants, "sink_flag", &c->sink_flag, 1) &&
         GetInt(constants, "split_tail_flag", &c->split_tail_flag, 1) &&
         GetInt(constants, "persistent_max_topk", &c->persistent_max_topk, 0) &&
         GetInt(constants, "persistent_max_tiles_per_cta", &c->persistent_max_tiles_per_cta, 0) &&
         GetInt(constants, "small_head_max_tiles_per_cta", &c->small_head_max_tiles_per_cta, 1) &&
         GetInt(constants, "small_head_split_min_parts", &c->small_head_split_min_parts, 2) &&
         GetInt(constants, "persistent_min_waves", &c->persistent_min_waves, 1) &&
         GetInt(constants, "split_min_slots", &c->split_min_slots, 1) &&
         GetInt(constants, "split_tail_min_topk", &c->split_tail_min_topk, 0);
}

// configure(constants): forgets every device and variant, and takes the constants the checks read.
PyObject* ConfigureCall(PyObject* /*module*/, PyObject* constants) {
  if (!PyDict_Check(constants)) {
    PyErr_SetString(PyExc_TypeError, "configure takes a dict of constants");
    return nullptr;
  }
  ReleaseAll();
  if (!Configure(constants, &registry.config)) {
    ReleaseAll();
    return nullptr;
  }
  const Config& c = registry.config;
  registry.variants.assign(c.q_dtypes.size() * c.supported_d_qk.size() * c.precisions.size() * kScheduleKinds *
                               (1 + c.small_head_counts.size()),
                           nullptr);
  registry.config.configured = true;
  Py_RETURN_NONE;
}

// reset(): forgets every device, variant and constant; nothing is taken until configure() again.
PyObject* Reset(PyObject* /*module*/, PyObject* /*unused*/) {
  ReleaseAll();
  Py_RETURN_NONE;
}

// register_device(device_type, device_id, sm_count): a device (DLPack's type and id) launches may run on.
PyObject* RegisterDevice(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "register_device(device_type, device_id, sm_count) takes 3 arguments");
    return nullptr;
  }
  const long long type = PyLong_AsLongLong(args[0]);
  const long long id = PyLong_AsLongLong(args[1]);
  const long long sm_count = PyLong_AsLongLong(args[2]);
  if (PyErr_Occurred()) return nullptr;
  if (!registry.config.configured || sm_count < 1) {
    PyErr_SetString(PyExc_ValueError, "register_device: not configured, or sm_count < 1");
    return nullptr;
  }
  const Device device{static_cast<int32_t>(type), static_cast<int32_t>(id), sm_count};
  for (Device& registered : registry.devices) {
    if (registered.type == device.type && registered.id == device.id) {
      registered = device;
      Py_RETURN_NONE;
    }
  }
  registry.devices.push_back(device);
  Py_RETURN_NONE;
}

// Whether `handle` is a TVM-FFI function's object handle, else a TypeError naming `caller`.
bool IsFunctionHandle(void* handle, const char* caller) {
  if (handle != nullptr && TVMFFIObjectGetTypeIndex(handle) == kTVMFFIFunction) return true;
  PyErr_Format(PyExc_TypeError, "%s: handle is not a TVM-FFI function", caller);
  return false;
}

// register_variant(d_qk, precision, schedule_kind, handle, q_dtype, heads): a kernel variant of a schedule kind
// (0 one tile per CTA, 1 persistent, 2 split) for a q of q_dtype (a torch dtype) and tiles of `heads` heads (the
// head alignment, or a small-head count: its persistent variant), the TVM-FFI function whose object handle
// (tvm_ffi.Function.__chandle__()) is `handle`; referenced until replaced or reset.
PyObject* RegisterVariant(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_Format(PyExc_TypeError,
                 "register_variant(d_qk, precision, schedule_kind, handle, q_dtype, heads) takes 6 arguments");
    return nullptr;
  }
  const Config& c = registry.config;
  const long long d_qk = PyLong_AsLongLong(args[0]);
  const long long kind = PyLong_AsLongLong(args[2]);
  void* handle = PyLong_AsVoidPtr(args[3]);
  const long long heads = PyLong_AsLongLong(args[5]);
  if (PyErr_Occurred()) return nullptr;
  const auto d_qk_found = std::find(c.supported_d_qk.begin(), c.supported_d_qk.end(), d_qk);
  size_t precision = c.precisions.size();
  for (size_t i = 0; i < c.precisions.size(); ++i) {
    if (PyUnicode_Check(args[1]) && PyUnicode_Compare(args[1], c.precisions[i]) == 0) precision = i;
  }
  size_t q_dtype = c.q_dtypes.size();
  if (THPDtype_Check(args[4])) {
    const DLDataType dtype = DLDtypeOf(reinterpret_cast<THPDtype*>(args[4])->scalar_type);
    for (size_t i = 0; i < c.q_dtypes.size(); ++i) {
      if (SameDtype(dtype, c.q_dtypes[i])) q_dtype = i;
    }
  }
  const size_t heads_slot = HeadsSlot(heads);
  if (!c.configured || d_qk_found == c.supported_d_qk.end() || precision == c.precisions.size() ||
      q_dtype == c.q_dtypes.size() || kind < 0 || kind >= static_cast<long long>(kScheduleKinds) ||
      (heads_slot == 0 && heads != c.head_alignment) || (heads_slot > 0 && kind != kPersistent)) {
    PyErr_Format(PyExc_ValueError,
                 "register_variant: not configured, or no variant d_qk %lld, precision %R, schedule kind %R, "
                 "q dtype %R, heads %R",
                 d_qk, args[1], args[2], args[4], args[5]);
    return nullptr;
  }
  if (!IsFunctionHandle(handle, "register_variant")) return nullptr;
  const size_t d_qk_index = static_cast<size_t>(d_qk_found - c.supported_d_qk.begin());
  TVMFFIObjectHandle& slot =
      registry.variants[VariantIndex(q_dtype, d_qk_index, precision, static_cast<size_t>(kind), heads_slot)];
  TVMFFIObjectIncRef(handle);
  if (slot != nullptr) TVMFFIObjectDecRef(slot);
  slot = handle;
  Py_RETURN_NONE;
}

#define Q8KV8_METHOD(name, function, flags, doc) \
  {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function)), flags, doc}

PyMethodDef methods[] = {
    Q8KV8_METHOD("launch", Launch, METH_O,
                 "launch(call) -> (out, max_logits, lse), or None when the call is left to the Python path"),
    Q8KV8_METHOD("plan", PlanCall, METH_O,
                 "plan(call) -> (tiles per CTA, splits, split_from) launch(call) would run (tiles 0: one-tile "
                 "kernel, its tokens from split_from on split into `splits` parts when > 1), or -1 (declined)"),
    Q8KV8_METHOD("decline_reason", DeclineReason, METH_O,
                 "decline_reason(call) -> why launch(call) declines, '' when it does not"),
    Q8KV8_METHOD("allocate", Allocate, METH_FASTCALL,
                 "allocate(q, d_v) -> launch's outputs for q, or (None, None, None) unless q is a 3-d torch.Tensor"),
    Q8KV8_METHOD("configure", ConfigureCall, METH_O,
                 "configure(constants): the constants the checks read (forgets every device and variant)"),
    Q8KV8_METHOD("reset", Reset, METH_NOARGS, "reset(): forget every constant, device and variant"),
    Q8KV8_METHOD("register_device", RegisterDevice, METH_FASTCALL,
                 "register_device(device_type, device_id, sm_count)"),
    Q8KV8_METHOD("register_variant", RegisterVariant, METH_FASTCALL,
                 "register_variant(d_qk, precision, schedule_kind, handle, q_dtype, heads)"),
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_q8kv8_native", nullptr, -1, methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__q8kv8_native() { return PyModule_Create(&module_def); }
