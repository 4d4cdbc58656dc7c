// q8kv8 fast call: the eager common case of sparse_mla_q8kv8_prefill_fwd from Python to the kernel launch,
// in one CPython call (q8kv8/fast_call.py builds this file against the running torch and explains when it
// is used).
//
// launch(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, out, max_logits, lse,
// precision) reads the torch tensors of a call directly (their TensorImpl: no DLPack conversion), fills
// DLPack views of them, and asks fast_launch.cc's checks (fast_launch_c_api.h) whether the fast path takes
// the call. If so it allocates the outputs when none is given (torch's allocator, as at::empty does),
// launches on torch's current stream and returns (out, max_logits, lse); otherwise it returns None having
// launched and kept nothing, and the Python path takes the call (and raises the contract's message for
// an invalid one). Anything outside what it reads with certainty is declined: a tensor subclass other than
// nn.Parameter, a tensor that is not a plain strided CPU or CUDA TensorImpl (wrappers, Python dispatch,
// negative or conjugate views), scalars of other Python types. An error raised by the launch itself
// propagates as the Python exception TVM-FFI makes of it (through q8kv8_fast_rethrow).
//
// allocate(q, d_v) returns new (out, max_logits, lse) for a plain 3-d torch tensor q ([s_q, h, d_v]
// bfloat16, [s_q, h] float32, [s_q, h] float32 on q's device), else (None, None, None).

#include <Python.h>

#include "fast_launch_c_api.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <cstdint>
#include <exception>
#include <typeinfo>

namespace {

constexpr int64_t kDv = 512;

const Q8kv8FastCApi* g_api = nullptr;  // set by bind(); launch() declines every call until then
PyObject* g_rethrow = nullptr;          // q8kv8_fast_rethrow (a TVM-FFI function)

// The allocator at::empty used on each CUDA device, learned from its first allocation there: an
// allocating call then makes its outputs with at::detail::empty_generic directly (what at::empty reaches
// through the dispatcher, ~0.6 us cheaper per tensor on the GPU host). torch lets the CUDA allocator be
// replaced only before its first allocation, so the learned one stays the current one.
std::array<c10::Allocator*, 64> g_cuda_allocators{};

bool FillDLTensor(const at::Tensor& tensor, DLTensor* view) {
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  // A plain strided tensor only: no wrapper TensorImpl (functorch, functionalisation, nested, sparse),
  // no Python dispatch, no lazy negative or conjugate view (the kernel would read the wrong values).
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
  switch (impl->dtype().toScalarType()) {
    case at::kFloat8_e4m3fn:
      view->dtype = {kDLFloat8_e4m3fn, 8, 1};
      break;
    case at::kInt:
      view->dtype = {kDLInt, 32, 1};
      break;
    case at::kFloat:
      view->dtype = {kDLFloat, 32, 1};
      break;
    case at::kBFloat16:
      view->dtype = {kDLBfloat, 16, 1};
      break;
    default:
      view->dtype = {kDLOpaqueHandle, 0, 0};  // no check accepts it
  }
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

PyObject* Declined() { Py_RETURN_NONE; }

PyObject* launch(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 13) {
    PyErr_Format(PyExc_TypeError, "launch takes the public call's 13 arguments (%zd given)", nargs);
    return nullptr;
  }
  if (g_api == nullptr) return Declined();
  PyObject* const sm_scale = args[3];
  PyObject* const d_v = args[6];
  PyObject* const attn_sink = args[7];
  PyObject* const topk_length = args[8];
  PyObject* const precision = args[12];

  // Scalars: exactly the Python types the common case uses (a float, the int 512, a str).
  if (!PyFloat_CheckExact(sm_scale) || !PyLong_CheckExact(d_v) || !PyUnicode_CheckExact(precision)) {
    return Declined();
  }
  int overflow = 0;
  if (PyLong_AsLongLongAndOverflow(d_v, &overflow) != kDv || overflow != 0) return Declined();
  Q8kv8Call call{};
  call.sm_scale = PyFloat_AS_DOUBLE(sm_scale);
  if (PyUnicode_CompareWithASCIIString(precision, "default") == 0) {
    call.precision = 0;
  } else if (PyUnicode_CompareWithASCIIString(precision, "accurate") == 0) {
    call.precision = 1;
  } else {
    return Declined();
  }

  DLTensor views[10];
  const at::Tensor* q = ReadTensor(args[0], &views[0]);
  if (q == nullptr || !ReadTensor(args[1], &views[1]) || !ReadTensor(args[2], &views[2]) ||
      !ReadTensor(args[4], &views[3]) || !ReadTensor(args[5], &views[4])) {
    return Declined();
  }
  call.q = &views[0];
  call.kv = &views[1];
  call.indices = &views[2];
  call.q_scale = &views[3];
  call.kv_scale = &views[4];
  if (attn_sink != Py_None) {
    if (!ReadTensor(attn_sink, &views[5])) return Declined();
    call.attn_sink = &views[5];
  }
  if (topk_length != Py_None) {
    if (!ReadTensor(topk_length, &views[6])) return Declined();
    call.topk_length = &views[6];
  }
  const bool allocate = args[9] == Py_None && args[10] == Py_None && args[11] == Py_None;
  if (!allocate) {
    if (!ReadTensor(args[9], &views[7]) || !ReadTensor(args[10], &views[8]) || !ReadTensor(args[11], &views[9])) {
      return Declined();
    }
    call.out = &views[7];
    call.max_logits = &views[8];
    call.lse = &views[9];
  }

  Q8kv8Plan plan{};
  g_api->plan(&call, &plan);
  if (plan.schedule < 0) return Declined();

  HANDLE_TH_ERRORS  // an allocation that fails raises torch's error (torch.OutOfMemoryError)
  Outputs outputs;
  if (allocate) {
    outputs = AllocateOutputs(*q, kDv);
    if (!FillDLTensor(outputs.out, &views[7]) || !FillDLTensor(outputs.max_logits, &views[8]) ||
        !FillDLTensor(outputs.lse, &views[9])) {
      return Declined();
    }
    call.out = &views[7];
    call.max_logits = &views[8];
    call.lse = &views[9];
  }
  // The stream TVM-FFI would set for a torch CUDA tensor: torch's current stream on the device.
  void* stream = nullptr;
  const bool on_cuda = q->is_cuda();
  if (on_cuda) {
    const c10::Device device = q->device();
    stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
  }
  const int32_t launched = g_api->launch(&call, &plan, on_cuda ? 1 : 0, stream);
  if (launched == 1) return Declined();
  if (launched != 0) {
    PyObject* raised = g_rethrow != nullptr ? PyObject_CallNoArgs(g_rethrow) : nullptr;
    Py_XDECREF(raised);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "q8kv8: the kernel launch failed");
    return nullptr;
  }
  if (allocate) return WrapOutputs(std::move(outputs));
  return PyTuple_Pack(3, args[9], args[10], args[11]);
  END_HANDLE_TH_ERRORS
}

PyObject* allocate(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
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

PyObject* bind(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "bind(c_api_address, rethrow) takes 2 arguments (%zd given)", nargs);
    return nullptr;
  }
  const auto address = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[0]));
  if (PyErr_Occurred()) return nullptr;
  const auto* api = reinterpret_cast<const Q8kv8FastCApi*>(address);
  if (api != nullptr && api->version != Q8KV8_FAST_C_API_VERSION) {
    PyErr_Format(PyExc_RuntimeError, "bind: the fast launch's C interface is version %d, expected %d",
                 api->version, Q8KV8_FAST_C_API_VERSION);
    return nullptr;
  }
  PyObject* rethrow = args[1] == Py_None ? nullptr : args[1];
  Py_XINCREF(rethrow);
  Py_XSETREF(g_rethrow, rethrow);
  g_api = api;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(launch)), METH_FASTCALL,
     "launch(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, out, max_logits, lse, "
     "precision) -> (out, max_logits, lse), or None when the fast path declines the call"},
    {"allocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(allocate)), METH_FASTCALL,
     "allocate(q, d_v) -> (out, max_logits, lse), or (None, None, None) unless q is a 3-d torch.Tensor"},
    {"bind", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(bind)), METH_FASTCALL,
     "bind(c_api_address, rethrow): the fast launch's C interface (0, None: none)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_q8kv8_fast_call", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__q8kv8_fast_call() { return PyModule_Create(&module_def); }
