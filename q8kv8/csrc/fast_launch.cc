// q8kv8 fast launch: the input contract's common case, checked in C++, and the kernel launched
// (q8kv8/fast_launch.py builds this file with the system c++ and explains when it is used).
//
// Two ways in, one set of checks (Check) and one launch (Run):
// - the C interface of fast_launch_c_api.h, which q8kv8/csrc/fast_call.cc (a CPython extension) calls
//   with DLPack views it fills from the torch tensors of a call: the per-call path;
// - q8kv8_fast_launch, one TVM-FFI call from Python with the public call's arguments as they are: the
//   path when fast_call.cc could not be built (and what the tests drive).
// Either launches the kernel variant the Python path would launch, with the same arguments, and returns
// the schedule it ran (tiles per CTA, 0 for the one-tile kernel), or declines without launching anything,
// so that the Python path (q8kv8/contract.py) takes the call: for every invalid call (and its message),
// and for every valid one outside the common case (head padding, copies for alignment, empty extents,
// optional buffers, an unregistered device, scalars of other Python types). It is therefore stricter than
// the contract, never looser: each check below is one of the contract's, or narrower.
//
// Every function here runs with the GIL held (q8kv8.fast_launch sets release_gil = False; fast_call.cc
// keeps it), so the registry below is never read and written at once.
//
// q8kv8_fast_plan runs the same checks and returns what q8kv8_fast_launch would (the tests compare it
// with the Python contract); nothing is launched.

#include "fast_launch_c_api.h"

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <optional>
#include <vector>

namespace {

using tvm::ffi::AnyView;
using tvm::ffi::Function;
using tvm::ffi::String;

constexpr int64_t kNotTaken = -1;
constexpr int64_t kHeadAlignment = 64;
constexpr int64_t kTopkAlignment = 128;
constexpr int64_t kDv = 512;

// What a registered device holds: the multiprocessor count the schedule reads.
struct Device {
  int32_t type;
  int32_t id;
  int64_t sm_count;
};

// Set by q8kv8_fast_configure from q8kv8's Python constants (one source of truth).
struct Config {
  bool configured = false;
  double log2_e = 0.0;
  int64_t q_alignment_bytes = 0;
  int64_t kv_row_alignment_bytes = 0;
  int64_t out_alignment_bytes = 0;
  int64_t persistent_max_topk = 0;
  int64_t persistent_max_tiles_per_cta = 0;
  int64_t persistent_min_waves = 0;
  bool persistent_precision[2] = {false, false};
};

struct Registry {
  Config config;
  std::vector<Device> devices;
  Function variants[2][2][2];  // [d_qk 512, 576][precision default, accurate][persistent]
};

// Never destroyed: what it holds (torch tensors, TVM-FFI functions) may need the Python interpreter to be
// released, which is gone when static destructors run; q8kv8.fast_launch empties it at exit instead.
Registry& registry = *new Registry();
thread_local bool t_in_launch = false;

const DLTensor* AsTensor(const AnyView& value) {
  const TVMFFIAny* raw = reinterpret_cast<const TVMFFIAny*>(&value);
  if (raw->type_index == tvm::ffi::TypeIndex::kTVMFFIDLTensorPtr) {
    return static_cast<const DLTensor*>(raw->v_ptr);
  }
  if (raw->type_index == tvm::ffi::TypeIndex::kTVMFFITensor) {
    return TVMFFITensorGetDLTensorPtr(raw->v_obj);
  }
  return nullptr;
}

bool IsNone(const AnyView& value) {
  return reinterpret_cast<const TVMFFIAny*>(&value)->type_index == tvm::ffi::TypeIndex::kTVMFFINone;
}

bool HasDtype(const DLTensor* t, uint8_t code, uint8_t bits) {
  return t->dtype.code == code && t->dtype.bits == bits && t->dtype.lanes == 1;
}

int64_t Stride(const DLTensor* t, int dim) {
  if (t->strides != nullptr) return t->strides[dim];
  int64_t stride = 1;  // compact row-major
  for (int i = t->ndim - 1; i > dim; --i) stride *= t->shape[i];
  return stride;
}

uintptr_t Address(const DLTensor* t) { return reinterpret_cast<uintptr_t>(t->data) + t->byte_offset; }

// Tensor.is_contiguous(): size-1 dims may have any stride, a tensor with no elements is contiguous.
bool IsContiguous(const DLTensor* t) {
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] == 0) return true;
  }
  int64_t expected = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    if (t->shape[i] != 1) {
      if (Stride(t, i) != expected) return false;
      expected *= t->shape[i];
    }
  }
  return true;
}

// The half-open byte interval a tensor's elements may touch (contract._span); empty when it has none.
struct Span {
  uintptr_t start;
  uintptr_t end;
};

Span SpanOf(const DLTensor* t) {
  int64_t last = 0;
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] == 0) return {0, 0};
    last += (t->shape[i] - 1) * Stride(t, i);
  }
  uintptr_t start = Address(t);
  return {start, start + static_cast<uintptr_t>((last + 1) * ((t->dtype.bits + 7) / 8))};
}

bool Overlap(const Span& a, const Span& b) {
  return a.start != a.end && b.start != b.end && a.start < b.end && b.start < a.end;
}

int64_t TilesPerCta(int64_t num_tiles, int64_t topk, bool has_topk_length, int precision,
                    int64_t sm_count) {
  // schedule.tiles_per_cta, on the constants q8kv8_fast_configure received.
  if (!registry.config.persistent_precision[precision] ||
      !(has_topk_length || topk <= registry.config.persistent_max_topk)) {
    return 0;
  }
  int64_t tiles = std::min(registry.config.persistent_max_tiles_per_cta,
                           num_tiles / (registry.config.persistent_min_waves * sm_count));
  return tiles >= 2 ? tiles : 0;
}

using Plan = Q8kv8Plan;

Plan Declined(const char* reason) {
  Plan plan{};
  plan.schedule = kNotTaken;
  plan.declined = reason;
  return plan;
}

// The outputs' checks (contract._check_signatures, _check_no_overlap, Problem.launch_ready for out):
// nullptr when they pass, else why not.
const char* CheckOutputs(const Q8kv8Call& call) {
  const DLTensor* q = call.q;
  const DLTensor* out = call.out;
  const DLTensor* max_logits = call.max_logits;
  const DLTensor* lse = call.lse;
  if (!out || !max_logits || !lse) return "a required tensor argument is not a tensor (or an output buffer is absent)";
  const int64_t s_q = q->shape[0], h_q = q->shape[1];
  if (out->ndim != 3 || out->shape[0] != s_q || out->shape[1] != h_q || out->shape[2] != kDv ||
      !HasDtype(out, kDLBfloat, 16) || !IsContiguous(out)) {
    return "out is not a contiguous [s_q, h_q, 512] bfloat16 tensor";
  }
  for (const DLTensor* row_stats : {max_logits, lse}) {
    if (row_stats->ndim != 2 || row_stats->shape[0] != s_q || row_stats->shape[1] != h_q ||
        !HasDtype(row_stats, kDLFloat, 32) || !IsContiguous(row_stats)) {
      return "max_logits or lse is not a contiguous [s_q, h_q] float32 tensor";
    }
  }

  // No output shares memory with another output or an input (contract._check_no_overlap).
  const Span outputs[3] = {SpanOf(out), SpanOf(max_logits), SpanOf(lse)};
  Span inputs[7] = {SpanOf(q), SpanOf(call.kv), SpanOf(call.indices), SpanOf(call.q_scale),
                    SpanOf(call.kv_scale), {0, 0}, {0, 0}};
  if (call.attn_sink) inputs[5] = SpanOf(call.attn_sink);
  if (call.topk_length) inputs[6] = SpanOf(call.topk_length);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < i; ++j) {
      if (Overlap(outputs[i], outputs[j])) return "two output buffers overlap";
    }
    for (const Span& input : inputs) {
      if (Overlap(outputs[i], input)) return "an output buffer overlaps an input";
    }
  }
  for (const DLTensor* t : {out, max_logits, lse}) {
    if (t->device.device_type != q->device.device_type || t->device.device_id != q->device.device_id) {
      return "the tensors are on more than one device";
    }
  }
  if (Address(out) % registry.config.out_alignment_bytes != 0) {
    return "q, kv or out does not meet the launch's alignment";
  }
  return nullptr;
}

// Every check, on the call's DLPack views; the outputs' only when given (all three, or the caller
// allocates them and launch() checks them).
Plan Check(const Q8kv8Call& call) {
  if (!registry.config.configured) return Declined("not configured");
  const DLTensor* q = call.q;
  const DLTensor* kv = call.kv;
  const DLTensor* indices = call.indices;
  const DLTensor* attn_sink = call.attn_sink;
  const DLTensor* topk_length = call.topk_length;
  const bool has_sink = attn_sink != nullptr;
  const bool has_topk_length = topk_length != nullptr;
  const bool outputs_given = call.out || call.max_logits || call.lse;
  if (!q || !kv || !indices || !call.q_scale || !call.kv_scale) {
    return Declined("a required tensor argument is not a tensor (or an output buffer is absent)");
  }
  if (!std::isfinite(call.sm_scale)) return Declined("sm_scale is not a finite Python float");
  if (call.precision != 0 && call.precision != 1) return Declined("precision is not 'default' or 'accurate'");

  // Ranks, dtypes, shapes (contract._check_signatures), in the common case: no head padding, no empty
  // extent.
  if (q->ndim != 3 || kv->ndim != 3 || indices->ndim != 3) return Declined("q, kv or indices is not 3-D");
  if (!HasDtype(q, kDLFloat8_e4m3fn, 8) || !HasDtype(kv, kDLFloat8_e4m3fn, 8) ||
      !HasDtype(indices, kDLInt, 32)) {
    return Declined("q, kv or indices has another dtype");
  }
  if (Stride(q, 2) != 1 || Stride(kv, 2) != 1 || Stride(indices, 2) != 1) {
    return Declined("q, kv or indices has a strided last dimension");
  }
  const int64_t s_q = q->shape[0], h_q = q->shape[1], d_qk = q->shape[2];
  const int64_t s_kv = kv->shape[0], topk = indices->shape[2];
  if (s_q < 1 || s_kv < 1 || h_q < 1 || h_q % kHeadAlignment != 0) {
    return Declined("s_q, s_kv or h_q is 0, or h_q needs padding to a multiple of 64");
  }
  if (kv->shape[1] != 1 || (d_qk != 512 && d_qk != 576) || kv->shape[2] != d_qk) {
    return Declined("kv's shape does not match q's");
  }
  if (indices->shape[0] != s_q || indices->shape[1] != 1) return Declined("indices' shape does not match q's");
  if (topk <= 0 || topk % kTopkAlignment != 0) return Declined("topk is not a positive multiple of 128");
  for (const DLTensor* scale : {call.q_scale, call.kv_scale}) {
    if (scale->ndim != 1 || scale->shape[0] != 1 || !HasDtype(scale, kDLFloat, 32)) {
      return Declined("q_scale or kv_scale is not a 1-D one-element float32 tensor");
    }
  }
  if (has_sink && (attn_sink->ndim != 1 || attn_sink->shape[0] != h_q ||
                   !HasDtype(attn_sink, kDLFloat, 32) || !IsContiguous(attn_sink))) {
    return Declined("attn_sink is not a contiguous [h_q] float32 tensor");
  }
  if (has_topk_length && (topk_length->ndim != 1 || topk_length->shape[0] != s_q ||
                          !HasDtype(topk_length, kDLInt, 32) || !IsContiguous(topk_length))) {
    return Declined("topk_length is not a contiguous [s_q] int32 tensor");
  }
  if (outputs_given) {
    if (const char* reason = CheckOutputs(call)) return Declined(reason);
  }

  // One device for all, registered (a CUDA SM90 device the Python path has launched on).
  const DLDevice device = q->device;
  for (const DLTensor* t : {kv, indices, call.q_scale, call.kv_scale, attn_sink, topk_length}) {
    if (t && (t->device.device_type != device.device_type || t->device.device_id != device.device_id)) {
      return Declined("the tensors are on more than one device");
    }
  }
  const Device* registered_device = nullptr;
  for (const Device& registered : registry.devices) {
    if (registered.type == device.device_type && registered.id == device.device_id) {
      registered_device = &registered;
      break;
    }
  }
  if (!registered_device) return Declined("the device is not registered");

  // The launch's layout needs (contract.Problem.launch_ready): else the Python path copies.
  if (Address(q) % registry.config.q_alignment_bytes != 0 || !IsContiguous(q) ||
      Address(kv) % registry.config.kv_row_alignment_bytes != 0 ||
      Stride(kv, 0) % registry.config.kv_row_alignment_bytes != 0) {
    return Declined("q, kv or out does not meet the launch's alignment");
  }

  const int64_t tiles = TilesPerCta(s_q * (h_q / kHeadAlignment), topk, has_topk_length, call.precision,
                                    registered_device->sm_count);
  const Function& variant = registry.variants[d_qk == 576][call.precision][tiles > 0];
  if (variant == nullptr) return Declined("the kernel variant is not registered");
  Plan plan{};
  plan.variant = &variant;
  plan.device = registered_device;
  plan.schedule = tiles;
  plan.logit_scale = call.sm_scale * registry.config.log2_e;
  plan.flags = (has_topk_length ? 1 : 0) | (has_sink ? 2 : 0);
  plan.outputs_checked = outputs_given ? 1 : 0;
  plan.declined = "";
  return plan;
}

// The call's TVM-FFI arguments as a Q8kv8Call (tensors as DLPack views), or why not.
const char* FromAnyViews(Q8kv8Call* call, const AnyView& q, const AnyView& kv, const AnyView& indices,
                         const AnyView& sm_scale_arg, const AnyView& q_scale, const AnyView& kv_scale,
                         const AnyView& d_v_arg, const AnyView& attn_sink, const AnyView& topk_length,
                         const AnyView& out, const AnyView& max_logits, const AnyView& lse,
                         const AnyView& precision_arg) {
  call->q = AsTensor(q);
  call->kv = AsTensor(kv);
  call->indices = AsTensor(indices);
  call->q_scale = AsTensor(q_scale);
  call->kv_scale = AsTensor(kv_scale);
  call->out = AsTensor(out);
  call->max_logits = AsTensor(max_logits);
  call->lse = AsTensor(lse);
  if (!call->q || !call->kv || !call->indices || !call->q_scale || !call->kv_scale || !call->out ||
      !call->max_logits || !call->lse) {
    return "a required tensor argument is not a tensor (or an output buffer is absent)";
  }
  call->attn_sink = IsNone(attn_sink) ? nullptr : AsTensor(attn_sink);
  call->topk_length = IsNone(topk_length) ? nullptr : AsTensor(topk_length);
  if ((!IsNone(attn_sink) && !call->attn_sink) || (!IsNone(topk_length) && !call->topk_length)) {
    return "attn_sink or topk_length is not a tensor";
  }

  // Scalars: exactly the Python types the common case uses (a float, the int 512, a str).
  const TVMFFIAny* sm_scale = reinterpret_cast<const TVMFFIAny*>(&sm_scale_arg);
  const TVMFFIAny* d_v = reinterpret_cast<const TVMFFIAny*>(&d_v_arg);
  if (sm_scale->type_index != tvm::ffi::TypeIndex::kTVMFFIFloat) return "sm_scale is not a Python float";
  call->sm_scale = sm_scale->v_float64;
  if (d_v->type_index != tvm::ffi::TypeIndex::kTVMFFIInt || d_v->v_int64 != kDv) {
    return "d_v is not the Python int 512";
  }
  std::optional<String> precision_name = precision_arg.as<String>();
  if (!precision_name) return "precision is not a str";
  if (*precision_name == "default") {
    call->precision = 0;
  } else if (*precision_name == "accurate") {
    call->precision = 1;
  } else {
    return "precision is not 'default' or 'accurate'";
  }
  return nullptr;
}

Plan CheckAnyViews(const AnyView& q, const AnyView& kv, const AnyView& indices, const AnyView& sm_scale,
                   const AnyView& q_scale, const AnyView& kv_scale, const AnyView& d_v,
                   const AnyView& attn_sink, const AnyView& topk_length, const AnyView& out,
                   const AnyView& max_logits, const AnyView& lse, const AnyView& precision,
                   Q8kv8Call* call) {
  if (const char* reason = FromAnyViews(call, q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink,
                                        topk_length, out, max_logits, lse, precision)) {
    return Declined(reason);
  }
  return Check(*call);
}

// Calls plan's variant with the Python path's arguments (tensors as DLPack views).
void Run(const Q8kv8Call& call, const Plan& plan) {
  // DLTensor* is how TVM-FFI passes a borrowed tensor view (kTVMFFIDLTensorPtr); the callee only reads it.
  auto view = [](const DLTensor* t) { return AnyView(const_cast<DLTensor*>(t)); };
  // An absent topk_length / attn_sink is passed as a view of the call's own one-element scales (q_scale's
  // bytes as int32, kv_scale), never read (the flags say absent): nothing is allocated or kept per device,
  // so a launch under CUDA graph capture leaves no allocation behind (kernels.placeholders).
  DLTensor no_topk_length = *call.q_scale;
  no_topk_length.dtype = {kDLInt, 32, 1};
  const AnyView topk_length = view(call.topk_length ? call.topk_length : &no_topk_length);
  const AnyView attn_sink = view(call.attn_sink ? call.attn_sink : call.kv_scale);
  (*static_cast<const Function*>(plan.variant))(
      view(call.q), view(call.kv), view(call.indices), topk_length, attn_sink, view(call.q_scale),
      view(call.kv_scale), view(call.out), view(call.max_logits), view(call.lse), plan.logit_scale, plan.flags,
      plan.schedule == 0 ? int64_t{1} : plan.schedule);
}

// The error the last C-API launch of this thread raised, until q8kv8_fast_rethrow raises it.
thread_local std::optional<tvm::ffi::Error> t_launch_error;

void CPlan(const Q8kv8Call* call, Q8kv8Plan* plan) { *plan = Check(*call); }

int32_t CLaunch(const Q8kv8Call* call, const Q8kv8Plan* plan, int32_t set_stream, void* stream) {
  if (plan->schedule == kNotTaken) return 1;
  if (!plan->outputs_checked && CheckOutputs(*call) != nullptr) return 1;
  const DLDevice device = call->q->device;
  TVMFFIStreamHandle previous = nullptr;
  bool stream_set = false;
  int32_t result = 0;
  try {
    if (set_stream) {
      TVM_FFI_CHECK_SAFE_CALL(TVMFFIEnvSetStream(device.device_type, device.device_id, stream, &previous));
      stream_set = true;
    }
    Run(*call, *plan);
  } catch (const tvm::ffi::Error& error) {
    t_launch_error = error;
    result = -1;
  } catch (const std::exception& error) {
    t_launch_error = tvm::ffi::Error("RuntimeError", error.what(), "");
    result = -1;
  }
  if (stream_set) TVMFFIEnvSetStream(device.device_type, device.device_id, previous, nullptr);
  return result;
}

const Q8kv8FastCApi c_api = {Q8KV8_FAST_C_API_VERSION, &CPlan, &CLaunch};

}  // namespace

// The Python constants the checks and the schedule read (q8kv8.metadata, q8kv8.schedule).
void q8kv8_fast_configure(double log2_e, int64_t q_alignment_bytes, int64_t kv_row_alignment_bytes,
                          int64_t out_alignment_bytes, int64_t persistent_max_topk,
                          int64_t persistent_max_tiles_per_cta, int64_t persistent_min_waves,
                          bool persistent_default, bool persistent_accurate) {
  registry.config.log2_e = log2_e;
  registry.config.q_alignment_bytes = q_alignment_bytes;
  registry.config.kv_row_alignment_bytes = kv_row_alignment_bytes;
  registry.config.out_alignment_bytes = out_alignment_bytes;
  registry.config.persistent_max_topk = persistent_max_topk;
  registry.config.persistent_max_tiles_per_cta = persistent_max_tiles_per_cta;
  registry.config.persistent_min_waves = persistent_min_waves;
  registry.config.persistent_precision[0] = persistent_default;
  registry.config.persistent_precision[1] = persistent_accurate;
  registry.config.configured = true;
}

// A compiled kernel variant (the TVM-FFI function the Python path calls).
void q8kv8_fast_register_variant(int64_t d_qk, bool accurate, bool persistent, Function function) {
  if (d_qk != 512 && d_qk != 576) TVM_FFI_THROW(ValueError) << "d_qk " << d_qk;
  registry.variants[d_qk == 576][accurate][persistent] = std::move(function);
}

// A device the fast path may launch on, with its multiprocessor count.
void q8kv8_fast_register_device(int64_t device_type, int64_t device_id, int64_t sm_count) {
  const Device device{static_cast<int32_t>(device_type), static_cast<int32_t>(device_id), sm_count};
  for (Device& registered : registry.devices) {
    if (registered.type == device.type && registered.id == device.id) {
      registered = device;
      return;
    }
  }
  registry.devices.push_back(device);
}

// Forget every device, variant and constant: the fast path takes no call until configured again.
void q8kv8_fast_reset() {
  registry.config = Config();
  registry.devices.clear();
  for (auto& by_precision : registry.variants) {
    for (auto& by_schedule : by_precision) {
      for (Function& variant : by_schedule) variant = Function();
    }
  }
}

int64_t q8kv8_fast_plan(AnyView q, AnyView kv, AnyView indices, AnyView sm_scale, AnyView q_scale,
                        AnyView kv_scale, AnyView d_v, AnyView attn_sink, AnyView topk_length,
                        AnyView out, AnyView max_logits, AnyView lse, AnyView precision) {
  Q8kv8Call call{};
  return CheckAnyViews(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, out,
                       max_logits, lse, precision, &call)
      .schedule;
}

int64_t q8kv8_fast_launch(AnyView q, AnyView kv, AnyView indices, AnyView sm_scale, AnyView q_scale,
                          AnyView kv_scale, AnyView d_v, AnyView attn_sink, AnyView topk_length,
                          AnyView out, AnyView max_logits, AnyView lse, AnyView precision) {
  Q8kv8Call call{};
  const Plan plan = CheckAnyViews(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length,
                                  out, max_logits, lse, precision, &call);
  if (plan.schedule == kNotTaken) return kNotTaken;
  // Set until the variant returns: an error raised by the launch itself is then told apart from one raised
  // before this function ran (a tensor TVM-FFI could not convert), which the Python path should take.
  // TVM-FFI has set the call's stream (torch's current one) for this outer call.
  t_in_launch = true;
  Run(call, plan);
  t_in_launch = false;
  return plan.schedule;
}

// Why q8kv8_fast_launch would decline these arguments ("" when it would take them): for diagnostics.
String q8kv8_fast_decline_reason(AnyView q, AnyView kv, AnyView indices, AnyView sm_scale, AnyView q_scale,
                                 AnyView kv_scale, AnyView d_v, AnyView attn_sink, AnyView topk_length,
                                 AnyView out, AnyView max_logits, AnyView lse, AnyView precision) {
  Q8kv8Call call{};
  return String(CheckAnyViews(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, out,
                              max_logits, lse, precision, &call)
                    .declined);
}

// Whether the last q8kv8_fast_launch of this thread raised from inside the kernel variant (and clears it).
bool q8kv8_fast_take_launch_error() {
  const bool in_launch = t_in_launch;
  t_in_launch = false;
  return in_launch;
}

// The address of the C interface (fast_launch_c_api.h) that q8kv8/csrc/fast_call.cc calls.
int64_t q8kv8_fast_c_api() { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&c_api)); }

// Raises the error the last C-interface launch of this thread kept (and forgets it); returns when none.
void q8kv8_fast_rethrow() {
  if (!t_launch_error) return;
  tvm::ffi::Error error = std::move(*t_launch_error);
  t_launch_error.reset();
  throw error;
}
