// q8kv8's eager fast path: a CPython extension, built against torch and linked to TVM-FFI, that runs the launch
// plans q8kv8.native computes in Python (q8kv8/native.py builds, loads and configures it, and tells the design).
// launch(call) reads a call's arguments (a PrefillCall or a PagedCall: a kind of call each) into a key, takes the
// plan memoised under it (else asks its kind's planner and memoises its plan or kept decline), checks the addresses
// the plan names, allocates absent outputs, launches the plan's TVM-FFI functions on torch's current stream and
// returns the outputs; else None, having launched nothing (the Python path takes the call). No rule of the call is
// written here. All runs with the GIL held; the planner and Python-defined variants may let other threads run,
// hence shared_ptr plans and kinds.

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
#include <bit>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr size_t kMaxFields = 32;  // of a call; and arguments of a launch, tensors and scalars
constexpr int kMaxDims = 8;  // of a tensor read here
constexpr size_t kMaxPlans = 4096;  // memoised before the memo is emptied

// A kernel argument: the call's tensor `field` (or the plan's constant tensor), viewed as `dtype` when retyped, with
// `sizes` and `strides` when given (else its own), a launch's rows when per_token.
struct Argument {
  Py_ssize_t field = -1;  // -1: the constant
  PyObject* constant = nullptr;  // owned by the plan (a torch.Tensor the planner holds for every call)
  DLTensor constant_view{};
  bool retyped = false;
  int per_token = 0;
  DLDataType dtype{};
  int64_t alignment = 1;  // of its address, in bytes (a power of two)
  std::vector<int64_t> sizes, strides;  // empty: the tensor's own
};

struct Launch {  // a TVM-FFI function (owned) on the tokens [first, first + count), with its scalars
  TVMFFIObjectHandle function = nullptr;
  int64_t first = 0, count = 0;
  std::vector<TVMFFIAny> scalars;
};

struct Output {  // a returned output, allocated with `sizes` and `dtype` when the call gives none
  Py_ssize_t field;
  std::vector<int64_t> sizes;
  c10::ScalarType dtype;
};

struct Plan {  // no launches: a declined key
  PyObject* schedule = nullptr;  // what plan(call) returns, owned; a declined key's: why (a str)
  std::vector<Argument> arguments;  // the first one's device runs the launches and gets the allocations
  std::vector<Launch> launches;
  std::vector<Output> outputs;
  ~Plan() {  // with the GIL held (dropped by this module's functions only)
    for (const Launch& launch : launches) TVMFFIObjectDecRef(launch.function);  // never null (Parse)
    for (const Argument& argument : arguments) Py_XDECREF(argument.constant);
    Py_XDECREF(schedule);
  }
};
using PlanPtr = std::shared_ptr<const Plan>;

struct KeyHash {  // keys are strings of words, found by a call's string_view; the first word: the others' hash
  using is_transparent = void;
  size_t operator()(std::string_view key) const { return *reinterpret_cast<const size_t*>(key.data()); }
};

struct Kind {  // a kind of call: its tuple type, fields and planner, and the plans memoised for its keys
  PyObject* type = nullptr;  // owned
  std::vector<std::pair<std::string, int>> fields;  // name, and the extent keyed only as zero or not (or -1)
  PyObject* planner = nullptr;  // owned
  std::unordered_map<std::string, PlanPtr, KeyHash, std::equal_to<>> plans;
};

struct State {  // configured while it has kinds
  std::vector<std::shared_ptr<Kind>> kinds;  // a call holds its kind: configure() may run under its planner
  PyObject* error_kinds = nullptr;  // dict: TVM-FFI error kind -> Python exception type, owned
  uint64_t generation = 0;  // of the configuration and memo: an answer given across a change is not kept
};

// Never destroyed (releasing needs the interpreter, gone when static destructors run): emptied at exit, reset().
State& state = *new State();

void ReleaseAll() {
  for (const auto& kind : state.kinds) {  // its fields stay, for a call under way
    kind->plans.clear();
    Py_CLEAR(kind->type);
    Py_CLEAR(kind->planner);
  }
  state.kinds.clear();
  ++state.generation;
  Py_CLEAR(state.error_kinds);
}

// DLPack's dtype of the scalar types the kernels take; an opaque handle for others.
DLDataType DLDtypeOf(c10::ScalarType type) {
  switch (type) {
    case at::kFloat8_e4m3fn: return {kDLFloat8_e4m3fn, 8, 1};
    case at::kByte: return {kDLUInt, 8, 1};
    case at::kInt: return {kDLInt, 32, 1};
    case at::kFloat: return {kDLFloat, 32, 1};
    case at::kBFloat16: return {kDLBfloat, 16, 1};
    default: return {kDLOpaqueHandle, 0, 0};
  }
}

// A DLPack view of a plain strided CPU or CUDA tensor of at most kMaxDims dimensions; false for anything else: a
// wrapper TensorImpl (functorch, functionalisation, nested, sparse), Python dispatch, a lazy negative or conjugate
// view (the kernel would read the wrong values).
bool FillDLTensor(const at::Tensor& tensor, DLTensor* view) {
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  const c10::DeviceType device = impl->device_type();
  if (typeid(*impl) != typeid(c10::TensorImpl) || impl->is_python_dispatch() || impl->layout() != c10::kStrided ||
      impl->is_neg() || impl->is_conj() || !impl->has_storage() || impl->dim() > kMaxDims ||
      (device != c10::DeviceType::CPU && device != c10::DeviceType::CUDA)) {
    return false;
  }
  view->device = device == c10::DeviceType::CUDA ? DLDevice{kDLCUDA, impl->device().index()} : DLDevice{kDLCPU, 0};
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

// A call's arguments as read: its tuple, a DLPack view of each tensor (valid while the call is alive), its key
// (each argument's type; a tensor's scalar type, device and rank in one word, its sizes and strides; a scalar).
struct Call {
  std::shared_ptr<Kind> kind;
  PyObject* tuple = nullptr;
  std::array<DLTensor, kMaxFields> views;
  std::array<const at::Tensor*, kMaxFields> tensors{};  // null: not a tensor
  std::array<int64_t, 1 + kMaxFields * (2 + 2 * kMaxDims)> key;  // key[0]: the hash of the others
  size_t key_size = 1;
  void Push(int64_t word) {  // each word multiplied (independently), folded in by rotation
    key[key_size++] = word;
    const auto hash = static_cast<uint64_t>(key[0]);
    key[0] = static_cast<int64_t>((hash << 5 | hash >> 59) ^ static_cast<uint64_t>(word) * 0x9E3779B97F4A7C15ULL);
  }
  std::string_view Key() const { return {reinterpret_cast<const char*>(key.data()), key_size * sizeof(int64_t)}; }
};

// Reads `call` into `c`: whether every argument is read, else *reason says why not.
bool Read(PyObject* call, Call* c, std::string* reason) {
  const auto& fields = c->kind->fields;
  c->tuple = call;
  c->key[0] = 0;
  for (Py_ssize_t f = 0; f < static_cast<Py_ssize_t>(fields.size()); ++f) {
    PyObject* value = PyTuple_GET_ITEM(call, f);
    c->Push(static_cast<int64_t>(reinterpret_cast<intptr_t>(Py_TYPE(value))));
    if (value == Py_None) continue;
    if (PyFloat_CheckExact(value) && (c->Push(std::bit_cast<int64_t>(PyFloat_AS_DOUBLE(value))), true)) continue;
    int overflow = 0;  // its value (a float's bits)
    if (PyLong_CheckExact(value) && (c->Push(PyLong_AsLongLongAndOverflow(value, &overflow)), overflow == 0)) continue;
    Py_ssize_t size = 0;
    const char* text = PyUnicode_CheckExact(value) ? PyUnicode_AsUTF8AndSize(value, &size) : nullptr;
    if (text != nullptr && size <= 8 * 2 * kMaxDims) {  // its length, then its bytes in words
      c->Push(size);
      for (Py_ssize_t i = 0; i < size; i += 8) {
        int64_t word = 0;
        std::memcpy(&word, text + i, static_cast<size_t>(std::min<Py_ssize_t>(8, size - i)));
        c->Push(word);
      }
      continue;
    }
    if (text == nullptr && PyUnicode_CheckExact(value)) PyErr_Clear();  // a str that is not UTF-8
    DLTensor& view = c->views[f];
    if (!THPVariable_CheckExact(value) || !FillDLTensor(THPVariable_Unpack(value), &view)) {
      *reason = fields[f].first + " is not a tensor read here (a plain CPU or CUDA torch.Tensor or "
                                        "nn.Parameter, no wrapper, negative or conjugate view; or None, a float, a "
                                        "64-bit int, a short str)";
      return false;
    }
    const at::Tensor& tensor = THPVariable_Unpack(value);
    c->tensors[f] = &tensor;
    c->Push(static_cast<int64_t>(tensor.scalar_type()) << 56 | int64_t{view.device.device_type} << 48 |
            int64_t{view.device.device_id} << 8 | view.ndim);  // a device index < 2^31, ndim <= kMaxDims
    for (int d = 0; d < view.ndim; ++d) c->Push(d == fields[f].second ? view.shape[d] != 0 : view.shape[d]);
    for (int d = 0; d < view.ndim; ++d) c->Push(view.strides[d]);
  }
  return true;
}

// `sizes` and `strides` of an argument's view (None, or tuples of as many ints, at most kMaxDims): whether valid.
bool ParseView(PyObject* sizes, PyObject* strides, Argument* argument) {
  if (sizes == Py_None || strides == Py_None) return sizes == strides;
  if (!PyTuple_Check(sizes) || !PyTuple_Check(strides) || PyTuple_GET_SIZE(sizes) != PyTuple_GET_SIZE(strides) ||
      PyTuple_GET_SIZE(sizes) > kMaxDims) {
    return false;
  }
  for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(sizes); ++d) {
    argument->sizes.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, d)));
    argument->strides.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(strides, d)));
    if (argument->sizes.back() < 0 || PyErr_Occurred()) return false;
  }
  return true;
}

// The planner's plan for the call read into `c` (and every call of its key), or null with a Python exception
// set (a malformed one, a bug of the planner: its tensor arguments and outputs must be the call's tensors or
// constants it holds).
PlanPtr Parse(PyObject* answer, const Call& c) {
  auto plan = std::make_shared<Plan>();
  const auto num_fields = static_cast<Py_ssize_t>(c.kind->fields.size());
  const auto is_field = [num_fields](Py_ssize_t f) { return f >= 0 && f < num_fields; };
  PyObject *schedule, *arguments, *launches, *outputs, *dtype, *handle, *scalars, *sizes, *source, *strides;
  bool ok = PyTuple_Check(answer) && PyArg_ParseTuple(answer, "OO!O!O!", &schedule, &PyTuple_Type, &arguments,
                                                      &PyTuple_Type, &launches, &PyTuple_Type, &outputs);
  if (ok) plan->schedule = Py_NewRef(schedule);
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(arguments); ++i) {
    Argument& argument = plan->arguments.emplace_back();
    ok = PyArg_ParseTuple(PyTuple_GET_ITEM(arguments, i), "OOpLOO", &source, &dtype, &argument.per_token,
                          &argument.alignment, &sizes, &strides) &&
         std::has_single_bit(static_cast<uint64_t>(argument.alignment)) &&
         (dtype == Py_None || THPDtype_Check(dtype)) && ParseView(sizes, strides, &argument) &&
         !(argument.per_token && !argument.sizes.empty());
    if (ok && PyLong_CheckExact(source)) {  // a field of the call
      argument.field = PyLong_AsSsize_t(source);
      ok = is_field(argument.field);
    } else if (ok) {  // a constant: a plain tensor (FillDLTensor), never per token
      ok = THPVariable_CheckExact(source) && !argument.per_token &&
           FillDLTensor(THPVariable_Unpack(source), &argument.constant_view);
      if (ok) argument.constant = Py_NewRef(source);
    }
    argument.retyped = ok && dtype != Py_None;
    if (argument.retyped) argument.dtype = DLDtypeOf(reinterpret_cast<THPDtype*>(dtype)->scalar_type);
  }
  ok = ok && !plan->arguments.empty() && plan->arguments[0].field >= 0;  // the first: a tensor of the call
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(launches); ++i) {
    Launch& launch = plan->launches.emplace_back();
    ok = PyArg_ParseTuple(PyTuple_GET_ITEM(launches, i), "OLLO!", &handle, &launch.first, &launch.count,
                          &PyTuple_Type, &scalars);
    void* function = ok ? PyLong_AsVoidPtr(handle) : nullptr;
    ok = function != nullptr && TVMFFIObjectGetTypeIndex(function) == kTVMFFIFunction &&
         plan->arguments.size() + static_cast<size_t>(PyTuple_GET_SIZE(scalars)) <= kMaxFields;
    if (!ok) plan->launches.pop_back();  // a launch kept has its function
    if (ok) TVMFFIObjectIncRef(launch.function = function);
    for (Py_ssize_t j = 0; ok && j < PyTuple_GET_SIZE(scalars); ++j) {
      PyObject* scalar = PyTuple_GET_ITEM(scalars, j);
      TVMFFIAny& any = launch.scalars.emplace_back();  // zeroed
      any.type_index = PyFloat_CheckExact(scalar) ? kTVMFFIFloat : kTVMFFIInt;
      if (PyFloat_CheckExact(scalar)) any.v_float64 = PyFloat_AS_DOUBLE(scalar);
      else ok = PyLong_CheckExact(scalar) && ((any.v_int64 = PyLong_AsLongLong(scalar)) != -1 || !PyErr_Occurred());
    }
  }
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(outputs); ++i) {
    Output& output = plan->outputs.emplace_back();
    ok = PyArg_ParseTuple(PyTuple_GET_ITEM(outputs, i), "nO!O!", &output.field, &PyTuple_Type, &sizes,
                          &THPDtypeType, &dtype) &&
         is_field(output.field) && (c.tensors[output.field] || PyTuple_GET_ITEM(c.tuple, output.field) == Py_None);
    if (ok) output.dtype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
    for (Py_ssize_t j = 0; ok && j < PyTuple_GET_SIZE(sizes); ++j) {
      ok = (output.sizes.emplace_back(PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, j)))) >= 0;
    }
  }
  for (size_t i = 0; ok && i < plan->arguments.size(); ++i) {  // a tensor of the call (the first), or an output
    const Argument& a = plan->arguments[i];
    if (a.constant != nullptr) continue;
    const auto is_a = [&a](const Output& o) { return o.field == a.field; };
    const auto output = std::find_if(plan->outputs.begin(), plan->outputs.end(), is_a);
    const auto allocated = i > 0 && output != plan->outputs.end() ? static_cast<int>(output->sizes.size()) : -1;
    ok = (c.tensors[a.field] != nullptr ? c.views[a.field].ndim : allocated) >= (a.per_token ? 1 : 0);
  }
  if (ok && !plan->arguments.empty() && !plan->launches.empty()) return plan;
  PyErr_SetString(PyExc_TypeError, "the planner's plan is malformed: expected (schedule, arguments, launches, "
                                   "outputs) as q8kv8.native.launch_plan documents them");
  return nullptr;
}

// The plan memoised under the key of the call read into `c`, else the planner's answer (memoised when a plan or
// a decline it keeps); null when declined (*reason set) or when the planner raised (a Python exception set).
PlanPtr Find(const Call& c, std::string* reason) {
  auto& plans = c.kind->plans;
  const auto found = plans.find(c.Key());
  PlanPtr plan = found == plans.end() ? nullptr : found->second;
  if (plan == nullptr) {
    const uint64_t generation = state.generation;  // the planner's Python code may let other threads run
    PyObject* planner = Py_NewRef(c.kind->planner);
    PyObject* answer = PyObject_CallOneArg(planner, c.tuple);
    Py_DECREF(planner);
    if (answer == nullptr) return nullptr;
    PyObject* why = nullptr;
    int kept = 0;  // (reason, kept): declined
    if (PyTuple_Check(answer) && PyTuple_GET_SIZE(answer) == 2 &&
        PyArg_ParseTuple(answer, "O!p", &PyUnicode_Type, &why, &kept) && PyUnicode_AsUTF8(why) != nullptr) {
      auto declined = std::make_shared<Plan>();
      declined->schedule = Py_NewRef(why);
      plan = declined;
    }
    plan = plan != nullptr ? plan : Parse(answer, c);
    Py_DECREF(answer);
    if (plan != nullptr && (kept || !plan->launches.empty()) && generation == state.generation) {
      if (plans.size() >= kMaxPlans) plans.clear();
      plans.emplace(c.Key(), plan);
    }
  }
  if (plan == nullptr || !plan->launches.empty()) return plan;
  *reason = PyUnicode_AsUTF8(plan->schedule);  // a declined key's reason, checked UTF-8
  return nullptr;
}

// The half-open byte interval a tensor's elements may touch (q8kv8.checks.span); empty when it has none.
std::pair<uintptr_t, uintptr_t> Span(const DLTensor& t) {
  int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) return {0, 0};
    last += (t.shape[i] - 1) * t.strides[i];
  }
  const auto start = reinterpret_cast<uintptr_t>(t.data);
  return {start, start + static_cast<uintptr_t>((last + 1) * ((t.dtype.bits + 7) / 8))};
}

// The plan's address checks (alignments; the contract's: no output given shares memory with another argument).
bool CheckAddresses(const Plan& plan, const Call& c, std::string* reason) {
  const auto& fields = c.kind->fields;
  for (const Argument& a : plan.arguments) {
    if (a.constant == nullptr && c.tensors[a.field] != nullptr &&
        (reinterpret_cast<uintptr_t>(c.views[a.field].data) & (a.alignment - 1))) {
      return *reason = fields[a.field].first + " is not " + std::to_string(a.alignment) + "-byte aligned", false;
    }
  }
  std::array<std::pair<uintptr_t, uintptr_t>, kMaxFields> spans;  // empty for a field without a tensor
  const auto num_fields = static_cast<Py_ssize_t>(fields.size());
  for (Py_ssize_t f = 0; f < num_fields; ++f) {
    spans[f] = c.tensors[f] != nullptr ? Span(c.views[f]) : std::pair<uintptr_t, uintptr_t>{};
  }
  for (const Output& output : plan.outputs) {
    const auto [start, end] = spans[output.field];
    for (Py_ssize_t f = 0; f < num_fields; ++f) {
      const auto [other_start, other_end] = spans[f];
      if (other_start < end && start < other_end && f != output.field && start != end && other_start != other_end) {
        return *reason = fields[output.field].first + " shares memory with " + fields[f].first, false;
      }
    }
  }
  return true;
}

// Reads `call`, finds its plan, checks the addresses: whether it applies (else why not, or a Python exception).
bool Prepare(PyObject* call, Call* c, PlanPtr* plan, std::string* reason) {
  if (state.kinds.empty()) return (*reason = "the fast path is not configured", false);
  for (const auto& kind : state.kinds) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(call)) == kind->type) c->kind = kind;
  }
  if (c->kind == nullptr || PyTuple_GET_SIZE(call) != static_cast<Py_ssize_t>(c->kind->fields.size())) {
    return PyErr_SetString(PyExc_TypeError, "expected a q8kv8.prefill_call.PrefillCall or PagedCall"), false;
  }
  return Read(call, c, reason) && (*plan = Find(*c, reason)) != nullptr && CheckAddresses(**plan, *c, reason);
}

// The allocator at::empty used on each CUDA device, learned from its first allocation there (torch lets it be
// replaced only before that): Empty, at::empty(sizes, like.options().dtype(dtype)), then calls
// at::detail::empty_generic directly, without the dispatcher (unless deterministic filling of new memory is on).
std::array<c10::Allocator*, 64> g_cuda_allocators{};

at::Tensor Empty(const at::Tensor& like, c10::IntArrayRef sizes, c10::ScalarType dtype) {
  const c10::Device device = like.device();
  const auto index = static_cast<size_t>(device.index());
  const bool learnt = device.is_cuda() && index < g_cuda_allocators.size();
  c10::Allocator* allocator = learnt ? g_cuda_allocators[index] : nullptr;
  at::Context& context = at::globalContext();
  if (allocator != nullptr && !(context.deterministicAlgorithms() && context.deterministicFillUninitializedMemory())) {
    const c10::DeviceGuard guard(device);  // the caching allocator allocates on the current device
    const c10::DispatchKeySet keys(c10::DispatchKey::CUDA);
    return at::detail::empty_generic(sizes, allocator, keys, dtype, std::nullopt);
  }
  at::Tensor tensor = at::empty(sizes, like.options().dtype(dtype).requires_grad(false));
  if (learnt) g_cuda_allocators[index] = tensor.storage().allocator();
  return tensor;
}

// Raises, as a Python exception, the error a TVM-FFI call just returned (its kind mapped through the configured
// error kinds, RuntimeError for other kinds); returns nullptr.
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
    PyObject* found = state.error_kinds == nullptr ? nullptr : PyDict_GetItemString(state.error_kinds, kind.c_str());
    PyObject* type = found != nullptr && PyExceptionClass_Check(found) ? found : PyExc_RuntimeError;
    PyObject* message = PyUnicode_DecodeUTF8(cell->message.data, Py_ssize_t(cell->message.size), "replace");
    if (message != nullptr) PyErr_SetObject(type, message);
    Py_XDECREF(message);
  }
  TVMFFIObjectDecRef(error);
  return nullptr;
}

// Calls one launch of the plan; returns TVM-FFI's status. Tensors pass as borrowed DLTensor views
// (kTVMFFIDLTensorPtr: the callee only reads them), a per-token one as the view of the launch's rows.
int CallLaunch(const Call& c, const Plan& plan, const Launch& launch) {
  std::array<DLTensor, kMaxFields> views;
  std::array<std::array<int64_t, kMaxDims>, kMaxFields> shapes;
  std::array<TVMFFIAny, kMaxFields> args;
  const size_t num_tensors = plan.arguments.size();
  for (size_t i = 0; i < num_tensors; ++i) {
    const Argument& argument = plan.arguments[i];
    const DLTensor& tensor = argument.constant != nullptr ? argument.constant_view : c.views[argument.field];
    const bool rows = argument.per_token && (launch.first != 0 || launch.count != tensor.shape[0]);
    const bool viewed = !argument.sizes.empty();
    (args[i] = TVMFFIAny{}).type_index = kTVMFFIDLTensorPtr;
    args[i].v_ptr = const_cast<DLTensor*>(&tensor);  // the tensor's own view, unless retyped, re-viewed or rows
    if (!argument.retyped && !rows && !viewed) continue;
    DLTensor& view = *static_cast<DLTensor*>(args[i].v_ptr = &(views[i] = tensor));
    if (argument.retyped) view.dtype = argument.dtype;
    if (viewed) {  // the plan's sizes and strides (never per token)
      view.ndim = static_cast<int32_t>(argument.sizes.size());
      view.shape = const_cast<int64_t*>(argument.sizes.data());
      view.strides = const_cast<int64_t*>(argument.strides.data());
    }
    if (rows) {
      std::copy(tensor.shape, tensor.shape + tensor.ndim, shapes[i].begin());
      shapes[i][0] = launch.count;
      view.shape = shapes[i].data();
      view.data = static_cast<char*>(tensor.data) + launch.first * tensor.strides[0] * ((tensor.dtype.bits + 7) / 8);
    }
  }
  std::copy(launch.scalars.begin(), launch.scalars.end(), args.begin() + static_cast<std::ptrdiff_t>(num_tensors));
  TVMFFIAny result{};  // kTVMFFINone
  const auto num_args = static_cast<int32_t>(num_tensors + launch.scalars.size());
  const int status = TVMFFIFunctionCall(launch.function, args.data(), num_args, &result);
  if (status == 0 && result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
  return status;
}

// launch(call): its outputs, having launched (on torch's current stream on a CUDA device: TVM-FFI's environment
// stream for the call); plan(call): the schedule of the plan launch(call) would run; decline_reason(call): "" when
// launch(call) would launch. Else None, -1, and why not.
enum Mode { kLaunch, kPlan, kReason };
template <Mode kMode>
PyObject* Entry(PyObject* /*module*/, PyObject* call) {
  Call c;
  PlanPtr plan;  // held for the call: another thread may empty the memo meanwhile
  std::string reason;
  const bool planned = Prepare(call, &c, &plan, &reason);
  if (PyErr_Occurred()) return nullptr;
  if (kMode == kReason) return PyUnicode_FromStringAndSize(reason.data(), static_cast<Py_ssize_t>(reason.size()));
  if (kMode == kPlan) return planned ? Py_NewRef(plan->schedule) : PyLong_FromLong(-1);
  if (!planned) Py_RETURN_NONE;
  HANDLE_TH_ERRORS  // an allocation that fails raises torch's error (torch.OutOfMemoryError)
  const at::Tensor& first = *c.tensors[plan->arguments[0].field];
  // Outputs the call does not give: new tensors, whose addresses torch's allocators align (64 bytes and more).
  std::vector<at::Tensor> allocated;
  for (size_t i = 0; i < plan->outputs.size(); ++i) {
    const Output& output = plan->outputs[i];
    if (c.tensors[output.field] != nullptr) continue;
    if (allocated.empty()) allocated.resize(plan->outputs.size());
    allocated[i] = Empty(first, output.sizes, output.dtype);
    if (!FillDLTensor(allocated[i], &c.views[output.field])) Py_RETURN_NONE;
    c.tensors[output.field] = &allocated[i];
  }
  const auto [type, id] = c.views[plan->arguments[0].field].device;
  const bool set_stream = first.is_cuda();
  void* stream = set_stream ? c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(first.device()).native_handle()
                            : nullptr;
  TVMFFIStreamHandle previous = nullptr;
  if (set_stream && TVMFFIEnvSetStream(type, id, stream, &previous) != 0) return RaiseFfiError();
  int status = 0;
  for (size_t i = 0; status == 0 && i < plan->launches.size(); ++i) status = CallLaunch(c, *plan, plan->launches[i]);
  if (status != 0) RaiseFfiError();
  if (set_stream && TVMFFIEnvSetStream(type, id, previous, nullptr) != 0) {
    TVMFFIObjectHandle error = nullptr;  // a launch's error is the one raised; else the restore's
    if (status == 0) return RaiseFfiError();
    TVMFFIErrorMoveFromRaised(&error);
    if (error != nullptr) TVMFFIObjectDecRef(error);
  }
  if (status != 0) return nullptr;
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(plan->outputs.size()));
  for (size_t i = 0; result != nullptr && i < plan->outputs.size(); ++i) {
    PyObject* given = PyTuple_GET_ITEM(call, plan->outputs[i].field);
    PyObject* output = given == Py_None ? THPVariable_Wrap(std::move(allocated[i])) : Py_NewRef(given);
    if (output == nullptr) Py_CLEAR(result);
    if (output != nullptr) PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), output);
  }
  return result;
  END_HANDLE_TH_ERRORS
}

// configure(kinds, error_kinds): forgets every plan, and takes the kinds of call, each a (tuple type, fields,
// planner) triple (fields: (name, the dimension of its extent keyed only as zero or not, or -1) pairs; planner:
// call -> plan, or (reason, kept)), and the dict of TVM-FFI error kinds -> Python exception types.
PyObject* Configure(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  ReleaseAll();
  static const char* names[] = {"kinds", "error_kinds", nullptr};
  PyObject *kinds, *error_kinds;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!:configure", const_cast<char**>(names), &PyTuple_Type, &kinds,
                                   &PyDict_Type, &error_kinds)) {
    return nullptr;
  }
  bool ok = true;
  for (Py_ssize_t k = 0; ok && k < PyTuple_GET_SIZE(kinds); ++k) {
    PyObject *type, *fields, *planner;
    ok = PyArg_ParseTuple(PyTuple_GET_ITEM(kinds, k), "O!O!O", &PyType_Type, &type, &PyTuple_Type, &fields,
                          &planner) &&
         PyCallable_Check(planner) && static_cast<size_t>(PyTuple_GET_SIZE(fields)) <= kMaxFields &&
         PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type), &PyTuple_Type);
    if (!ok) break;
    auto kind = std::make_shared<Kind>();
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(fields); ++i) {
      const char* name = nullptr;
      int dim = -1;
      ok = PyArg_ParseTuple(PyTuple_GET_ITEM(fields, i), "si", &name, &dim) && dim >= -1 && dim < kMaxDims;
      if (ok) kind->fields.emplace_back(name, dim);
    }
    kind->type = Py_NewRef(type);
    kind->planner = Py_NewRef(planner);
    state.kinds.push_back(std::move(kind));
  }
  if (!ok) {
    ReleaseAll();
    PyErr_Clear();
    return PyErr_SetString(PyExc_ValueError, "configure: expected (tuple type, (name, dim or -1) pairs, planner) "
                                             "triples and a dict of error kinds"),
           nullptr;
  }
  state.error_kinds = Py_NewRef(error_kinds);
  Py_RETURN_NONE;
}

PyObject* Reset(PyObject* /*module*/, PyObject* /*unused*/) { return ReleaseAll(), Py_NewRef(Py_None); }

#define Q8KV8_METHOD(name, function, flags, doc) \
  {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function)), flags, doc}

PyMethodDef methods[] = {
    Q8KV8_METHOD("launch", Entry<kLaunch>, METH_O, "launch(call) -> its outputs, or None: left to the Python path"),
    Q8KV8_METHOD("plan", Entry<kPlan>, METH_O, "plan(call) -> the schedule of the plan launch(call) runs, or -1"),
    Q8KV8_METHOD("decline_reason", Entry<kReason>, METH_O, "decline_reason(call) -> why launch(call) declines, or ''"),
    Q8KV8_METHOD("configure", Configure, METH_VARARGS | METH_KEYWORDS,
                 "configure(kinds, error_kinds): forgets every plan"),
    Q8KV8_METHOD("reset", Reset, METH_NOARGS, "reset(): forget the configuration and every plan"),
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_q8kv8_native", nullptr, -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__q8kv8_native() { return PyModule_Create(&module_def); }
