// The key of a torch module tree that fastbert's plans compare before every forward (fastbert/plan.py,
// ``structure_ref`` is the reference): the same tuple, built without running Python bytecode per module. Torch-free:
// it reads the modules' ``__dict__`` entries as Python objects.
#pragma once

#include <pybind11/pybind11.h>

namespace fastbert {

// One entry per module, depth first from ``model`` (children pushed in order, the last one walked first):
// (module, type, training, p, "forward" in __dict__, children, hooks or None, parameters or None), as
// fastbert/plan.py's structure_ref builds it. Raises KeyError where a module lacks an nn.Module attribute.
pybind11::tuple module_tree(pybind11::handle model);

// module_tree(model) == key, for a key it returned: the same reads compared as they are made, building no tuple where
// the tree holds the key's very modules without hooks (a plan's check before every forward: bert-base's 228 modules).
bool module_tree_matches(pybind11::handle model, pybind11::handle key);

}  // namespace fastbert
