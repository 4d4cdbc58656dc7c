// q8kv8's eager fast path: a CPython extension, built against torch and linked to TVM-FFI, that runs the launch
// plans q8kv8.native computes (q8kv8/native.py builds, loads and configures it).
//
// launch(call) reads a q8kv8.prefill_call.PrefillCall's arguments directly (a torch tensor from its TensorImpl,
// as a DLPack view; None; a Python float, int or str) into a key: each argument's type, a tensor's dtype,
// device, shape (a configured free extent only as zero or not) and strides, a scalar's value. Under the key it
// memoises the plan the configured planner (q8kv8.native.launch_plan) computes in Python for the first call
// with that key: kernel variants (TVM-FFI functions), their tensor arguments and scalars, each launch's token
// rows, the alignments to check, the outputs to return and to allocate. A call with a plan pays for its key,
// the checks that depend on addresses (the alignments; no output sharing memory with another argument), the
// allocations (with the allocator at::empty uses) and the launches on torch's current stream, and gets its
// outputs. Any other call gets None having launched nothing, and the Python path takes it: an argument not
// read here, a plan declined (not memoised), an address check failed. A launch's error becomes the Python
// exception of its TVM-FFI error kind. Nothing about the call is written here: the fields, free extents,
// planner and error kinds come through configure(). Every function runs with the GIL held; the planner and
// Python-defined variants may let other threads run, so a plan in use is held by a shared_ptr.

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
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr Py_ssize_t kMaxFields = 32;  // of a call
constexpr size_t kMaxArguments = 32;  // of a launch, tensors and scalars
constexpr int kMaxDims = 8;  // of a tensor read here
constexpr size_t kMaxPlans = 4096;  // memoised before the memo is emptied

struct Argument {  // the call's tensor `field`, viewed as `dtype` when retyped, a launch's rows when per_token
  Py_ssize_t field;
  bool retyped, per_token;
  DLDataType dtype;
  int64_t alignment;  // of its address, in bytes
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

struct Plan {
  PyObject* schedule = nullptr;  // what plan(call) returns, owned
  std::vector<Argument> arguments;  // the first one's device runs the launches and gets the allocations
  std::vector<Launch> launches;
  std::vector<Output> outputs;
  std::string declined;  // a plan without launches: why calls of its key are declined
  ~Plan() {  // with the GIL held (dropped by this module's functions only)
    for (const Launch& launch : launches) {
      if (launch.function != nullptr) TVMFFIObjectDecRef(launch.function);
    }
    Py_XDECREF(schedule);
  }
};
using PlanPtr = std::shared_ptr<const Plan>;

// A call's key as read, in place (hashed as it grows), and as memoised (a vector); found by either.
struct KeyView {
  const int64_t* words;
  size_t size;
  size_t hash;
};
constexpr uint64_t kHashStart = 0xcbf29ce484222325ULL;
uint64_t HashWord(uint64_t hash, int64_t word) { return (hash ^ static_cast<uint64_t>(word)) * 0x100000001b3ULL; }
size_t Hash(const int64_t* words, size_t size) {
  uint64_t hash = kHashStart;
  for (size_t i = 0; i < size; ++i) hash = HashWord(hash, words[i]);
  return static_cast<size_t>(hash ^ (hash >> 29));
}
struct KeyHash {
  using is_transparent = void;
  size_t operator()(const KeyView& key) const { return key.hash; }
  size_t operator()(const std::vector<int64_t>& key) const { return Hash(key.data(), key.size()); }
};
struct KeyEqual {
  using is_transparent = void;
  static bool Equal(const int64_t* a, size_t a_size, const int64_t* b, size_t b_size) {
    return a_size == b_size && std::equal(a, a + a_size, b);
  }
  bool operator()(const std::vector<int64_t>& a, const KeyView& b) const { return Equal(a.data(), a.size(), b.words, b.size); }
  bool operator()(const KeyView& a, const std::vector<int64_t>& b) const { return Equal(a.words, a.size, b.data(), b.size()); }
  bool operator()(const std::vector<int64_t>& a, const std::vector<int64_t>& b) const { return a == b; }
};

struct State {
  bool configured = false;
  std::vector<std::string> fields;  // the call's field names, for the reasons given
  std::vector<int> free_dim;  // per field: the extent keyed only as zero or not, or -1
  PyObject* planner = nullptr;  // owned
  PyObject* error_kinds = nullptr;  // dict: TVM-FFI error kind -> Python exception type, owned
  std::unordered_map<std::vector<int64_t>, PlanPtr, KeyHash, KeyEqual> plans;
  uint64_t generation = 0;  // of the configuration and memo: a plan computed across a change is not kept
};

// Never destroyed: releasing what it holds needs the interpreter, which is gone when static destructors run;
// q8kv8.native empties it at exit instead (reset()).
State& state = *new State();

void ReleaseAll() {
  state.plans.clear();
  ++state.generation;
  Py_CLEAR(state.planner);
  Py_CLEAR(state.error_kinds);
  state.fields.clear();
  state.free_dim.clear();
  state.configured = false;
}

// DLPack's dtype of the scalar types the kernels take; an opaque handle for others.
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

// A DLPack view of a plain strided CPU or CUDA tensor of at most kMaxDims dimensions; false for anything else.
bool FillDLTensor(const at::Tensor& tensor, DLTensor* view) {
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  // No wrapper TensorImpl (functorch, functionalisation, nested, sparse), no Python dispatch, no lazy
  // negative or conjugate view (the kernel would read the wrong values).
  if (typeid(*impl) != typeid(c10::TensorImpl) || impl->is_python_dispatch() ||
      impl->layout() != c10::kStrided || impl->is_neg() || impl->is_conj() || !impl->has_storage() ||
      impl->dim() > kMaxDims) {
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

// A call's arguments as read: its tuple, a DLPack view of each tensor (valid while the call is alive), its key
// (each argument's type word, then a tensor's scalar type, device and rank in one word, its sizes and strides;
// a scalar's value).
struct Call {
  PyObject* tuple = nullptr;
  std::array<DLTensor, kMaxFields> views;
  std::array<const at::Tensor*, kMaxFields> tensors{};  // null: not a tensor
  std::array<int64_t, kMaxFields * (2 + 2 * kMaxDims)> key;
  size_t key_size = 0;
  uint64_t hash = kHashStart;
  void Push(int64_t word) {
    key[key_size++] = word;
    hash = HashWord(hash, word);
  }
  KeyView View() const { return {key.data(), key_size, static_cast<size_t>(hash ^ (hash >> 29))}; }
};

// Reads `call` into `c`: "" when every argument is read, else why not.
std::string Read(PyObject* call, Call* c) {
  c->tuple = call;
  for (Py_ssize_t f = 0; f < static_cast<Py_ssize_t>(state.fields.size()); ++f) {
    PyObject* value = PyTuple_GET_ITEM(call, f);
    c->Push(static_cast<int64_t>(reinterpret_cast<intptr_t>(Py_TYPE(value))));
    if (value == Py_None) continue;
    if (PyFloat_CheckExact(value)) {
      const double number = PyFloat_AS_DOUBLE(value);
      int64_t bits;
      std::memcpy(&bits, &number, sizeof(bits));
      c->Push(bits);
      continue;
    }
    if (PyLong_CheckExact(value)) {
      int overflow = 0;
      c->Push(PyLong_AsLongLongAndOverflow(value, &overflow));
      if (overflow != 0) return state.fields[f] + " does not fit in 64 bits";
      continue;
    }
    if (PyUnicode_CheckExact(value)) {
      Py_ssize_t size = 0;
      const char* text = PyUnicode_AsUTF8AndSize(value, &size);
      if (text == nullptr) {
        PyErr_Clear();
        return state.fields[f] + " is not valid UTF-8";
      }
      if (size > 8 * 2 * kMaxDims) return state.fields[f] + " is longer than the strings read here";
      c->Push(size);
      for (Py_ssize_t i = 0; i < size; i += 8) {
        int64_t word = 0;
        std::memcpy(&word, text + i, static_cast<size_t>(std::min<Py_ssize_t>(8, size - i)));
        c->Push(word);
      }
      continue;
    }
    DLTensor& view = c->views[f];
    if (!THPVariable_CheckExact(value) || !FillDLTensor(THPVariable_Unpack(value), &view)) {
      return state.fields[f] +
             " is not a tensor read here (a plain CPU or CUDA torch.Tensor: no subclass but nn.Parameter, no "
             "wrapper, no negative or conjugate view; or None, a Python float, int or str)";
    }
    const at::Tensor& tensor = THPVariable_Unpack(value);
    c->tensors[f] = &tensor;
    c->Push(static_cast<int64_t>(tensor.scalar_type()) << 56 | int64_t{view.device.device_type} << 48 |
            int64_t{view.device.device_id} << 8 | view.ndim);  // a device index < 2^31, ndim <= kMaxDims
    for (int d = 0; d < view.ndim; ++d) c->Push(d == state.free_dim[f] ? view.shape[d] != 0 : view.shape[d]);
    for (int d = 0; d < view.ndim; ++d) c->Push(view.strides[d]);
  }
  return std::string();
}

// An output's (sizes, dtype).
bool ParseLayout(PyObject* sizes, PyObject* dtype, Output* output) {
  output->dtype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(sizes); ++j) {
    output->sizes.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, j)));
    if (output->sizes.back() < 0) return false;
  }
  return true;
}

// The planner's plan, or null with a Python exception set (a malformed one: a bug of the planner).
PlanPtr Parse(PyObject* answer) {
  auto plan = std::make_shared<Plan>();
  const auto is_field = [](Py_ssize_t field) { return field >= 0 && field < static_cast<Py_ssize_t>(state.fields.size()); };
  PyObject *schedule, *arguments, *launches, *outputs, *dtype, *handle, *scalars, *sizes;
  bool ok = PyTuple_Check(answer) && PyArg_ParseTuple(answer, "OO!O!O!", &schedule, &PyTuple_Type, &arguments,
                                                      &PyTuple_Type, &launches, &PyTuple_Type, &outputs);
  if (ok) plan->schedule = Py_NewRef(schedule);
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(arguments); ++i) {
    Argument& argument = plan->arguments.emplace_back();
    int per_token = 0;
    ok = PyArg_ParseTuple(PyTuple_GET_ITEM(arguments, i), "nOpL", &argument.field, &dtype, &per_token,
                          &argument.alignment) &&
         is_field(argument.field) && argument.alignment >= 1 && (dtype == Py_None || THPDtype_Check(dtype));
    argument.per_token = per_token != 0;
    argument.retyped = ok && dtype != Py_None;
    if (argument.retyped) argument.dtype = DLDtypeOf(reinterpret_cast<THPDtype*>(dtype)->scalar_type);
  }
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(launches); ++i) {
    Launch& launch = plan->launches.emplace_back();
    ok = PyArg_ParseTuple(PyTuple_GET_ITEM(launches, i), "OLLO!", &handle, &launch.first, &launch.count,
                          &PyTuple_Type, &scalars);
    void* function = ok ? PyLong_AsVoidPtr(handle) : nullptr;
    ok = function != nullptr && TVMFFIObjectGetTypeIndex(function) == kTVMFFIFunction &&
         plan->arguments.size() + static_cast<size_t>(PyTuple_GET_SIZE(scalars)) <= kMaxArguments;
    if (ok) TVMFFIObjectIncRef(launch.function = function);
    for (Py_ssize_t j = 0; ok && j < PyTuple_GET_SIZE(scalars); ++j) {
      PyObject* scalar = PyTuple_GET_ITEM(scalars, j);
      TVMFFIAny& any = launch.scalars.emplace_back();
      any = {};
      any.type_index = PyFloat_CheckExact(scalar) ? kTVMFFIFloat : kTVMFFIInt;
      if (PyFloat_CheckExact(scalar)) any.v_float64 = PyFloat_AS_DOUBLE(scalar);
      else ok = PyLong_CheckExact(scalar) && ((any.v_int64 = PyLong_AsLongLong(scalar)) != -1 || !PyErr_Occurred());
    }
  }
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(outputs); ++i) {
    Output& output = plan->outputs.emplace_back();
    ok = PyArg_ParseTuple(PyTuple_GET_ITEM(outputs, i), "nO!O!", &output.field, &PyTuple_Type, &sizes,
                          &THPDtypeType, &dtype) &&
         is_field(output.field) && ParseLayout(sizes, dtype, &output);
  }
  if (ok && !plan->arguments.empty() && !plan->launches.empty()) return plan;
  PyErr_Clear();
  PyErr_SetString(PyExc_TypeError,
                  "the planner's plan is malformed: expected (schedule, ((field, dtype, per token, alignment), ...), "
                  "((TVM-FFI function handle, first, count, scalars), ...), ((field, sizes, dtype), ...))");
  return nullptr;
}

// The plan memoised under the key of the call read into `c`, else the planner's answer (memoised when a plan,
// or a decline it keeps); null when declined (*reason set) or when the planner raised (a Python exception set).
PlanPtr Find(const Call& c, std::string* reason) {
  const auto found = state.plans.find(c.View());
  if (found != state.plans.end()) {
    if (found->second->launches.empty()) *reason = found->second->declined;
    return found->second->launches.empty() ? nullptr : found->second;
  }
  const uint64_t generation = state.generation;  // the planner's Python code may let other threads run
  PyObject* planner = Py_NewRef(state.planner);
  PyObject* answer = PyObject_CallOneArg(planner, c.tuple);
  Py_DECREF(planner);
  if (answer == nullptr) return nullptr;
  PlanPtr plan;
  PyObject* text;
  int kept = 0;
  if (PyTuple_Check(answer) && PyTuple_GET_SIZE(answer) == 2 &&
      PyArg_ParseTuple(answer, "Up", &text, &kept)) {  // (reason, kept): declined
    auto declined = std::make_shared<Plan>();
    const char* utf8 = PyUnicode_AsUTF8(text);
    *reason = declined->declined = utf8 == nullptr ? "(a reason that is not UTF-8)" : utf8;
    PyErr_Clear();
    if (kept) plan = declined;
  } else {
    plan = Parse(answer);
  }
  Py_DECREF(answer);
  if (plan != nullptr && generation == state.generation) {
    if (state.plans.size() >= kMaxPlans) state.plans.clear();
    state.plans.emplace(std::vector<int64_t>(c.key.data(), c.key.data() + c.key_size), plan);
  }
  return plan == nullptr || plan->launches.empty() ? nullptr : plan;
}

// The half-open byte interval a tensor's elements may touch (contract._span); empty when it has none.
std::pair<uintptr_t, uintptr_t> Span(const DLTensor& t) {
  int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) return {0, 0};
    last += (t.shape[i] - 1) * t.strides[i];
  }
  const auto start = reinterpret_cast<uintptr_t>(t.data);
  return {start, start + static_cast<uintptr_t>((last + 1) * ((t.dtype.bits + 7) / 8))};
}

// The plan's checks of the tensors' addresses: "" when they pass, else why not. `overlaps`: also that no output
// given shares memory with another argument (the contract's rule; outputs allocated here share none).
std::string CheckAddresses(const Plan& plan, const Call& c, bool overlaps) {
  for (const Argument& argument : plan.arguments) {
    const Py_ssize_t f = argument.field;
    if (c.tensors[f] != nullptr && reinterpret_cast<uintptr_t>(c.views[f].data) % argument.alignment != 0) {
      return state.fields[f] + " is not " + std::to_string(argument.alignment) + "-byte aligned (the Python path copies)";
    }
  }
  std::array<std::pair<uintptr_t, uintptr_t>, kMaxFields> spans;
  bool spans_read = false;
  for (const Output& output : plan.outputs) {
    if (!overlaps || c.tensors[output.field] == nullptr) continue;
    for (Py_ssize_t f = 0; !spans_read && f < static_cast<Py_ssize_t>(state.fields.size()); ++f) {
      spans[f] = c.tensors[f] == nullptr ? std::pair<uintptr_t, uintptr_t>{} : Span(c.views[f]);
    }
    spans_read = true;
    const auto [start, end] = spans[output.field];
    for (Py_ssize_t f = 0; f < static_cast<Py_ssize_t>(state.fields.size()); ++f) {
      if (f == output.field || c.tensors[f] == nullptr) continue;
      const auto [other_start, other_end] = spans[f];
      if (start != end && other_start != other_end && start < other_end && other_start < end) {
        const bool both = std::any_of(plan.outputs.begin(), plan.outputs.end(), [f](const Output& o) { return o.field == f; });
        return both ? "two output buffers overlap" : "an output buffer overlaps an input";
      }
    }
  }
  return std::string();
}

// Reads `call`, finds its plan and checks the addresses: true when the plan applies, else false with
// *reason set, or with a Python exception set (the call is not a PrefillCall, the planner raised).
bool Prepare(PyObject* call, Call* c, PlanPtr* plan, std::string* reason) {
  if (!state.configured) {
    *reason = "the fast path is not configured";
    return false;
  }
  if (!PyTuple_Check(call) || PyTuple_GET_SIZE(call) != static_cast<Py_ssize_t>(state.fields.size())) {
    PyErr_SetString(PyExc_TypeError, "expected a q8kv8.prefill_call.PrefillCall");
    return false;
  }
  *reason = Read(call, c);
  if (!reason->empty()) return false;
  *plan = Find(*c, reason);
  if (*plan == nullptr) return false;
  *reason = CheckAddresses(**plan, *c, true);
  return reason->empty();
}

// The allocator at::empty used on each CUDA device, learned from its first allocation there: later
// allocations call at::detail::empty_generic directly (what at::empty reaches through the dispatcher). torch
// lets the CUDA allocator be replaced only before its first allocation, so the learned one stays current.
std::array<c10::Allocator*, 64> g_cuda_allocators{};

// at::empty(sizes, like.options().dtype(dtype)), without the dispatcher on a CUDA device whose allocator is
// known (and deterministic filling of new memory off).
at::Tensor Empty(const at::Tensor& like, c10::IntArrayRef sizes, c10::ScalarType dtype) {
  const c10::Device device = like.device();
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
    at::Tensor tensor = at::empty(sizes, like.options().dtype(dtype).requires_grad(false));
    if (allocator == nullptr) g_cuda_allocators[index] = tensor.storage().allocator();
    return tensor;
  }
  return at::empty(sizes, like.options().dtype(dtype).requires_grad(false));
}

// Raises, as a Python exception, the error a TVM-FFI call just returned (its kind mapped through the
// configured error kinds, RuntimeError for other kinds); returns nullptr.
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
    PyObject* kinds = state.error_kinds;
    PyObject* found = kinds == nullptr ? nullptr : PyDict_GetItemString(kinds, kind.c_str());
    if (found != nullptr && PyExceptionClass_Check(found)) type = found;
    PyObject* message =
        PyUnicode_DecodeUTF8(cell->message.data, static_cast<Py_ssize_t>(cell->message.size), "replace");
    if (message != nullptr) {
      PyErr_SetObject(type, message);
      Py_DECREF(message);
    }
  }
  TVMFFIObjectDecRef(error);
  return nullptr;
}

// Calls one launch of the plan; returns TVM-FFI's status. Tensors pass as borrowed DLTensor views
// (kTVMFFIDLTensorPtr: the callee only reads them), a per-token one as the view of the launch's rows.
int CallLaunch(const Call& c, const Plan& plan, const Launch& launch) {
  std::array<DLTensor, kMaxArguments> views;
  std::array<std::array<int64_t, kMaxDims>, kMaxArguments> shapes;
  std::array<TVMFFIAny, kMaxArguments> args{};
  const size_t num_tensors = plan.arguments.size();
  for (size_t i = 0; i < num_tensors; ++i) {
    const Argument& argument = plan.arguments[i];
    const DLTensor& tensor = c.views[argument.field];
    DLTensor& view = views[i] = tensor;
    if (argument.retyped) view.dtype = argument.dtype;
    if (argument.per_token && (launch.first != 0 || launch.count != tensor.shape[0])) {
      std::copy(tensor.shape, tensor.shape + tensor.ndim, shapes[i].begin());
      shapes[i][0] = launch.count;
      view.shape = shapes[i].data();
      view.data = static_cast<char*>(tensor.data) + launch.first * tensor.strides[0] * ((tensor.dtype.bits + 7) / 8);
    }
    args[i].type_index = kTVMFFIDLTensorPtr;
    args[i].v_ptr = &view;
  }
  std::copy(launch.scalars.begin(), launch.scalars.end(), args.begin() + static_cast<std::ptrdiff_t>(num_tensors));
  TVMFFIAny result = {};
  result.type_index = kTVMFFINone;
  const auto num_args = static_cast<int32_t>(num_tensors + launch.scalars.size());
  const int status = TVMFFIFunctionCall(launch.function, args.data(), num_args, &result);
  if (status == 0 && result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
  return status;
}

// Runs the plan's launches in order on `stream` (set as TVM-FFI's environment stream of the device for the call
// when set_stream). Returns nullptr with a Python exception set when a launch raised, else Py_None (borrowed).
PyObject* Run(const Call& c, const Plan& plan, bool set_stream, void* stream) {
  const DLDevice device = c.views[plan.arguments[0].field].device;
  TVMFFIStreamHandle previous = nullptr;
  if (set_stream && TVMFFIEnvSetStream(device.device_type, device.device_id, stream, &previous) != 0) {
    return RaiseFfiError();
  }
  int status = 0;
  for (const Launch& launch : plan.launches) {
    status = CallLaunch(c, plan, launch);
    if (status != 0) break;
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

PyObject* LaunchCall(PyObject* /*module*/, PyObject* call) {
  Call c;
  PlanPtr plan;  // held for the call: another thread may empty the memo meanwhile
  std::string reason;
  if (!Prepare(call, &c, &plan, &reason)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  HANDLE_TH_ERRORS  // an allocation that fails raises torch's error (torch.OutOfMemoryError)
  const at::Tensor& first = *c.tensors[plan->arguments[0].field];
  std::vector<at::Tensor> allocated;  // per output, when the call gives some none
  for (size_t i = 0; i < plan->outputs.size(); ++i) {
    const Output& output = plan->outputs[i];
    if (c.tensors[output.field] != nullptr) continue;
    if (allocated.empty()) allocated.resize(plan->outputs.size());
    allocated[i] = Empty(first, output.sizes, output.dtype);
    if (!FillDLTensor(allocated[i], &c.views[output.field])) Py_RETURN_NONE;
    c.tensors[output.field] = &allocated[i];
  }
  if (!allocated.empty() && !CheckAddresses(*plan, c, false).empty()) Py_RETURN_NONE;
  // The stream TVM-FFI would set for a torch CUDA tensor: torch's current stream on the device.
  void* stream = nullptr;
  const bool on_cuda = first.is_cuda();
  if (on_cuda) {
    const c10::Device device = first.device();
    stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
  }
  if (Run(c, *plan, on_cuda, stream) == nullptr) return nullptr;
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(plan->outputs.size()));
  if (result == nullptr) return nullptr;
  for (size_t i = 0; i < plan->outputs.size(); ++i) {
    PyObject* output = !allocated.empty() && allocated[i].defined()
                           ? THPVariable_Wrap(std::move(allocated[i]))
                           : Py_NewRef(PyTuple_GET_ITEM(call, plan->outputs[i].field));
    if (output == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), output);
  }
  return result;
  END_HANDLE_TH_ERRORS
}

PyObject* PlanCall(PyObject* /*module*/, PyObject* call) {
  Call c;
  PlanPtr plan;
  std::string reason;
  if (Prepare(call, &c, &plan, &reason)) return Py_NewRef(plan->schedule);
  return PyErr_Occurred() ? nullptr : PyLong_FromLong(-1);
}

PyObject* DeclineReason(PyObject* /*module*/, PyObject* call) {
  Call c;
  PlanPtr plan;
  std::string reason;
  if (!Prepare(call, &c, &plan, &reason) && PyErr_Occurred()) return nullptr;
  return PyUnicode_FromStringAndSize(reason.data(), static_cast<Py_ssize_t>(reason.size()));
}

// allocate(like, layouts): a new tensor on like's device for each (sizes, dtype) of `layouts`, as launch
// allocates absent outputs; a None for each unless `like` is a plain torch.Tensor.
PyObject* Allocate(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_Check(args[1])) {
    PyErr_Format(PyExc_TypeError, "allocate(like, layouts) takes 2 arguments, layouts a tuple (%zd given)", nargs);
    return nullptr;
  }
  std::vector<Output> layouts(static_cast<size_t>(PyTuple_GET_SIZE(args[1])));
  for (size_t i = 0; i < layouts.size(); ++i) {
    PyObject *sizes, *dtype;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(args[1], static_cast<Py_ssize_t>(i)), "O!O!", &PyTuple_Type, &sizes,
                          &THPDtypeType, &dtype)) {
      return nullptr;
    }
    if (!ParseLayout(sizes, dtype, &layouts[i])) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "allocate: sizes must be >= 0");
      return nullptr;
    }
  }
  const bool plain = THPVariable_CheckExact(args[0]);
  HANDLE_TH_ERRORS
  std::vector<at::Tensor> tensors;
  for (const Output& layout : layouts) {
    if (plain) tensors.push_back(Empty(THPVariable_Unpack(args[0]), layout.sizes, layout.dtype));
  }
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(layouts.size()));
  for (size_t i = 0; result != nullptr && i < layouts.size(); ++i) {
    PyObject* item = plain ? THPVariable_Wrap(std::move(tensors[i])) : Py_NewRef(Py_None);
    if (item == nullptr) Py_CLEAR(result);
    if (item != nullptr) PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), item);
  }
  return result;
  END_HANDLE_TH_ERRORS
}

// configure(fields, free_extents, planner, error_kinds): forgets every plan, and takes the call's field names,
// its free extents ((field, dimension) pairs), the planner (call -> plan, or why not) and the dict of TVM-FFI
// error kinds -> Python exception types.
PyObject* Configure(PyObject* /*module*/, PyObject* args, PyObject* kwargs) {
  ReleaseAll();
  static const char* names[] = {"fields", "free_extents", "planner", "error_kinds", nullptr};
  PyObject *fields, *free_extents, *planner, *error_kinds;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!OO!:configure", const_cast<char**>(names), &PyTuple_Type,
                                   &fields, &PyTuple_Type, &free_extents, &planner, &PyDict_Type, &error_kinds)) {
    return nullptr;
  }
  bool ok = PyCallable_Check(planner) && PyTuple_GET_SIZE(fields) <= kMaxFields;
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(fields); ++i) {
    PyObject* name = PyTuple_GET_ITEM(fields, i);
    const char* text = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : nullptr;
    if (text != nullptr) state.fields.emplace_back(text);
    ok = text != nullptr;
  }
  state.free_dim.assign(state.fields.size(), -1);
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(free_extents); ++i) {
    Py_ssize_t field = -1;
    int dim = -1;
    ok = PyArg_ParseTuple(PyTuple_GET_ITEM(free_extents, i), "ni", &field, &dim) && field >= 0 &&
         field < static_cast<Py_ssize_t>(state.fields.size()) && dim >= 0 && dim < kMaxDims;
    if (ok) state.free_dim[static_cast<size_t>(field)] = dim;
  }
  if (!ok) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError,
                    "configure: expected the call's field names, (field, dimension) pairs of it, a callable planner");
    ReleaseAll();
    return nullptr;
  }
  state.planner = Py_NewRef(planner);
  state.error_kinds = Py_NewRef(error_kinds);
  state.configured = true;
  Py_RETURN_NONE;
}

PyObject* Clear(PyObject* /*module*/, PyObject* /*unused*/) {
  state.plans.clear();
  ++state.generation;
  Py_RETURN_NONE;
}

PyObject* Reset(PyObject* /*module*/, PyObject* /*unused*/) {
  ReleaseAll();
  Py_RETURN_NONE;
}

#define Q8KV8_METHOD(name, function, flags, doc) \
  {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function)), flags, doc}

PyMethodDef methods[] = {
    Q8KV8_METHOD("launch", LaunchCall, METH_O,
                 "launch(call) -> its outputs, or None when the call is left to the Python path"),
    Q8KV8_METHOD("plan", PlanCall, METH_O,
                 "plan(call) -> the schedule of the plan launch(call) would run, or -1 (declined)"),
    Q8KV8_METHOD("decline_reason", DeclineReason, METH_O,
                 "decline_reason(call) -> why launch(call) declines, '' when it does not"),
    Q8KV8_METHOD("allocate", Allocate, METH_FASTCALL,
                 "allocate(like, ((sizes, dtype), ...)) -> new tensors on like's device, as launch allocates"),
    Q8KV8_METHOD("configure", Configure, METH_VARARGS | METH_KEYWORDS,
                 "configure(fields, free_extents, planner, error_kinds): forgets every plan"),
    Q8KV8_METHOD("clear", Clear, METH_NOARGS, "clear(): forget every memoised plan"),
    Q8KV8_METHOD("reset", Reset, METH_NOARGS, "reset(): forget the configuration and every plan"),
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_q8kv8_native", nullptr, -1, methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__q8kv8_native() { return PyModule_Create(&module_def); }
