// See module_tree.h. Raw CPython calls with interned keys: the Python reference already runs near dict-lookup
// speed, so anything slower per module (a key string made per lookup, pybind11's argument casts) loses to it.
// Every object put in an entry is a new reference owned by that entry, so the children walked later stay alive
// through their parent's entry whatever the walk reads. Every value read is held at once: any allocation can run
// the garbage collector, whose finalizers (or the threads they let in) may reassign what was borrowed.
#include "module_tree.h"

#include <vector>

#include "interned.h"

namespace py = pybind11;

namespace fastbert {
namespace {

// A new reference, or the pending Python exception raised as a C++ one.
PyObject* checked(PyObject* object) {
  if (object == nullptr) throw py::error_already_set();
  return object;
}

// d[key] (borrowed); KeyError naming the attribute when the module lacks it.
PyObject* item(PyObject* dict, PyObject* key) {
  PyObject* value = PyDict_GetItemWithError(dict, key);
  if (value == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
    throw py::error_already_set();
  }
  return value;
}

// tuple(mapping.values()) (new), in the mapping's own order (a plain dict, or an OrderedDict as older torch kept).
PyObject* values_of(PyObject* mapping) {
  if (PyDict_CheckExact(mapping)) {
    const Py_ssize_t size = PyDict_Size(mapping);
    PyObject* values = checked(PyTuple_New(size));
    if (PyDict_Size(mapping) == size) {  // (making the tuple can run the collector, whose finalizers may add or drop)
      Py_ssize_t position = 0, i = 0;
      PyObject *key, *value;
      while (i < size && PyDict_Next(mapping, &position, &key, &value)) {  // (nothing here runs Python code)
        Py_INCREF(value);
        PyTuple_SET_ITEM(values, i++, value);
      }
      return values;
    }
    Py_DECREF(values);
  }
  py::object listed = py::reinterpret_steal<py::object>(checked(PyMapping_Values(mapping)));
  return checked(PySequence_Tuple(listed.ptr()));
}

bool truthy(PyObject* object) {
  int truth = PyObject_IsTrue(object);
  if (truth < 0) throw py::error_already_set();
  return truth > 0;
}

// (tuple(forward hooks), tuple(forward pre-hooks), tuple(backward hooks), tuple(backward pre-hooks)) (new): their
// handles' ids; None where all four are empty.
PyObject* hooks_of(const py::object (&hooks)[4]) {
  bool any = false;
  for (const auto& kind : hooks) any = truthy(kind.ptr()) || any;
  if (!any) Py_RETURN_NONE;
  py::object handles = py::reinterpret_steal<py::object>(checked(PyTuple_New(4)));
  for (int i = 0; i < 4; ++i) PyTuple_SET_ITEM(handles.ptr(), i, checked(PySequence_Tuple(hooks[i].ptr())));
  return handles.release().ptr();
}

// tuple(None if p is None else (id(p), type(p), p.requires_grad) for p in parameters.values()) (new); None when
// there are none.
PyObject* parameters_of(PyObject* parameters) {
  if (!truthy(parameters)) Py_RETURN_NONE;
  py::object values = py::reinterpret_steal<py::object>(values_of(parameters));
  Py_ssize_t count = PyTuple_GET_SIZE(values.ptr());
  py::object entries = py::reinterpret_steal<py::object>(checked(PyTuple_New(count)));
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* p = PyTuple_GET_ITEM(values.ptr(), i);
    if (p == Py_None) {
      Py_INCREF(Py_None);
      PyTuple_SET_ITEM(entries.ptr(), i, Py_None);
      continue;
    }
    py::object type = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(p)));
    py::object requires_grad = py::reinterpret_steal<py::object>(checked(PyObject_GetAttr(p, names().requires_grad)));
    py::object id = py::reinterpret_steal<py::object>(checked(PyLong_FromVoidPtr(p)));
    PyObject* entry = checked(PyTuple_Pack(3, id.ptr(), type.ptr(), requires_grad.ptr()));
    PyTuple_SET_ITEM(entries.ptr(), i, entry);
  }
  return entries.release().ptr();
}

// a == b: identity, what an unchanged tree gives, else Python's ==.
bool same(PyObject* a, PyObject* b) {
  if (a == b) return true;
  const int equal = PyObject_RichCompareBool(a, b, Py_EQ);
  if (equal < 0) throw py::error_already_set();
  return equal > 0;
}

// Whether ``entries`` (a tuple parameters_of built) is parameters_of(parameters), an exact dict with some.
bool same_parameters(PyObject* parameters, PyObject* entries) {
  py::object values = py::reinterpret_steal<py::object>(values_of(parameters));  // (held: the reads below run code)
  const Py_ssize_t count = PyTuple_GET_SIZE(values.ptr());
  if (!PyTuple_CheckExact(entries) || PyTuple_GET_SIZE(entries) != count) return false;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject *p = PyTuple_GET_ITEM(values.ptr(), i), *entry = PyTuple_GET_ITEM(entries, i);
    if (p == Py_None || entry == Py_None) {
      if (p != entry) return false;
      continue;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3 || !PyLong_CheckExact(PyTuple_GET_ITEM(entry, 0))
        || PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 0)) != p
        || !same(reinterpret_cast<PyObject*>(Py_TYPE(p)), PyTuple_GET_ITEM(entry, 1))) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return false;
    }
    py::object requires_grad = py::reinterpret_steal<py::object>(checked(PyObject_GetAttr(p, names().requires_grad)));
    if (!same(requires_grad.ptr(), PyTuple_GET_ITEM(entry, 2))) return false;
  }
  return true;
}

// module_tree(model) == key, reading the tree as module_tree does but building nothing where each module is the
// key's very object and has no hooks and a plain dict of children; elsewhere (hooks, an OrderedDict, an equal but
// other object) the tuple is built and compared.
bool matches(py::handle model, py::handle key) {
  const Names& name = names();
  PyObject* entries = key.ptr();
  if (!PyTuple_CheckExact(entries)) return false;
  const Py_ssize_t count = PyTuple_GET_SIZE(entries);
  Py_ssize_t at = 0;
  // (borrowed: each held by the key, whose children are walked once found to be the tree's very modules)
  std::vector<PyObject*> stack{model.ptr()};
  while (!stack.empty()) {
    PyObject* module = stack.back();
    stack.pop_back();
    if (at == count) return false;
    PyObject* entry = PyTuple_GET_ITEM(entries, at++);
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 8 || PyTuple_GET_ITEM(entry, 0) != module) {
      return same(module_tree(model).ptr(), entries);
    }
    py::object dict = py::reinterpret_steal<py::object>(checked(PyObject_GenericGetDict(module, nullptr)));
    PyObject* d = dict.ptr();
    // (read in module_tree's order, each held from the moment it is read)
    py::object modules = py::reinterpret_borrow<py::object>(item(d, name.modules));
    py::object parameters = py::reinterpret_borrow<py::object>(item(d, name.parameters));
    py::object hooks[4];
    bool hooked = false;
    for (int i = 0; i < 4; ++i) hooks[i] = py::reinterpret_borrow<py::object>(item(d, name.hooks[i]));
    for (const auto& kind : hooks) hooked = truthy(kind.ptr()) || hooked;
    py::object training = py::reinterpret_borrow<py::object>(item(d, name.training));
    PyObject* found = PyDict_GetItemWithError(d, name.p);
    if (found == nullptr && PyErr_Occurred()) throw py::error_already_set();
    py::object p = found == nullptr ? py::none() : py::reinterpret_borrow<py::object>(found);
    const int overridden = PyDict_Contains(d, name.forward);
    if (overridden < 0) throw py::error_already_set();
    PyObject* children = PyTuple_GET_ITEM(entry, 5);
    if (hooked || !PyDict_CheckExact(modules.ptr()) || !PyTuple_CheckExact(children)) {
      return same(module_tree(model).ptr(), entries);
    }
    if (!same(reinterpret_cast<PyObject*>(Py_TYPE(module)), PyTuple_GET_ITEM(entry, 1))
        || !same(training.ptr(), PyTuple_GET_ITEM(entry, 2)) || !same(p.ptr(), PyTuple_GET_ITEM(entry, 3))
        || !same(PyTuple_GET_ITEM(entry, 4), overridden ? Py_True : Py_False)
        || PyTuple_GET_ITEM(entry, 6) != Py_None) {
      return false;
    }
    const bool has_parameters = truthy(parameters.ptr());
    if (has_parameters != (PyTuple_GET_ITEM(entry, 7) != Py_None)
        || (has_parameters && !same_parameters(parameters.ptr(), PyTuple_GET_ITEM(entry, 7)))) {
      return false;
    }
    // The children: the key's very objects, in the dict's order (nothing here runs Python code)
    if (PyDict_Size(modules.ptr()) != PyTuple_GET_SIZE(children)) return false;
    Py_ssize_t position = 0, i = 0;
    PyObject *name_of_child, *child;
    while (PyDict_Next(modules.ptr(), &position, &name_of_child, &child)) {
      if (child != PyTuple_GET_ITEM(children, i++)) return same(module_tree(model).ptr(), entries);
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(children); ++j) {
      PyObject* held = PyTuple_GET_ITEM(children, j);
      if (held != Py_None) stack.push_back(held);  // (pushed in order: the last one is walked first)
    }
  }
  return at == count;
}

}  // namespace

bool module_tree_matches(py::handle model, py::handle key) { return matches(model, key); }

py::tuple module_tree(py::handle model) {
  const Names& key = names();
  py::list entries;
  std::vector<PyObject*> stack{model.ptr()};  // (borrowed: each is held by its parent's entry, or is the model)
  while (!stack.empty()) {
    PyObject* module = stack.back();
    stack.pop_back();
    py::object dict = py::reinterpret_steal<py::object>(checked(PyObject_GenericGetDict(module, nullptr)));
    PyObject* d = dict.ptr();
    // (read in the reference's order, so a module that lacks one raises the same KeyError; each value held from
    // the moment it is read: what runs later, a requires_grad property or the collector, may reassign it)
    py::object type = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(module)));
    py::object modules = py::reinterpret_borrow<py::object>(item(d, key.modules));
    py::object children = py::reinterpret_steal<py::object>(values_of(modules.ptr()));
    py::object parameters = py::reinterpret_borrow<py::object>(item(d, key.parameters));
    py::object hooks[4];
    for (int i = 0; i < 4; ++i) hooks[i] = py::reinterpret_borrow<py::object>(item(d, key.hooks[i]));
    py::object training = py::reinterpret_borrow<py::object>(item(d, key.training));
    PyObject* found = PyDict_GetItemWithError(d, key.p);
    if (found == nullptr && PyErr_Occurred()) throw py::error_already_set();
    py::object p = found == nullptr ? py::none() : py::reinterpret_borrow<py::object>(found);
    int overridden = PyDict_Contains(d, key.forward);
    if (overridden < 0) throw py::error_already_set();
    py::object hook_handles = py::reinterpret_steal<py::object>(hooks_of(hooks));
    py::object parameter_keys = py::reinterpret_steal<py::object>(parameters_of(parameters.ptr()));
    py::object entry = py::reinterpret_steal<py::object>(checked(PyTuple_Pack(
        8, module, type.ptr(), training.ptr(), p.ptr(),
        overridden ? Py_True : Py_False, children.ptr(), hook_handles.ptr(), parameter_keys.ptr())));
    if (PyList_Append(entries.ptr(), entry.ptr()) < 0) throw py::error_already_set();
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(children.ptr()); ++i) {
      PyObject* child = PyTuple_GET_ITEM(children.ptr(), i);
      if (child != Py_None) stack.push_back(child);  // (pushed in order: the last one is walked first)
    }
  }
  return py::reinterpret_steal<py::tuple>(checked(PyList_AsTuple(entries.ptr())));
}

}  // namespace fastbert
