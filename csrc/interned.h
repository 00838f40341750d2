// The Python names the native walks read (module_tree.cpp: a module's __dict__ entries; parameter_state.cpp: a
// tensor's attributes), made once as interned strings: a dict lookup or attribute read with one hashes nothing.
#pragma once

#include <pybind11/pybind11.h>

namespace fastbert {

// ``text`` as an interned str, never freed.
inline PyObject* interned(const char* text) {
  PyObject* name = PyUnicode_InternFromString(text);
  if (name == nullptr) throw pybind11::error_already_set();
  return name;
}

struct Names {
  // nn.Module's __dict__
  PyObject* modules = interned("_modules");
  PyObject* parameters = interned("_parameters");
  PyObject* training = interned("training");
  PyObject* p = interned("p");
  PyObject* forward = interned("forward");
  PyObject* hooks[4] = {interned("_forward_hooks"), interned("_forward_pre_hooks"), interned("_backward_hooks"),
                        interned("_backward_pre_hooks")};
  // torch.Tensor's attributes and methods
  PyObject* requires_grad = interned("requires_grad");
  PyObject* version = interned("_version");
  PyObject* is_cpu = interned("is_cpu");
  PyObject* data_ptr = interned("data_ptr");
  PyObject* dtype = interned("dtype");
  PyObject* device = interned("device");
  PyObject* is_contiguous = interned("is_contiguous");
  PyObject* nbytes = interned("nbytes");
  PyObject* is_inference = interned("is_inference");
};

// Made on first use (under the GIL: the walks' callers hold it), never freed.
inline const Names& names() {
  static const Names* made = new Names();
  return *made;
}

}  // namespace fastbert
