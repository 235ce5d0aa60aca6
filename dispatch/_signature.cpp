// The public ops' fast path, its tensor reads in one call (dispatch/native.py builds this file).
//
// Each read of a tensor attribute from Python (x.dtype, x.shape, x.is_cuda, ...) is a call into
// libtorch_python of ~0.1 us on the H200's host; the fast path made 13-16 of them a call, 1.3-2 us
// (benchmarks/probes/probe_wrapper_floor.py). Here they are C++ reads of the same at::Tensor.
//
// Both functions answer for the common valid call only: plain tensors or Parameters (exact types),
// strided, not nested, floating, all on x's device, CPU or CUDA, shapes matching, and no
// __torch_function__ mode active. Anything else returns None and the caller takes its full checks,
// which raise the errors that name the argument. Nothing here raises.

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

bool floating(c10::ScalarType s) {
  return s == c10::kFloat || s == c10::kBFloat16 || s == c10::kHalf || s == c10::kDouble;
}

// -1 for CPU, the index for CUDA, -2 for any other device (not served here)
long device_code(const at::Tensor& t) {
  const c10::Device d = t.device();
  if (d.is_cpu()) return -1;
  if (d.is_cuda()) return d.index();
  return -2;
}

bool plain(const at::Tensor& t) {
  return t.layout() == c10::kStrided && !t.is_nested();
}

// x's checks: a floating strided tensor of at least one dimension on CPU or CUDA. Sets its device
// code and the product of its leading dimensions (M).
bool check_x(const at::Tensor& x, long* device, int64_t* m) {
  if (!plain(x) || !floating(x.scalar_type()) || x.dim() < 1) return false;
  *device = device_code(x);
  if (*device < -1) return false;
  const auto sizes = x.sizes();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < sizes.size(); ++i) rows *= sizes[i];
  *m = rows;
  return true;
}

bool like(const at::Tensor& t, const at::Tensor& x, long device) {
  return plain(t) && t.scalar_type() == x.scalar_type() && device_code(t) == device;
}

// bias (None, or a 1-D tensor of N elements like x): folds its requires_grad into *requires_grad
// and sets *contiguous; false where it is anything else.
bool read_bias(PyObject* bo, const at::Tensor& x, long device, int64_t n, bool* requires_grad,
               bool* contiguous) {
  if (bo == Py_None) return true;
  if (!THPVariable_CheckExact(bo)) return false;
  const at::Tensor& b = THPVariable_Unpack(bo);
  if (!like(b, x, device) || b.dim() != 1 || b.sizes()[0] != n) return false;
  *requires_grad = *requires_grad || b.requires_grad();
  *contiguous = b.is_contiguous();
  return true;
}

// A new tuple of new references; on a failed item (no memory) none leaks and the error stands.
PyObject* tuple_of(std::initializer_list<PyObject*> items) {
  bool built = true;
  for (PyObject* item : items) built = built && item != nullptr;
  PyObject* out = built ? PyTuple_New(static_cast<Py_ssize_t>(items.size())) : nullptr;
  if (out == nullptr) {
    for (PyObject* item : items) Py_XDECREF(item);
    return nullptr;
  }
  Py_ssize_t i = 0;
  for (PyObject* item : items) PyTuple_SET_ITEM(out, i++, item);
  return out;
}

PyObject* new_ref(PyObject* o) {
  Py_INCREF(o);
  return o;
}

PyObject* as_bool(bool b) { return new_ref(b ? Py_True : Py_False); }

// bias_act_signature(x, bias) -> (device, dtype, M, N, grad, bias_contiguous, x.ndim) or None
PyObject* bias_act_signature(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) Py_RETURN_NONE;
  try {
    PyObject *xo = args[0], *bo = args[1];
    if (at::impl::torch_function_mode_enabled() || !THPVariable_CheckExact(xo)) Py_RETURN_NONE;
    const at::Tensor& x = THPVariable_Unpack(xo);
    long device;
    int64_t m;
    if (!check_x(x, &device, &m)) Py_RETURN_NONE;
    const int64_t n = x.sizes().back();
    bool requires_grad = x.requires_grad(), contiguous = true;
    if (!read_bias(bo, x, device, n, &requires_grad, &contiguous)) Py_RETURN_NONE;
    return tuple_of({PyLong_FromLong(device), new_ref((PyObject*)torch::getTHPDtype(x.scalar_type())),
                     PyLong_FromLongLong(m), PyLong_FromLongLong(n),
                     as_bool(requires_grad && at::GradMode::is_enabled()), as_bool(contiguous),
                     PyLong_FromLongLong(x.dim())});
  } catch (...) {  // e.g. a tensor whose sizes are symbolic: the caller's full checks decide
    Py_RETURN_NONE;
  }
}

// linear_signature(x, weight, bias) -> (device, dtype, M, N, K, grad, bias_contiguous, x.ndim) or None
PyObject* linear_signature(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) Py_RETURN_NONE;
  try {
    PyObject *xo = args[0], *wo = args[1], *bo = args[2];
    if (at::impl::torch_function_mode_enabled() || !THPVariable_CheckExact(xo) ||
        !THPVariable_CheckExact(wo))
      Py_RETURN_NONE;
    const at::Tensor& x = THPVariable_Unpack(xo);
    const at::Tensor& w = THPVariable_Unpack(wo);
    long device;
    int64_t m;
    if (!check_x(x, &device, &m) || !like(w, x, device) || w.dim() != 2) Py_RETURN_NONE;
    const int64_t n = w.sizes()[0], k = w.sizes()[1];
    if (x.sizes().back() != k) Py_RETURN_NONE;
    bool requires_grad = x.requires_grad() || w.requires_grad(), contiguous = true;
    if (!read_bias(bo, x, device, n, &requires_grad, &contiguous)) Py_RETURN_NONE;
    return tuple_of({PyLong_FromLong(device), new_ref((PyObject*)torch::getTHPDtype(x.scalar_type())),
                     PyLong_FromLongLong(m), PyLong_FromLongLong(n), PyLong_FromLongLong(k),
                     as_bool(requires_grad && at::GradMode::is_enabled()), as_bool(contiguous),
                     PyLong_FromLongLong(x.dim())});
  } catch (...) {
    Py_RETURN_NONE;
  }
}

PyMethodDef methods[] = {
    {"bias_act_signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(bias_act_signature)),
     METH_FASTCALL, "(x, bias) -> (device, dtype, M, N, grad, bias_contiguous, ndim) or None"},
    {"linear_signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(linear_signature)),
     METH_FASTCALL, "(x, weight, bias) -> (device, dtype, M, N, K, grad, bias_contiguous, ndim) or None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_signature", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__signature() { return PyModule_Create(&module); }
