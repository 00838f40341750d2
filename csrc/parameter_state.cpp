// See parameter_state.h. Each tensor costs a handful of attribute reads here against ~2 us of bytecode, a
// detach and three list appends in the reference; a bert-base forward reads ~100 such parameters before it runs.
#include "parameter_state.h"

#include <cstdint>

#include "fingerprint.h"
#include "interned.h"

namespace py = pybind11;

namespace fastbert {
namespace {

py::object attribute(PyObject* object, PyObject* name) {
  PyObject* value = PyObject_GetAttr(object, name);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

py::object call(PyObject* object, PyObject* method) {
  PyObject* value = PyObject_CallMethodNoArgs(object, method);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

// p._version, or -1 for an inference tensor (which keeps no version counter and raises RuntimeError for it).
py::object version_of(PyObject* p) {
  PyObject* version = PyObject_GetAttr(p, names().version);
  if (version != nullptr) return py::reinterpret_steal<py::object>(version);
  if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) throw py::error_already_set();
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject* inference = PyObject_CallMethodNoArgs(p, names().is_inference);
  if (inference == Py_True) {
    Py_DECREF(inference);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    return py::int_(-1);
  }
  Py_XDECREF(inference);
  PyErr_Restore(type, value, traceback);  // (not an inference tensor: its own error, as the reference raises)
  throw py::error_already_set();
}

}  // namespace

py::object parameter_state(py::tuple params) {
  const Names& name = names();
  const size_t count = params.size();
  py::tuple versions(count), layout(count);
  uint64_t hash = kFingerprintSeed;
  bool all_cpu = count > 0;
  for (size_t i = 0; i < count; ++i) {
    PyObject* p = params[i].ptr();
    versions[i] = version_of(p);
    py::object dtype = attribute(p, name.dtype), device = attribute(p, name.device);
    const bool cpu = attribute(p, name.is_cpu).ptr() == Py_True;
    int64_t nbytes = 0;
    if (cpu) {
      if (call(p, name.is_contiguous).ptr() != Py_True) return py::none();  // (the reference samples it via torch)
      nbytes = attribute(p, name.nbytes).cast<int64_t>();
    }
    // The address last, and its memory read before anything else is allocated: an allocation can run the garbage
    // collector, whose finalizers (or the thread they let in) could swap the tensor's storage and free this one.
    // (The Python int it comes back as is not collected: making it runs nothing.)
    py::object address = call(p, name.data_ptr);
    if (cpu) {
      const auto pointer = PyLong_AsUnsignedLongLong(address.ptr());
      if (PyErr_Occurred()) throw py::error_already_set();
      if (nbytes < 0 || (nbytes > 0 && pointer == 0)) return py::none();  // (freed storage: the reference says so)
      hash = fingerprint_add(hash, static_cast<std::uintptr_t>(pointer), nbytes);
    }
    all_cpu = all_cpu && cpu;
    layout[i] = py::make_tuple(address, dtype, device);
  }
  return py::make_tuple(versions, layout, all_cpu ? py::object(py::int_(hash)) : py::object(py::none()));
}

}  // namespace fastbert
