// The parts of the module torch_bps._C (module.cpp defines it and binds the client): each binds its classes
// into the module it is given.
#pragma once

#include <pybind11/pybind11.h>

namespace bps::python {

// ServerCore, for torch_bps/server/server.py (server_bindings.cpp).
void bindServerCore(pybind11::module_& m);
// torch_bps._C._testing: what only the tests call (testing.cpp).
void bindTesting(pybind11::module_& m);

}  // namespace bps::python
