// q8kv8 output allocation: the three outputs of an allocating call, made in C++ (q8kv8/output_alloc.py
// builds this file against the running torch and explains when it is used).
//
// allocate(q, d_v) returns (out, max_logits, lse) for a 3-d torch.Tensor q of shape [s_q, h, d_qk]: new,
// contiguous, uninitialised [s_q, h, d_v] bfloat16, [s_q, h] float32 and [s_q, h] float32 tensors on q's
// device, exactly what q.new_empty makes (at::empty through the dispatcher: torch's caching allocator on
// the current stream, graph-capture pools, deterministic fill and inference mode apply as in Python).
// For anything else (not a tensor, a tensor subclass other than nn.Parameter, another rank) it returns
// (None, None, None): the fast launch then declines and the Python path checks the call. Three
// torch.Tensor.new_empty calls cost about 10 us of host time on the CPU; this call about 3.

#include <Python.h>

#include <ATen/ops/empty.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

PyObject* no_buffers() { return PyTuple_Pack(3, Py_None, Py_None, Py_None); }

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
  if (!THPVariable_CheckExact(args[0])) return no_buffers();
  const at::Tensor& q = THPVariable_Unpack(args[0]);
  if (q.dim() != 3) return no_buffers();
  HANDLE_TH_ERRORS  // torch's own translation: an out-of-memory error raises torch.OutOfMemoryError
  const int64_t s_q = q.size(0);
  const int64_t h = q.size(1);
  const at::TensorOptions options = q.options().requires_grad(false);
  at::Tensor out = at::empty({s_q, h, d_v}, options.dtype(at::kBFloat16));
  at::Tensor max_logits = at::empty({s_q, h}, options.dtype(at::kFloat));
  at::Tensor lse = at::empty({s_q, h}, options.dtype(at::kFloat));
  PyObject* buffers = PyTuple_New(3);
  if (buffers == nullptr) return nullptr;
  PyTuple_SET_ITEM(buffers, 0, THPVariable_Wrap(std::move(out)));
  PyTuple_SET_ITEM(buffers, 1, THPVariable_Wrap(std::move(max_logits)));
  PyTuple_SET_ITEM(buffers, 2, THPVariable_Wrap(std::move(lse)));
  for (Py_ssize_t i = 0; i < 3; ++i) {
    if (PyTuple_GET_ITEM(buffers, i) == nullptr) {
      Py_DECREF(buffers);
      return nullptr;
    }
  }
  return buffers;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"allocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(allocate)), METH_FASTCALL,
     "allocate(q, d_v) -> (out, max_logits, lse), or (None, None, None) unless q is a 3-d torch.Tensor"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_q8kv8_output_alloc", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__q8kv8_output_alloc() { return PyModule_Create(&module_def); }
