// What a derived weight's parameters hold now (fastbert/derived.py's ``state_ref`` is the reference): their version
// counters, (address, dtype, device) and, on the CPU, the fingerprint of their memory (fingerprint.h), read in one
// call. Torch-free: it reads the tensors' Python attributes.
#pragma once

#include <pybind11/pybind11.h>

namespace fastbert {

// (versions, layout, fingerprint) as ``state_ref`` builds them, less its epoch; None where a CPU tensor is not
// contiguous (``state_ref`` samples those through torch) or has no memory behind it (the reference raises). Each
// CPU tensor's memory is sampled as soon as its address is read, before anything that could run Python code (the
// reference holds a detached view instead).
pybind11::object parameter_state(pybind11::tuple params);

}  // namespace fastbert
